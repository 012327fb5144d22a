"""optim: what an accumulation window computes when its batches differ in size, as the README
says ("Optimizers: accumulation and schedulers"): each batch's loss is divided by the window's
number of batches, so the step follows the mean of the batches' gradients, every batch weighing
the same; that is one large batch's only for batches of one size. The README's per-sample
recipe (the loss scaled by the window's batches times the batch's share of the window's
samples) makes each window step as its batches taken as one large batch.

The data is float64 (see test_optim_accumulate): rounding is ~1e-16, the weighting the tests
tell apart changes the parameters by ~1e-3."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hookfit
from hookfit.plugins.optim import Optim
from conftest import mse_step
from test_optim import assert_bitwise, params
from test_optim_accumulate import TIGHT, accumulated, batches64, large_batches, model64, windows

ACCUMULATE = 4


def uneven(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of 8 samples, the last of 3 (as an epoch's last batch often is)."""
    batches = batches64(n)
    x, y = batches[-1]
    batches[-1] = (x[:3], y[:3])
    return batches


def train(batches: list[Any], step: Any = mse_step) -> list[torch.Tensor]:
    m = model64()
    hookfit.Loop(step, batches, model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
                 plugins=[Optim(accumulate=ACCUMULATE)]).fit()
    return params(m)


@pytest.mark.parametrize("n", [8, 10], ids=["windows-4-4", "windows-4-4-2"])
def test_a_window_steps_on_the_mean_of_its_batches_gradients_whatever_their_sizes(n: int) -> None:
    batches = uneven(n)
    got = train(batches)
    assert_bitwise(got, accumulated(batches, ACCUMULATE, len))  # each loss / the window's batches
    one_large = large_batches(batches, ACCUMULATE)
    assert max((a - b).abs().max().item() for a, b in zip(got, one_large)) > 1e-6  # not one large batch's


@pytest.mark.parametrize("n", [8, 10], ids=["windows-4-4", "windows-4-4-2"])
def test_the_readmes_per_sample_recipe_steps_as_one_large_batch(n: int) -> None:
    batches = uneven(n)
    spans = windows(len(batches), ACCUMULATE)

    def per_sample_step(loop: Any, batch: Any) -> dict[str, Any]:
        inputs, targets = batch
        span = spans[loop.state.batch_idx // ACCUMULATE]
        samples_in_window = sum(len(batches[i][0]) for i in span)
        loss = torch.nn.functional.mse_loss(loop.model(inputs), targets)
        loop.backward(loss * len(span) * len(inputs) / samples_in_window)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    torch.testing.assert_close(train(batches, per_sample_step), large_batches(batches, ACCUMULATE), **TIGHT)
