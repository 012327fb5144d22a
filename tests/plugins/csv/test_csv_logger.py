"""csv: metrics.csv (a row per stage of every epoch) and metrics_updates.csv (a row per
publication) in the run folder, compared with the run's metrics.jsonl; a stable header that
widens by an atomic rewrite; resumes append; a full disk warns once."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import StopAfter, squeeze

import hookfit
from hookfit.files import FileWarning
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.csv_log import CSVLogger
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.metrics_log import MetricsLog
from hookfit.plugins.optim import Optim

VALID = [3.0, 2.0, 2.5]


class Published:
    """Keeps every snapshot the metrics plugin publishes while a stage runs."""

    name = "published"

    def __init__(self) -> None:
        self.updates: list = []

    @hookfit.hookimpl
    def metrics_update(self, metrics):
        self.updates.append(metrics)


def run(run_dir: Path, *plugins, max_epochs: int = 3, late: int | None = None, **kwargs) -> hookfit.Loop:
    """Three epochs of four batches, validated on two; ``late``: from that epoch (from 0) on,
    the step also returns ``grad_norm``, a metric the header did not have."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(4)]

    def step(loop, batch):
        for group in loop.optimizers.param_groups:
            group["lr"] = 0.1 / (1 + loop.state.epoch)
        loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        out = {"loss": loss}
        if late is not None and loop.state.epoch >= late:
            out["grad_norm"] = 1.0 + loop.state.epoch
        return out

    def val_step(loop, batch):
        return {"loss": torch.tensor(VALID[loop.state.epoch]), "accuracy": 1.0 / (1 + loop.state.epoch)}

    loop = hookfit.Loop(step, data, val_step=val_step, val_data=[0, 1], model=model, optimizers=optimizer,
                        max_epochs=max_epochs, run_dir=run_dir,
                        plugins=[Optim(), Metrics(interval=0.0), MetricsLog(), *plugins], **kwargs)
    loop.fit()
    return loop


def jsonl_epochs(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r["event"] == "epoch"]


def table(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """The header and the rows; every line must have exactly the header's fields."""
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    header, rows = lines[0], lines[1:]
    assert all(len(r) == len(header) for r in rows), lines
    return header, [dict(zip(header, r)) for r in rows]


def test_a_row_per_stage_of_every_epoch_equal_to_metrics_jsonl(tmp_path: Path) -> None:
    logger = CSVLogger()
    loop = run(tmp_path / "run", logger)
    assert loop.state.status == "completed" and logger.path == tmp_path / "run" / "metrics.csv"
    header, rows = table(tmp_path / "run" / "metrics.csv")
    assert header == ["epoch", "step", "stage", "accuracy", "loss", "lr_default"]
    expected = jsonl_epochs(tmp_path / "run")
    assert len(rows) == len(expected) == 6
    for row, line in zip(rows, expected):
        assert (int(row["epoch"]), int(row["step"]), row["stage"]) == (line["epoch"], line["step"], line["stage"])
        assert float(row["loss"]) == line["loss"]  # exactly: written to the last digit
        assert float(row["lr_default"]) == line["lr_default"]
        assert (row["accuracy"] == "") if row["stage"] == "train" else float(row["accuracy"]) == line["accuracy"]
    assert [r["loss"] for r in rows if r["stage"] == "valid"] == ["3.0", "2.0", "2.5"]
    assert not (tmp_path / "run" / "metrics_updates.csv").exists()


def test_every_publication_has_its_row_with_running_means(tmp_path: Path) -> None:
    published = Published()
    logger = CSVLogger(every_publication=True)
    run(tmp_path / "run", logger, published)
    header, rows = table(Path(logger.updates_path))
    assert header == ["epoch", "step", "stage", "batches", "accuracy", "loss", "lr_default"]
    assert len(rows) == len(published.updates) == 3 * (4 + 2)  # interval=0: every batch
    for row, snapshot in zip(rows, published.updates):
        assert (int(row["epoch"]), int(row["step"]), row["stage"], int(row["batches"])) == (
            snapshot.epoch + 1, snapshot.step, snapshot.stage, snapshot.batches)
        assert float(row["loss"]) == snapshot.values["loss"].running
    assert [r["step"] for r in rows[:6]] == ["1", "2", "3", "4", "4", "4"]  # validation at the step it follows
    assert len(table(tmp_path / "run" / "metrics.csv")[1]) == 6


def test_publications_come_at_most_every_metrics_interval_which_the_option_says(tmp_path: Path) -> None:
    """metrics_updates.csv has a row per publication, which the built-in metrics plugin makes at
    most every Metrics(interval=0.5) seconds: a run of a few milliseconds has fewer rows than
    batches, and Metrics(interval=0) a row after every batch. The option says so."""
    import hookfit.plugins.csv_log as module

    def step(loop, batch):
        return {"loss": float(batch)}

    for folder, metrics in (("bounded", Metrics()), ("every", Metrics(interval=0))):
        hookfit.Loop(step, list(range(40)), run_dir=tmp_path / folder,
                     plugins=[metrics, CSVLogger(every_publication=True)]).fit()
    rows = {folder: table(tmp_path / folder / "metrics_updates.csv")[1] if (tmp_path / folder /
            "metrics_updates.csv").exists() else [] for folder in ("bounded", "every")}
    assert [int(r["step"]) for r in rows["every"]] == list(range(1, 41)) and len(rows["bounded"]) < 40
    for doc in (module.__doc__, CSVLogger.__doc__):
        assert "Metrics(interval=0.5)" in doc and "Metrics(interval=0)" in doc


def test_a_metric_appearing_later_widens_the_header_and_every_row_lines_up(tmp_path: Path) -> None:
    run(tmp_path / "run", CSVLogger(every_publication=True), late=1)
    header, rows = table(tmp_path / "run" / "metrics.csv")
    assert header == ["epoch", "step", "stage", "accuracy", "grad_norm", "loss", "lr_default"]
    assert [(r["epoch"], r["stage"], r["grad_norm"]) for r in rows] == [
        ("1", "train", ""), ("1", "valid", ""), ("2", "train", "2.0"), ("2", "valid", ""),
        ("3", "train", "3.0"), ("3", "valid", "")]
    expected = jsonl_epochs(tmp_path / "run")
    assert [float(r["loss"]) for r in rows] == [line["loss"] for line in expected]
    header, rows = table(tmp_path / "run" / "metrics_updates.csv")
    assert "grad_norm" in header and sum(1 for r in rows if r["grad_norm"]) == 8
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.suffix not in (".jsonl", ".lock")) == [
        "metrics.csv", "metrics_updates.csv"]  # no temporary file left


@pytest.mark.fault
def test_a_resumed_run_appends_without_a_second_header_and_drops_what_followed_its_checkpoint(tmp_path: Path) -> None:
    """The first run wrote epoch 3 and then lost its last checkpoint (as a kill right before
    it would): the resumed run redoes epoch 3, and the table has each row once."""
    folder = tmp_path / "run"
    run(folder, CSVLogger(every_publication=True), Checkpoint(background=False))
    (last,) = (folder / "checkpoints").glob("epoch0003-*.pt")
    last.unlink()
    loop = run(folder, CSVLogger(every_publication=True), Checkpoint(background=False), resume="latest")
    assert loop.state.resumed_from is not None and loop.state.resumed_from.step == 8
    text = (folder / "metrics.csv").read_text()
    assert text.count("epoch,step,stage") == 1
    header, rows = table(folder / "metrics.csv")
    assert [(r["epoch"], r["stage"]) for r in rows] == [(e, s) for e in "123" for s in ("train", "valid")]
    final = {}
    for line in jsonl_epochs(folder):  # the resumed run's lines come last
        final[(line["epoch"], line["stage"])] = line
    assert [float(r["loss"]) for r in rows] == [final[(int(r["epoch"]), r["stage"])]["loss"] for r in rows]
    _, updates = table(folder / "metrics_updates.csv")
    assert [int(r["step"]) for r in updates if r["stage"] == "train"] == list(range(1, 13))



def test_a_fresh_run_in_a_used_folder_sets_the_earlier_runs_tables_aside(tmp_path: Path) -> None:
    """A script run again with the same ``run_dir`` and no resume: the earlier run's tables are
    renamed ``*.earlier-run-N.csv`` (never deleted), one warning names both, and the fresh files
    hold this run's rows alone (no second history under the first: ``pandas.read_csv`` would mix
    them); a resumed run appends (above)."""
    folder = tmp_path / "run"
    run(folder, CSVLogger(every_publication=True))
    first = (folder / "metrics.csv").read_text(), (folder / "metrics_updates.csv").read_text()
    with pytest.warns(hookfit.HookfitWarning) as caught:
        run(folder, CSVLogger(every_publication=True), max_epochs=1)
    said = [str(w.message) for w in caught if "earlier run" in str(w.message)]
    assert len(said) == 1 and "metrics.csv" in said[0] and "metrics.earlier-run-1.csv" in said[0], said
    assert "metrics_updates.earlier-run-1.csv" in said[0] and "resume" in said[0]
    assert ((folder / "metrics.earlier-run-1.csv").read_text(),
            (folder / "metrics_updates.earlier-run-1.csv").read_text()) == first
    _, rows = table(folder / "metrics.csv")
    assert [(r["epoch"], r["stage"]) for r in rows] == [("1", "train"), ("1", "valid")]
    with pytest.warns(hookfit.HookfitWarning, match="earlier-run-2.csv"):
        run(folder, CSVLogger(), max_epochs=2)
    assert len(table(folder / "metrics.earlier-run-2.csv")[1]) == 2 and len(table(folder / "metrics.csv")[1]) == 4
    assert (folder / "metrics.earlier-run-1.csv").read_text() == first[0]


@pytest.mark.fault
def test_a_fifo_named_as_the_table_is_not_opened_to_be_read(tmp_path: Path) -> None:
    """The check of whether an earlier run's table is there opened the path before asking whether it is a file: a
    FIFO named metrics.csv blocked the run's start."""
    from hookfit.plugins.support.logger import table_of

    os.mkfifo(tmp_path / "metrics.csv")
    assert table_of(tmp_path / "metrics.csv", ("epoch",)) is False  # returns at once
    (tmp_path / "other.csv").write_text("epoch,step\n")
    assert table_of(tmp_path / "other.csv", ("epoch", "step")) and not table_of(tmp_path / "other.csv", ("step",))


# where a stop lands, counting batches of four training and two validation batches an epoch
STOPS = {8: "inside epoch 2's training", 10: "right after epoch 2's last training batch",
         11: "inside epoch 2's validation", 12: "right after epoch 2's validation"}


@pytest.mark.parametrize("stop", sorted(STOPS))
def test_a_run_stopped_and_resumed_writes_the_files_of_the_run_that_never_stopped(tmp_path: Path, stop: int) -> None:
    """The stopped run writes the stage the stop cut short (its means so far); the resumed run
    writes that stage again, whole, at its end, and drops the earlier row: both files read as
    the uninterrupted run's, byte for byte."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run(whole, CSVLogger(every_publication=True))
    first = run(resumed, CSVLogger(every_publication=True), Checkpoint(background=False), StopAfter(stop))
    assert first.state.status == "interrupted", STOPS[stop]
    loop = run(resumed, CSVLogger(every_publication=True), Checkpoint(background=False), resume="latest")
    assert loop.state.resumed_from is not None and loop.state.status == "completed"
    for name in ("metrics.csv", "metrics_updates.csv"):
        assert (resumed / name).read_text() == (whole / name).read_text(), (name, STOPS[stop])


@pytest.mark.fault
def test_a_last_line_cut_short_is_dropped(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    run(folder, CSVLogger(), Checkpoint(background=False), max_epochs=1)
    with open(folder / "metrics.csv", "a") as f:
        f.write("2,8,tra")  # killed in the middle of a write
    run(folder, CSVLogger(), Checkpoint(background=False), max_epochs=2, resume="latest")
    header, rows = table(folder / "metrics.csv")
    assert [(r["epoch"], r["stage"]) for r in rows] == [(e, s) for e in "12" for s in ("train", "valid")]


@pytest.mark.fault
def test_a_file_that_is_not_its_table_is_left_alone(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.csv").write_text("name,score\nalice,3\n")
    with pytest.warns(FileWarning, match=r"csv: .*metrics.csv is not a table this plugin writes \(its header "
                                         r"starts 'name,score', not 'epoch,step,stage'\); it is left as it is") as caught:
        loop = run(folder, CSVLogger())
    assert loop.state.status == "completed"
    assert len([w for w in caught if w.category is FileWarning]) == 1
    assert (folder / "metrics.csv").read_text() == "name,score\nalice,3\n"


def test_discovered_it_is_inert_until_configured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOKFIT_PLUGINS", "csv")
    loop = run(tmp_path / "found")
    assert loop.run.pm.get_plugin("csv") is None  # unregistered at configure: no hook of it runs
    assert not (tmp_path / "found" / "metrics.csv").exists()

    config = tmp_path / "hookfit.toml"
    config.write_text("[plugins.csv]\nevery_publication = true\n")
    monkeypatch.setenv("HOOKFIT_CONFIG", str(config))
    run(tmp_path / "configured")
    assert len(table(tmp_path / "configured" / "metrics.csv")[1]) == 6
    assert len(table(tmp_path / "configured" / "metrics_updates.csv")[1]) == 18

    config.write_text("[plugins.csv]\nenabled = false\n")
    run(tmp_path / "off")
    assert not (tmp_path / "off" / "metrics.csv").exists()


@pytest.mark.bad_input
@pytest.mark.parametrize("options, message", [
    ({"enabled": "no"}, r"csv: enabled must be True, False or None, got 'no'"),
    ({"every_publication": 1}, r"csv: every_publication must be True or False, got 1"),
])
def test_bad_options_are_named(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CSVLogger(**options)


FULL_DISK_CHILD = r'''
import json, os, resource, signal, sys, warnings
import hookfit
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.csv_log import CSVLogger

run_dir, late = sys.argv[1], sys.argv[2] == "late"
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the kernel answers EFBIG instead of the signal
logger = CSVLogger()


''' + squeeze('logger.path', 5) + r'''

def step(loop, batch):
    out = {"loss": float(batch)}
    if late and loop.state.epoch >= 1:
        out["extra"] = 1.0  # a new column: the header is rewritten, into a file that does not fit
    return out

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    state = hookfit.Loop(step, [1, 2, 3, 4], max_epochs=3, run_dir=run_dir,
                         plugins=[Metrics(), logger, Squeeze()]).fit()
print(json.dumps({"status": state.status, "step": state.step,
                  "warnings": [(w.category.__name__, str(w.message)) for w in caught]}))
'''


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.parametrize("late", ["append", "late"])
def test_a_full_disk_warns_once_and_training_completes(tmp_path: Path, late: str) -> None:
    """RLIMIT_FSIZE makes the kernel refuse the writes as a full disk would (EFBIG for ENOSPC),
    in a child process; an append cut short and a header rewrite that does not fit alike leave
    the rows written before, whole."""
    script = tmp_path / "child.py"
    script.write_text(FULL_DISK_CHILD)
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, str(script), str(run_dir), late], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HOOKFIT_PLUGINS": ""})
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert (result["status"], result["step"]) == ("completed", 12)
    assert {category for category, _ in result["warnings"]} == {"FileWarning"}
    # the run's own run.jsonl (written by the core) may hit the limit too: not this plugin's file
    mine = [text for _, text in result["warnings"] if not text.startswith("hookfit: could not write ")]
    assert len(mine) == 1, result["warnings"]  # once, for every refused write
    message = mine[0]
    assert message.startswith("csv: could not write ") and "metrics.csv (OSError: [Errno 27] File too large" in message
    assert "training goes on" in message
    text = (run_dir / "metrics.csv").read_text()
    if late == "late":  # the rewrite failed before it replaced anything: the file is as it was
        assert text == "epoch,step,stage,loss\n1,4,train,2.5\n"
    else:  # the append was cut short: a next run afresh sets the file aside as it is (a resumed one drops the line)
        assert text == "epoch,step,stage,loss\n1,4,train,2.5\n2,8,t"  # 5 bytes more: the limit
        with pytest.warns(hookfit.HookfitWarning, match="set aside as metrics.earlier-run-1.csv"):
            hookfit.Loop(lambda loop, b: {"loss": 1.0}, [1], run_dir=run_dir,
                         plugins=[Metrics(), CSVLogger()]).fit()
        assert (run_dir / "metrics.earlier-run-1.csv").read_text() == text
        assert table(run_dir / "metrics.csv")[1] == [{"epoch": "1", "step": "1", "stage": "train", "loss": "1.0"}]
    # the run's lock (hookfit.locks: one process a run folder) beside its record
    aside = ["metrics.earlier-run-1.csv"] if late == "append" else []
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.csv", *aside, "run.jsonl", "run.lock"]


@pytest.mark.fault
def test_a_read_only_run_folder_warns_once_as_every_other_writer(read_only_folder: Path) -> None:
    """Both tables fail for the one reason: one ``FileWarning`` from the plugin, as the metric
    log gives one, and the run completes."""
    logger = CSVLogger(every_publication=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = hookfit.Loop(lambda loop, b: {"loss": float(b)}, [1, 2, 3], val_step=lambda loop, b: {"loss": 1.0},
                             val_data=[1], max_epochs=2, run_dir=read_only_folder,
                             plugins=[Metrics(interval=0), logger, MetricsLog()]).fit()
    assert state.status == "completed"
    said = [str(w.message) for w in caught if w.category is FileWarning]
    mine = [text for text in said if text.startswith("csv: ")]
    log = [text for text in said if text.startswith("metrics_log: ")]
    assert len(mine) == 1 and len(log) == 1, said
    assert "metrics_updates.csv" in mine[0] and "training goes on" in mine[0]
    assert not any(read_only_folder.iterdir())


def test_a_file_that_is_not_its_table_fails_that_table_alone(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.csv").write_text("name,value\nx,1\n")
    with pytest.warns(FileWarning, match="is not a table this plugin writes"):
        hookfit.Loop(lambda loop, b: {"loss": float(b)}, [1, 2], run_dir=tmp_path / "run",
                     plugins=[Metrics(interval=0), CSVLogger(every_publication=True)]).fit()
    assert (tmp_path / "run" / "metrics.csv").read_text() == "name,value\nx,1\n"
    assert (tmp_path / "run" / "metrics_updates.csv").read_text().startswith("epoch,step,stage,batches,loss\n")


def test_an_evaluation_in_the_runs_folder_leaves_its_tables_alone_and_writes_its_own(tmp_path: Path) -> None:
    """``Loop.validate(resume=<epoch 1's checkpoint>)`` in the training run's folder: the run's
    ``metrics.csv`` stays byte for byte (a resume would drop the rows after the checkpoint: an
    evaluation is none), and the evaluation's row goes to ``evaluation.csv``, labelled with the
    checkpoint's epoch and step."""
    loop = run(tmp_path, Checkpoint(background=False), CSVLogger())
    before = (tmp_path / "metrics.csv").read_bytes()
    first = sorted((tmp_path / "checkpoints").glob("*.pt"))[0]

    def test_step(loop, batch):
        return {"loss": torch.tensor(100.0)}

    hookfit.Loop(None, [], val_step=test_step, val_data=[0], model=loop.model, run_dir=tmp_path,
                 plugins=[Metrics(), Checkpoint(), CSVLogger()]).validate(resume=str(first))
    assert (tmp_path / "metrics.csv").read_bytes() == before
    _, rows = table(tmp_path / "evaluation.csv")
    assert [(r["epoch"], r["step"], r["stage"], r["loss"]) for r in rows] == [("1", "4", "valid", "100.0")]


def test_evaluations_of_two_runs_checkpoints_in_one_folder_name_the_checkpoint_each_evaluated(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs' checkpoints at the same epoch and step, evaluated into one folder: each row of
    ``evaluation.csv`` and ``evaluation_updates.csv`` names its checkpoint by its absolute path (given relative to
    the working folder: as ``results["last_checkpoint"]`` names it) in
    the column after ``stage`` (``batches``), where epoch and step alone could not tell them apart; a table
    written before that column is widened, its rows kept with an empty cell, and an evaluation of the weights
    as they are leaves it empty. A metric named ``checkpoint`` takes ``metric.checkpoint``."""
    firsts = []
    for name in ("a", "b"):
        run(tmp_path / name, Checkpoint(background=False), max_epochs=1)
        firsts.append(sorted((tmp_path / name / "checkpoints").glob("*.pt"))[0])
    assert firsts[0].name == firsts[1].name
    folder = tmp_path / "evaluations"
    folder.mkdir()
    (folder / "evaluation.csv").write_text("epoch,step,stage,loss\n3,9,valid,1.5\n")

    def evaluate(resume: Path | None) -> Any:
        def test_step(loop: Any, batch: Any) -> dict[str, Any]:
            return {"loss": torch.tensor(100.0), "checkpoint": 1.0}

        with pytest.warns(hookfit.HookfitWarning, match="'metric.checkpoint'"):
            return hookfit.Loop(None, [], val_step=test_step, val_data=[0], model=torch.nn.Linear(2, 1),
                                run_dir=folder, plugins=[Optim(), Metrics(interval=0), Checkpoint(),
                                                         CSVLogger(every_publication=True)]).validate(resume=resume)

    monkeypatch.chdir(tmp_path)
    states = [evaluate(first.relative_to(tmp_path)) for first in firsts] + [evaluate(None)]
    assert [state.resumed_from.source for state in states[:2]] == [str(f.relative_to(tmp_path)) for f in firsts]
    sources = [str(state.results["last_checkpoint"]) for state in states[:2]]
    assert sources == list(map(str, firsts))
    header, rows = table(folder / "evaluation.csv")
    assert header == ["epoch", "step", "stage", "checkpoint", "loss", "metric.checkpoint"]
    assert [(r["epoch"], r["step"], r["checkpoint"], r["loss"]) for r in rows] == [
        ("3", "9", "", "1.5"), ("1", "4", sources[0], "100.0"), ("1", "4", sources[1], "100.0"), ("1", "0", "", "100.0")]
    header, rows = table(folder / "evaluation_updates.csv")
    assert header[:5] == ["epoch", "step", "stage", "batches", "checkpoint"]
    assert [r["checkpoint"] for r in rows if r["batches"] == "1"] == [*sources, ""]
