"""lr_find in a resumed run and in a smoke run: a resumed run does not sweep again (its
optimizers' states hold the rates), one asked to resume that finds nothing sweeps before its
first epoch, and a smoke run sweeps one pass of its two batches, not ``num_steps``."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit.data import Batches
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.lr_find import LRFinder
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim
from hookfit.plugins.smoke import Smoke

from conftest import StopAt, mse_step


class Counted:
    """The training step, counting its calls (the sweep's included)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, loop: Any, batch: Any) -> dict[str, Any]:
        self.calls += 1
        return mse_step(loop, batch)


def fit(run_dir: Path, *plugins: Any, resume: str | None = None, smoke: bool = False) -> tuple[torch.nn.Module, Counted,
                                                                                             hookfit.State]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(48, 4, generator=generator), torch.randn(48, 1, generator=generator)
    step = Counted()
    state = hookfit.Loop(step, Batches(x, y, batch_size=8, shuffle=True, seed=0), model=model, max_epochs=2,
                         optimizers=torch.optim.Adam(model.parameters(), lr=1e-2), run_dir=run_dir, resume=resume,
                         smoke=smoke, plugins=[Optim(), Metrics(), *plugins]).fit()
    return model, step, state


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_a_resumed_run_does_not_sweep_again_and_ends_as_the_run_without_a_finder(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    whole, _, _ = fit(tmp_path / "plain")

    first = LRFinder(num_steps=10)
    _, step, state = fit(tmp_path / "cut", first, Checkpoint(background=False), StopAt(5), resume="latest")
    assert state.status == "interrupted" and state.step == 5
    assert len(first.rates) == 10 and step.calls == 10 + 5  # nothing to resume: swept, then trained
    assert "hookfit lr_find: 10 step(s)" in capfd.readouterr().err

    finder = LRFinder(num_steps=10)
    resumed, step, state = fit(tmp_path / "cut", finder, Checkpoint(background=False), resume="latest")
    assert state.resumed_from is not None and state.resumed_from.step == 5
    assert step.calls == 12 - 5  # the batches left to train, and no sweep
    assert finder.rates == [] and finder.skipped == "resumed"
    assert state.results["lr_find"] == {"suggestion": None, "steps": 0, "diverged": False, "skipped": "resumed"}
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("hookfit lr_find")]
    assert lines == [f"hookfit lr_find: no sweep: this run resumed from {state.resumed_from.source}, whose "
                     f"optimizers' state holds the learning rates it trains with"], err
    assert same(resumed, whole)


def test_a_smoke_run_sweeps_one_pass_of_its_two_batches(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    finder = LRFinder()  # num_steps=100 in a run that is not a smoke run
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no 'too few points to suggest' for a smoke run's check
        _, step, state = fit(tmp_path / "smoke", finder, Smoke(), smoke=True)
    assert state.status == "completed" and state.step == 2
    assert len(finder.rates) == 2 and step.calls == 2 + 2
    assert state.results["lr_find"] == {"suggestion": None, "steps": 2, "diverged": False, "skipped": "smoke"}
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("hookfit lr_find")]
    assert lines == ["hookfit lr_find: smoke run: 2 step(s), one pass over its batches, to check the sweep "
                     "(num_steps=100 in a run that is not a smoke run); no suggestion"]
