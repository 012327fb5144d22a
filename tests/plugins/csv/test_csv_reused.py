"""csv: a run that does not continue the tables an earlier run left in its folder sets them aside
as ``*.earlier-run-N.csv``, one ``N`` for one earlier run, and writes fresh ones (the run that
sets aside tables written by a whole run: test_csv_logger.py)."""

from __future__ import annotations

import csv
import os
import warnings
from pathlib import Path

import pytest
import torch

import hookfit
from hookfit.files import FileWarning
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.csv_log import CSVLogger
from hookfit.plugins.metrics import Metrics

from conftest import Refuse

EARLIER = "epoch,step,stage,loss\n1,2,train,9.0\n"
"""A ``metrics.csv`` of an earlier run."""
EARLIER_UPDATES = "epoch,step,stage,batches,loss\n1,1,train,1,8.0\n"
"""A ``metrics_updates.csv`` of an earlier run."""


def _fit(folder: Path, every_publication: bool = True, plugins_extra: tuple | list = (),
         **options) -> list[warnings.WarningMessage]:
    """A run of one epoch of two batches (losses 1 and 2) writing its tables in ``folder``; the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = hookfit.Loop(lambda loop, batch: {"loss": float(batch)}, [1, 2], run_dir=folder,
                             plugins=[Metrics(interval=0), CSVLogger(every_publication=every_publication),
                                      *plugins_extra], **options).fit()
    assert state.status == "completed"
    return caught


def _rows(path: Path) -> list[tuple[str, ...]]:
    with open(path, newline="") as file:
        return [tuple(row) for row in csv.reader(file)][1:]


def _set_aside(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if w.category is hookfit.HookfitWarning and "earlier run" in str(w.message)]


def test_one_number_is_one_earlier_runs_whatever_tables_each_left(tmp_path: Path) -> None:
    """``metrics.earlier-run-1.csv`` is a run's that wrote no ``metrics_updates.csv``; the
    ``metrics_updates.csv`` a later run left (killed before its first epoch's end) is set aside as
    ``-2``, never as the ``-1`` of another run."""
    (tmp_path / "metrics.earlier-run-1.csv").write_text(EARLIER)
    (tmp_path / "metrics_updates.csv").write_text(EARLIER_UPDATES)
    said = _set_aside(_fit(tmp_path))
    assert len(said) == 1 and "set aside as metrics_updates.earlier-run-2.csv;" in said[0], said
    assert not (tmp_path / "metrics_updates.earlier-run-1.csv").exists()
    assert (tmp_path / "metrics_updates.earlier-run-2.csv").read_text() == EARLIER_UPDATES
    assert (tmp_path / "metrics.earlier-run-1.csv").read_text() == EARLIER
    assert _rows(tmp_path / "metrics.csv") == [("1", "2", "train", "1.5")]


@pytest.mark.fault
@pytest.mark.parametrize("every_publication", [True, False])
def test_a_table_that_cannot_be_set_aside_is_named_left_alone_and_not_written(tmp_path: Path, every_publication: bool,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The earlier ``metrics.csv`` cannot be renamed: a ``FileWarning`` names it, it is left as it
    was (this run's rows are not mixed into it), the warning of what was set aside lists only
    ``metrics_updates.csv``, which moved, and what this run writes (without ``every_publication``,
    no table), and the run completes."""
    (tmp_path / "metrics.csv").write_text(EARLIER)
    (tmp_path / "metrics_updates.csv").write_text(EARLIER_UPDATES)
    rename = os.rename

    def refused(source, target, *args, **kwargs):
        if Path(source).name == "metrics.csv":
            raise PermissionError(13, "Permission denied", str(source))
        return rename(source, target, *args, **kwargs)

    monkeypatch.setattr(os, "rename", refused)
    caught = _fit(tmp_path, every_publication)
    failed = [str(w.message) for w in caught if w.category is FileWarning]
    assert len(failed) == 1 and str(tmp_path / "metrics.csv") in failed[0] and "PermissionError" in failed[0], failed
    said = _set_aside(caught)
    assert len(said) == 1 and f"{tmp_path} holds metrics_updates.csv of an earlier run" in said[0], said
    writes = "a fresh metrics_updates.csv." if every_publication else "no table."
    assert "metrics.earlier-run-1.csv" not in said[0] and f"this run writes {writes}" in said[0], said
    assert (tmp_path / "metrics.csv").read_text() == EARLIER
    assert not (tmp_path / "metrics.earlier-run-1.csv").exists()
    assert (tmp_path / "metrics_updates.earlier-run-1.csv").read_text() == EARLIER_UPDATES
    if every_publication:
        assert _rows(tmp_path / "metrics_updates.csv") == [("1", "1", "train", "1", "1.0"),
                                                           ("1", "2", "train", "2", "1.5")]
    else:
        assert not (tmp_path / "metrics_updates.csv").exists()


def test_a_run_refused_before_its_first_write_leaves_the_earlier_tables_as_they_were(tmp_path: Path) -> None:
    (tmp_path / "metrics.csv").write_text(EARLIER)
    (tmp_path / "metrics_updates.csv").write_text(EARLIER_UPDATES)
    loop = hookfit.Loop(lambda loop, batch: {"loss": float(batch)}, [1, 2], run_dir=tmp_path,
                        plugins=[Metrics(interval=0), CSVLogger(every_publication=True), Refuse()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="refused"):
            loop.fit()
    assert not _set_aside(caught)
    assert (tmp_path / "metrics.csv").read_text() == EARLIER
    assert (tmp_path / "metrics_updates.csv").read_text() == EARLIER_UPDATES
    assert not list(tmp_path.glob("*.earlier-run-*"))


def test_a_resume_that_finds_no_checkpoint_starts_afresh_and_sets_the_tables_aside(tmp_path: Path) -> None:
    """``resume="latest"`` in a folder with no checkpoint starts from the beginning: its history
    is not appended under the earlier run's."""
    (tmp_path / "metrics.csv").write_text(EARLIER)
    said = _set_aside(_fit(tmp_path, every_publication=False, model=torch.nn.Linear(1, 1), resume="latest",
                           plugins_extra=[Checkpoint(background=False)]))
    assert len(said) == 1 and "set aside as metrics.earlier-run-1.csv;" in said[0], said
    assert (tmp_path / "metrics.earlier-run-1.csv").read_text() == EARLIER
    assert _rows(tmp_path / "metrics.csv") == [("1", "2", "train", "1.5")]


def test_the_warning_names_only_the_tables_this_run_writes(tmp_path: Path) -> None:
    """The earlier run wrote both tables; this one, without ``every_publication``, sets both aside
    and writes ``metrics.csv`` alone, which is all the warning says it writes."""
    (tmp_path / "metrics.csv").write_text(EARLIER)
    (tmp_path / "metrics_updates.csv").write_text(EARLIER_UPDATES)
    said = _set_aside(_fit(tmp_path, every_publication=False))
    assert len(said) == 1 and "metrics_updates.earlier-run-1.csv" in said[0], said
    assert "this run writes a fresh metrics.csv. " in said[0], said
    assert not (tmp_path / "metrics_updates.csv").exists()


def test_evaluations_add_to_one_table_which_a_fresh_fit_sets_aside_with_its_runs(tmp_path: Path) -> None:
    """Two evaluations of the run's checkpoint in its folder (a script that evaluates checkpoint after
    checkpoint): both rows in one ``evaluation.csv``, nothing set aside, the run's ``metrics.csv`` as it was.
    A fit afresh in the folder then sets the earlier run's tables aside, its evaluations' with them, under one
    number no table of the folder has."""
    model = torch.nn.Linear(1, 1)
    (tmp_path / "metrics.earlier-run-1.csv").write_text(EARLIER)
    _fit(tmp_path, every_publication=False, model=model, plugins_extra=[Checkpoint(background=False)])
    fitted = (tmp_path / "metrics.csv").read_text()

    def evaluate(loss: float) -> list[warnings.WarningMessage]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = hookfit.Loop(None, [], val_step=lambda loop, batch: {"loss": loss}, val_data=[0], model=model,
                                 run_dir=tmp_path, plugins=[Metrics(), Checkpoint(), CSVLogger()]).validate("latest")
        assert state.status == "completed" and state.resumed_from is not None
        return caught

    assert not _set_aside(evaluate(5.0)) and not _set_aside(evaluate(7.0))
    evaluated = str(tmp_path / "checkpoints" / "epoch0001-step000000002.pt")  # (the column after stage)
    assert _rows(tmp_path / "evaluation.csv") == [("1", "2", "valid", evaluated, "5.0"),
                                                   ("1", "2", "valid", evaluated, "7.0")]
    assert (tmp_path / "metrics.csv").read_text() == fitted
    said = _set_aside(_fit(tmp_path, every_publication=False))
    assert len(said) == 1 and "set aside as metrics.earlier-run-2.csv, evaluation.earlier-run-2.csv;" in said[0], said
    assert _rows(tmp_path / "evaluation.earlier-run-2.csv") == [("1", "2", "valid", evaluated, "5.0"),
                                                                 ("1", "2", "valid", evaluated, "7.0")]
    assert (tmp_path / "metrics.earlier-run-2.csv").read_text() == fitted
    assert not (tmp_path / "evaluation.csv").exists()


def test_a_run_resumed_from_a_checkpoint_set_aside_sets_the_later_runs_tables_aside(tmp_path: Path) -> None:
    """Run A (loss 1), then B afresh in the same run_dir (loss 2: A's tables into ``*.earlier-run-1.csv``, its
    checkpoints where they are, B's named apart), then A's epoch 1 resumed by its path: it continues A's checkpoints,
    not B's run, so B's tables are set aside whole, A's resumed epochs starting a fresh one (not appended to B's
    ``metrics.csv`` after dropping B's rows past A's step)."""
    def fit(loss: float, epochs: int, **options) -> list[warnings.WarningMessage]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = hookfit.Loop(lambda loop, batch: {"loss": loss}, [1, 2], model=torch.nn.Linear(1, 1),
                                 max_epochs=epochs, run_dir=tmp_path,
                                 plugins=[Metrics(interval=0), CSVLogger(every_publication=False),
                                          Checkpoint(background=False)], **options).fit()
        assert state.status == "completed"
        return caught

    fit(1.0, 2)
    fit(2.0, 2)
    later = (tmp_path / "metrics.csv").read_text()
    assert _rows(tmp_path / "metrics.earlier-run-1.csv") == [("1", "2", "train", "1.0"), ("2", "4", "train", "1.0")]
    said = _set_aside(fit(1.0, 2, resume=tmp_path / "checkpoints" / "epoch0001-step000000002.pt"))
    assert len(said) == 1 and "set aside as metrics.earlier-run-2.csv;" in said[0], said
    assert (tmp_path / "metrics.earlier-run-2.csv").read_text() == later
    assert _rows(tmp_path / "metrics.csv") == [("2", "4", "train", "1.0")]
