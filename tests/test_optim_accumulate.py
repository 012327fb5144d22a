"""optim: accumulation windows with data whose length is unknown or known."""

from __future__ import annotations

import pytest
import torch

import hookfit
from hookfit.plugins.optim import Optim
from conftest import mse_step
from test_optim import assert_bitwise, data, model, params


def batches64(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x.double(), y.double()) for x, y in data(n)]


def model64() -> torch.nn.Module:
    return model().double()


def windows(n: int, accumulate: int) -> list[range]:
    """The accumulation windows of an epoch of ``n`` batches, aligned to batch indices."""
    return [range(start, min(start + accumulate, n)) for start in range(0, n, accumulate)]


def accumulated(batches, accumulate: int, divisor, make_opt=None) -> list[torch.Tensor]:
    """A raw loop that accumulates ``loss / divisor(window)`` per batch over each window."""
    raw = model64()
    opt = (make_opt or (lambda p: torch.optim.SGD(p, lr=0.1)))(raw.parameters())
    for span in windows(len(batches), accumulate):
        for i in span:
            x, y = batches[i]
            (torch.nn.functional.mse_loss(raw(x), y) / divisor(span)).backward()
        opt.step()
        opt.zero_grad()
    return params(raw)


def train(data, accumulate: int = 4, opt=None, epochs: int = 1, **kwargs) -> list[torch.Tensor]:
    m = model64()
    optimizer = (opt or (lambda p: torch.optim.SGD(p, lr=0.1)))(m.parameters())
    hookfit.Loop(mse_step, data, model=m, optimizers=optimizer, max_epochs=epochs,
                 plugins=[Optim(accumulate=accumulate, **kwargs)]).fit()
    return params(m)


class Unsized:
    """Re-iterable batches from a generator, with no ``__len__``: the epoch's length is unknown."""

    def __init__(self, batches) -> None:
        self.batches = batches

    def __iter__(self):
        return (b for b in self.batches)


class Stream(torch.utils.data.IterableDataset):
    """Rows of ``batches`` one by one: ``len()`` of a DataLoader over it raises TypeError."""

    def __init__(self, batches) -> None:
        self.batches = batches

    def __iter__(self):
        for x, y in self.batches:
            yield from zip(x, y)


@pytest.mark.parametrize("wrap", ["generator", "iterable-dataset"])
def test_data_of_unknown_length_keeps_dividing_by_accumulate(wrap: str) -> None:
    """The last window cannot be told in advance: every loss is divided by ``accumulate``,
    the partial window's too (as documented), and a DataLoader whose ``len()`` raises is
    such data, not an error."""
    batches = batches64(9)
    given = Unsized(batches) if wrap == "generator" else torch.utils.data.DataLoader(Stream(batches), batch_size=8)
    assert_bitwise(train(given), accumulated(batches, 4, lambda span: 4))
