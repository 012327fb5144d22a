"""optim: a non-finite loss inside a window the step function keeps by hand.

Scripts port accumulation as they wrote it (``loop.backward(loss / 3)`` every batch, the optimizer
stepped every third batch) with ``Optim()`` accumulating nothing. A NaN loss inside such a window
must skip that window's step, for that optimizer only, on the host check and on the device path
alike, and must not skip a clean step of an optimizer that stepped (or was cleared) since. The
references are raw loops that skip what optim must skip; float64, compared to 1e-12.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.optim import Optim, OptimWarning
from test_optim import assert_bitwise, params
from test_optim_accumulate import TIGHT, batches64, model64

PATHS = pytest.mark.parametrize("defer", [False, True], ids=["host-check", "device-path"])


def mse(net, batch) -> torch.Tensor:
    return torch.nn.functional.mse_loss(net(batch[0]), batch[1])


def nan_at(loss: torch.Tensor, batch_idx: int, bad: set[int]) -> torch.Tensor:
    return loss * float("nan") if batch_idx in bad else loss


def hand_step(bad: set[int]):
    """Windows of three batches kept by hand; the loss of the batches in ``bad`` is NaN."""
    def step(loop, batch):
        loss = nan_at(mse(loop.model, batch), loop.state.batch_idx, bad)
        loop.backward(loss / 3)
        if loop.state.batch_idx % 3 == 2:
            loop.optimizers.step()
            loop.optimizers.zero_grad()
        return {"loss": loss}
    return step


def raw_windows(batches, skipped: set[int]) -> list[torch.Tensor]:
    """Windows of three batches, those starting at a batch in ``skipped`` left out."""
    raw = model64()
    opt = torch.optim.SGD(raw.parameters(), lr=0.1)
    for start in range(0, len(batches), 3):
        if start in skipped:
            continue
        for batch in batches[start:start + 3]:
            (mse(raw, batch) / 3).backward()
        opt.step()
        opt.zero_grad()
    return params(raw)


@PATHS
def test_a_non_finite_loss_inside_a_window_kept_by_hand_skips_that_window_s_step(defer: bool) -> None:
    """NaN in the middle batch of the first window: its step is skipped, counted and warned, and the
    second window trains as in a raw loop that skipped the first. Before, the host check dropped the
    window's first gradients and stepped on its last batch's alone, without a word, and the device
    path stepped on the NaN gradients (the model became NaN)."""
    batches = batches64(6)
    m = model64()
    with pytest.warns(OptimWarning, match="skipped the step of optimizer 'default': non-finite loss"):
        state = hookfit.Loop(hand_step({1}), batches, model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
                             max_epochs=1, plugins=[Optim(defer=defer)]).fit()
    assert state.results["skipped_steps"] == 1
    torch.testing.assert_close(params(m), raw_windows(batches, {0}), **TIGHT)


@PATHS
def test_only_the_optimizer_whose_window_held_the_loss_skips_a_later_step(defer: bool) -> None:
    """Two optimizers on two halves of a model: ``a`` steps every batch, ``b`` every third batch
    (a window kept by hand). A NaN loss at batch 1 skips ``a``'s step of batch 1 and ``b``'s step
    of batch 2, and nothing else: ``a``'s clean steps of batches 2-5 and ``b``'s second window are
    taken, as in a raw loop that skips those two."""
    batches = batches64(6)

    def nets():
        torch.manual_seed(3)
        return torch.nn.Linear(4, 8).double(), torch.nn.Linear(8, 1).double()

    def loss_of(first, second, batch):
        return torch.nn.functional.mse_loss(second(torch.tanh(first(batch[0]))), batch[1])

    first, second = nets()
    model = {"first": first, "second": second}
    opts = {"a": torch.optim.SGD(first.parameters(), lr=0.1), "b": torch.optim.SGD(second.parameters(), lr=0.1)}

    def step(loop, batch):
        i = loop.state.batch_idx
        loop.optimizers["a"].zero_grad()
        loss = nan_at(loss_of(first, second, batch), i, {1})
        loop.backward(loss)
        loop.optimizers["a"].step()
        if i % 3 == 2:
            loop.optimizers["b"].step()
            loop.optimizers["b"].zero_grad()
        return {"loss": loss}

    with pytest.warns(OptimWarning):
        state = hookfit.Loop(step, batches, model=model, optimizers=opts, max_epochs=1,
                             plugins=[Optim(defer=defer)]).fit()
    assert state.results["skipped_steps"] == 2
    raw_first, raw_second = nets()
    raw_a = torch.optim.SGD(raw_first.parameters(), lr=0.1)
    raw_b = torch.optim.SGD(raw_second.parameters(), lr=0.1)
    for i, batch in enumerate(batches):
        raw_a.zero_grad()
        if i != 1:  # the NaN batch: nothing back-propagated that counts, a's step skipped
            loss_of(raw_first, raw_second, batch).backward()
            raw_a.step()
        if i == 2:  # b's first window held the NaN: skipped, dropped
            raw_b.zero_grad()
        elif i == 5:
            raw_b.step()
            raw_b.zero_grad()
    torch.testing.assert_close(params(first) + params(second), params(raw_first) + params(raw_second), **TIGHT)


@PATHS
@pytest.mark.parametrize("to_none", [True, False], ids=["set_to_none", "zeros"])
@pytest.mark.parametrize("clear", ["before", "after"])
def test_a_step_function_that_skips_its_own_step_for_a_non_finite_loss_loses_no_clean_step(
        defer: bool, clear: str, to_none: bool) -> None:
    """The step reads its loss and leaves out its step where it is not finite, clearing the
    gradients at the batch's start or its end: every clean batch steps (nothing counted as
    skipped), as in a raw loop that leaves out the NaN batch. Zeros left by
    ``zero_grad(set_to_none=False)`` are no gradients of an earlier batch."""
    batches = batches64(5)

    def step(loop, batch):
        if clear == "before":
            loop.optimizers.zero_grad(set_to_none=to_none)
        loss = nan_at(mse(loop.model, batch), loop.state.batch_idx, {1, 3})
        loop.backward(loss)
        if torch.isfinite(loss):
            loop.optimizers.step()
        if clear == "after":
            loop.optimizers.zero_grad(set_to_none=to_none)
        return {"loss": loss}

    m = model64()
    with warnings.catch_warnings():
        warnings.simplefilter("error", OptimWarning)
        state = hookfit.Loop(step, batches, model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
                             max_epochs=1, plugins=[Optim(defer=defer)]).fit()
    assert state.results["skipped_steps"] == 0
    raw = model64()
    opt = torch.optim.SGD(raw.parameters(), lr=0.1)
    for i, batch in enumerate(batches):
        if i not in (1, 3):
            mse(raw, batch).backward()
            opt.step()
            opt.zero_grad()
    torch.testing.assert_close(params(m), params(raw), **TIGHT)


@PATHS
def test_gradients_a_poisoned_batch_itself_left_skip_no_later_step(defer: bool) -> None:
    """PyTorch's DCGAN step, the models cleared with their own ``zero_grad()``: a NaN loss of the
    discriminator at batch 1 skips both steps of that batch, and the generator's loss, which
    back-propagates into the discriminator after it, leaves that batch no window: the
    discriminator's next, clean step is taken, as in a raw loop that leaves out batch 1."""
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=gen, dtype=torch.float64), torch.randn(8, 2, generator=gen,
                                                                                  dtype=torch.float64))
               for _ in range(4)]

    def nets():
        torch.manual_seed(3)
        return torch.nn.Linear(2, 4).double(), torch.nn.Linear(4, 1).double()

    def losses(g, d, batch):
        real, z = batch
        fake = g(z)
        return (lambda: d(real).mean() - d(fake.detach()).mean()), (lambda: -d(fake).mean())

    g, d = nets()

    def step(loop, batch):
        d.zero_grad()
        d_loss, g_loss = losses(g, d, batch)
        loss = nan_at(d_loss(), loop.state.batch_idx, {1})
        loop.backward(loss)
        loop.optimizers["d"].step()
        g.zero_grad()
        loop.backward(g_loss())
        loop.optimizers["g"].step()
        return {"loss": loss}

    opts = {"g": torch.optim.SGD(g.parameters(), lr=0.05), "d": torch.optim.SGD(d.parameters(), lr=0.05)}
    with pytest.warns(OptimWarning):
        state = hookfit.Loop(step, batches, model={"g": g, "d": d}, optimizers=opts, max_epochs=1,
                             plugins=[Optim(defer=defer)]).fit()
    assert state.results["skipped_steps"] == 2
    raw_g, raw_d = nets()
    raw = {"g": torch.optim.SGD(raw_g.parameters(), lr=0.05), "d": torch.optim.SGD(raw_d.parameters(), lr=0.05)}
    for i, batch in enumerate(batches):
        if i != 1:
            d_loss, g_loss = losses(raw_g, raw_d, batch)
            raw_d.zero_grad()
            d_loss().backward()
            raw["d"].step()
            raw_g.zero_grad()
            g_loss().backward()
            raw["g"].step()
    torch.testing.assert_close(params(g) + params(d), params(raw_g) + params(raw_d), **TIGHT)


def test_an_optimizer_stepping_twice_a_batch_hides_no_other_s_window_on_the_device_path() -> None:
    """Optimizer ``a`` steps twice a batch, ``b`` keeps a window of three batches by hand (inside
    its toggle) and holds a NaN loss at batch 1: ``b``'s step is skipped on the device, not taken
    on NaN gradients."""
    batches = batches64(3)
    torch.manual_seed(3)
    first, second = torch.nn.Linear(4, 8).double(), torch.nn.Linear(8, 1).double()
    opts = {"a": torch.optim.SGD(first.parameters(), lr=0.1), "b": torch.optim.SGD(second.parameters(), lr=0.1)}

    def step(loop, batch):
        for _ in range(2):
            loop.optimizers["a"].zero_grad()
            loop.backward(torch.nn.functional.mse_loss(first(batch[0]).sum(1, keepdim=True), batch[1]))
            loop.optimizers["a"].step()
        with loop.optimizers.toggle("b"):
            loss = nan_at(torch.nn.functional.mse_loss(second(torch.tanh(first(batch[0]))), batch[1]),
                          loop.state.batch_idx, {1})
            loop.backward(loss / 3)
        if loop.state.batch_idx == 2:
            loop.optimizers["b"].step()
            loop.optimizers["b"].zero_grad()
        return {"loss": loss}

    before = params(second)
    with pytest.warns(OptimWarning):
        state = hookfit.Loop(step, batches, model={"f": first, "s": second}, optimizers=opts, max_epochs=1,
                             plugins=[Optim(defer=True)]).fit()
    assert state.results["skipped_steps"] == 1
    assert_bitwise(params(second), before)


@PATHS
def test_a_checkpoint_inside_a_poisoned_window_kept_by_hand_resumes_its_skip(tmp_path, defer: bool) -> None:
    """A run that ends (max_steps=2) right after the NaN batch of a window kept by hand: the
    resumed run still skips that window's step, and ends as the uninterrupted run does."""
    batches = batches64(6)

    def run(m, **options):
        return hookfit.Loop(hand_step({1}), batches, model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
                            max_epochs=1, run_dir=tmp_path, plugins=[Optim(defer=defer), Checkpoint(background=False)],
                            **options).fit()

    with pytest.warns(OptimWarning):
        assert run(model64(), max_steps=2).step == 2
        resumed = model64()
        assert run(resumed, resume="latest").results["skipped_steps"] == 1
    torch.testing.assert_close(params(resumed), raw_windows(batches, {0}), **TIGHT)


def test_zeros_left_by_zero_grad_are_no_window_in_a_checkpoint(tmp_path) -> None:
    """``zero_grad(set_to_none=False)`` after every step leaves zeros, no window: checkpoints carry
    no gradients (before, every checkpoint copied the zeros), and the resumed run still ends as an
    uninterrupted one."""
    batches = batches64(4)

    def step(loop, batch):
        loop.backward(mse(loop.model, batch))
        loop.optimizers.step()
        loop.optimizers.zero_grad(set_to_none=False)
        return {"loss": torch.tensor(0.0)}

    def run(m, folder, **options):
        return hookfit.Loop(step, batches, model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
                            max_epochs=1, run_dir=folder, plugins=[Optim(), Checkpoint(background=False)],
                            **options).fit()

    whole = model64()
    run(whole, tmp_path / "whole")
    run(model64(), tmp_path / "cut", max_steps=2)
    saved = next((tmp_path / "cut" / "checkpoints").glob("*.pt"))
    assert torch.load(saved, weights_only=True)["plugins"]["optim"]["window"] is None
    resumed = model64()
    run(resumed, tmp_path / "cut", resume="latest")
    assert_bitwise(params(resumed), params(whole))
