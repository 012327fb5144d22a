"""``hookfit show`` of a run folder resumed into (several ``fit()`` calls appended to it): its
time lines count every fit, as its clock and ``hookfit runs`` do, and also say the last fit's."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit.payloads import TimeSplit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.metrics_log import MetricsLog
from hookfit.plugins.optim import Optim
from hookfit.plugins.tui import TuiRenderer
from hookfit.plugins.tui.replay import _dashboard
from hookfit.tools import cli, runs

from conftest import mse_step

TIME_LINE = re.compile(r"^  time in (\w+)( \((?:\d+ fits|last fit)\))?: ([\d.]+)s over (\d+) batches", re.M)


def show_text(folder: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(["show", str(folder), "--text"], plugins=[TuiRenderer()]) == 0
    return capsys.readouterr().out


def train(folder: Path, epochs: int) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(4)]
    loop = hookfit.Loop(mse_step, data, val_step=lambda loop, b: {"loss": torch.tensor(1.0)}, val_data=data[:2],
                        model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.01), max_epochs=epochs,
                        run_dir=folder, resume="latest",
                        plugins=[Optim(), Metrics(), MetricsLog(), Checkpoint(background=False)])
    return loop.fit()


def test_a_resumed_runs_time_lines_count_every_fit_and_the_last_one_apart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HOOKFIT_PLUGINS", "metrics,metrics_log,optim,checkpoint")
    folder = tmp_path / "run"
    fits = [train(folder, epochs) for epochs in (2, 3, 5)]  # 2 epochs, then resumed for 1, then for 2
    assert [state.status for state in fits] == ["completed"] * 3
    splits = [state.time_split for state in fits]
    out = show_text(folder, capsys)
    said = {(stage, label): (float(seconds), int(batches)) for stage, label, seconds, batches in TIME_LINE.findall(out)}
    assert said.keys() == {(s, label) for s in ("train", "valid") for label in (" (3 fits)", " (last fit)")}, out
    for stage, per_epoch in (("train", 4), ("valid", 2)):
        assert said[stage, " (3 fits)"][1] == 5 * per_epoch and said[stage, " (last fit)"][1] == 2 * per_epoch
        whole = sum((split[stage] for split in splits[1:]), splits[0][stage])
        assert said[stage, " (3 fits)"][0] == pytest.approx(whole.total, abs=0.05)
        assert said[stage, " (last fit)"][0] == pytest.approx(splits[-1][stage].total, abs=0.05)
    model, _, info, _ = _dashboard(folder, draw=False)  # the dashboard's time row: the whole run's
    assert {stage: split.batches for stage, split in model.time_split.items()} == {"train": 20, "valid": 10}
    assert info.fits == 3 and out.splitlines()[1].endswith(f"after {info.duration:.1f}s, 20 steps")


def _folder(tmp_path: Path, *lines: dict[str, Any]) -> Path:
    folder = tmp_path / "run"
    folder.mkdir(parents=True)
    rows = [{"event": "epoch", "stage": "train", "epoch": e, "step": 4 * e, "batches": 4, "loss": 1.0} for e in (1, 2)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "run.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def _end(duration: float, **stages: tuple[float, int]) -> dict[str, Any]:
    return {"event": "end", "status": "completed", "duration": duration, "epochs": 2, "steps": 8,
            "time_split": {stage: {"data": 0.0, "step": seconds, "plugins": 0.0, "batches": batches}
                           for stage, (seconds, batches) in stages.items()}}


def test_an_evaluation_in_the_folder_is_no_fit_and_one_fit_keeps_its_plain_lines(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    start = {"event": "run", "name": "run", "started": "2026-01-01T00:00:00", "max_epochs": 2}
    folder = _folder(tmp_path, start, _end(12.0, train=(10.0, 8), valid=(1.0, 2)),
                     {**start, "mode": "validate"}, _end(0.5, valid=(0.4, 2)))
    out = show_text(folder, capsys)
    assert TIME_LINE.findall(out) == [("train", "", "10.0", "8"), ("valid", "", "1.0", "2")], out
    model, _, _, _ = _dashboard(folder, draw=False)
    assert model.time_split == {"train": TimeSplit("train", 0.0, 10.0, 0.0, 8),
                                "valid": TimeSplit("valid", 0.0, 1.0, 0.0, 2)}
    evaluated = _folder(tmp_path / "evaluated", start, _end(12.0, train=(10.0, 8)),
                        {**start, "mode": "validate", "max_epochs": 1}, _end(0.5, valid=(0.4, 2)))
    assert _dashboard(evaluated, draw=False)[0].max_epochs == 2  # the fit's, not the evaluation Loop's 1
    again = tmp_path / "again"
    _folder(again, start, _end(20.0, train=(15.0, 6)), start, _end(31.1, train=(25.0, 10), valid=(2.0, 4)))
    out = show_text(again / "run", capsys)
    assert TIME_LINE.findall(out) == [("train", " (2 fits)", "40.0", "16"), ("train", " (last fit)", "25.0", "10"),
                                      ("valid", " (2 fits)", "2.0", "4"), ("valid", " (last fit)", "2.0", "4")], out
    assert runs.load(again / "run").duration == pytest.approx(51.1) and "after 51.1s" in out


def test_show_leaves_out_the_rows_a_resume_abandoned_as_hookfit_runs_does(tmp_path: Path) -> None:
    """A run stopped at step 51 (its partial epoch's row) and resumed from its checkpoint at step 50:
    `hookfit show` drew the stopped fit's partial mean at 51 before the whole epoch's at 60."""
    lines = [
        {"event": "best", "metrics": {"train/loss": "min"}},
        {"event": "epoch", "stage": "train", "epoch": 1, "step": 51, "batches": 51, "loss": 9.0, "stopped": True},
        {"event": "end", "status": "interrupted", "reason": "SIGTERM", "epoch": 1, "step": 51, "time": 1.0},
        {"event": "resume", "from": "epoch0001-step000000050.pt", "epoch": 1, "batch": 50, "step": 50},
        {"event": "epoch", "stage": "train", "epoch": 1, "step": 60, "batches": 60, "loss": 1.0},
        {"event": "epoch", "stage": "train", "epoch": 2, "step": 120, "batches": 60, "loss": 0.5},
        {"event": "end", "status": "completed", "reason": "max_epochs=2 reached", "epoch": 2, "step": 120, "time": 1.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    dash, _, _, _ = _dashboard(tmp_path, draw=False)
    assert [x for x, _ in dash.series[("train", "loss")].recent] == [60, 120]
    assert [row["step"] for row in runs.epoch_rows(tmp_path)] == [60, 120]  # what hookfit runs and compare read


def test_show_lists_the_warnings_the_run_recorded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import warnings

    def step(loop, batch) -> Any:
        if loop.state.step == 2:
            warnings.warn("THE STEP WARNS\nON TWO LINES", UserWarning)
        return mse_step(loop, batch)

    model = torch.nn.Linear(2, 1)
    data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore")
        warnings.simplefilter("always", UserWarning)
        hookfit.Loop(step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.01), run_dir=tmp_path,
                     plugins=[Optim(), Metrics(), MetricsLog()]).fit()
    assert [str(w.message) for w in caught] == ["THE STEP WARNS\nON TWO LINES"]
    out = show_text(tmp_path, capsys)
    assert "\n  warning: UserWarning: THE STEP WARNS ON TWO LINES (step 2)\n" in out, out
    model_, _, _, _ = _dashboard(tmp_path, draw=False)  # the dashboard's log pane too
    assert model_.log == ["warning: UserWarning: THE STEP WARNS ON TWO LINES (step 2)"]


def test_show_of_a_training_run_leaves_out_an_evaluations_warnings_and_shows_them_of_an_evaluation(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An evaluation (``Loop.validate(resume=...)``) in the training run's folder records its own
    warnings in ``run.jsonl``: the training's view (the summary and the log pane) shows the
    training's alone; the view of a folder of evaluations alone shows theirs, and how many were
    not recorded."""
    import warnings

    from hookfit.runwarnings import KEPT

    def step(loop, batch) -> Any:
        if loop.state.step == 1:
            warnings.warn("THE FIT WARNS", UserWarning)
        return mse_step(loop, batch)

    def val_step(loop, batch) -> Any:
        if loop.mode != "fit":
            for i in range(KEPT + 3):
                warnings.warn(f"THE EVALUATION WARNS {i}", UserWarning)
        return {"loss": torch.tensor(1.0)}

    model = torch.nn.Linear(2, 1)
    data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(2)]
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        hookfit.Loop(step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
                     val_step=val_step, val_data=[0], run_dir=tmp_path,
                     plugins=[Optim(), Metrics(), MetricsLog(), Checkpoint(background=False)]).fit()
        for folder in (tmp_path, tmp_path / "evaluated"):  # the run's folder, then one of its own
            hookfit.Loop(step, data, model=model, val_step=val_step, val_data=[0], run_dir=folder,
                         plugins=[Metrics(), MetricsLog(), Checkpoint(background=False)]).validate(
                resume=str(tmp_path / "checkpoints"))
    assert "THE EVALUATION WARNS 0" in (tmp_path / "run.jsonl").read_text()  # recorded, as the evaluation's
    out = show_text(tmp_path, capsys)
    assert "\n  warning: UserWarning: THE FIT WARNS (step 1)\n" in out, out
    assert "EVALUATION" not in out and "more" not in out, out
    model_, _, _, _ = _dashboard(tmp_path, draw=False)
    assert model_.log == ["warning: UserWarning: THE FIT WARNS (step 1)"]
    out = show_text(tmp_path / "evaluated", capsys)
    assert re.search(r"^  warning: UserWarning: THE EVALUATION WARNS 0 \(step \d+\)$", out, re.M), out
    assert re.search(r"^  warning: … and \d+ more$", out, re.M) and "THE FIT WARNS" not in out, out
