"""optim's device path (a loss on an accelerator; ``defer=True`` takes it on the CPU): no host
read per step, the same skip and raise semantics as the CPU path, and torch's fused kernels
where the user left the choice of kernel to torch."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import hookfit
from hookfit.plugins.optim import Optim, OptimWarning
from test_optim import Skips, assert_bitwise, data, model, mse, params
from conftest import REPO

KERNELS = {"fused": True, "plain": False, "default": None}
"""The SGD a test builds: ``fused=True`` (the user chose the fused kernel), ``fused=False``
(the user chose the for-loop kernel: no device-side skip) or left to torch (optim runs the
fused kernel on the device path)."""


def _syncs():
    """benchmarks/syncs.py, whose HostReads counter the benchmark's numbers come from."""
    import importlib.util
    from pathlib import Path

    path = REPO / "benchmarks" / "syncs.py"
    spec = importlib.util.spec_from_file_location("hookfit_bench_syncs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


syncs = _syncs()


class ReadsPerBatch:
    """The host reads counted from each training batch's start to the next one's (the last
    batch's run to the stage's end), with the calls that made them."""

    def __init__(self, reads) -> None:
        self.reads, self.starts = reads, []

    @hookfit.hookimpl
    def batch_start(self, loop) -> None:
        if loop.training:
            self.starts.append(self.reads.count)

    @hookfit.hookimpl(trylast=True)
    def stage_end(self, stage) -> None:
        if stage == "train":
            self.starts.append(self.reads.count)

    def per_batch(self) -> list[int]:
        return [b - a for a, b in zip(self.starts, self.starts[1:-1])]  # the last batch left out

    def calls(self) -> list[str]:
        return self.reads.calls[self.starts[0]:self.starts[-2]]


def default_stack(opt_kind: str, m, batches, *, defer=True, step=None, interval=3600.0, **optim):
    """optim, metrics, console and interrupter (the default stack) on ``m`` with ``opt_kind``
    SGD (a key of ``KERNELS``), counting host reads; returns the counter plugin."""
    from io import StringIO

    from hookfit.plugins.console import Console
    from hookfit.plugins.interrupter import Interrupter
    from hookfit.plugins.metrics import Metrics

    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=KERNELS[opt_kind])

    def default_step(loop, batch):
        loss = mse(m, batch)
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    counter = ReadsPerBatch(syncs.HostReads(trace=True))
    with counter.reads:
        hookfit.Loop(step or default_step, batches, model=m, optimizers=opt, max_epochs=1,
                     plugins=[Optim(defer=defer, **optim), Metrics(defer=defer, interval=interval),
                              Console(stream=StringIO()), Interrupter(signals=False), counter]).fit()
    return counter


def test_the_default_stack_reads_the_host_only_at_publications_on_the_device_path() -> None:
    """Through the path a loss on an accelerator takes (defer=True), the default stack reads
    nothing per step with an optimizer that skips on the device, and exactly the documented
    read at the step with one that cannot; publications read; the CPU path reads per step
    (no synchronisation there), which shows the counter sees what it must."""
    fused = default_stack("fused", model(), data(12))
    assert fused.per_batch() == [1] + [0] * 10, fused.calls()  # the first step reads: no state yet
    plain = default_stack("plain", model(), data(12))
    assert plain.per_batch() == [1] * 11
    assert all("optim/nonfinite.py" in call and call.startswith("tolist") for call in plain.calls())
    publishing = default_stack("fused", model(), data(12), interval=0.0)  # a publication every batch
    assert all(n >= 1 for n in publishing.per_batch())
    assert any("metrics/aggregate.py" in call for call in publishing.calls())
    cpu = default_stack("fused", model(), data(12), defer=None)
    assert cpu.per_batch() == [2] * 11  # loss.item() in optim's check and in metrics
    # torch's SGD as users build it: optim runs its fused kernel, which skips on the device,
    # with momentum buffers made beforehand, so even its first step reads nothing
    default = default_stack("default", model(), data(12))
    assert default.per_batch() == [0] * 11, default.calls()
    unfused = default_stack("default", model(), data(12), fuse=False)  # Optim(fuse=False): as given
    assert unfused.per_batch() == [1] * 11


def nan_at(m, bad: set[int]):
    def step(loop, batch):
        loss = mse(m, batch)
        if loop.state.batch_idx in bad:
            loss = loss * float("nan")
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    return step


def raw_skipping(bad: set[int], batches, fused: bool, make=None) -> list[torch.Tensor]:
    """A raw loop that leaves the batches ``bad`` out, with SGD (momentum 0.9; its fused kernel
    or not) or the optimizer ``make(parameters)`` builds."""
    raw = model()
    opt = make(raw.parameters()) if make else torch.optim.SGD(raw.parameters(), lr=0.1, momentum=0.9,
                                                               fused=fused or None)
    for i, b in enumerate(batches):
        if i not in bad:
            mse(raw, b).backward()
            opt.step()
        opt.zero_grad()
    return params(raw)


@pytest.mark.fault
@pytest.mark.parametrize("opt_kind", ["fused", "plain", "default"])
def test_the_device_path_skips_a_nonfinite_loss_s_step_as_the_cpu_path_does(opt_kind: str) -> None:
    """NaN losses at batches 2 and 4: their steps are skipped (fused, and torch's default that
    optim runs fused: on the device, counted at the stage's end; plain SGD: after its one read
    at the step), the parameters are those of a raw loop with the same kernel that left the
    two batches out, one warning then the total. (A NaN loss in a fused optimizer's first
    step: test_the_first_step_of_a_fused_optimizer_reads_the_flag.)"""
    on_device = opt_kind != "plain"
    batches, bad = data(8), {2, 4}
    m = model()
    seen = []

    class Skipped:
        @hookfit.hookimpl
        def batch_end(self, loop):
            seen.append(loop.optimizers["default"].skipped)

        @hookfit.hookimpl
        def fit_end(self, loop):
            seen.append((loop.optimizers["default"].skipped, loop.optimizers["default"].steps))

    skips = Skips()
    with pytest.warns(OptimWarning) as caught:
        counter = _run_with(opt_kind, m, batches, nan_at(m, bad), Skipped(), skips)
    assert_bitwise(params(m), raw_skipping(bad, batches, on_device))
    # announced when known on the host: the reason names the batch of the bad loss
    assert [(reason.split(" (")[0], step) for _, reason, step in skips.seen] == (
        [("non-finite loss at epoch 1, batch 3", 8), ("non-finite loss at epoch 1, batch 5", 8)]
        if on_device else
        [("non-finite loss at epoch 1, batch 3", 2), ("non-finite loss at epoch 1, batch 5", 4)])
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages
    assert "skipped the step of optimizer 'default': non-finite loss at epoch 1, batch 3" in messages[0]
    assert "2 optimizer steps were skipped" in messages[1]
    assert seen[-1] == (2, 6)
    if on_device:  # counted at the next host read: here the stage's end
        assert seen[:-1] == [0] * 8 and "skipped on the device; read on the host at epoch 1, batch 8" in messages[0]
        # a fused SGD given with momentum reads until it has buffers (see Optim); one that
        # optim switched got its buffers with the switch
        assert counter.per_batch() == ([1] + [0] * 6 if opt_kind == "fused" else [0] * 7), counter.calls()
    else:
        assert seen[:-1] == [0, 0, 1, 1, 2, 2, 2, 2]
        assert counter.per_batch() == [1] * 7


def _run_with(opt_kind: str, m, batches, step, *plugins, **optim):
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=KERNELS[opt_kind])
    counter = ReadsPerBatch(syncs.HostReads(trace=True))
    with counter.reads:
        hookfit.Loop(step, batches, model=m, optimizers=opt, max_epochs=1,
                     plugins=[Optim(defer=True, **optim), *plugins, counter]).fit()
    return counter


@pytest.mark.fault
@pytest.mark.parametrize("publish", [True, False])
def test_the_device_path_raises_at_the_next_host_read_with_the_loss_s_batch(publish: bool) -> None:
    """nonfinite="raise": the error comes at optim's next host read (the training stage's end;
    a metrics publication is the metrics plugin's read, not optim's) and names the batch of the
    NaN loss; the steps in between were skipped on the device, so the parameters hold no NaN."""
    from hookfit.plugins.metrics import Metrics

    m, batches = model(), data(6)
    plugins = [Metrics(defer=True, interval=0.0)] if publish else []
    read_at = 5
    with pytest.raises(FloatingPointError, match=rf"optim: non-finite loss at epoch 1, batch 2 \(its steps "
                                                 rf"were skipped on the device; read on the host at epoch 1, "
                                                 rf"batch {read_at + 1}\)"):  # (batch_idx 5: the sixth)
        _run_with("fused", m, batches, nan_at(m, {1}), *plugins, nonfinite="raise")
    assert_bitwise(params(m), raw_skipping({1}, batches[:read_at + 1], fused=True))


@pytest.mark.fault
def test_the_device_path_with_a_grad_scaler_and_accumulation_skips_through_the_scaler() -> None:
    """amp=True, windows of 2, a NaN loss at batch 2: the window 2-3 is skipped by the
    scaler (the flag joins its found_inf, so its scale backs off), counted at the stage's
    end naming both batches; the other windows step."""
    m = model()
    optim = Optim(defer=True, amp=True, accumulate=2)
    with pytest.warns(OptimWarning, match=r"non-finite loss at epoch 1, batches 3-4 \(skipped on the device"):
        hookfit.Loop(nan_at(m, {2}), data(6), model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
                     max_epochs=1, plugins=[optim]).fit()
    managed = optim.optimizers["default"]
    assert (managed.steps, managed.skipped) == (2, 1)
    assert optim.scaler.get_scale() == 2.0 ** 15  # backed off once, for the NaN window
    assert all(torch.isfinite(p).all() for p in m.parameters())


@pytest.mark.bad_input
def test_defer_must_be_a_bool_or_none() -> None:
    with pytest.raises(ValueError, match="optim: defer must be True, False or None, got 'yes'"):
        Optim(defer="yes")


@pytest.mark.fault
def test_a_publication_inside_an_accumulation_window_leaves_its_flag_to_its_step() -> None:
    """Windows of 4, a NaN loss at batch 5 and a metrics publication after every batch: the
    publications read only closed windows, so the step of the window 4-7 still skips on the
    device; the window 0-3 steps."""
    from hookfit.plugins.metrics import Metrics

    m, batches = model(), data(8)
    optim = Optim(defer=True, accumulate=4)
    with pytest.warns(OptimWarning, match=r"non-finite loss at epoch 1, batches 5-8 \(skipped on the device; "
                                          r"read on the host at epoch 1, batch 8\)"):
        hookfit.Loop(nan_at(m, {5}), batches, model=m, max_epochs=1,
                     optimizers=torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=True),
                     plugins=[optim, Metrics(defer=True, interval=0.0)]).fit()
    raw = model()
    opt = torch.optim.SGD(raw.parameters(), lr=0.1, momentum=0.9, fused=True)
    for b in batches[:4]:
        (mse(raw, b) / 4).backward()
    opt.step()
    assert_bitwise(params(m), params(raw))
    assert (optim.optimizers["default"].steps, optim.optimizers["default"].skipped) == (1, 1)


@pytest.mark.fault
def test_the_first_step_of_a_fused_optimizer_reads_the_flag() -> None:
    """A NaN loss in batch 0: torch's fused SGD has no momentum buffers yet, and skipped by
    found_inf it would leave them uninitialised; optim reads the flag for that step instead,
    skips it as on the CPU, and the run matches a raw loop that left batch 0 out."""
    m, batches = model(), data(4)
    with pytest.warns(OptimWarning, match="non-finite loss at epoch 1, batch 1"):
        counter = _run_with("fused", m, batches, nan_at(m, {0}))
    assert_bitwise(params(m), raw_skipping({0}, batches, fused=True))
    assert counter.per_batch() == [1, 1, 0]  # until a step gave the optimizer its state


# -- torch's fused kernels, chosen where the user left the kernel to torch -------------------
@pytest.mark.fault
def test_torch_s_adam_runs_fused_and_reads_nothing_even_when_its_first_step_is_skipped() -> None:
    """Adam built as torch's default: on the device path optim runs its fused kernel, whose
    state is made before the kernel runs, so even the first step skips on the device: no host
    read in any batch, and the parameters are those of a raw fused Adam without batch 0."""
    m, batches = model(), data(6)
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    counter = ReadsPerBatch(syncs.HostReads(trace=True))
    with pytest.warns(OptimWarning, match=r"non-finite loss at epoch 1, batch 1 \(skipped on the device"):
        with counter.reads:
            hookfit.Loop(nan_at(m, {0}), batches, model=m, optimizers=opt, max_epochs=1,
                         plugins=[Optim(defer=True), counter]).fit()
    assert counter.per_batch() == [0] * 5, counter.calls()
    assert [group["fused"] for group in opt.param_groups] == [True]
    assert_bitwise(params(m), raw_skipping({0}, batches, True, lambda p: torch.optim.Adam(p, lr=0.01, fused=True)))


def unfused_reads(opt_factory, m, batches, **optim) -> list[int]:
    """Host reads per batch of a device-path run whose optimizer optim must leave as it is."""
    opt = opt_factory(m)
    counter = ReadsPerBatch(syncs.HostReads(trace=True))
    with counter.reads:
        hookfit.Loop(nan_at(m, set()), batches, model=m, optimizers=opt, max_epochs=1,
                     plugins=[Optim(defer=True, **optim), counter]).fit()
    assert not any(group.get("fused") for group in opt.param_groups), opt.param_groups
    return counter.per_batch()


class MySGD(torch.optim.SGD):
    """A subclass defined outside torch: its step may not be torch's, so it is not switched."""


@pytest.mark.parametrize("factory", [
    pytest.param(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, foreach=True), id="foreach-chosen"),
    pytest.param(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, fused=False), id="fused-false"),
    pytest.param(lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01), id="no-fused-kernel"),
    pytest.param(lambda m: MySGD(m.parameters(), lr=0.1), id="subclass"),
])
def test_an_optimizer_whose_kernel_was_chosen_or_has_no_fused_one_is_left_as_given(factory) -> None:
    """Only torch's own optimizers whose kernel the user left to torch are switched: an
    explicit ``foreach``/``fused`` choice, a class with no fused kernel or one defined
    elsewhere keeps its kernel and reads the flag once per step."""
    assert unfused_reads(factory, model(), data(6)) == [1] * 5


def test_fuse_false_keeps_torch_s_default_kernel() -> None:
    assert unfused_reads(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), model(), data(6), fuse=False) == [1] * 5


def test_a_differentiable_optimizer_is_not_fused() -> None:
    """torch's fused kernels refuse ``differentiable=True``."""
    from hookfit.plugins.support import kernels

    m = model()
    for differentiable in (False, True):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, differentiable=differentiable)
        kernels.fuse(opt, m)
        assert opt.param_groups[0]["fused"] is (None if differentiable else True)


def test_sparse_gradients_keep_the_kernel_that_takes_them() -> None:
    """torch's fused SGD refuses sparse gradients: an embedding with ``sparse=True`` keeps the
    for-loop kernel (one read per step) and trains as a raw loop does."""
    def embedding():
        torch.manual_seed(3)
        return torch.nn.Embedding(10, 3, sparse=True)

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 10, (4,), generator=g), torch.randn(4, 3, generator=g)) for _ in range(6)]
    m = embedding()
    assert unfused_reads(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), m, batches) == [1] * 5
    raw = embedding()
    opt = torch.optim.SGD(raw.parameters(), lr=0.1)
    for b in batches:
        mse(raw, b).backward()
        opt.step()
        opt.zero_grad()
    assert_bitwise(params(m), params(raw))


def test_state_an_optimizer_already_has_moves_to_the_fused_layout() -> None:
    """An Adam with state loaded before the run (three steps of the for-loop kernel) is
    switched with its state, re-loaded the way torch loads a state into a fused Adam: the run
    continues bit for bit as a raw fused Adam that loaded the same state, with no host read
    per step."""
    batches = data(8)
    first = model()
    opt = torch.optim.Adam(first.parameters(), lr=0.01)
    for b in batches[:3]:
        mse(first, b).backward()
        opt.step()
        opt.zero_grad()
    saved, weights = copy.deepcopy(opt.state_dict()), first.state_dict()  # (it holds the live tensors)

    m = model()
    m.load_state_dict(weights)
    resumed = torch.optim.Adam(m.parameters(), lr=0.01)
    resumed.load_state_dict(copy.deepcopy(saved))
    counter = ReadsPerBatch(syncs.HostReads(trace=True))
    with counter.reads:
        hookfit.Loop(nan_at(m, set()), batches[3:], model=m, optimizers=resumed, max_epochs=1,
                     plugins=[Optim(defer=True), counter]).fit()
    assert counter.per_batch() == [0] * 4, counter.calls()

    raw = model()
    raw.load_state_dict(weights)
    fused = torch.optim.Adam(raw.parameters(), lr=0.01, fused=True)
    as_fused = copy.deepcopy(saved)  # (torch's load_state_dict takes the groups' options, fused too)
    for group in as_fused["param_groups"]:
        group["fused"] = True
    fused.load_state_dict(as_fused)
    for b in batches[3:]:
        mse(raw, b).backward()
        fused.step()
        fused.zero_grad()
    assert_bitwise(params(m), params(raw))


def test_a_state_saved_by_a_fused_run_skips_on_the_device_after_loading() -> None:
    """The groups of a state saved by a run that optim switched say ``fused=True``: an
    optimizer that loads it runs torch's fused kernel (torch's load_state_dict takes the
    groups' options), so it skips on the device with no read even under ``fuse=False``."""
    m, batches = model(), data(4)
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    hookfit.Loop(nan_at(m, set()), batches, model=m, optimizers=opt, max_epochs=1,
                 plugins=[Optim(defer=True)]).fit()
    again = torch.optim.Adam(m.parameters(), lr=0.01)
    again.load_state_dict(opt.state_dict())
    counter = ReadsPerBatch(syncs.HostReads(trace=True))
    with pytest.warns(OptimWarning, match=r"batch 2 \(skipped on the device"), counter.reads:
        hookfit.Loop(nan_at(m, {1}), batches, model=m, optimizers=again, max_epochs=1,
                     plugins=[Optim(defer=True, fuse=False), counter]).fit()
    assert counter.per_batch() == [0] * 3, counter.calls()


@pytest.mark.fault
@pytest.mark.parametrize("opt_kind", ["fused", "default"])
def test_a_grad_scaler_with_fused_sgd_never_leaves_momentum_buffers_uninitialised(opt_kind: str) -> None:
    """amp=True with SGD with momentum and a NaN loss in batch 0. A fused SGD given by the user
    has no momentum buffers yet, and a first step skipped inside its kernel would keep
    uninitialised ones, so until a step has really been taken (batch 1) it goes through the
    scaler's own read of found_inf. torch's SGD as users build it is switched by optim with
    zero buffers made, so it skips on the device from the first step. Either way the
    parameters are a raw fused SGD's without batch 0."""
    m, batches = model(), data(6)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=KERNELS[opt_kind])
    counter = ReadsPerBatch(syncs.HostReads(trace=True))
    with pytest.warns(OptimWarning, match=r"non-finite loss at epoch 1, batch 1 \(skipped on the device"):
        with counter.reads:
            hookfit.Loop(nan_at(m, {0}), batches, model=m, optimizers=opt, max_epochs=1,
                         plugins=[Optim(defer=True, amp=True), counter]).fit()
    assert [group["fused"] for group in opt.param_groups] == [True]
    if opt_kind == "fused":
        assert counter.per_batch() == [1, 1, 0, 0, 0], counter.calls()
        assert all("amp/grad_scaler.py" in call for call in counter.calls()), counter.calls()
    else:
        assert counter.per_batch() == [0] * 5, counter.calls()
    assert_bitwise(params(m), raw_skipping({0}, batches, fused=True))


@pytest.mark.bad_input
def test_fuse_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="optim: fuse must be True or False, got 'yes'"):
        Optim(fuse="yes")


# -- gradient checks (clip_norm, check_grads) on the device path ---------------------------
def nan_grad_at(m, bad: set[int], named: bool = False):
    """A step whose loss stays finite but whose first layer's weight gets a NaN gradient in the
    batches ``bad``; ``named``: it steps optimizers "a" and "b"."""
    def step(loop, batch):
        loss = mse(m, batch)
        hook = m[0].weight.register_hook(lambda g: g * float("nan")) if loop.state.batch_idx in bad else None
        loop.backward(loss)
        if hook is not None:
            hook.remove()
        for name in ("a", "b") if named else ("default",):
            loop.optimizers[name].step()
            loop.optimizers[name].zero_grad()
        return {"loss": loss}

    return step


def gradient_run(defer: bool, named: bool = False, **optim):
    """NaN gradients at batches 2 and 4 on the device path (``defer``) or the CPU path, with
    fused SGD (one optimizer, or "a" for the first layer and "b" for the last); returns the
    model, what step_skipped said ((optimizer, reason, step) each) and the reads counted."""
    m, skips = model(), Skips()
    sgd = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)  # noqa: E731
    opt = {"a": sgd(m[0].parameters()), "b": sgd(m[2].parameters())} if named else sgd(m.parameters())
    counter = ReadsPerBatch(syncs.HostReads(trace=True))
    with pytest.warns(OptimWarning, match="non-finite gradient at epoch 1, batch 3"), counter.reads:
        hookfit.Loop(nan_grad_at(m, {2, 4}, named), data(8), model=m, optimizers=opt, max_epochs=1,
                     plugins=[Optim(defer=defer, **optim), skips, counter]).fit()
    return m, skips.seen, counter


@pytest.mark.fault
@pytest.mark.parametrize("check", [{"clip_norm": 1.0}, {"check_grads": True}], ids=["clip_norm", "check_grads"])
def test_a_nonfinite_gradient_is_skipped_on_the_device_as_the_cpu_path_skips_it(check) -> None:
    """NaN gradients (the loss finite) at batches 2 and 4: on the device path the gradient
    check is a flag of the step's own, joined to found_inf, so after the first step (fused SGD
    with momentum reads until it has buffers) no batch reads; the skips are counted at the
    stage's end with the batch named, and the parameters are those of the CPU path, which
    reads the check at every step and skips there."""
    on_device, device_skips, device_reads = gradient_run(True, **check)
    on_cpu, cpu_skips, _ = gradient_run(False, **check)
    assert_bitwise(params(on_device), params(on_cpu))
    assert all(torch.isfinite(p).all() for p in on_device.parameters())
    assert [(reason, step) for _, reason, step in cpu_skips] == [
        ("non-finite gradient at epoch 1, batch 3", 2), ("non-finite gradient at epoch 1, batch 5", 4)]
    assert [(reason.split(" (")[0], step) for _, reason, step in device_skips] == [
        ("non-finite gradient at epoch 1, batch 3", 8), ("non-finite gradient at epoch 1, batch 5", 8)]
    assert "skipped on the device; read on the host at epoch 1, batch 8" in device_skips[0][1]
    assert device_reads.per_batch()[1:] == [0] * 6, device_reads.calls()


@pytest.mark.fault
def test_only_the_optimizer_whose_gradients_are_not_finite_skips_on_the_device() -> None:
    """Two optimizers, NaN gradients in the first layer only: "a" skips its two steps, "b"
    steps every batch, on the device path as on the CPU path."""
    on_device, device_skips, _ = gradient_run(True, named=True, clip_norm=1.0)
    on_cpu, cpu_skips, _ = gradient_run(False, named=True, clip_norm=1.0)
    assert_bitwise(params(on_device), params(on_cpu))
    assert [name for name, _, _ in device_skips] == [name for name, _, _ in cpu_skips] == ["a", "a"]


@pytest.mark.fault
def test_a_nonfinite_gradient_raises_at_the_next_host_read_on_the_device_path() -> None:
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=True)
    with pytest.raises(FloatingPointError, match=r"optim: non-finite gradient at epoch 1, batch 3 \(its step was "
                                                 r"skipped on the device; read on the host at epoch 1, batch 6\)"):
        hookfit.Loop(nan_grad_at(m, {2}), data(6), model=m, optimizers=opt, max_epochs=1,
                     plugins=[Optim(defer=True, clip_norm=1.0, nonfinite="raise")]).fit()
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_with_a_grad_scaler_clipping_reads_nothing_per_step() -> None:
    """A GradScaler finds non-finite gradients itself (unscale_), so optim does not check them
    again: with clipping and torch's Adam (run fused) no batch reads on the device path."""
    m = model()
    counter = ReadsPerBatch(syncs.HostReads(trace=True))
    with counter.reads:
        hookfit.Loop(nan_at(m, set()), data(6), model=m, optimizers=torch.optim.Adam(m.parameters(), lr=0.01),
                     max_epochs=1, plugins=[Optim(defer=True, amp=True, clip_norm=1.0), counter]).fit()
    assert counter.per_batch() == [0] * 5, counter.calls()


# -- where torch's fused kernels are not taken, and the counts with several optimizers --------
def device_and_cpu(make_opt, step_factory, batches, model_factory=model, **optim):
    """The same run on the device path and on the CPU path: (model, Optim plugin) of each."""
    runs = []
    for defer in (True, None):
        m = model_factory()
        plugin = Optim(defer=defer, **optim)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OptimWarning)
            hookfit.Loop(step_factory(m), batches, model=m, optimizers=make_opt(m), max_epochs=1,
                         plugins=[plugin]).fit()
        runs.append((m, plugin))
    return runs


def counts(plugin) -> dict[str, tuple[int, int]]:
    return {name: (managed.steps, managed.skipped) for name, managed in plugin.optimizers.items()}


def assert_close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    """Equal up to rounding: torch's fused kernels and its for-loop ones round differently
    (fused SGD too, in the elements past the last full vector of a tensor)."""
    assert len(a) == len(b) and all(torch.allclose(x, y, rtol=1e-5, atol=1e-7) for x, y in zip(a, b))


def test_sgd_with_momentum_is_switched_with_its_buffers_so_late_gradients_are_taken() -> None:
    """The last layer gets gradients only from batch 2 on (a branch unused before): torch's
    fused SGD fails when some parameters have momentum buffers and others not yet; switched
    by optim, every parameter has its zero buffer from the start, and the run ends as the
    CPU path's (torch's for-loop SGD), whose first step per parameter is the same update (up
    to the two kernels' rounding)."""
    def step_factory(m):
        def step(loop, batch):
            x, y = batch
            hidden = m[1](m[0](x))
            out = m[2](hidden) if loop.state.batch_idx >= 2 else hidden.sum(dim=1, keepdim=True)
            loop.backward(torch.nn.functional.mse_loss(out, y))
            loop.optimizers.step()
            loop.optimizers.zero_grad()
        return step

    (on_device, _), (on_cpu, _) = device_and_cpu(
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True), step_factory, data(6))
    assert_close(params(on_device), params(on_cpu))


def test_sgd_of_a_model_with_sparse_gradients_is_not_switched() -> None:
    """An embedding with sparse=True first used in batch 1: torch's fused SGD refuses sparse
    gradients, so optim leaves the kernel torch picks (found through the model's modules, not
    the gradients of the first step), and the run matches the CPU path."""
    def make():
        torch.manual_seed(3)
        return torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, 3, sparse=True), "lin": torch.nn.Linear(3, 3)})

    def step_factory(m):
        def step(loop, batch):
            idx, y = batch
            x = m["emb"](idx) if loop.state.batch_idx >= 1 else torch.zeros(4, 3)
            loop.backward(mse(m["lin"], (x, y)))
            loop.optimizers.step()
            loop.optimizers.zero_grad()
        return step

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 10, (4,), generator=g), torch.randn(4, 3, generator=g)) for _ in range(4)]
    (on_device, _), (on_cpu, _) = device_and_cpu(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), step_factory,
                                                 batches, model_factory=make)
    assert_bitwise(params(on_device), params(on_cpu))


def test_a_group_added_during_the_run_is_switched_too_with_its_buffers() -> None:
    """A layer unfrozen at batch 2 with add_param_group, and a NaN loss in that batch: the new
    group is switched with zero momentum buffers, so the step skipped inside the kernel leaves
    them zero (not the uninitialised memory of torch's first fused step); a user's fused SGD
    reads the flag until the new parameters have buffers. Both end as the CPU path does (up to
    rounding)."""
    for fused in (None, True):
        def make(m, fused=fused):
            return torch.optim.SGD(m[0].parameters(), lr=0.1, momentum=0.9, fused=fused)

        def step_factory(m):
            def step(loop, batch):
                if loop.state.batch_idx == 2:
                    loop.optimizers["default"].optimizer.add_param_group({"params": list(m[2].parameters())})
                loss = mse(m, batch)
                if loop.state.batch_idx == 2:
                    loss = loss * float("nan")
                loop.backward(loss)
                loop.optimizers.step()
                loop.optimizers.zero_grad()
            return step

        (on_device, plugin), (on_cpu, cpu) = device_and_cpu(make, step_factory, data(6))
        assert_close(params(on_device), params(on_cpu))
        opt = plugin.optimizers["default"].optimizer
        assert [group["fused"] for group in opt.param_groups] == [True, True]
        assert counts(plugin) == counts(cpu) == {"default": (5, 1)}


def test_switching_keeps_the_groups_the_user_holds() -> None:
    """An Adam with state (loaded before the run) is switched in place: a parameter group the
    step holds is still the optimizer's, so setting its learning rate to 0 stops training."""
    m, batches = model(), data(6)
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    mse(m, batches[0]).backward()
    opt.step()
    opt.zero_grad()
    group, seen = opt.param_groups[0], []

    def step(loop, batch):
        if loop.state.batch_idx == 2:
            group["lr"] = 0.0
        seen.append(params(m))
        loop.backward(mse(m, batch))
        loop.optimizers.step()
        loop.optimizers.zero_grad()

    hookfit.Loop(step, batches, model=m, optimizers=opt, max_epochs=1, plugins=[Optim(defer=True)]).fit()
    assert opt.param_groups[0] is group and group["fused"] is True
    assert not torch.equal(seen[1][0], seen[2][0])  # trained while lr was set
    assert_bitwise(seen[3], params(m))  # lr 0 from batch 2 on


def gan(nan: str, make_d, make_g):
    """A GAN step: the discriminator "d" steps, then the generator "g" (its loss through d,
    toggled); a NaN loss at batch 1 in ``nan``'s update."""
    def step_factory(models):
        g_net, d_net = models["g"], models["d"]

        def step(loop, x):
            opts = loop.optimizers
            d_loss = (torch.nn.functional.softplus(d_net(g_net(x).detach())).mean()
                      + torch.nn.functional.softplus(-d_net(x)).mean())
            if nan == "d" and loop.state.batch_idx == 1:
                d_loss = d_loss * float("nan")
            opts["d"].zero_grad()
            loop.backward(d_loss)
            opts["d"].step()
            with opts.toggle("g"):
                g_loss = torch.nn.functional.softplus(-d_net(g_net(x))).mean()
                if nan == "g" and loop.state.batch_idx == 1:
                    g_loss = g_loss * float("nan")
                opts["g"].zero_grad()
                loop.backward(g_loss)
                opts["g"].step()
        return step

    def models():
        torch.manual_seed(3)
        return {"g": torch.nn.Linear(2, 2), "d": torch.nn.Linear(2, 1)}

    batches = [torch.randn(16, 2, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    return device_and_cpu(lambda m: {"g": make_g(m["g"].parameters()), "d": make_d(m["d"].parameters())},
                          step_factory, batches, model_factory=models)


ADAM = lambda params: torch.optim.Adam(params, lr=0.01)  # noqa: E731
RMSPROP = lambda params: torch.optim.RMSprop(params, lr=0.01)  # noqa: E731


@pytest.mark.fault
@pytest.mark.parametrize("nan", ["d", "g"])
@pytest.mark.parametrize("kinds", [(ADAM, ADAM), (RMSPROP, ADAM), (ADAM, RMSPROP)], ids=["both-fused", "d-read", "g-read"])
def test_two_optimizers_in_one_batch_are_each_counted_by_the_flag_they_stepped_on(nan, kinds) -> None:
    """The discriminator steps before the generator's loss exists: a NaN generator loss must
    not count its step as skipped (it stepped on the flag as it was), nor must a read made for
    an optimizer that cannot skip on the device drop the other's skip. Counts and parameters
    as on the CPU path, whichever of the two is fused by optim and which reads."""
    (on_device, plugin), (on_cpu, cpu) = gan(nan, *kinds)
    assert counts(plugin) == counts(cpu) == {"g": (3, 1), "d": (3, 1) if nan == "d" else (4, 0)}
    for name in ("g", "d"):  # (the same steps taken: a skipped one would differ far beyond rounding)
        assert_close(params(on_device[name]), params(on_cpu[name]))


@pytest.mark.fault
def test_a_gradient_skip_on_the_device_is_counted_when_another_optimizer_reads() -> None:
    """clip_norm with "a" (Adam, run fused) and "b" (RMSprop, reads the loss flag at its step):
    a NaN gradient in a's layer at batch 2 is skipped on the device and counted (with its
    warning) at b's read, as the CPU path counts it."""
    def make(m):
        return {"a": torch.optim.Adam(m[0].parameters(), lr=0.01), "b": torch.optim.RMSprop(m[2].parameters(), lr=0.01)}

    def step_factory(m):
        return nan_grad_at(m, {2}, named=True)

    (on_device, plugin), (on_cpu, cpu) = device_and_cpu(make, step_factory, data(5), clip_norm=1.0)
    assert counts(plugin) == counts(cpu) == {"a": (4, 1), "b": (5, 0)}
    assert_close(params(on_device), params(on_cpu))


@pytest.mark.fault
def test_a_checkpoint_at_batch_end_counts_the_batch_s_skipped_step() -> None:
    """The checkpoint plugin saves at batch_end: the state optim gives there counts the step
    skipped on the device in that very batch as skipped, as the CPU path's state does."""
    saved = {}

    def step_factory(m):
        return nan_at(m, {1})

    class Saver:
        def __init__(self, key):
            self.key = key

        @hookfit.hookimpl
        def batch_end(self, loop):
            if loop.state.batch_idx == 1:
                state = loop.pm.get_plugin("optim").state_dict()["optimizers"]["default"]
                saved[self.key] = (state["steps"], state["skipped"])

    for defer in (True, None):
        m = model()
        with pytest.warns(OptimWarning):
            hookfit.Loop(step_factory(m), data(4), model=m, optimizers=torch.optim.Adam(m.parameters(), lr=0.01),
                         max_epochs=1, plugins=[Optim(defer=defer), Saver(defer)]).fit()
    assert saved[True] == saved[None] == (1, 1)


def test_sharded_parameters_switch_adam_only(tmp_path) -> None:
    """FSDP2's parameters are DTensors: torch's fused Adam has their sharding rules, its fused
    SGD and Adagrad have none (their step would fail), so only Adam is switched, and it steps
    (skipping on found_inf) on them. One process, gloo, on the CPU."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hookfit.plugins.support import kernels

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))

        def sharded():
            param = torch.nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]))
            param.grad = distribute_tensor(torch.full((4, 4), 0.5), mesh, [Shard(0)])
            return param

        for kind, switched in ((torch.optim.SGD, False), (torch.optim.Adagrad, False), (torch.optim.Adam, True)):
            opt = kind([sharded()], lr=0.1)
            kernels.fuse(opt)
            assert kernels.skips_on_device(opt) is switched, kind
        param = opt.param_groups[0]["params"][0]
        for found_inf, moved in ((1.0, False), (0.0, True)):
            before = param.full_tensor().clone()
            opt.found_inf, opt.grad_scale = torch.tensor(found_inf), None
            opt.step()
            assert torch.equal(before, param.full_tensor()) is not moved
    finally:
        dist.destroy_process_group()


# -- nonfinite="raise" on the device path: the error at the next read, never inside a save ----
def adam_run(bad: set[int], *plugins, step=None, **loop_options):
    """Adam (run fused) on the device path under nonfinite="raise", NaN losses at ``bad``."""
    m = model()
    optim = Optim(defer=True, nonfinite="raise")
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    hookfit.Loop(step or nan_at(m, bad), data(9), model=m, optimizers=opt, max_epochs=1,
                 plugins=[optim, *plugins], **loop_options).fit()
    return m, optim, opt


@pytest.mark.fault
def test_a_run_that_max_steps_ends_before_any_read_still_raises() -> None:
    """max_steps ends the run in the middle of the epoch, so no stage end reads the flags: the
    end of the run reads them and raises, as the CPU path raised at the loss."""
    with pytest.raises(FloatingPointError, match=r"non-finite loss at epoch 1, batch 4 \(its steps were skipped"):
        adam_run({3}, max_steps=7)


@pytest.mark.fault
def test_a_raise_comes_after_every_window_read_is_counted() -> None:
    """NaN losses at batch_idx 2 and 5 (batches 3 and 6), read at the stage's end: both skipped steps are counted
    before the error (a failure checkpoint would otherwise save them as real steps), so the
    counters agree with the steps Adam really took."""
    holder = {}

    class Keep:
        @hookfit.hookimpl
        def fit_start(self, loop):
            holder["optim"] = loop.pm.get_plugin("optim")

    with pytest.raises(FloatingPointError, match="batch 3"), \
            pytest.warns(OptimWarning, match=r"2 optimizer steps were skipped .*\(first: non-finite loss at epoch 1, batch 3"):
        adam_run({2, 5}, Keep())
    managed = holder["optim"].optimizers["default"]
    assert (managed.steps, managed.skipped) == (7, 2)
    assert managed.optimizer.state[next(iter(managed.params))]["step"].item() == 7


@pytest.mark.fault
def test_an_interrupt_checkpoint_is_written_when_its_read_finds_a_nonfinite_loss(tmp_path) -> None:
    """A stop at step 5 and a NaN loss at batch 3 never read before: the interrupt checkpoint
    reads the flags and is written whole (the error is not raised inside the save); the
    interrupted run then warns, naming the batch, as runs that end otherwise do."""
    from hookfit.plugins.checkpoint import Checkpoint

    class Stop:
        @hookfit.hookimpl
        def batch_end(self, loop):
            if loop.training and loop.state.step == 5:
                loop.request_stop("user stop")

    with pytest.warns(OptimWarning, match=r"non-finite loss at epoch 1, batch 4 .*found at the end of the run"):
        adam_run({3}, Stop(), Checkpoint(background=False, on_interrupt=True), run_dir=str(tmp_path))
    [saved] = list(tmp_path.rglob("*.pt"))
    state = torch.load(saved, weights_only=False)["plugins"]["optim"]["optimizers"]["default"]
    assert (state["steps"], state["skipped"]) == (4, 1)


@pytest.mark.fault
def test_a_step_before_the_batch_s_backward_skips_on_the_window_its_gradients_are_from() -> None:
    """The step function steps first (on the gradients of the batch before) and then calls
    backward; a NaN loss at batch 2: the step at batch 3 skips on batch 2's flag, so the
    parameters stay finite and end as on the CPU path."""
    def step_factory(m):
        def step(loop, batch):
            loop.optimizers.step()
            loop.optimizers.zero_grad()
            loss = mse(m, batch)
            if loop.state.batch_idx == 2:
                loss = loss * float("nan")
            loop.backward(loss)
        return step

    (on_device, _), (on_cpu, _) = device_and_cpu(lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
                                                 step_factory, data(6))
    assert all(torch.isfinite(p).all() for p in on_device.parameters())
    assert_close(params(on_device), params(on_cpu))


def test_sgd_over_parameters_outside_the_model_is_not_switched() -> None:
    """A sparse embedding the model does not hold (optim cannot look at its module) keeps the
    kernel torch picks: torch's fused SGD would refuse its sparse gradient."""
    m = model()
    table = torch.nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SGD([*m.parameters(), *table.parameters()], lr=0.1)

    def step(loop, batch):
        x, y = batch
        loop.backward(torch.nn.functional.mse_loss(m(x + table(torch.arange(8) % 10)), y))
        loop.optimizers.step()
        loop.optimizers.zero_grad()

    hookfit.Loop(step, data(4), model=m, optimizers=opt, max_epochs=1, plugins=[Optim(defer=True)]).fit()
    assert opt.param_groups[0]["fused"] is None


@pytest.mark.fault
def test_a_state_taken_before_optim_s_batch_end_counts_the_batch_s_skipped_step() -> None:
    """accumulate=2, a NaN loss at batch 2: a plugin that takes optim's state in a batch_end
    that runs before optim's (tryfirst) sees the window 2-3's step as skipped."""
    seen = []

    class Early:
        @hookfit.hookimpl(tryfirst=True)
        def batch_end(self, loop):
            if loop.state.batch_idx == 3:
                state = loop.pm.get_plugin("optim").state_dict()["optimizers"]["default"]
                seen.append((state["steps"], state["skipped"]))

    m = model()
    with pytest.warns(OptimWarning):
        hookfit.Loop(nan_at(m, {2}), data(6), model=m, optimizers=torch.optim.Adam(m.parameters(), lr=0.01),
                     max_epochs=1, plugins=[Optim(defer=True, accumulate=2), Early()]).fit()
    assert seen == [(1, 1)]


class OpsPerBatch:
    """The torch operators run from each training batch's start to its end, every plugin's
    ``batch_end`` included (``detach``, which runs no kernel, left out)."""

    def __init__(self) -> None:
        from test_flag import Ops

        self.mode, self.batches = Ops(), []

    @hookfit.hookimpl(tryfirst=True)
    def batch_start(self, loop) -> None:
        if loop.training:
            self.mode.ops = []
            self.mode.__enter__()

    @hookfit.hookimpl(trylast=True)
    def batch_end(self, loop) -> None:
        if loop.training:
            self.mode.__exit__(None, None, None)
            self.batches.append([op for op in self.mode.ops if op != "detach.default"])


def test_the_device_path_adds_one_operator_a_step_to_a_raw_loop_s_the_window_s_flag() -> None:
    """On an accelerator every operator is a kernel launch a step. The default stack's step on
    the device path runs a raw loop's operators (the same fused kernel, given the window's flag
    as ``found_inf``) and one more: the loss's check into a flag made zero ahead of time. The
    zeros themselves are one operator per 1024 windows (here at the first step)."""
    from io import StringIO

    from hookfit.plugins.console import Console
    from hookfit.plugins.interrupter import Interrupter
    from hookfit.plugins.metrics import Metrics
    from test_flag import Ops

    batches = data(8)
    m_raw, m = model(), model()
    raw_opt = torch.optim.SGD(m_raw.parameters(), lr=0.1, momentum=0.9, fused=True)
    raw = Ops()
    for i, batch in enumerate(batches):
        raw.ops = []
        with raw:
            loss = mse(m_raw, batch)
            loss.backward()
            raw_opt.step()
            raw_opt.zero_grad()
        if i == 3:
            raw_ops = [op for op in raw.ops if op != "detach.default"]
    ops = OpsPerBatch()
    hookfit.Loop(nan_at(m, set()), batches, model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                 max_epochs=1, plugins=[Optim(defer=True), Metrics(defer=True, interval=3600.0),
                                        Console(stream=StringIO()), Interrupter(signals=False), ops]).fit()
    assert "_fused_sgd_.default" in raw_ops
    for seen in ops.batches[1:-1]:  # (the first makes the zeros; the last runs into the stage's end)
        extra = list(seen)
        for op in raw_ops:
            extra.remove(op)
        assert extra == ["_amp_foreach_non_finite_check_and_unscale_.default"], seen
    assert params(m) and all(torch.equal(a, b) for a, b in zip(params(m), params(m_raw)))
