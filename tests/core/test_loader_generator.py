"""A DataLoader that shuffles with a generator of its own (``generator=``, as many published
scripts seed their data) resumes exactly: the run's state holds that generator's state as the
epoch's iterator was made and as the position left it, mid-epoch and at an epoch's end, with
and without workers, and such a resume says nothing about an order it cannot rebuild."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.optim import Optim

from conftest import StopAfter

BATCHES = 6  # training batches an epoch


class Noisy(Dataset):
    """Samples with noise drawn where the sample is made: in a worker, from the seed the
    loader's base seed gives it; without workers, from the global generator."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(4 * BATCHES, 3, generator=g), torch.randn(4 * BATCHES, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i] + 0.01 * torch.randn(3), self.y[i]


class StopAtEpochEnd:
    """Asks for a stop at the end of the first epoch: the run's last checkpoint is then the
    epoch boundary's."""

    name = "stop_at_epoch_end"

    @hookfit.hookimpl
    def epoch_end(self, loop):
        loop.request_stop("test stop at an epoch's end")


def train(run_dir: Path, workers: int, *, stopper=None, resume=None, sampler: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    g = torch.Generator().manual_seed(5)
    if sampler:  # the generator on a RandomSampler the script makes
        data = DataLoader(Noisy(), batch_size=4, sampler=torch.utils.data.RandomSampler(Noisy(), generator=g),
                          num_workers=workers)
    else:
        data = DataLoader(Noisy(), batch_size=4, shuffle=True, generator=g, num_workers=workers)

    def step(loop, batch):
        loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1]) + 0 * torch.rand(())
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return loss

    plugins = [Optim(), Checkpoint(every_n_epochs=1, background=False), *([stopper] if stopper else [])]
    loop = hookfit.Loop(step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                        max_epochs=3, run_dir=run_dir, resume=resume, plugins=plugins)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = loop.fit()
    return state, [p.detach().clone() for p in model.parameters()], [str(w.message) for w in caught]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted runs, by number of workers and where the generator is given."""
    runs = {}

    def get(workers: int, sampler: bool):
        if (workers, sampler) not in runs:
            state, params, _ = train(tmp_path_factory.mktemp("straight"), workers, sampler=sampler)
            assert state.status == "completed"
            runs[workers, sampler] = params
        return runs[workers, sampler]

    return get


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("where", ["first epoch", "second epoch", "epoch boundary", "sampler's generator"])
def test_a_loader_with_its_own_generator_resumes_to_bitwise_equal_parameters_without_a_warning(
        tmp_path: Path, straight, workers: int, where: str) -> None:
    sampler = where == "sampler's generator"
    stopper = {"first epoch": StopAfter(3), "second epoch": StopAfter(BATCHES + 2),
               "epoch boundary": StopAtEpochEnd(), "sampler's generator": StopAfter(BATCHES + 4)}[where]
    stopped, _, _ = train(tmp_path, workers, stopper=stopper, sampler=sampler)
    assert stopped.status == "interrupted"
    resumed, params, said = train(tmp_path, workers, resume="latest", sampler=sampler)
    assert resumed.resumed_from is not None and resumed.status == "completed" and resumed.step == 3 * BATCHES
    assert not [m for m in said if "cannot be rebuilt" in m], said
    assert all(torch.equal(p, q) for p, q in zip(params, straight(workers, sampler)))


def test_the_run_state_holds_the_loaders_generator_as_the_iterator_was_made_and_now(tmp_path: Path) -> None:
    seen = {}

    class Look:
        name = "look"

        @hookfit.hookimpl
        def batch_end(self, loop, batch_idx):
            if loop.state.epoch == 1 and batch_idx == 2:
                seen["state"], seen["generator"] = loop.state_dict(), loop.train_data.generator.get_state()

    g = torch.Generator().manual_seed(5)
    data = DataLoader(list(range(12)), batch_size=2, shuffle=True, generator=g)
    hookfit.Loop(lambda loop, batch: None, data, max_epochs=2, run_dir=tmp_path, plugins=[Look()]).fit()
    state = seen["state"]
    assert torch.equal(state["rng"]["data"]["generator"], seen["generator"])
    made = torch.Generator().manual_seed(5)  # the first epoch's iterator drew from it: a seed, a shuffle
    list(DataLoader(list(range(12)), batch_size=2, shuffle=True, generator=made))
    assert torch.equal(state["data_rng"]["data"]["generator"], made.get_state())
    assert not torch.equal(state["data_rng"]["data"]["generator"], seen["generator"])
