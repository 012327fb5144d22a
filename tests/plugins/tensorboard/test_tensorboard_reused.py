"""tensorboard: a script run again with the same ``run_dir`` and no resume moves the earlier run's
event files into ``earlier-run-N/``, where TensorBoard shows them as a run of their own: the
folder's curves are the new run's, never jumping back to step 0; a resumed run keeps writing beside
them (test_tensorboard.py)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

import hookfit  # noqa: E402
from hookfit.plugins.metrics import Metrics  # noqa: E402
from hookfit.plugins.tensorboard import TensorBoard  # noqa: E402

from conftest import Refuse  # noqa: E402


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


def test_a_run_refused_at_its_start_writes_nothing_and_moves_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    _run(folder, 1)
    before = sorted(p.relative_to(folder) for p in folder.rglob("*") if "tfevents" in p.name)
    loop = hookfit.Loop(lambda loop, batch: {"loss": torch.tensor(5.0)}, [0, 1], run_dir=folder,
                        plugins=[Metrics(interval=3600.0), TensorBoard(every_publication=False), Refuse()])
    with pytest.raises(RuntimeError, match="refused"):
        loop.fit()
    assert sorted(p.relative_to(folder) for p in folder.rglob("*") if "tfevents" in p.name) == before
    assert len(before) == 1 and not (folder / "earlier-run-1").exists()


def test_a_resume_that_finds_no_checkpoint_starts_afresh_and_moves_the_earlier_events(tmp_path: Path) -> None:
    from hookfit.plugins.checkpoint import Checkpoint

    folder = tmp_path / "run"
    _run(folder, 2)
    with pytest.warns(hookfit.HookfitWarning, match="earlier-run-1/"):
        hookfit.Loop(lambda loop, batch: {"loss": torch.tensor(1.0)}, [0, 1], model=torch.nn.Linear(1, 1),
                     run_dir=folder, resume="latest",
                     plugins=[Metrics(interval=3600.0), TensorBoard(every_publication=False),
                              Checkpoint(background=False)]).fit()
    assert _steps(folder) == [(2, 1.0)] and _steps(folder / "earlier-run-1") == [(2, 2.0), (4, 2.0)]


def test_evaluations_are_one_run_which_a_fresh_fit_moves_aside_with_its_run(tmp_path: Path) -> None:
    """Evaluations in the run's folder are one TensorBoard run, ``evaluation/``: the second moves nothing.
    A fit afresh there then moves the earlier run's events into ``earlier-run-1/``, its evaluations' into
    ``earlier-run-1/evaluation/``: TensorBoard shows the earlier run and its evaluations apart."""
    folder = tmp_path / "run"
    _run(folder, 1)

    def evaluate(loss: float) -> None:
        hookfit.Loop(None, [], val_step=lambda loop, batch: {"loss": loss}, val_data=[0], model=torch.nn.Linear(1, 1),
                     run_dir=folder, plugins=[Metrics(), TensorBoard()]).validate()

    def valid(events: Path) -> list[float]:
        accumulated = EventAccumulator(str(events))
        accumulated.Reload()
        return sorted(e.value for e in accumulated.Scalars("valid/loss"))

    evaluate(5.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hookfit.HookfitWarning)
        evaluate(7.0)
    assert valid(folder / "evaluation") == [5.0, 7.0] and not (folder / "evaluation" / "earlier-run-1").exists()
    with pytest.warns(hookfit.HookfitWarning, match="earlier-run-1/evaluation/"):
        _run(folder, 2)
    assert valid(folder / "earlier-run-1" / "evaluation") == [5.0, 7.0] and _steps(folder / "earlier-run-1") == [(2, 1.0)]
    assert not list((folder / "evaluation").glob("events.out.tfevents.*")) and _steps(folder) == [(2, 2.0), (4, 2.0)]


def test_a_run_resumed_from_a_checkpoint_set_aside_moves_the_later_runs_events_aside(tmp_path: Path) -> None:
    """Run A (loss 3), then B afresh in the same folder (loss 2: A's events into ``earlier-run-1/``, its checkpoints
    where they are, B's named apart), then A's epoch 1 resumed by its path: it continues A's checkpoints, not B's
    run, so B's events are moved aside, and A's next epochs are not written into B's curves."""
    from hookfit.plugins.checkpoint import Checkpoint

    folder = tmp_path / "run"

    def fit(loss: float, **options) -> None:
        state = hookfit.Loop(lambda loop, batch: {"loss": torch.tensor(loss)}, [0, 1], model=torch.nn.Linear(1, 1),
                             max_epochs=3, run_dir=folder,
                             plugins=[Metrics(interval=3600.0), TensorBoard(every_publication=False),
                                      Checkpoint(background=False)], **options).fit()
        assert state.status == "completed"

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(3.0)
        fit(2.0)
    with pytest.warns(hookfit.HookfitWarning, match="earlier-run-2/"):
        fit(3.0, resume=folder / "checkpoints" / "epoch0001-step000000002.pt")
    assert _steps(folder / "earlier-run-1") == [(2, 3.0), (4, 3.0), (6, 3.0)]
    assert _steps(folder / "earlier-run-2") == [(2, 2.0), (4, 2.0), (6, 2.0)]
    assert _steps(folder) == [(4, 3.0), (6, 3.0)]
