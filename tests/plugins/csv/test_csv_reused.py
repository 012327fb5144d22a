"""csv: a run that does not continue the tables an earlier run left in its folder sets them aside
as ``*.earlier-run-N.csv``, one ``N`` for one earlier run, and writes fresh ones (the run that
sets aside tables written by a whole run: test_csv_logger.py)."""

from __future__ import annotations

import csv
import os
import warnings
from pathlib import Path

import pytest

import hookfit
from hookfit.files import FileWarning
from hookfit.plugins.csv_log import CSVLogger
from hookfit.plugins.metrics import Metrics

EARLIER = "epoch,step,stage,loss\n1,2,train,9.0\n"
"""A ``metrics.csv`` of an earlier run."""
EARLIER_UPDATES = "epoch,step,stage,batches,loss\n1,1,train,1,8.0\n"
"""A ``metrics_updates.csv`` of an earlier run."""


def _fit(folder: Path, every_publication: bool = True, **options) -> list[warnings.WarningMessage]:
    """A run of one epoch of two batches (losses 1 and 2) writing its tables in ``folder``; the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = hookfit.Loop(lambda loop, batch: {"loss": float(batch)}, [1, 2], run_dir=folder,
                             plugins=[Metrics(interval=0), CSVLogger(every_publication=every_publication)],
                             **options).fit()
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
def test_a_table_that_cannot_be_set_aside_is_named_left_alone_and_not_written(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The earlier ``metrics.csv`` cannot be renamed: a ``FileWarning`` names it, it is left as it
    was (this run's rows are not mixed into it), the warning of what was set aside lists only
    ``metrics_updates.csv``, which moved, and the run completes."""
    (tmp_path / "metrics.csv").write_text(EARLIER)
    (tmp_path / "metrics_updates.csv").write_text(EARLIER_UPDATES)
    rename = os.rename

    def refused(source, target, *args, **kwargs):
        if Path(source).name == "metrics.csv":
            raise PermissionError(13, "Permission denied", str(source))
        return rename(source, target, *args, **kwargs)

    monkeypatch.setattr(os, "rename", refused)
    caught = _fit(tmp_path)
    failed = [str(w.message) for w in caught if w.category is FileWarning]
    assert len(failed) == 1 and str(tmp_path / "metrics.csv") in failed[0] and "PermissionError" in failed[0], failed
    said = _set_aside(caught)
    assert len(said) == 1 and f"{tmp_path} holds metrics_updates.csv of an earlier run" in said[0], said
    assert "metrics.earlier-run-1.csv" not in said[0] and "fresh metrics_updates.csv." in said[0], said
    assert (tmp_path / "metrics.csv").read_text() == EARLIER
    assert not (tmp_path / "metrics.earlier-run-1.csv").exists()
    assert (tmp_path / "metrics_updates.earlier-run-1.csv").read_text() == EARLIER_UPDATES
    assert _rows(tmp_path / "metrics_updates.csv") == [("1", "1", "train", "1", "1.0"), ("1", "2", "train", "2", "1.5")]
