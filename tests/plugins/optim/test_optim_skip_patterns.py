"""optim: a step function that handles a non-finite loss itself loses no clean step.

Patterns that scripts port as they wrote them: a step that reads its loss and leaves out its own
step where it is not finite, and PyTorch's DCGAN step (the models cleared with their own
``zero_grad()``, the generator's loss back-propagated through the discriminator). optim's
non-finite policy must skip what a raw loop leaves out and nothing more, on the host check and on
the device path alike. The references are raw loops; float64, compared to 1e-12.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import hookfit
from hookfit.plugins.optim import Optim, OptimWarning
from test_optim import params
from test_optim_accumulate import TIGHT, batches64, model64

PATHS = pytest.mark.parametrize("defer", [False, True], ids=["host-check", "device-path"])


def mse(net, batch) -> torch.Tensor:
    return torch.nn.functional.mse_loss(net(batch[0]), batch[1])


def nan_at(loss: torch.Tensor, batch_idx: int, bad: set[int]) -> torch.Tensor:
    return loss * float("nan") if batch_idx in bad else loss


def unskipped(step, batches, defer: bool) -> torch.nn.Module:
    """The model ``step`` trained for an epoch, no step skipped and no ``OptimWarning``."""
    m = model64()
    with warnings.catch_warnings():
        warnings.simplefilter("error", OptimWarning)
        state = hookfit.Loop(step, batches, model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
                             max_epochs=1, plugins=[Optim(defer=defer)]).fit()
    assert state.results["skipped_steps"] == 0
    return m


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

    m = unskipped(step, batches, defer)
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


@PATHS
@pytest.mark.parametrize("clear", ["model", "optimizers"])
def test_two_losses_a_batch_the_second_not_finite_lose_no_clean_step(defer: bool, clear: str) -> None:
    """Two losses back-propagated a batch, the second NaN in batches 1 and 2, the step left out
    there by the step function itself, the gradients cleared at each batch's start by the model or
    through ``loop.optimizers``: every clean batch steps, nothing is counted as skipped."""
    batches = batches64(5)

    def step(loop, batch):
        if clear == "model":
            loop.model.zero_grad()
        else:
            loop.optimizers.zero_grad()
        first = mse(loop.model, batch) / 2
        second = nan_at(mse(loop.model, batch) / 2, loop.state.batch_idx, {1, 2})
        loop.backward(first)
        loop.backward(second)
        if torch.isfinite(second):
            loop.optimizers.step()
        return {"loss": first + second}

    m = unskipped(step, batches, defer)
    raw = model64()
    opt = torch.optim.SGD(raw.parameters(), lr=0.1)
    for i, batch in enumerate(batches):
        opt.zero_grad()
        if i not in (1, 2):
            (mse(raw, batch) / 2).backward()
            (mse(raw, batch) / 2).backward()
            opt.step()
    torch.testing.assert_close(params(m), params(raw), **TIGHT)


@pytest.mark.parametrize("defer", [False, True])  # the skip known at once, or read from the device's flag later
def test_the_skip_warnings_point_at_the_script_s_lines(defer: bool) -> None:
    """The first skip and the run's total are warned about at the script's lines (the step function's, or the fit()
    call's where the skip is read after the step), as every hookfit warning, not at optim's or the core's."""
    import warnings

    m = torch.nn.Linear(4, 1)
    batches = [(torch.full((2, 4), float("nan") if i in (1, 3) else 1.0), torch.ones(2, 1)) for i in range(4)]

    def step(loop, batch):
        loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hookfit.Loop(step, batches, model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1), max_epochs=1,
                     disable=["console"], plugins=[Optim(defer=defer)]).fit()
    skips = [w for w in caught if issubclass(w.category, OptimWarning) and "skipped" in str(w.message)]
    assert len(skips) == 2 and [w.filename for w in skips] == [__file__] * 2, [(w.filename, w.lineno) for w in skips]
