"""lr_find puts back the random state the sweep draws from the training data itself: the
generator of a ``DataLoader`` (``generator=``), of its sampler, of its batch sampler's sampler.
The training after the sweep is bitwise the run without it, and the generator ends as it would."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

import hookfit
from hookfit.plugins.lr_find import LRFinder
from hookfit.plugins.optim import Optim

from conftest import mse_step

Loader = Callable[[TensorDataset, torch.Generator, int], DataLoader[Any]]

LOADERS: dict[str, Loader] = {
    "DataLoader(generator=)": lambda ds, g, workers: DataLoader(ds, batch_size=8, shuffle=True, generator=g,
                                                                num_workers=workers),
    "sampler's generator": lambda ds, g, workers: DataLoader(ds, batch_size=8, sampler=RandomSampler(ds, generator=g),
                                                             num_workers=workers),
    "batch sampler's sampler's generator": lambda ds, g, workers: DataLoader(
        ds, batch_sampler=BatchSampler(RandomSampler(ds, generator=g), batch_size=8, drop_last=False),
        num_workers=workers),
}


def train(run_dir: Path, loader: Loader, workers: int, finder: LRFinder | None) -> tuple[torch.nn.Module,
                                                                                       torch.Tensor]:
    """Two epochs over 48 samples shuffled by a generator of the loader's own, the global one
    seeded the same in both runs; the model and the generator's state at the end."""
    hookfit.seed_everything(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    source = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 4, generator=source), torch.randn(48, 1, generator=source))
    generator = torch.Generator().manual_seed(0)
    state = hookfit.Loop(mse_step, loader(data, generator, workers), model=model, max_epochs=2, run_dir=run_dir,
                         optimizers=torch.optim.SGD(model.parameters(), lr=1e-2),
                         plugins=[Optim(), *([finder] if finder is not None else [])]).fit()
    assert state.status == "completed" and state.step == 12
    return model, generator.get_state()


def check(tmp_path: Path, loader: Loader, workers: int) -> None:
    plain, plain_rng = train(tmp_path / "plain", loader, workers, None)
    finder = LRFinder(num_steps=10, end_lr=1.0)
    swept, swept_rng = train(tmp_path / "swept", loader, workers, finder)
    assert len(finder.rates) == 10  # the sweep ran: 10 batches, drawn in two passes over the loader
    for name, value in plain.state_dict().items():
        assert torch.equal(swept.state_dict()[name], value), name
    assert torch.equal(swept_rng, plain_rng)  # and the generator ends as without the sweep


@pytest.mark.parametrize("loader", list(LOADERS.values()), ids=list(LOADERS))
def test_the_loaders_own_generator_is_put_back_after_the_sweep(tmp_path: Path, loader: Loader) -> None:
    check(tmp_path, loader, workers=0)


def test_with_workers_their_base_seed_is_drawn_as_without_the_sweep(tmp_path: Path) -> None:
    """Each pass of a loader with workers draws their base seed from its generator."""
    check(tmp_path, LOADERS["DataLoader(generator=)"], workers=2)


def test_a_state_no_checkpoint_could_hold_does_not_fail_a_sweep_that_writes_none(tmp_path: Path) -> None:
    """The sweep keeps the plugins' states in memory: a numpy number there (which a checkpoint refuses)
    failed an lr_find run without any checkpoint plugin once the states were checked as gathered."""
    import numpy as np

    class Tracker:
        name = "tracker"
        best = np.float64(1.0)

        @hookfit.hookimpl
        def save_state(self):
            return {"best": self.best}

        @hookfit.hookimpl
        def load_state(self, state):
            self.best = state["best"]

    model = torch.nn.Linear(2, 1)

    def step(loop: Any, batch: torch.Tensor) -> torch.Tensor:
        loss = model(batch).pow(2).mean()
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return loss

    state = hookfit.Loop(step, [torch.ones(4, 2)] * 6, model=model, optimizers=torch.optim.SGD(model.parameters(), 0.01),
                         run_dir=tmp_path, plugins=[Optim(), LRFinder(num_steps=5), Tracker()]).fit()
    assert state.status == "completed"
