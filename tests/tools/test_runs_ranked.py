"""``hookfit runs`` and ``hookfit compare`` rank a run by the metric its script configured a
direction for (``Metrics(best={"valid/acc": "max"})``), not by its loss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.metrics_log import MetricsLog
from hookfit.plugins.tui import TuiRenderer
from hookfit.tools import cli, runs

ACC = [0.5, 0.75, 0.625]  # validation accuracy: best in the second epoch
LOSS = [2.0, 1.5, 1.0]  # validation loss: best in the third


def _train(folder: Path) -> None:
    def train(loop: Any, batch: Any) -> dict[str, Any]:
        return {"loss": torch.tensor(1.0)}

    def valid(loop: Any, batch: Any) -> dict[str, Any]:
        epoch = loop.state.epoch
        return {"loss": torch.tensor(LOSS[epoch]), "acc": torch.tensor(ACC[epoch])}

    state = hookfit.Loop(train, [0, 1], val_step=valid, val_data=[0], model=torch.nn.Linear(1, 1), max_epochs=3,
                         run_dir=folder, plugins=[Metrics(best={"valid/acc": "max"}), MetricsLog(),
                                                  Checkpoint(monitor="valid/acc")]).fit()
    assert state.status == "completed"


def test_runs_and_compare_rank_by_the_configured_metric(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HOOKFIT_PLUGINS", "metrics,metrics_log,checkpoint")
    folder = tmp_path / "runs" / "acc"
    _train(folder)
    info = runs.load(folder)
    assert (info.metric, info.mode, info.best) == ("valid/acc", "max", ("valid/acc", 0.75, 2))
    assert runs.load(folder, metric="valid/loss").best == ("valid/loss", 1.0, 3)  # --metric still chooses
    assert cli.main(["runs", str(tmp_path / "runs")]) == 0
    table = capsys.readouterr().out
    assert "valid/acc 0.75 (epoch 2)" in table and "valid/loss" not in table, table
    assert cli.main(["compare", str(folder), "--width", "40"], plugins=[TuiRenderer()]) == 0
    assert capsys.readouterr().out.startswith("valid/acc over steps")


def _fold(folder: Path, acc: float, auroc: float) -> None:
    """One epoch whose validation step returns ``acc`` before ``auroc``; the directions given,
    ``auroc`` first."""
    def valid(loop: Any, batch: Any) -> dict[str, Any]:
        return {"acc": torch.tensor(acc), "auroc": torch.tensor(auroc)}

    state = hookfit.Loop(lambda loop, batch: {"loss": torch.tensor(1.0)}, [0, 1], val_step=valid, val_data=[0],
                         model=torch.nn.Linear(1, 1), max_epochs=1, run_dir=folder,
                         plugins=[Metrics(best={"valid/auroc": "max", "valid/acc": "max"}), MetricsLog()]).fit()
    assert state.status == "completed"


def test_the_default_metric_is_the_first_direction_given_not_the_steps_first_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``Metrics(best={"valid/auroc": "max", "valid/acc": "max"})`` with a step returning
    ``{"acc": ..., "auroc": ...}``: the log's ``"best"`` line keeps the order given, and ``hookfit
    runs`` and ``compare`` judge and rank the folds by ``valid/auroc``, where they took
    ``valid/acc``, the step's first key, and ranked the folds the other way."""
    monkeypatch.setenv("HOOKFIT_PLUGINS", "metrics,metrics_log")
    high_auroc, high_acc = tmp_path / "runs" / "f0", tmp_path / "runs" / "f1"
    _fold(high_auroc, acc=0.625, auroc=0.875)
    _fold(high_acc, acc=0.75, auroc=0.5)
    given = runs.directions(runs.read_metrics(high_auroc / "metrics.jsonl"))
    assert [name for name in given if name.startswith("valid/")] == ["valid/auroc", "valid/acc"]
    assert runs.load(high_auroc).best == ("valid/auroc", 0.875, 1)
    assert runs.load(high_acc).best == ("valid/auroc", 0.5, 1)
    assert cli.main(["runs", str(tmp_path / "runs")]) == 0
    table = capsys.readouterr().out
    assert "valid/auroc 0.875 (epoch 1)" in table and "valid/acc" not in table, table
    assert cli.main(["compare", str(high_acc), str(high_auroc), "--width", "40"], plugins=[TuiRenderer()]) == 0
    out = capsys.readouterr().out
    assert out.startswith("valid/auroc over steps"), out
    ranked = [line.split()[1] for line in out.split("#  RUN", 1)[1].splitlines()[1:]]  # the table's rows
    assert ranked == [str(high_auroc), str(high_acc)], out
