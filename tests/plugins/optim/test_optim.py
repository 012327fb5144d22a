"""optim: manual stepping matches hand-written PyTorch bit for bit, and its policies hold."""

from __future__ import annotations

import pytest
import torch

import hookfit
from hookfit.plugins.optim import Optim, OptimWarning
from hookfit.errors import UsageError
from conftest import Recorder
from conftest import REPO


def data(n: int = 10, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def model(seed: int = 1) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def mse(m: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(m(x), y)


def params(m: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in m.parameters()]


def assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def fit(m, opt, batches, *plugins, epochs=2, step=None, **kwargs):
    def default_step(loop, batch):
        loss = mse(m, batch)
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return loss

    return hookfit.Loop(
        step or default_step, batches, model=m, optimizers=opt, max_epochs=epochs,
        plugins=[Optim(**kwargs), *plugins],
    ).fit()


def test_plain_sgd_is_bitwise_equal_to_a_raw_loop() -> None:
    batches = data()
    raw = model()
    opt = torch.optim.SGD(raw.parameters(), lr=0.1)
    for _ in range(2):
        for b in batches:
            opt.zero_grad()
            mse(raw, b).backward()
            opt.step()
    m = model()
    fit(m, torch.optim.SGD(m.parameters(), lr=0.1), batches)
    assert_bitwise(params(m), params(raw))


@pytest.mark.parametrize("zero_first", [False, True])
def test_accumulation_with_adam_and_clipping_matches_raw(zero_first: bool) -> None:
    batches = data(10)  # windows of 4: steps after batches 3, 7 and the partial 8-9
    raw = model()
    opt = torch.optim.Adam(raw.parameters(), lr=0.01)
    for _ in range(2):
        for i, b in enumerate(batches):
            (mse(raw, b) / (4 if i < 8 else 2)).backward()  # the partial window holds 2 batches
            if (i + 1) % 4 == 0 or i == len(batches) - 1:
                torch.nn.utils.clip_grad_norm_(list(raw.parameters()), 0.5)
                opt.step()
                opt.zero_grad()

    m = model()
    adam = torch.optim.Adam(m.parameters(), lr=0.01)

    def step(loop, batch):
        if zero_first:  # both orders users write work the same
            loop.optimizers.zero_grad()
        loss = mse(m, batch)
        loop.backward(loss)
        loop.optimizers.step()
        if not zero_first:
            loop.optimizers.zero_grad()
        return loss

    state = fit(m, adam, batches, step=step, accumulate=4, clip_norm=0.5)
    assert_bitwise(params(m), params(raw))
    assert state.step == 20  # batches, not optimizer steps


def test_alternating_optimizers_with_toggle_match_raw_and_count_apart() -> None:
    def pair():
        torch.manual_seed(3)
        return torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)

    batches = [torch.randn(16, 2, generator=torch.Generator().manual_seed(i)) for i in range(6)]

    def losses(g, d, x):
        fake = g(x)
        d_loss = torch.nn.functional.softplus(d(fake.detach())).mean() + torch.nn.functional.softplus(-d(x)).mean()
        return fake, d_loss

    g, d = pair()
    og, od = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)
    for x in batches:
        fake, d_loss = losses(g, d, x)
        od.zero_grad(); d_loss.backward(); od.step()
        for p in d.parameters():
            p.requires_grad_(False)
        g_loss = torch.nn.functional.softplus(-d(g(x))).mean()
        og.zero_grad(); g_loss.backward(); og.step()
        for p in d.parameters():
            p.requires_grad_(True)

    G, D = pair()
    flags_inside = []

    def step(loop, x):
        opts = loop.optimizers
        fake, d_loss = losses(G, D, x)
        opts["d"].zero_grad(); loop.backward(d_loss); opts["d"].step()
        with opts.toggle("g"):
            flags_inside.append(all(not p.requires_grad for p in D.parameters()))
            g_loss = torch.nn.functional.softplus(-D(G(x))).mean()
            opts["g"].zero_grad(); loop.backward(g_loss); opts["g"].step()
        return {"d_loss": d_loss, "g_loss": g_loss}  # no "loss" key

    counts = {}

    class Count:
        @hookfit.hookimpl
        def fit_end(self, loop):
            counts.update({n: o.steps for n, o in loop.optimizers.items()})

    loop = hookfit.Loop(
        step, batches, model={"g": G, "d": D},
        optimizers={"g": torch.optim.SGD(G.parameters(), lr=0.1), "d": torch.optim.SGD(D.parameters(), lr=0.1)},
        plugins=[Optim(), Count()],
    )
    state = loop.fit()
    assert_bitwise(params(G) + params(D), params(g) + params(d))
    assert all(flags_inside) and all(p.requires_grad for p in D.parameters())
    assert counts == {"g": 6, "d": 6} and state.step == 6
    assert isinstance(loop.optimizers, dict)  # the user's own object is given back at fit_end


def test_optimizer_hooks_fire_in_order() -> None:
    rec = Recorder()
    m = model()
    fit(m, torch.optim.SGD(m.parameters(), lr=0.1), data(2), rec, epochs=1)
    names = [n for n in rec.names() if n in ("backward", "before_backward", "after_backward",
                                             "before_optimizer_step", "after_optimizer_step")]
    # the recorder's own backward (registered last, so asked first) returns None: optim's runs
    assert names == ["backward", "before_backward", "after_backward", "before_optimizer_step", "after_optimizer_step"] * 2
    args = [a for n, a in rec.events if n == "before_optimizer_step"]
    assert args[0]["name"] == "default" and isinstance(args[0]["optimizer"], torch.optim.SGD)


def test_hooks_of_a_plugin_registered_or_removed_mid_run_are_honoured() -> None:
    """optim skips its event calls while nobody listens; a listener that arrives (or leaves)
    during the run is seen from the next step on."""
    seen = []

    class Listener:
        @hookfit.hookimpl
        def before_backward(self, loop):
            seen.append(("backward", loop.state.batch_idx))

        @hookfit.hookimpl
        def after_optimizer_step(self, loop):
            seen.append(("step", loop.state.batch_idx))

    listener = Listener()

    class Manage:
        @hookfit.hookimpl
        def batch_end(self, loop, batch_idx):
            if batch_idx == 1:
                loop.pm.register(listener, name="listener")
            if batch_idx == 3:
                loop.pm.unregister(listener)

    m = model()
    fit(m, torch.optim.SGD(m.parameters(), lr=0.1), data(6), Manage(), epochs=1)
    assert seen == [("backward", 2), ("step", 2), ("backward", 3), ("step", 3)]


GRAD_NORM = REPO / "examples" / "grad_norm_plugin.py"


def grad_norm_example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("grad_norm_plugin", GRAD_NORM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grad_norm_example_plugin_sees_final_gradients() -> None:
    norms = grad_norm_example().GradNorm()
    m = model()
    fit(m, torch.optim.SGD(m.parameters(), lr=0.1), data(3), norms, epochs=1, clip_norm=0.01)
    assert len(norms.norms) == 3
    assert all(0 < n <= 0.01 + 1e-6 for n in norms.norms)  # measured after clipping


def test_grad_norm_example_plugin_measures_sparse_gradients_beside_dense_ones() -> None:
    """An embedding with sparse gradients under SparseAdam beside a dense layer under Adam (a
    recommender's two optimizers): each optimizer's norm is the one plain torch computes from the
    coalesced gradient, where vector_norm of the sparse tensor itself raises."""
    torch.manual_seed(0)
    table, head = torch.nn.Embedding(10, 3, sparse=True), torch.nn.Linear(3, 1)
    optimizers = {"sparse": torch.optim.SparseAdam(table.parameters(), lr=0.01),
                  "dense": torch.optim.Adam(head.parameters(), lr=0.01)}
    batches = [(torch.tensor([1, 2, 2, 5]), torch.randn(4, 1)) for _ in range(3)]
    expected: list[tuple[float, float]] = []

    def step(loop, batch):
        ids, y = batch
        loss = torch.nn.functional.mse_loss(head(table(ids)), y)
        loop.backward(loss)
        dense = torch.cat([head.weight.grad.flatten(), head.bias.grad.flatten()]).norm().item()
        expected.append((table.weight.grad.coalesce().values().norm().item(), dense))
        for optimizer in loop.optimizers.values():
            optimizer.step()
            optimizer.zero_grad()

    norms = grad_norm_example().GradNorm()
    state = hookfit.Loop(step, batches, model=torch.nn.ModuleList([table, head]), optimizers=optimizers,
                         max_epochs=1, plugins=[Optim(), norms]).fit()
    assert state.status == "completed"
    assert len(norms.norms) == 6  # two optimizers, three steps
    assert norms.norms == pytest.approx([norm for pair in expected for norm in pair], rel=1e-5)


def test_grad_norm_example_plugin_reads_the_host_once_an_epoch_and_skips_an_optimizer_without_gradients(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The example follows the advice it illustrates: no host read per step (its norms stay
    tensors until the training stage's end), and an optimizer none of whose parameters got a
    gradient (a part of the model this step did not use) has no norm instead of an error."""
    import sys

    reads: list[str] = []
    for method in ("item", "tolist", "__float__"):
        original = getattr(torch.Tensor, method)

        def counted(self, *args, _original=original, _method=method):
            if sys._getframe(1).f_code.co_filename == str(GRAD_NORM):
                reads.append(_method)
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, method, counted)

    norms = grad_norm_example().GradNorm()
    m, unused = model(), torch.nn.Linear(4, 1)
    optimizers = {"model": torch.optim.SGD(m.parameters(), lr=0.1), "unused": torch.optim.SGD(unused.parameters(), lr=0.1)}

    def step(loop, batch):
        loop.backward(mse(m, batch))
        for optimizer in loop.optimizers.values():
            optimizer.step()
            optimizer.zero_grad()

    state = hookfit.Loop(step, data(4), model=m, optimizers=optimizers, max_epochs=2,
                         plugins=[Optim(accumulate=3), norms]).fit()
    assert state.status == "completed"
    assert len(reads) == 2, reads  # one an epoch, for its 2 steps (a window of 3, then a partial one of 1)
    assert len(norms.norms) == 4 and all(n > 0 for n in norms.norms)


def test_grad_norm_example_plugin_publishes_each_epochs_last_norm_in_the_csv_and_metrics_jsonl(tmp_path) -> None:
    import csv
    import json

    from hookfit.plugins.csv_log import CSVLogger
    from hookfit.plugins.metrics import Metrics
    from hookfit.plugins.metrics_log import MetricsLog

    norms = grad_norm_example().GradNorm()
    m = model()
    state = hookfit.Loop(lambda loop, batch: fit_step(loop, m, batch), data(3),
                         val_step=lambda loop, batch: {"loss": mse(m, batch)}, val_data=data(1), model=m,
                         optimizers=torch.optim.SGD(m.parameters(), lr=0.1), max_epochs=2, run_dir=tmp_path,
                         plugins=[Optim(), Metrics(interval=0), MetricsLog(every_n_steps=1), CSVLogger(), norms]).fit()
    assert state.status == "completed" and len(norms.norms) == 6
    last = [norms.norms[2], norms.norms[5]]  # each epoch's last step's, as read once an epoch
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["grad_norm"]) for r in rows if r["stage"] == "train"] == pytest.approx(last, rel=1e-6)
    assert [r["grad_norm"] for r in rows if r["stage"] == "valid"] == ["", ""]  # a training metric only
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["grad_norm"] for r in lines if r["event"] == "epoch" and r["stage"] == "train"] == pytest.approx(last)
    steps = [r["grad_norm"] for r in lines if r["event"] == "step"]
    assert steps == pytest.approx(norms.norms)  # a publication after every batch: that step's norm


def test_the_optimizer_step_events_see_the_position_their_specs_state() -> None:
    """``before_optimizer_step``'s docstring: ``batch_idx`` is the closing batch; ``step`` is its
    global number inside the step function, one more for a partial window stepped at the stage's
    end; ``step`` kept from ``batch_start`` is the closing batch's number in both; the managed
    optimizer's ``steps`` counts real steps before it there, and this one in ``after_optimizer_step``."""
    seen: list[tuple[str, int, int, int, int]] = []

    class Probe:
        kept = -1

        @hookfit.hookimpl
        def batch_start(self, loop):
            self.kept = loop.state.step

        @hookfit.hookimpl
        def before_optimizer_step(self, loop, name):
            seen.append(("before", loop.state.step, loop.state.batch_idx, self.kept, loop.optimizers[name].steps))

        @hookfit.hookimpl
        def after_optimizer_step(self, loop, name):
            seen.append(("after", loop.state.step, loop.state.batch_idx, self.kept, loop.optimizers[name].steps))

    m = model()
    fit(m, torch.optim.SGD(m.parameters(), lr=0.1), data(6), Probe(), epochs=2, accumulate=4)
    # data with a len(): the epoch's last, partial window steps in its last batch, as the step asks
    assert seen == [("before", 3, 3, 3, 0), ("after", 3, 3, 3, 1), ("before", 5, 5, 5, 1), ("after", 5, 5, 5, 2),
                    ("before", 9, 3, 9, 2), ("after", 9, 3, 9, 3), ("before", 11, 5, 11, 3), ("after", 11, 5, 11, 4)]
    seen.clear()

    class Unsized:  # batches without a len()
        def __iter__(self):
            return iter(data(6))

    fit(m, torch.optim.SGD(m.parameters(), lr=0.1), Unsized(), Probe(), epochs=2, accumulate=4)
    # without a len(): the partial window is known only at the stage's end, which steps it
    assert seen == [("before", 3, 3, 3, 0), ("after", 3, 3, 3, 1), ("before", 6, 5, 5, 1), ("after", 6, 5, 5, 2),
                    ("before", 9, 3, 9, 2), ("after", 9, 3, 9, 3), ("before", 12, 5, 11, 3), ("after", 12, 5, 11, 4)]


class Skips:
    """Records ``step_skipped``: (optimizer, reason, step)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, int]] = []

    @hookfit.hookimpl
    def step_skipped(self, optimizer: str, reason: str, step: int) -> None:
        self.seen.append((optimizer, reason, step))


@pytest.mark.fault
def test_nonfinite_loss_skips_the_step_with_one_warning_and_a_count() -> None:
    m = model()
    batches = data(6)
    before = None

    def step(loop, batch):
        nonlocal before
        loss = mse(m, batch)
        if loop.state.batch_idx in (2, 4):
            loss = loss * float("nan")
            before = params(m) if before is None else before
        loop.backward(loss)
        stepped = loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss, "stepped": float(stepped)}

    skipped = []

    class Watch:
        @hookfit.hookimpl
        def fit_end(self, loop):
            skipped.append(loop.optimizers["default"].skipped)

    skips = Skips()
    with pytest.warns(OptimWarning) as caught:
        fit(m, torch.optim.SGD(m.parameters(), lr=0.1), batches, Watch(), skips, epochs=1, step=step)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert "skipped the step of optimizer 'default': non-finite loss at epoch 1, batch 3" in messages[0]
    assert "2 optimizer steps were skipped" in messages[1]
    assert skipped == [2]
    # every skip is announced, when it happens (the step counter is that batch's, before it ends)
    assert skips.seen == [("default", "non-finite loss at epoch 1, batch 3", 2),
                          ("default", "non-finite loss at epoch 1, batch 5", 4)]
    assert all(torch.isfinite(p).all() for p in m.parameters())


@pytest.mark.fault
@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_nonfinite_loss_skips_its_own_window_only(accumulate: int) -> None:
    """Two optimizers, a NaN loss for the second in batch 1: every step of that accumulation
    window is skipped (its gradients are incomplete) and the next window steps normally, with
    or without optim's per-batch hook (it has none without accumulation)."""
    batches, bad = data(6), 1

    def losses(a, b, i, batch):
        loss_b = mse(b, batch)
        return mse(a, batch), loss_b * float("nan") if i == bad else loss_b

    raw_a, raw_b = model(1), model(2)
    opt_a, opt_b = torch.optim.SGD(raw_a.parameters(), lr=0.1), torch.optim.SGD(raw_b.parameters(), lr=0.1)
    for start in range(0, len(batches), accumulate):
        window = range(start, start + accumulate)
        if bad in window:
            continue
        for i in window:
            loss_a, loss_b = losses(raw_a, raw_b, i, batches[i])
            (loss_a / accumulate).backward()
            (loss_b / accumulate).backward()
        opt_a.step(); opt_b.step(); opt_a.zero_grad(); opt_b.zero_grad()

    a, b = model(1), model(2)

    def step(loop, batch):
        loss_a, loss_b = losses(a, b, loop.state.batch_idx, batch)
        loop.backward(loss_a)
        loop.backward(loss_b)
        for opt in loop.optimizers.values():
            opt.step()
            opt.zero_grad()

    skipped = {}

    class Count:
        @hookfit.hookimpl
        def fit_end(self, loop):
            skipped.update({n: o.skipped for n, o in loop.optimizers.items()})

    with pytest.warns(OptimWarning, match="non-finite loss at epoch 1, batch 2"):
        hookfit.Loop(step, batches, model=[a, b], plugins=[Optim(accumulate=accumulate), Count()],
                     optimizers={"a": torch.optim.SGD(a.parameters(), lr=0.1),
                                 "b": torch.optim.SGD(b.parameters(), lr=0.1)}).fit()
    assert_bitwise(params(a) + params(b), params(raw_a) + params(raw_b))
    assert skipped == {"a": 1, "b": 1}


@pytest.mark.fault
def test_nonfinite_loss_raise_policy() -> None:
    m = model()

    def step(loop, batch):
        loop.backward(mse(m, batch) * float("inf"))

    with pytest.raises(FloatingPointError, match="non-finite loss.*epoch 1, batch 1"):
        fit(m, torch.optim.SGD(m.parameters(), lr=0.1), data(2), step=step, nonfinite="raise")


@pytest.mark.fault
def test_optim_names_a_batch_counted_from_1_as_the_core_s_note_on_the_same_error_names_it() -> None:
    """A NaN loss at the second epoch's batch_idx 2 under "raise": optim's error names "epoch 2, batch 3", the batch
    the core's note on that error names (``epoch 2, stage train, batch 3``, batches counted from 1 as the console's
    ``batch=``), not ``batch 2``."""
    import re

    m = model()

    def step(loop, batch):
        bad = loop.state.epoch == 1 and loop.state.batch_idx == 2
        loop.backward(mse(m, batch) * (float("nan") if bad else 1.0))
        loop.optimizers.step()
        loop.optimizers.zero_grad()

    with pytest.raises(FloatingPointError) as caught:
        fit(m, torch.optim.SGD(m.parameters(), lr=0.1), data(4), step=step, nonfinite="raise")
    said = re.search(r"at epoch (\d+), batch (\d+)$", str(caught.value))
    noted = [re.search(r"\(epoch (\d+), stage train, batch (\d+)\)", note) for note in caught.value.__notes__]
    assert said is not None and said.groups() == ("2", "3"), str(caught.value)
    assert [n.groups() for n in noted if n] == [("2", "3")], caught.value.__notes__


@pytest.mark.fault
@pytest.mark.parametrize("values", [2, 0])
def test_a_loss_of_several_values_or_none_is_checked_whole(values: int) -> None:
    """The check reads a CPU loss of one number at once; any other count (per-sample losses
    not reduced, an empty tensor) is checked value by value: an infinite one among several
    raises before ``backward`` would refuse the shape, and an empty one has nothing to flag."""
    m = model()

    def step(loop, batch):
        losses = torch.nn.functional.mse_loss(m(batch[0]), batch[1], reduction="none").flatten()[:values]
        if values:
            losses = losses * torch.tensor([1.0, float("inf")])
        loop.backward(losses)

    error = FloatingPointError if values else RuntimeError  # backward: no implicit gradient for it
    with pytest.raises(error, match="non-finite loss.*epoch 1, batch 1" if values else "scalar outputs"):
        fit(m, torch.optim.SGD(m.parameters(), lr=0.1), data(2), step=step, nonfinite="raise")


@pytest.mark.fault
def test_nonfinite_policy_none_checks_nothing() -> None:
    m = model()

    def step(loop, batch):
        loop.backward(mse(m, batch) * float("nan"))
        assert loop.optimizers.step() is True  # stepped: the user asked for no check
        loop.optimizers.zero_grad()

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", OptimWarning)
        fit(m, torch.optim.SGD(m.parameters(), lr=0.1), data(1), step=step, epochs=1, nonfinite=None)
    assert all(torch.isnan(p).all() for p in m.parameters())


@pytest.mark.fault
def test_nonfinite_gradient_is_caught_when_clipping() -> None:
    m = model()

    def step(loop, batch):
        loss = mse(m, batch)
        loop.backward(loss)
        if loop.state.batch_idx == 1:
            next(m.parameters()).grad[0, 0] = float("inf")
        loop.optimizers.step()
        loop.optimizers.zero_grad()

    with pytest.warns(OptimWarning, match="non-finite gradient"):
        fit(m, torch.optim.SGD(m.parameters(), lr=0.1), data(3), step=step, epochs=1, clip_norm=1.0)
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_schedulers_per_step_and_per_epoch() -> None:
    for interval, expected in (("step", 0.1 * 0.5 ** 6), ("epoch", 0.1 * 0.5 ** 2)):
        m = model()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        fit(m, opt, data(3), schedulers=sched, scheduler_interval=interval)
        assert opt.param_groups[0]["lr"] == pytest.approx(expected)


def test_amp_grad_scaler_scales_the_loss() -> None:
    m = model()
    seen = []

    class Grad:
        @hookfit.hookimpl
        def after_backward(self):
            seen.append(next(m.parameters()).grad.abs().max().item())

        @hookfit.hookimpl
        def before_optimizer_step(self):
            seen.append(next(m.parameters()).grad.abs().max().item())

    fit(m, torch.optim.SGD(m.parameters(), lr=0.1), data(1), Grad(), epochs=1, amp=True)
    scaled, unscaled = seen
    assert scaled / unscaled == pytest.approx(2.0 ** 16, rel=1e-3)  # GradScaler's initial scale


@pytest.mark.bad_input
def test_unknown_optimizer_name_lists_the_known_ones() -> None:
    m = model()

    def step(loop, batch):
        loop.optimizers["gen"].step()

    with pytest.raises(KeyError, match=r"unknown optimizer 'gen'; this run's optimizers are: 'g', 'd'"):
        hookfit.Loop(step, [1], optimizers={"g": torch.optim.SGD(m.parameters()), "d": torch.optim.SGD(m.parameters())},
                     plugins=[Optim()]).fit()


@pytest.mark.bad_input
def test_parameters_an_optimizer_steps_outside_the_model_are_warned_of_at_configure() -> None:
    """A loss module with learnable parameters and a tensor made apart, stepped by the optimizer but not in
    Loop(model=...): checkpoints and EMA would leave them out silently. One warning names the optimizer, how
    many, their shapes; none where the model holds them all, nor without a model, nor in a validation."""
    import warnings

    m, scale = model(), torch.nn.Linear(1, 1)
    extra = torch.nn.Parameter(torch.zeros(3))  # (a plain tensor with requires_grad=True alike)
    opts = {"net": torch.optim.SGD(m.parameters(), lr=0.1),
            "loss": torch.optim.SGD([*scale.parameters(), extra], lr=0.1)}

    def step(loop, batch):
        loss = torch.nn.functional.mse_loss(scale(m(batch[0])), batch[1]) + extra.sum()
        loop.backward(loss)
        for opt in loop.optimizers.values():
            opt.step()
            opt.zero_grad()
        return loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hookfit.Loop(step, data(2), model=m, optimizers=opts, plugins=[Optim()]).fit()
    said = [str(w.message) for w in caught if issubclass(w.category, OptimWarning)]
    assert said == ["optim: optimizer 'loss' steps 3 parameter tensor(s) that Loop(model=...) does not hold (a tensor "
                    "of shape (1, 1), a tensor of shape (1,), a tensor of shape (3,)): checkpoints do not save them "
                    "and EMA does not average them. Give the model the module that holds them: "
                    "Loop(model=torch.nn.ModuleList([net, criterion]))"]
    assert [w.filename for w in caught if issubclass(w.category, OptimWarning)] == [__file__]  # the user's line
    for held in ({"net": m, "loss": torch.nn.ModuleList([scale]), "extra": torch.nn.ParameterList([extra])}, None):
        with warnings.catch_warnings():
            warnings.simplefilter("error", OptimWarning)
            hookfit.Loop(step, data(2), model=held, optimizers=opts, plugins=[Optim()]).fit()
            hookfit.Loop(val_step=lambda loop, batch: None, val_data=data(1), model=m, optimizers=opts,
                         plugins=[Optim()]).validate()


def test_one_optimizer_is_a_collection_of_one_stepped_with_or_without_its_name() -> None:
    """With one optimizer, loop.optimizers is that managed optimizer: a mapping of one whose item is
    itself, so a step through the name and one without count alike; it compares and hashes as
    an object, not as a mapping; unknown names are refused as in a collection."""
    m = model()
    seen: dict[str, object] = {}

    def step(loop, batch):
        opts = loop.optimizers
        loss = m(batch).pow(2).mean()
        loop.backward(loss)
        (opts["default"] if loop.state.step % 2 else opts).step()
        opts.zero_grad()
        seen.update(keys=list(opts), len=len(opts), item=opts["default"] is opts, hashed={opts: 1}[opts],
                    steps=opts.steps, groups=opts.param_groups is opts.optimizer.param_groups)
        with pytest.raises(KeyError, match="unknown optimizer 'gen'; this run's optimizers are: 'default'"):
            opts["gen"]
        return loss

    hookfit.Loop(step, [torch.randn(2, 4) for _ in range(4)], model=m, max_epochs=1,
                 optimizers=torch.optim.SGD(m.parameters(), lr=0.1), plugins=[Optim()]).fit()
    assert seen == {"keys": ["default"], "len": 1, "item": True, "hashed": 1, "steps": 4, "groups": True}


@pytest.mark.bad_input
@pytest.mark.parametrize("named", [False, True])
def test_a_closure_given_to_the_managed_step_is_refused_not_taken_for_the_stage_end(named: bool) -> None:
    """``loop.optimizers.step(closure)`` under an accumulation window is refused by name: its one flag
    (``partial``) is keyword only and a closure makes its gradients inside torch's step, so a closure can
    never make a step outside its accumulation window, whether the optimizer is named or not."""
    m = model()
    calls = []

    def step(loop, batch):
        x, y = batch
        loop.backward(torch.nn.functional.mse_loss(m(x), y))
        (loop.optimizers["default"] if named else loop.optimizers).step(lambda: calls.append(1))

    with pytest.raises(UsageError, match=r"step\(closure\) makes its gradients in torch's step"):
        hookfit.Loop(step, data(8), model=m, max_epochs=1, optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
                     plugins=[Optim(accumulate=4)]).fit()
    assert calls == []


def test_the_distributed_plugin_finds_no_torch_optimizer_in_a_collection_of_one_and_does_not_recurse() -> None:
    """A collection of one is its own item: walking ``loop.optimizers`` for torch optimizers
    (the distributed plugin's repointing at shards) stops there, as for any managed optimizer."""
    from hookfit.plugins.distributed.wrapping import torch_optimizers

    m = model()
    seen = {}

    def step(loop, batch):
        seen["found"] = list(torch_optimizers(loop.optimizers))
        return None

    hookfit.Loop(step, data(1), model=m, max_epochs=1, optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
                 plugins=[Optim()]).fit()
    assert seen == {"found": []}


@pytest.mark.bad_input
def test_unnamed_access_with_two_optimizers_asks_for_a_name() -> None:
    m = model()

    def step(loop, batch):
        loop.optimizers.step()

    with pytest.raises(TypeError, match="2 optimizers .* name one") as caught:
        hookfit.Loop(step, [1], optimizers={"g": torch.optim.SGD(m.parameters()), "d": torch.optim.SGD(m.parameters())},
                     plugins=[Optim()]).fit()
    # the step used optim wrongly: the note blames the step, naming what refused the call
    assert caught.value.__notes__[-1].startswith(
        "hookfit: raised in step function 'test_unnamed_access_with_two_optimizers_asks_for_a_name.<locals>.step', "
        "which called plugin 'optim'")
    with pytest.raises(KeyError, match="'e'") as caught:
        hookfit.Loop(lambda loop, batch: loop.optimizers["e"].step(), [1], plugins=[Optim()],
                     optimizers={"g": torch.optim.SGD(m.parameters()), "d": torch.optim.SGD(m.parameters())}).fit()
    assert "<lambda>', which called plugin 'optim'" in caught.value.__notes__[-1]


def test_whether_loop_optimizers_steps_unnamed_is_a_question_hasattr_answers() -> None:
    """``hasattr(loop.optimizers, "step")`` tells a plugin whether it may step without a name:
    ``True`` with one optimizer; ``False`` with several (the "name one" error is also an
    AttributeError), while calling it still raises the TypeError that asks for a name."""
    m = model()
    seen: dict[str, object] = {}

    def step(loop, batch):
        opts = loop.optimizers
        seen[str(len(opts))] = [hasattr(opts, what) for what in ("step", "zero_grad", "param_groups")]
        if len(opts) > 1:
            with pytest.raises(TypeError, match="2 optimizers .* name one: loop.optimizers\\[name\\].zero_grad"):
                opts.zero_grad()
            assert getattr(opts, "step", None) is None

    hookfit.Loop(step, [1], optimizers=torch.optim.SGD(m.parameters()), plugins=[Optim()]).fit()
    hookfit.Loop(step, [1], optimizers={"g": torch.optim.SGD(m.parameters()), "d": torch.optim.SGD(m.parameters())},
                 plugins=[Optim()]).fit()
    assert seen == {"1": [True, True, True], "2": [False, False, False]}


@pytest.mark.bad_input
def test_backward_without_the_optim_plugin_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HOOKFIT_PLUGINS")
    monkeypatch.setenv("HOOKFIT_DISABLE_PLUGINS", "optim")
    m = model()

    def step(loop, batch):
        loop.backward(mse(m, batch))

    with pytest.raises(RuntimeError, match=r"loop.backward\(\) needs a plugin .*disabled plugins: optim") as raised:
        hookfit.Loop(step, data(1), model=m, optimizers=torch.optim.SGD(m.parameters())).fit()
    # which plugin to enable, and what disabled it
    assert "the built-in 'optim' (disabled by HOOKFIT_DISABLE_PLUGINS=optim) does;" in str(raised.value)


@pytest.mark.bad_input
def test_resume_without_the_checkpoint_plugin_names_the_built_in_that_resumes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOKFIT_PLUGINS", "")
    m = model()
    with pytest.raises(RuntimeError, match=r"resume='latest' needs a plugin that implements the 'resume' event and no "
                       r"enabled plugin does \(the built-in 'checkpoint' \(disabled by HOOKFIT_PLUGINS= \(not listed "
                       r"there\)\) does; disabled plugins: .*\boptim\b"):
        hookfit.Loop(lambda loop, batch: None, data(1), model=m, resume="latest").fit()


@pytest.mark.bad_input
def test_resume_with_the_checkpoint_plugin_replaced_by_one_without_it_says_replaced() -> None:
    class Mine:
        name = "checkpoint"

        @hookfit.hookimpl
        def fit_start(self, loop):
            pass

    with pytest.raises(RuntimeError, match=r"the built-in 'checkpoint' \(replaced by [\w.<>]*Mine\) does;"):
        hookfit.Loop(lambda loop, batch: None, data(1), model=model(), resume="latest", plugins=[Mine()]).fit()


@pytest.mark.bad_input
def test_bad_configuration_is_named() -> None:
    with pytest.raises(ValueError, match="optim: accumulate must be a positive integer, got 0"):
        Optim(accumulate=0)
    with pytest.raises(ValueError, match="optim: nonfinite"):
        Optim(nonfinite="ignore")
    with pytest.raises(TypeError, match="optim: optimizer 'default' is a str"):
        hookfit.Loop(lambda l, b: None, [1], optimizers="sgd", plugins=[Optim()]).fit()


def test_state_dict_round_trip() -> None:
    m = model()
    plugin = Optim(amp=True)
    hookfit.Loop(lambda l, b: None, [1], optimizers=torch.optim.Adam(m.parameters()), plugins=[plugin]).fit()
    loop = hookfit.Loop(lambda l, b: None, [1], optimizers=torch.optim.Adam(m.parameters()), plugins=[plugin])
    captured = {}

    class Save:
        @hookfit.hookimpl
        def fit_start(self, loop):
            pass

        @hookfit.hookimpl(trylast=True)
        def batch_end(self, loop):
            loop.optimizers["default"].steps = 5
            captured["state"] = plugin.state_dict()
            loop.optimizers["default"].steps = 0
            plugin.load_state_dict(captured["state"])
            captured["after"] = loop.optimizers["default"].steps

    loop._given = loop._given + (Save(),)
    loop.fit()
    assert captured["after"] == 5 and captured["state"]["scaler"]["scale"] == 2.0 ** 16


@pytest.mark.parametrize("accumulate, max_steps", [(1, None), (3, None), (4, 6), (4, None)])
def test_should_sync_gradients_answers_exactly_the_batches_after_which_optim_steps(accumulate, max_steps) -> None:
    """The gradient-sync contract, as a distributed plugin asks it before each training batch:
    True exactly for the batches after which the optimizer really steps (the window's last, the
    stage's last with its partial window) and for the last before max_steps."""
    answers, stepped = [], []

    class Asker:
        name = "asker"

        @hookfit.hookimpl
        def batch_start(self, loop, batch_idx):
            if loop.training:
                answers.append((batch_idx, loop.hooks.should_sync_gradients(loop)))

        @hookfit.hookimpl
        def after_optimizer_step(self, loop):
            stepped.append(loop.state.batch_idx)

    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def step(loop, batch):
        loop.backward(mse(m, batch))
        loop.optimizers.step()
        loop.optimizers.zero_grad()

    hookfit.Loop(step, data(10), model=m, optimizers=opt, max_steps=max_steps,
                 plugins=[Optim(accumulate=accumulate), Asker()]).fit()
    # True after which it steps, and on the last batch of max_steps (the run may end there
    # with the window open: the gradients a checkpoint keeps must be every process's)
    assert [i for i, sync in answers if sync] == sorted(set(stepped) | ({max_steps - 1} if max_steps else set()))
    assert all(isinstance(sync, bool) for _, sync in answers)
    assert len(answers) == (max_steps or 10)


def test_with_data_of_unknown_length_every_batch_synchronises() -> None:
    """The stage's last batch, where a partial window is stepped, cannot be told in advance
    when the data has no length: optim answers True for every batch rather than leave the
    last window's gradients unsynchronised under DDP."""
    answers = []

    class Unsized:
        def __iter__(self):
            return iter(data(5))

    class Asker:
        name = "asker"

        @hookfit.hookimpl
        def batch_start(self, loop):
            answers.append(loop.hooks.should_sync_gradients(loop))

    m = model()

    def step(loop, batch):
        loop.backward(mse(m, batch))
        loop.optimizers.step()
        loop.optimizers.zero_grad()

    hookfit.Loop(step, Unsized(), model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
                 plugins=[Optim(accumulate=2), Asker()]).fit()
    assert answers == [True] * 5


def test_managed_optimizers_are_in_place_for_every_plugins_fit_start() -> None:
    """optim replaces loop.optimizers at configure: a plugin's fit_start sees the managed
    optimizers whatever the order the plugins run in."""
    from hookfit.plugins.optim import OnlyOptimizer, Optimizers

    seen = []

    class Early:
        name = "early"

        @hookfit.hookimpl(tryfirst=True)
        def fit_start(self, loop):
            seen.append(type(loop.optimizers))

    m = model()
    fit(m, torch.optim.SGD(m.parameters(), lr=0.1), data(2), Early(), epochs=1)
    assert seen == [OnlyOptimizer] and issubclass(OnlyOptimizer, Optimizers)  # one optimizer: the collection of one


# -- options are checked at construction -----------------------------------------------------

@pytest.mark.bad_input
@pytest.mark.parametrize("option", ["clip_norm", "clip_value"])
@pytest.mark.parametrize("value", [-1.0, 0, 0.0, -0.5, float("nan"), float("inf"), float("-inf"), "1", True, [1.0]],
                         ids=repr)
def test_clip_options_must_be_positive_finite_numbers(option: str, value) -> None:
    """clip_norm=-1.0 used to be accepted, and clip_grad_norm_ then scaled every gradient by a
    negative factor: training by gradient ascent. Refused with the option and the value named."""
    import re

    with pytest.raises(ValueError, match=re.escape(f"optim: {option} must be a positive finite number or None, got {value!r}")):
        Optim(**{option: value})


@pytest.mark.parametrize("value, expected", [(None, None), (1, 1.0), (0.5, 0.5), (1e-8, 1e-8)])
def test_clip_options_accept_positive_numbers_and_none(value, expected) -> None:
    plugin = Optim(clip_norm=value, clip_value=value)
    assert plugin.clip_norm == expected and plugin.clip_value == expected


# -- what runs is what is written: no method replaced, no plugin of optim's own ---------------

class Counted(Optim):
    """optim, counting the training batches its ``batch_end`` runs in."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.batch_ends: list[int] = []

    @hookfit.hookimpl(tryfirst=True)
    def batch_end(self, loop) -> None:
        if loop.training:
            self.batch_ends.append(loop.state.batch_idx)
        super().batch_end(loop)


class Shadowing:
    """Records, at each training batch's start, whether a plugin optim registered for itself is
    in the run, and the instance attributes that would shadow the methods of
    ``loop.optimizers`` and of each managed optimizer."""

    name = "shadowing_probe"

    def __init__(self) -> None:
        self.seen: list[tuple[bool, list[str]]] = []

    @hookfit.hookimpl
    def batch_start(self, loop) -> None:
        if loop.training:
            owners = [("optimizers", loop.optimizers), *loop.optimizers.items()]
            self.seen.append((any(name.startswith("optim.") for name, _ in loop.pm.list_name_plugin()),
                              [f"{owner}.{attr}" for owner, obj in owners for attr in ("step", "zero_grad")
                               if attr in vars(obj)]))


@pytest.mark.parametrize("options, batches", [(dict(), []), (dict(accumulate=2), [0, 1, 2]),
                                              (dict(amp=True), [0, 1, 2])])
def test_optim_takes_part_in_batch_end_itself_only_where_a_batch_needs_it(options, batches) -> None:
    """optim implements ``batch_end`` itself and declares (``batch_events``) that a run takes it
    only where a batch can close an accumulation window or update a loss scale; it registers no
    plugin of its own, and no method of ``loop.optimizers`` or a managed optimizer is replaced
    on the instance."""
    m = model()
    optim, probe = Counted(**options), Shadowing()
    hookfit.Loop(lambda loop, batch: fit_step(loop, m, batch), data(3), model=m, max_epochs=1,
                 optimizers=torch.optim.SGD(m.parameters(), lr=0.1), plugins=[optim, probe]).fit()
    assert optim.batch_ends == batches
    assert probe.seen == [(False, [])] * 3


def fit_step(loop, m, batch):
    loss = mse(m, batch)
    loop.backward(loss)
    stepped = loop.optimizers.step()
    loop.optimizers.zero_grad()
    return {"loss": loss, "stepped": float(stepped)}


def test_after_a_nonfinite_loss_optim_closes_windows_at_batch_end() -> None:
    """A plain run takes no per-batch event of optim's; the batch of a non-finite loss makes it
    take part in ``batch_end``, which closes that window, and the next batch steps again."""
    m = model()
    optim, stepped = Counted(), []

    def step(loop, batch):
        loss = mse(m, batch) * (float("nan") if loop.state.batch_idx == 1 else 1.0)
        loop.backward(loss)
        stepped.append(loop.optimizers.step())
        loop.optimizers.zero_grad()

    with pytest.warns(OptimWarning, match="non-finite loss at epoch 1, batch 2"):
        hookfit.Loop(step, data(4), model=m, max_epochs=1, optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
                     plugins=[optim]).fit()
    assert optim.batch_ends == [1, 2, 3]
    assert stepped == [True, False, True, True]


# -- a step that bypasses loop.optimizers ------------------------------------------------------

class Hooks:
    """Records, at each training batch's end, whether optim still watches the optimizers and
    whether it registered a plugin of its own (it never does)."""

    name = "hooks_probe"

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, bool]] = []

    @hookfit.hookimpl
    def batch_end(self, loop) -> None:
        if loop.training:
            managed = next(iter(loop.optimizers.values()))
            self.seen.append((loop.state.epoch, len(managed.optimizer._optimizer_step_pre_hooks),
                              any(name.startswith("optim.") for name, _ in loop.pm.list_name_plugin())))


@pytest.mark.bad_input
def test_stepping_the_optimizer_variable_instead_of_loop_optimizers_warns_once() -> None:
    """The step steps the script's own optimizer: clipping, schedulers and counters are silently
    bypassed. optim sees it with torch's step pre-hook, warns once naming the optimizer and what
    to call, and stops watching after the first training stage."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    probe = Hooks()

    def step(loop, batch):
        loss = mse(m, batch)
        loop.backward(loss)
        opt.step()  # the script's variable: not loop.optimizers.step()
        opt.zero_grad()
        return loss

    with pytest.warns(OptimWarning) as caught:
        fit(m, opt, data(3), probe, step=step, epochs=2)
    bypass = [w for w in caught if "stepped directly" in str(w.message)]
    assert len(bypass) == 1, [str(w.message) for w in caught]
    message = str(bypass[0].message)
    assert "optimizer 'default' (SGD) was stepped directly (epoch 1, batch 1)" in message
    assert "Call loop.optimizers.step() in the step function" in message
    assert "clipping" in message and "schedulers" in message
    assert bypass[0].filename == __file__  # points at the step function's line
    # watched during the first training stage only, with no plugin of optim's own; then no hook
    assert probe.seen == [(0, 1, False)] * 3 + [(1, 0, False)] * 3
    assert not opt._optimizer_step_pre_hooks


def test_stepping_through_loop_optimizers_never_warns_on_any_path() -> None:
    """Every way optim itself steps (the fast path, the full path with clipping and a scheduler,
    accumulation with the partial window stepped at the stage's end, AMP's scaler, two named
    optimizers) is its own: no warning, and nothing is left registered after the run."""
    import warnings

    cases = [dict(), dict(clip_norm=1.0), dict(accumulate=3), dict(amp=True), dict(accumulate=2, clip_value=0.5)]
    for kwargs in cases:
        m = model()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        with warnings.catch_warnings():
            warnings.simplefilter("error", OptimWarning)
            fit(m, opt, data(4), schedulers=sched, epochs=2, **kwargs)
        assert not opt._optimizer_step_pre_hooks, kwargs

    a, b = model(1), model(2)
    opts = {"a": torch.optim.SGD(a.parameters(), lr=0.1), "b": torch.optim.Adam(b.parameters(), lr=0.1)}

    def step(loop, batch):
        for name, net in (("a", a), ("b", b)):
            loop.backward(mse(net, batch))
            loop.optimizers[name].step()
            loop.optimizers[name].zero_grad()

    with warnings.catch_warnings():
        warnings.simplefilter("error", OptimWarning)
        hookfit.Loop(step, data(3), model=[a, b], optimizers=opts, plugins=[Optim(accumulate=2)]).fit()


@pytest.mark.bad_input
def test_stepping_the_optimizer_variable_inside_an_accumulation_window_is_refused_before_it_steps() -> None:
    """A direct step under accumulate=2 was warned of and trained another model (every batch stepped on one
    batch's gradients), while a loss.backward() bypass in the same run was refused: both are refused now."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = [p.detach().clone() for p in m.parameters()]

    def step(loop, batch):
        loop.backward(mse(m, batch))
        opt.step()  # the script's variable: not loop.optimizers.step()
        opt.zero_grad()

    with pytest.raises(RuntimeError, match=r"optimizer 'default' \(SGD\) was stepped directly \(epoch 1, batch 1\).*"
                                           r"Call loop\.optimizers\.step\(\) .*; with accumulate=2 \(each loss must "
                                           r"be divided by the window\), the run would train another model"):
        hookfit.Loop(step, data(2), model=m, optimizers=opt, plugins=[Optim(accumulate=2)]).fit()
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


@pytest.mark.bad_input
def test_a_bypassed_named_optimizer_is_named_with_the_call_to_use() -> None:
    a, b = model(1), model(2)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)

    def step(loop, batch):
        loop.backward(mse(a, batch))
        loop.optimizers["a"].step()
        loop.backward(mse(b, batch))
        opt_b.step()

    with pytest.warns(OptimWarning, match=r"optimizer 'b' \(SGD\) was stepped directly .*"
                                          r"Call loop\.optimizers\['b'\]\.step\(\)"):
        hookfit.Loop(step, data(2), model=[a, b], plugins=[Optim()],
                     optimizers={"a": torch.optim.SGD(a.parameters(), lr=0.1), "b": opt_b}).fit()


def test_an_lbfgs_step_with_a_closure_is_bitwise_equal_to_a_raw_loop_and_returns_its_loss() -> None:
    """``loop.optimizers.step(closure)`` as pytorch/examples' LBFGS scripts call ``optimizer.step(closure)``: the
    closure back-propagates through ``loop.backward``; the step counts, its scheduler steps, nothing warns."""
    import warnings

    batches = data(3)
    raw = model()
    opt = torch.optim.LBFGS(raw.parameters(), lr=0.5, max_iter=4)
    for _ in range(2):
        for b in batches:
            def closure(b=b):
                opt.zero_grad()
                loss = mse(raw, b)
                loss.backward()
                return loss
            opt.step(closure)
    m = model()
    opt = torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=4)
    returned = []

    def step(loop, batch):
        def closure():
            loop.optimizers.zero_grad()
            loss = mse(m, batch)
            loop.backward(loss)
            return loss
        returned.append(loop.optimizers.step(closure))
        return returned[-1]

    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OptimWarning)
        loop = hookfit.Loop(step, batches, model=m, optimizers=opt, max_epochs=2,
                            plugins=[Optim(schedulers=sched, nonfinite=None)])
        loop.fit()
    assert_bitwise(params(m), params(raw))
    assert all(isinstance(loss, torch.Tensor) and loss.dim() == 0 for loss in returned) and len(returned) == 6
    assert loop.run.pm.get_plugin("optim").optimizers.steps == 6 and sched.last_epoch == 6


@pytest.mark.bad_input
@pytest.mark.parametrize("options", [{"accumulate": 2, "nonfinite": None}, {"clip_norm": 1.0, "nonfinite": None}, {},
                                     {"defer": True}])
def test_a_step_with_a_closure_where_optim_must_prepare_the_gradients_is_refused_by_name(options) -> None:
    """Accumulation and clipping prepare the gradients before the step; the non-finite check (the host's, or the
    device path's flag: ``defer=True``) cannot skip a step whose losses come inside it."""
    m = model()

    def step(loop, batch):
        loop.optimizers.step(lambda: loop.backward(mse(m, batch)))

    with pytest.raises(UsageError, match=r"optim: optimizer 'default': step\(closure\) makes its "
                                                  r"gradients in torch's step, unchecked, unprepared: give "
                                                  r"Optim\(nonfinite=None\), no accumulate, clipping or scaling"):
        fit(m, torch.optim.LBFGS(m.parameters()), data(2), step=step, **options)


@pytest.mark.bad_input
def test_a_closure_step_that_bypasses_optim_is_named_with_the_call_to_use_at_the_scripts_line() -> None:
    """A scheduler wraps the optimizer's step in torch's own frames: the warning still points at the step."""
    m = model()
    opt = torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=2)

    def step(loop, batch):
        def closure():
            opt.zero_grad()
            loss = mse(m, batch)
            loop.backward(loss)
            return loss
        return opt.step(closure)

    with pytest.warns(OptimWarning) as caught:
        fit(m, opt, data(2), step=step, epochs=1, schedulers=torch.optim.lr_scheduler.StepLR(opt, step_size=9))
    (bypass,) = [w for w in caught if "stepped directly" in str(w.message)]
    assert "Call loop.optimizers.step(closure) in the step function" in str(bypass.message)
    assert bypass.filename == __file__, bypass.filename


def test_a_run_stopped_in_its_first_stage_stops_watching() -> None:
    """The watch ends with the run, whatever way it ends (a stop, a failure)."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def step(loop, batch):
        loop.backward(mse(m, batch))
        loop.optimizers.step()
        loop.request_stop("enough")

    loop = hookfit.Loop(step, data(4), model=m, optimizers=opt, plugins=[Optim()])
    assert loop.fit().status == "interrupted"
    assert not opt._optimizer_step_pre_hooks

    def failing(loop, batch):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        hookfit.Loop(failing, data(2), model=m, optimizers=opt, plugins=[Optim()]).fit()
    assert not opt._optimizer_step_pre_hooks


# -- no optimizer given --------------------------------------------------------------------

@pytest.mark.bad_input
@pytest.mark.parametrize("call", ["step", "zero_grad", "param_groups", "item"])
@pytest.mark.parametrize("given", ["none", "omitted"])
def test_without_optimizers_the_step_is_told_none_was_given(call: str, given: str) -> None:
    def step(loop, batch):
        if call == "step":
            loop.optimizers.step()
        elif call == "zero_grad":
            loop.optimizers.zero_grad()
        elif call == "param_groups":
            loop.optimizers.param_groups
        else:
            loop.optimizers["default"]

    kwargs = {"optimizers": None} if given == "none" else {}
    error = KeyError if call == "item" else TypeError
    with pytest.raises(error) as info:
        hookfit.Loop(step, [1], plugins=[Optim()], **kwargs).fit()
    message = str(info.value)
    assert "no optimizer: none was given to Loop(optimizers=...)" in message, message
    assert "name one" not in message
    if call != "item":  # the run's end line names the class: it says what is wrong (none, or several, unnamed)
        assert type(info.value).__name__ == "NoSingleOptimizer"


# -- checkpoints of another optimizer ------------------------------------------------------

def _train(make, plugin: Optim, batches: int = 2) -> torch.nn.Module:
    m = model()

    def step(loop, batch):
        loop.backward(mse(m, batch))
        loop.optimizers.step()
        loop.optimizers.zero_grad()

    hookfit.Loop(step, data(batches), model=m, optimizers=make(m), plugins=[plugin]).fit()
    return m


def _load(make, state: dict) -> Optim:
    """A run whose optim loads ``state`` at fit_start, as a resume does."""
    plugin = Optim()

    class Resume:
        @hookfit.hookimpl
        def fit_start(self, loop):
            loop.load_plugin_states({"optim": state})

    m = model()
    hookfit.Loop(lambda loop, b: None, [1], model=m, optimizers=make(m), plugins=[plugin, Resume()]).fit()
    return plugin


def adam(m):
    return torch.optim.Adam(m.parameters(), lr=0.01)


def sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def test_the_optimizer_class_is_saved_with_its_state_and_the_same_class_resumes() -> None:
    saver = Optim()
    _train(adam, saver)
    state = saver.state_dict()
    assert state["optimizers"]["default"]["class"] == "torch.optim.adam.Adam"
    loaded = _load(adam, state)
    assert loaded.optimizers["default"].steps == 2
    assert loaded.optimizers["default"].optimizer.state_dict()["state"][0]["step"] == 2
    # a state saved before the class was recorded still loads
    del state["optimizers"]["default"]["class"]
    assert _load(adam, state).optimizers["default"].steps == 2


@pytest.mark.bad_input
def test_a_state_of_another_optimizer_class_is_refused_naming_both() -> None:
    """Adam's state loaded into SGD used to load without a word (SGD then stepped with Adam's
    hyperparameters, without momentum buffers). Refused before anything is restored."""
    saver = Optim()
    _train(adam, saver)
    with pytest.raises(ValueError) as info:
        _load(sgd, saver.state_dict())
    message = str(info.value)
    assert ("optim: optimizer 'default' was a torch.optim.adam.Adam in the checkpoint and is a "
            "torch.optim.sgd.SGD in this run") in message, message


@pytest.mark.bad_input
def test_a_state_with_other_parameter_groups_is_refused_naming_them() -> None:
    saver = Optim()
    _train(adam, saver)
    state = saver.state_dict()

    def two_groups(m):
        first, *rest = list(m.parameters())
        return torch.optim.Adam([{"params": [first]}, {"params": rest}], lr=0.01)

    with pytest.raises(ValueError, match=r"optim: optimizer 'default' \(torch.optim.adam.Adam\) has 2 "
                                         r"parameter group\(s\) in this run and 1 in the checkpoint"):
        _load(two_groups, state)

    def fewer_params(m):
        return torch.optim.Adam(list(m.parameters())[:2], lr=0.01)

    with pytest.raises(ValueError, match=r"optim: parameter group 0 of optimizer 'default' \(torch.optim.adam.Adam\) "
                                         r"has 2 parameter\(s\) in this run and 4 in the checkpoint"):
        _load(fewer_params, state)


@pytest.mark.bad_input
def test_resuming_a_checkpoint_of_another_optimizer_class_fails(tmp_path) -> None:
    """End to end, with the checkpoint plugin: a run of Adam checkpointed, resumed with SGD."""
    from hookfit.plugins.checkpoint import Checkpoint

    def run(make, **kwargs):
        m = model()

        def step(loop, batch):
            loop.backward(mse(m, batch))
            loop.optimizers.step()
            loop.optimizers.zero_grad()

        return hookfit.Loop(step, data(3), model=m, optimizers=make(m), run_dir=tmp_path / "run",
                            plugins=[Optim(), Checkpoint(background=False)], **kwargs).fit()

    assert run(adam, max_epochs=1).status == "completed"
    with pytest.raises(ValueError, match=r"optimizer 'default' was a torch.optim.adam.Adam in the checkpoint "
                                         r"and is a torch.optim.sgd.SGD in this run"):
        run(sgd, max_epochs=2, resume="latest")
    assert run(adam, max_epochs=2, resume="latest").step == 6  # the same class resumes


def _resumed(folder, make, schedulers=lambda opt: None, plugins=(), first=None, again=None, **options):
    """A run of ``first`` (else ``make``) for an epoch, then one of ``make`` and ``plugins`` resumed from it for two
    more (with ``Optim`` options ``again`` where given): the optimizer of the resumed run, the first run's learning
    rate at its end, the resume's OptimWarnings."""
    import warnings

    from hookfit.plugins.checkpoint import Checkpoint
    from hookfit.plugins.metrics import Metrics

    def run(make, plugins=(), options=options, **kwargs):
        m = model()

        def step(loop, batch):
            loss = mse(m, batch)
            loop.backward(loss)
            loop.optimizers.step()
            loop.optimizers.zero_grad()
            return loss

        opt = make(m)
        hookfit.Loop(step, data(3), val_step=lambda loop, batch: {"loss": mse(m, batch)}, val_data=data(2, seed=1),
                     model=m, optimizers=opt, run_dir=folder, disable=["console"],
                     plugins=[Optim(schedulers=schedulers(opt), **options), Metrics(), Checkpoint(background=False),
                              *plugins],
                     **kwargs).fit()
        return opt

    rate = run(first or make, max_epochs=1).param_groups[0]["lr"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = run(make, plugins, options=options if again is None else again, max_epochs=3, resume="latest")
    return opt, float(rate), [w for w in caught if issubclass(w.category, OptimWarning)]


@pytest.mark.parametrize("make, schedulers, options", [
    (sgd, lambda opt: None, {}),
    (adam, lambda opt: None, {}),
    (lambda m: torch.optim.Adam(m.parameters(), lr=torch.tensor(0.01), foreach=False), lambda opt: None, {}),
    (sgd, lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5), {}),
    (sgd, lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=9), {}),
    (adam, lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.02, total_steps=9), {}),
    (sgd, lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5, threshold=10.0),
     {"monitor": "valid/loss"}),
], ids=["SGD", "Adam", "Adam-tensor-lr", "StepLR", "OneCycleLR-SGD", "OneCycleLR-Adam", "ReduceLROnPlateau"])
def test_a_resume_with_the_optimizer_the_run_was_built_with_warns_nothing(tmp_path, make, schedulers, options) -> None:
    opt, rate, caught = _resumed(tmp_path, make, schedulers, **options)
    assert caught == []
    start = make(model()).param_groups[0]["lr"]
    if schedulers(make(model())) is not None:  # the checkpoint's rate is not the one given: a scheduler moved it
        assert rate != pytest.approx(float(start))
    assert opt.param_groups[0]["lr"] != start or schedulers(opt) is None


@pytest.mark.bad_input
def test_a_resume_that_replaces_the_settings_given_says_so_with_both_values(tmp_path) -> None:
    """torch's load_state_dict puts back the saved groups' settings, as an exact resume needs: a rate and a
    weight decay changed for the resumed run never took effect, without a word."""
    opt, _, caught = _resumed(tmp_path, lambda m: torch.optim.Adam(m.parameters(), lr=1e-4, weight_decay=0.1),
                              first=adam)
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["weight_decay"] == 0  # the checkpoint's
    assert len(caught) == 1 and caught[0].filename == __file__, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert ("optim: optimizer 'default' (Adam) resumed with the settings of the checkpoint, not those it was built "
            "with: parameter group 0: the checkpoint's lr=0.01 replaces lr=0.0001 given, the checkpoint's "
            "weight_decay=0 replaces weight_decay=0.1 given") in message, message
    assert "start a new run (another Loop(run_dir=...) or Loop(name=...), or no resume)" in message, message
    assert "resumed(loop, info) hook: loop.optimizers['default'].param_groups[0]['lr'] = 0.0001" in message, message


@pytest.mark.bad_input
@pytest.mark.parametrize("build, key, then, now", [
    (lambda opt, n: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=9 + 3 * n), "total_steps", 9, 12),
    (lambda opt, n: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=3 + 6 * n), "T_max", 3, 9),
    (lambda opt, n: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=(0.5, 0.1)[n]), "gamma", 0.5, 0.1),
], ids=["OneCycleLR", "CosineAnnealingLR", "StepLR"])
def test_a_resume_that_replaces_the_schedule_given_says_so_with_both_values(tmp_path, build, key, then, now) -> None:
    """A longer run resumed with a schedule rebuilt for it (OneCycleLR's total_steps, a cosine's T_max): torch's
    load_state_dict puts back the saved schedule, which then fails past its end or climbs back up, without a word."""
    built = []

    def schedulers(opt):
        built.append(build(opt, len(built)))
        return built[-1]

    _, _, caught = _resumed(tmp_path, sgd, schedulers)
    assert len(caught) == 1 and caught[0].filename == __file__, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert message.startswith(f"optim: scheduler {type(built[1]).__name__} of optimizer 'default' resumed with the "
                              f"settings of the checkpoint, not those it was built with: the checkpoint's "
                              f"{key}={then!r} replaces {key}={now!r} given. A resumed run continues"), message
    assert "start a new run (another Loop(run_dir=...) or Loop(name=...), or no resume)" in message, message
    assert built[1].state_dict()[key] == then  # the checkpoint's, as the warning says


@pytest.mark.bad_input
def test_a_resume_with_other_options_that_change_how_it_trains_says_so(tmp_path) -> None:
    """The window, clipping and precision shape every step: changed between a run and its resume, the resumed
    run is not the saved one continued, as a changed learning rate is not (which warns)."""
    _, _, caught = _resumed(tmp_path, sgd, accumulate=2, clip_norm=1.0,
                            again={"accumulate": 3, "clip_norm": 1.0, "precision": "bf16-mixed"})
    assert len(caught) == 1 and caught[0].filename == __file__, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert message.startswith("optim: this run resumes with other options than the run that saved the checkpoint "
                              "(accumulate=2 then, accumulate=3 now; precision='32' then, precision='bf16-mixed' "
                              "now): it trains on with the new ones"), message
    assert "give Optim() the options of that run to resume it exactly" in message, message
    _, _, caught = _resumed(tmp_path / "same", sgd, accumulate=2, clip_norm=1.0)
    assert caught == []
    import numpy  # options saved as the plain numbers optim checked: a NumPy one is no longer refused by torch.load
    _, _, caught = _resumed(tmp_path / "numpy", sgd, accumulate=numpy.int64(2), clip_norm=numpy.float64(1.0))
    assert caught == []


def test_settings_set_in_a_resumed_hook_are_those_the_resumed_run_trains_with(tmp_path) -> None:
    """What the warning advises for training a resumed run with new settings."""
    rates = []

    class NewRate:
        @hookfit.hookimpl
        def resumed(self, loop, info):
            loop.optimizers["default"].param_groups[0]["lr"] = 1e-4

        @hookfit.hookimpl
        def after_optimizer_step(self, loop, name, optimizer):
            rates.append(optimizer.param_groups[0]["lr"])

    opt, _, caught = _resumed(tmp_path, lambda m: torch.optim.Adam(m.parameters(), lr=1e-4), plugins=[NewRate()],
                              first=adam)
    assert len(caught) == 1 and rates == [1e-4] * 6 and opt.param_groups[0]["lr"] == 1e-4


# -- mixed precision: Optim(precision=...) -------------------------------------------------------


class _AutocastProbe:
    """Whether autocast is on during each backward pass (before_backward runs inside it)."""

    name = "probe"

    def __init__(self) -> None:
        self.backward: list[bool] = []

    @hookfit.hookimpl
    def before_backward(self, loop, loss):
        self.backward.append(torch.is_autocast_enabled("cpu"))


def test_bf16_mixed_runs_the_unchanged_step_s_forward_in_bfloat16_and_the_rest_in_float32() -> None:
    m = model()
    seen = []

    def step(loop, batch):  # the step of a float32 run, word for word
        out = loop.model(batch[0])
        seen.append(("train", out.dtype, torch.is_autocast_enabled("cpu")))
        loss = torch.nn.functional.mse_loss(out.float(), batch[1])
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    def valid(loop, batch):
        seen.append(("valid", loop.model(batch[0]).dtype, torch.is_autocast_enabled("cpu")))

    probe = _AutocastProbe()
    before = [p.detach().clone() for p in m.parameters()]
    state = hookfit.Loop(step, data(3), val_step=valid, val_data=data(1), model=m,
                         optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
                         plugins=[Optim(precision="bf16-mixed"), probe]).fit()
    assert state.status == "completed"
    assert seen == [("train", torch.bfloat16, True)] * 3 + [("valid", torch.bfloat16, True)]
    assert probe.backward == [False] * 3, "backward runs outside autocast"
    assert all(p.dtype == torch.float32 for p in m.parameters())  # the weights stay float32
    assert not all(torch.equal(a, b) for a, b in zip(before, m.parameters()))  # and trained
    assert not torch.is_autocast_enabled("cpu")


def test_16_mixed_scales_the_loss_and_steps_through_the_scaler() -> None:
    m = model()
    dtypes = []

    def step(loop, batch):
        out = loop.model(batch[0])
        dtypes.append(out.dtype)
        loss = torch.nn.functional.mse_loss(out.float(), batch[1])
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()

    optim = Optim(precision="16-mixed")
    hookfit.Loop(step, data(2), model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1), plugins=[optim]).fit()
    assert dtypes == [torch.float16] * 2
    assert optim.scaler is not None and optim.scaler.get_scale() > 1  # the loss was scaled
    assert optim.optimizers["default"].steps == 2


def test_float32_by_default_adds_no_step_wrapper() -> None:
    m = model()
    steps = []

    def step(loop, batch):
        steps.append(loop.train_step)
        assert loop.model(batch[0]).dtype == torch.float32 and not torch.is_autocast_enabled("cpu")

    hookfit.Loop(step, data(1), model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1), plugins=[Optim()]).fit()
    assert steps == [step]


@pytest.mark.bad_input
@pytest.mark.parametrize("options, message", [
    ({"precision": "16"}, r"optim: precision must be one of '32', 'bf16-mixed', '16-mixed', got '16'"),
    ({"precision": "bf16-mixed", "amp": True}, r"optim: precision='bf16-mixed' needs no loss scaling"),
])
def test_precision_is_checked(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Optim(**options)


def test_a_step_wrapped_for_autocast_is_still_named_in_errors() -> None:
    m = model()

    def my_step(loop, batch):
        raise RuntimeError("inside the step")

    with pytest.raises(RuntimeError, match="inside the step") as raised:
        hookfit.Loop(my_step, data(1), model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
                     plugins=[Optim(precision="bf16-mixed")]).fit()
    assert any("my_step" in note for note in raised.value.__notes__), raised.value.__notes__


def test_a_resume_of_a_run_whose_code_sets_its_own_rate_warns_nothing(tmp_path) -> None:
    """A schedule of the training code's own (nanoGPT sets every group's lr each step, no torch scheduler):
    the rate the checkpoint holds is the code's, not a setting the user changed."""
    import warnings

    from hookfit.plugins.checkpoint import Checkpoint

    class OwnRate:
        @hookfit.hookimpl
        def batch_start(self, loop):
            for group in loop.optimizers.param_groups:
                group["lr"] = 0.01 / (1 + loop.state.step)

    def run(**kwargs):
        m = model()
        opt = sgd(m)
        hookfit.Loop(lambda loop, batch: fit_step(loop, m, batch), data(3), model=m, optimizers=opt, run_dir=tmp_path,
                     plugins=[Optim(), OwnRate(), Checkpoint(background=False)], **kwargs).fit()
        return opt

    assert run(max_epochs=1).param_groups[0]["lr"] != 0.1  # the checkpoint holds the code's rate
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run(max_epochs=2, resume="latest").param_groups[0]["lr"] == pytest.approx(0.01 / 6)
    assert [str(w.message) for w in caught if issubclass(w.category, OptimWarning)] == []
