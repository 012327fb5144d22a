"""tensorboard: a script run again with the same ``run_dir`` and no resume moves the earlier run's
event files into ``earlier-run-N/``, where TensorBoard shows them as a run of their own: the
folder's curves are the new run's, never jumping back to step 0; a resumed run keeps writing beside
them (test_tensorboard.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

import hookfit  # noqa: E402
from hookfit.plugins.metrics import Metrics  # noqa: E402
from hookfit.plugins.tensorboard import TensorBoard  # noqa: E402


def _run(run_dir: Path, epochs: int) -> None:
    """``epochs`` epochs of two batches, a constant loss of ``epochs``."""
    state = hookfit.Loop(lambda loop, batch: {"loss": torch.tensor(float(epochs))}, [0, 1],
                         model=torch.nn.Linear(1, 1), max_epochs=epochs, run_dir=run_dir,
                         plugins=[Metrics(interval=3600.0), TensorBoard(every_publication=False)]).fit()
    assert state.status == "completed"


def _steps(folder: Path) -> list[tuple[int, float]]:
    events = EventAccumulator(str(folder))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars("train/loss")]


def test_a_fresh_run_in_a_used_folder_moves_the_earlier_runs_events_aside(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    _run(folder, 3)
    (earlier,) = folder.glob("events.out.tfevents.*")
    with pytest.warns(hookfit.HookfitWarning) as caught:
        _run(folder, 2)
    said = [str(w.message) for w in caught if "earlier run" in str(w.message)]
    assert len(said) == 1 and earlier.name in said[0] and f"earlier-run-1/{earlier.name}" in said[0], said
    assert _steps(folder) == [(2, 2.0), (4, 2.0)]  # the new run's alone
    assert _steps(folder / "earlier-run-1") == [(2, 3.0), (4, 3.0), (6, 3.0)]  # kept, a run of its own
    assert len(list(folder.glob("events.out.tfevents.*"))) == 1
    with pytest.warns(hookfit.HookfitWarning, match="earlier-run-2/"):
        _run(folder, 1)
    assert _steps(folder / "earlier-run-2") == [(2, 2.0), (4, 2.0)] and _steps(folder) == [(2, 1.0)]
