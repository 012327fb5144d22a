"""Metric names with a space, ``=``, a comma, a quote or a line break are written safely in every
output: the CSV tables (the csv module's quoting, read back by any CSV reader, a continued run
included), TensorBoard tags (sanitized, said once), and ``metrics.jsonl``, which ``hookfit
runs``, ``show`` and ``compare`` read back."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import hookfit
from hookfit.errors import HookfitWarning
from hookfit.plugins.csv_log import CSVLogger
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.metrics_log import MetricsLog
from hookfit.plugins.optim import Optim
from hookfit.tools import runs

NAMES = ["loss", "top 1 acc", "f=1", "a,b", 'say "hi"', "two\nlines", "x\r", "tab\there", "é/ü"]
"""Metric names, each returned with its index as its value."""


def train(run_dir: Path, *plugins: object, epochs: int = 2, extra: str | None = None,
          resume: str | None = None) -> hookfit.State:
    def step(loop, batch):
        out = {name: float(i) for i, name in enumerate(NAMES)}
        if extra is not None and loop.state.epoch == epochs - 1:  # a name that comes later
            out[extra] = 42.0
        return out

    return hookfit.Loop(step, [torch.zeros(2, 1)] * 2, val_step=step, val_data=[torch.zeros(2, 1)],
                        max_epochs=epochs, run_dir=run_dir, resume=resume, model=torch.nn.Linear(1, 1),
                        plugins=[Metrics(best={"top 1 acc": "max"}), MetricsLog(), *plugins]).fit()


def test_csv_quotes_names_so_a_csv_reader_gets_them_back_and_a_continued_run_appends_under_them(
        tmp_path: Path) -> None:
    from hookfit.plugins.checkpoint import Checkpoint

    logger = CSVLogger()
    train(tmp_path, logger, Checkpoint(background=False), extra="late\nname, new")  # the header widens by a rewrite
    resumed = train(tmp_path, logger, Checkpoint(background=False), epochs=3, resume="latest")
    assert resumed.resumed_from is not None  # continued in the folder: appends under the header it reads
    with open(tmp_path / "metrics.csv", newline="", encoding="utf-8") as file:
        rows = list(csv.DictReader(file))
    with open(tmp_path / "metrics.csv", newline="", encoding="utf-8") as file:
        header = next(csv.reader(file))
    assert header == ["epoch", "step", "stage", *sorted([*NAMES, "late\nname, new"])], header
    assert [(r["epoch"], r["stage"]) for r in rows] == [("1", "train"), ("1", "valid"), ("2", "train"),
                                                        ("2", "valid"), ("3", "train"), ("3", "valid")]
    for row in rows:
        assert {name: float(row[name]) for name in NAMES} == {name: float(i) for i, name in enumerate(NAMES)}
    assert [r["late\nname, new"] for r in rows] == ["", "", "42.0", "42.0", "", ""]


@pytest.mark.bad_input
def test_tensorboard_tags_are_sanitized_kept_apart_and_each_change_said_once(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hookfit.plugins.tensorboard import TensorBoard, tag_part

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(tmp_path, TensorBoard(), extra="top_1_acc")  # what "top 1 acc" becomes, returned as well
    changed = [str(w.message) for w in caught if issubclass(w.category, HookfitWarning)
               and str(w.message).startswith("tensorboard: ")]
    expected = {name: tag_part(name) for name in NAMES}
    assert expected["top 1 acc"] == "top_1_acc" and expected["two\nlines"] == "two_lines"
    assert expected["é/ü"] == "é/ü" and expected["f=1"] == "f_1"
    renamed = {name for name in NAMES if expected[name] != name}
    assert len(changed) == len(renamed) + 1, changed  # once a name, though written at every publication
    for name in renamed:
        assert sum(text.startswith(f"tensorboard: {name!r} is written as {expected[name]!r}") for text in changed) == 1
    (clash,) = [text for text in changed if text.startswith("tensorboard: 'top_1_acc' is written as 'top_1_acc_2'")]
    assert "taken by another name" in clash
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for stage in ("train", "valid"):
        for i, name in enumerate(NAMES):
            assert [e.value for e in events.Scalars(f"{stage}/{expected[name]}")] == [float(i)] * 2
        assert [e.value for e in events.Scalars(f"{stage}/top_1_acc_2")] == [42.0]
    assert all(not any(c in tag for c in " =\"\n\r\t,") for tag in tags), tags


def hookfit_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")}
    return subprocess.run([sys.executable, "-m", "hookfit", *args], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=120)


def test_metrics_jsonl_keeps_the_names_and_runs_show_and_compare_read_them_back(tmp_path: Path) -> None:
    folder = tmp_path / "runs" / "names" / "one"
    train(folder)
    rows = runs.epoch_rows(folder)
    assert [(r["stage"], r["epoch"]) for r in rows] == [("train", 1), ("valid", 1), ("train", 2), ("valid", 2)]
    assert runs.metric_names(rows) == [f"{stage}/{name}" for stage in ("train", "valid") for name in NAMES]
    info = runs.load(folder, metric="valid/top 1 acc")
    assert (info.best, info.mode) == (("valid/top 1 acc", 1.0, 1), "max")

    listed = hookfit_cli("runs", str(folder.parent), "--json", "--metric", "valid/two\nlines", "--mode", "min",
                         cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    (got,) = json.loads(listed.stdout)
    assert got["best"] == {"metric": "valid/two\nlines", "value": 5.0, "epoch": 1} and got["steps"] == 4
    compared = hookfit_cli("compare", str(folder), str(folder), "--metric", 'train/say "hi"', cwd=tmp_path)
    assert compared.returncode == 0, compared.stderr
    assert 'train/say "hi" over steps' in compared.stdout
    shown = hookfit_cli("show", str(folder), "--text", cwd=tmp_path)
    assert shown.returncode == 0 and not shown.stderr.strip(), shown.stderr
    assert "top 1 acc" in shown.stdout


@pytest.mark.bad_input
def test_csv_puts_a_metric_named_as_a_column_of_its_own_in_a_column_apart_said_once(tmp_path: Path) -> None:
    logger = CSVLogger(every_publication=True)

    def step(loop, batch):
        loop.backward(loop.model(batch).sum())
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"stage": 9.0, "batches": 10.0, "lr_default": 11.0, "loss": 1.0}  # (epoch, step: refused)

    model = torch.nn.Linear(1, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hookfit.Loop(step, [torch.ones(2, 1)] * 2, model=model,
                     optimizers=torch.optim.SGD(model.parameters(), lr=0.5), max_epochs=2, run_dir=tmp_path,
                     plugins=[Optim(), Metrics(interval=0), logger]).fit()
    said = sorted(str(w.message) for w in caught if str(w.message).startswith("csv: "))
    assert {w.filename for w in caught if str(w.message).startswith("csv: ")} == {__file__}  # the fit() line
    assert said == sorted(f"csv: the metric {name!r} is written in the column 'metric.{name}' of the CSV tables: "
                          f"{name!r} is a column of their own"
                          for name in ("stage", "batches", "lr_default"))
    for table in ("metrics.csv", "metrics_updates.csv"):
        with open(tmp_path / table, newline="") as file:
            rows = list(csv.DictReader(file))
        assert [(r["epoch"], r["step"], r["stage"], r["lr_default"]) for r in rows][-1] == ("2", "4", "train", "0.5")
        for row in rows:
            assert {k: row[k] for k in row if k.startswith("metric.")} == {
                "metric.stage": "9.0", "metric.batches": "10.0", "metric.lr_default": "11.0"}
