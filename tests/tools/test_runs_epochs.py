"""The epochs ``hookfit runs`` and ``hookfit compare`` count for a run are those of its end line in
``run.jsonl`` (the epoch it was in when it ended, counted from 1, as the console prints it), whatever
the status: a run that failed or was aborted inside an epoch counts that epoch, as an interrupted one
does; a run with no end line (killed) counts the epochs of its metric log."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.metrics_log import MetricsLog
from hookfit.plugins.optim import Optim
from hookfit.plugins.tui import TuiRenderer
from hookfit.tools import cli, runs
from conftest import mse_step


def _run(folder: Path, at: int, how: str) -> None:
    """Four batches an epoch, three epochs; at step ``at`` the step fails (``RuntimeError``),
    aborts (``KeyboardInterrupt``, as a second Ctrl-C does) or asks for a stop."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(4)]

    def step(loop: Any, batch: Any) -> dict[str, Any]:
        if loop.state.step == at and how == "failed":
            raise RuntimeError(f"boom at step {at}")
        if loop.state.step == at and how == "aborted":
            raise KeyboardInterrupt("second SIGINT: aborting")
        out = mse_step(loop, batch)
        if loop.state.step == at and how == "stopped":
            loop.request_stop("enough")
        return out

    loop = hookfit.Loop(step, data, val_step=lambda loop, b: {"loss": torch.nn.functional.mse_loss(loop.model(b[0]),
                                                                                                  b[1])},
                        val_data=data[:1], model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                        max_epochs=3, run_dir=folder, plugins=[Optim(), Metrics(), MetricsLog()])
    if how == "failed":
        with pytest.raises(RuntimeError, match="boom"):
            loop.fit()
    elif how == "aborted":
        with pytest.raises(KeyboardInterrupt):
            loop.fit()
    else:
        loop.fit()


def _end(folder: Path) -> dict[str, Any]:
    return [json.loads(line) for line in (folder / "run.jsonl").read_text().splitlines()][-1]


@pytest.mark.parametrize(("how", "at", "status", "epochs"), [
    ("failed", 6, "failed", 2),  # in epoch 2, after epoch 1's rows
    ("failed", 1, "failed", 1),  # in epoch 1, before any row
    ("aborted", 1, "interrupted", 1),
    ("aborted", 9, "interrupted", 3),
    ("stopped", 6, "interrupted", 2),  # the stopped epoch's partial rows count it already
    ("completed", -1, "completed", 3),
])
def test_runs_and_compare_count_the_epochs_of_the_end_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str], how: str, at: int,
                                                           status: str, epochs: int) -> None:
    monkeypatch.setenv("HOOKFIT_PLUGINS", "metrics,metrics_log,optim")
    folder = tmp_path / "runs" / how
    _run(folder, at, how)
    end = _end(folder)
    assert (end["status"], end["epochs"]) == (status, epochs), end
    capsys.readouterr()
    assert cli.main(["runs", str(folder), "--json"]) == 0
    [listed] = json.loads(capsys.readouterr().out)
    assert (listed["status"], listed["epochs"], listed["steps"]) == (status, epochs, end["steps"]), listed
    assert runs.load(folder).epochs == epochs
    if runs.epoch_rows(folder):  # (compare draws a metric: a run with none is not compared)
        assert cli.main(["compare", str(folder), "--metric", "train/loss"], plugins=[TuiRenderer()]) == 0
        row = next(line for line in capsys.readouterr().out.splitlines() if str(folder) in line).split()
        assert row[1:5] == [str(folder), status, str(epochs), str(end["steps"])], row


def test_a_run_without_end_lines_in_run_jsonl_counts_the_epoch_of_its_metric_logs_end(tmp_path: Path) -> None:
    """A ``run.jsonl`` without end lines (written by a process that could not append its end):
    the metric log's end line says where the run ended, the epoch it failed in included."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "run.jsonl").write_text(json.dumps({"event": "run", "name": "run", "started": "2026-01-01T00:00:00",
                                                  "max_epochs": 3, "resume": None}) + "\n")
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in (
        {"event": "epoch", "stage": "train", "epoch": 1, "step": 4, "loss": 1.0},
        {"event": "end", "status": "failed", "reason": "RuntimeError: boom", "epoch": 2, "step": 6, "time": 1.0})))
    info = runs.load(folder)
    assert (info.status, info.epochs, info.steps) == ("failed", 2, 6), info


def test_a_killed_run_counts_the_epochs_of_its_metric_log(tmp_path: Path) -> None:
    """No end line anywhere (the process was killed): the epochs its metric log holds."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "run.jsonl").write_text(json.dumps({"event": "run", "name": "run", "started": "2026-01-01T00:00:00",
                                                  "max_epochs": 3, "resume": None, "pid": 0}) + "\n")
    (folder / "metrics.jsonl").write_text(json.dumps({"event": "epoch", "stage": "train", "epoch": 1, "step": 4,
                                                      "loss": 1.0}) + "\n")
    info = runs.load(folder)
    assert (info.status, info.epochs, info.steps) == ("unfinished", 1, 4), info
