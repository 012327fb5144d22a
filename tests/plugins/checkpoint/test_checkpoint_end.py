"""checkpoint at a run's end: a run whose end stands where it started or resumed (no batch
trained, no epoch ended) writes no checkpoint there, so the next run of its name starts anew
instead of resuming an untrained state; a failure's ``failed-*`` file is still written, and a
run that trained one batch is saved as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit import hookimpl
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.lr_find import LRFinder
from hookfit.plugins.optim import Optim

from conftest import StopAt, mse_step


class Saves:
    """The checkpoints a run announces (``checkpoint_saved``): ``(file name, reason, step)``."""

    name = "saves"

    def __init__(self) -> None:
        self.saved: list[tuple[str, str, int]] = []

    @hookimpl
    def checkpoint_saved(self, loop: hookfit.Run, path: str, reason: str, step: int) -> None:
        self.saved.append((Path(path).name, reason, step))


class StopFirst:
    """Asks for a graceful stop before the first batch: at ``fit_start``, or once the run resumed."""

    name = "stop_first"

    def __init__(self, when: str) -> None:
        self.when = when

    @hookimpl
    def fit_start(self, loop: hookfit.Run) -> None:
        if self.when == "fit_start":
            loop.request_stop("test stop before the first batch", by=self.name)

    @hookimpl
    def resumed(self, loop: hookfit.Run, info: Any) -> None:
        if self.when == "resumed":
            loop.request_stop("test stop once resumed", by=self.name)


def fit(folder: Path, *plugins: Any, lr: float = 1e-2, resume: str | None = None, step: Any = mse_step,
        max_steps: int | None = None) -> tuple[torch.nn.Module, torch.optim.Optimizer, hookfit.State, Saves]:
    """Two epochs of six batches, checkpoints in ``folder`` every epoch (the default schedule)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)) for _ in range(6)]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    saves = Saves()
    state = hookfit.Loop(step, data, model=model, optimizers=optimizer, max_epochs=2, max_steps=max_steps,
                         resume=resume, plugins=[Optim(), Checkpoint(dir=folder, background=False), saves,
                                                 *plugins]).fit()
    return model, optimizer, state, saves


def files(folder: Path) -> list[str]:
    """The checkpoint files in ``folder`` (not its lock file)."""
    return sorted(p.name for p in folder.glob("*.pt"))


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_a_tuning_run_that_stops_before_training_leaves_no_checkpoint_for_the_next_run(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    finder = LRFinder(num_steps=10, end_lr=1.0, then="stop")
    _, _, state, saves = fit(folder, finder, resume="latest")
    assert state.status == "completed" and state.step == 0 and finder.suggestion is not None
    assert saves.saved == [] and state.results["last_checkpoint"] is None
    assert files(folder) == []

    lr = finder.suggestion
    trained, optimizer, state, saves = fit(folder, lr=lr, resume="latest")  # the real run, resuming if it can
    assert state.resumed_from is None and state.step == 12
    assert optimizer.param_groups[0]["lr"] == lr
    fresh, _, _, _ = fit(tmp_path / "fresh", lr=lr)
    assert same(trained, fresh)


@pytest.mark.parametrize("when", ["fit_start", "resumed"])
def test_a_run_stopped_where_it_began_writes_no_checkpoint(tmp_path: Path, when: str) -> None:
    folder = tmp_path / "checkpoints"
    if when == "resumed":  # a run stopped after 3 batches, resumed, then stopped before its next batch
        _, _, state, saves = fit(folder, StopAt(3))
        assert state.status == "interrupted" and saves.saved == [("epoch0001-step000000003.pt", "interrupt", 3)]
    before = files(folder)
    _, _, state, saves = fit(folder, StopFirst(when), resume="latest")
    assert state.status == "interrupted" and state.stop_reason.startswith("test stop")
    assert saves.saved == []
    assert files(folder) == before
    assert state.results["last_checkpoint"] == (folder / before[0] if before else None)


def test_a_run_resumed_at_its_end_writes_no_second_checkpoint(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    _, _, state, saves = fit(folder, max_steps=9)
    assert state.step == 9 and saves.saved[-1] == ("epoch0002-step000000009.pt", "max_steps", 9)
    _, _, state, saves = fit(folder, max_steps=9, resume="latest")
    assert state.resumed_from is not None and state.status == "completed" and state.step == 9
    assert saves.saved == []


def test_a_run_that_trained_one_batch_is_saved_and_a_failure_at_the_start_still_is(tmp_path: Path) -> None:
    _, _, state, saves = fit(tmp_path / "one", StopAt(1))
    assert saves.saved == [("epoch0001-step000000001.pt", "interrupt", 1)]

    def failing(loop: hookfit.Run, batch: Any) -> Any:
        raise RuntimeError("the first batch fails")

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    loop = hookfit.Loop(failing, [(torch.ones(2, 4), torch.ones(2, 1))], model=model,
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.1), max_epochs=1,
                        plugins=[Optim(), Checkpoint(dir=tmp_path / "failed", on_failure=True, background=False)])
    with pytest.raises(RuntimeError, match="the first batch fails"):
        loop.fit()
    assert files(tmp_path / "failed") == ["failed-epoch0001-step000000000.pt"]
