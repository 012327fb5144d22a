"""``hookfit runs``, ``show`` and ``compare`` read past damaged lines and values of a run's
``metrics.jsonl`` (a torn last line, a hand-edited value), naming them once, ``--json`` too; and
``hookfit runs`` and ``show`` count the steps of a run whose metric log a full disk cut short from its end
line in ``run.jsonl``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hookfit
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.metrics_log import MetricsLog
from hookfit.tools import runs


def hookfit_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")}
    return subprocess.run([sys.executable, "-m", "hookfit", *args], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=120, stdin=subprocess.DEVNULL)


def notes_of(stderr: str, folder: Path) -> list[str]:
    return [line for line in stderr.splitlines() if f"hookfit runs: {folder}:" in line]


@pytest.fixture
def run_folder(tmp_path: Path) -> Path:
    """A real run of 3 epochs (train and valid), valid/loss 0.3, 0.2, 0.25: best 0.2 at epoch 2."""
    folder = tmp_path / "runs" / "demo" / "1"
    valid = [0.3, 0.2, 0.25]

    def step(loop, batch):
        return {"loss": torch.tensor(1.0 / (1 + loop.state.epoch)), "acc": 0.5}

    def val_step(loop, batch):
        return {"loss": torch.tensor(valid[loop.state.epoch])}

    hookfit.Loop(step, [0, 1], val_step=val_step, val_data=[0], max_epochs=3, run_dir=folder,
                 plugins=[Metrics(), MetricsLog()]).fit()
    return folder


def damage(folder: Path, edit) -> list[dict]:
    """Rewrite the run's metrics.jsonl with ``edit`` applied to its lines (a list of dicts)."""
    path = folder / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    edit(lines)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return lines


def valid_rows(lines: list[dict]) -> list[int]:
    return [i for i, line in enumerate(lines) if line.get("event") == "epoch" and line.get("stage") == "valid"]


@pytest.mark.fault
def test_damaged_values_and_a_torn_last_line_are_read_past_and_named_once(run_folder: Path, tmp_path: Path) -> None:
    def edit(lines: list[dict]) -> None:
        first, second, third = valid_rows(lines)
        lines[first]["loss"] = "abc"  # hand-edited values: the row stays, without them
        lines[third]["loss"] = {}
        lines[second]["time"] = "soon"
        train = [i for i, line in enumerate(lines) if line.get("event") == "epoch" and line.get("stage") == "train"]
        lines[train[0]]["epoch"] = "one"  # a row that cannot be placed: skipped

    lines = damage(run_folder, edit)
    with open(run_folder / "metrics.jsonl", "a") as log:
        log.write('{"event": "epoch", "stage": "train", "ep')  # a torn last line
    numbers = {i + 1 for i in valid_rows(lines)}

    listed = hookfit_cli("runs", str(run_folder.parent), "--json", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    (info,) = json.loads(listed.stdout)
    assert info["status"] == "completed" and (info["epochs"], info["steps"]) == (3, 6)
    assert info["best"] == {"metric": "valid/loss", "value": pytest.approx(0.2), "epoch": 2}
    (note,) = info["notes"]
    assert note.startswith("metrics.jsonl: ")
    for number, what in zip(sorted(numbers), ("'loss' is \"abc\", not a number: left out",
                                              "'time' is \"soon\", not a number of seconds: left out",
                                              "'loss' is {}, not a number: left out")):
        assert f"line {number}: {what}" in note, note
    assert "'epoch' is \"one\", not an epoch counted from 1: the line is skipped" in note
    assert note.endswith("its last line is cut short (a run killed while writing it, or a full disk): skipped")
    (warned,) = notes_of(listed.stderr, run_folder)  # once, in the warning as in --json
    assert warned.endswith(note)

    table = hookfit_cli("runs", str(run_folder.parent), cwd=tmp_path)
    assert table.returncode == 0 and "valid/loss 0.2 (epoch 2)" in table.stdout, table.stdout + table.stderr
    assert len(notes_of(table.stderr, run_folder)) == 1

    compared = hookfit_cli("compare", str(run_folder), str(run_folder), "--metric", "valid/loss", cwd=tmp_path)
    assert compared.returncode == 0, compared.stderr
    assert "0.2 (epoch 2)" in compared.stdout
    assert len(notes_of(compared.stderr, run_folder)) == 1  # the same run twice: said once

    rows = runs.epoch_rows(run_folder)
    assert [(r["stage"], r["epoch"]) for r in rows] == [("valid", 1), ("train", 2), ("valid", 2), ("train", 3),
                                                        ("valid", 3)]
    assert [r.get("loss") for r in rows if r["stage"] == "valid"] == [None, pytest.approx(0.2), None]


@pytest.mark.fault
def test_show_reads_past_damaged_metric_values(run_folder: Path, tmp_path: Path) -> None:
    def edit(lines: list[dict]) -> None:
        first, _, third = valid_rows(lines)
        lines[first]["loss"] = "abc"
        lines[third]["loss"] = {}

    damage(run_folder, edit)
    with open(run_folder / "metrics.jsonl", "a") as log:
        log.write('{"event": "end", "sta')
    shown = hookfit_cli("show", str(run_folder), "--text", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "completed" in shown.stdout
    assert len(notes_of(shown.stderr, run_folder)) == 1


def test_show_reads_past_damaged_progress_fields(run_folder: Path, tmp_path: Path) -> None:
    """``epoch`` and ``time`` that are not what hookfit writes: the dashboard's follower reads
    the log itself, and took them as numbers (a traceback)."""
    def edit(lines: list[dict]) -> None:
        first, second, _ = valid_rows(lines)
        lines[first]["epoch"] = "x"
        lines[second]["time"] = "x"

    damage(run_folder, edit)
    shown = hookfit_cli("show", str(run_folder), "--text", cwd=tmp_path)
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr
    assert "completed" in shown.stdout


@pytest.mark.bad_input
@pytest.mark.parametrize("line, note", [
    ({"event": "resume", "step": "x", "epoch": 1, "batch": 0, "from": "a.pt"},
     ": 'step' of its resume line is \"x\", not a step count: the line is skipped"),
    ({"event": "end", "status": {}, "step": -1, "epoch": 2, "time": 1.0},
     ": 'status' of its end line is {}, not a status: left out; "
     "line 1: 'step' of its end line is -1, not a step count"),
    ({"event": "epoch", "stage": "train", "epoch": 1, "step": True, "loss": 1.0},
     ": 'step' is true, not a step count: the line is skipped"),
    ({"event": "epoch", "stage": "", "epoch": 1, "step": 2},
     ": 'stage' is \"\", not a stage name: the line is skipped"),
    ({"event": "step", "stage": "train", "epoch": 1, "step": 2, "lr_default": "fast", "acc": True},
     ": 'lr_default' is \"fast\", not a number: left out; line 1: 'acc' is true, not a number: left out"),
    ([1, 2], " is not a JSON object ('[1, 2]'): skipped"),
], ids=["resume-step", "end-status-and-step", "bool-step", "empty-stage", "lr-and-bool-metric", "not-an-object"])
def test_each_kind_of_damage_is_named(tmp_path: Path, line: object, note: str) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    with pytest.warns(hookfit.HookfitWarning) as caught:
        info = runs.load(folder)
    (warned,) = caught
    assert str(warned.message).startswith(f"hookfit runs: {folder}: metrics.jsonl: line 1{note}"), warned.message
    assert info.notes == (str(caught[0].message).split(f"{folder}: ", 1)[1],)


def test_a_live_runs_last_line_being_written_is_no_damage(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "run.jsonl").write_text(json.dumps({"event": "run", "pid": os.getpid(), "host": os.uname().nodename,
                                                  "started": "2026-01-01T00:00:00"}) + "\n")
    (folder / "metrics.jsonl").write_text(json.dumps({"event": "epoch", "stage": "train", "epoch": 1, "step": 2,
                                                      "loss": 1.0}) + "\n" + '{"event": "ep')
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        info = runs.load(folder)
    assert (info.status, info.steps, info.notes) == ("running", 2, ())


FULL_DISK = textwrap.dedent('''
    import os, resource, signal, sys
    import torch
    import hookfit
    from hookfit.plugins.metrics import Metrics
    from hookfit.plugins.metrics_log import MetricsLog

    run_dir = sys.argv[1]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the kernel answers EFBIG, as a full disk answers ENOSPC


    class Fill:
        """From the second epoch on, no file may grow past 2000 bytes more than run.jsonl has
        (room for its end line, not for the metric log of 40 epochs)."""

        name = "fill"

        @hookfit.hookimpl
        def epoch_start(self, epoch):
            if epoch == 1:
                limit = os.path.getsize(os.path.join(run_dir, "run.jsonl")) + 2000
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


    def step(loop, batch):  # better every epoch: the best is the last epoch's, which the log does not hold
        return {"loss": torch.tensor(float(batch) / (1 + loop.state.epoch))}


    state = hookfit.Loop(step, [1, 2], max_epochs=40,
                         run_dir=run_dir, plugins=[Metrics(), MetricsLog(), Fill()]).fit()
    print(state.status, state.step)
''')


@pytest.mark.slow
@pytest.mark.fault
def test_runs_and_show_count_the_steps_of_a_run_whose_metric_log_filled_the_disk(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(FULL_DISK)
    folder = tmp_path / "runs" / "full" / "1"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")}
    done = subprocess.run([sys.executable, str(script), str(folder)], capture_output=True, text=True, timeout=120,
                          env={**env, "HOOKFIT_PLUGINS": ""})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-2:] == ["completed", "80"]
    assert "metrics_log: could not write" in done.stderr
    kept = runs.epoch_rows(folder)
    assert kept and kept[-1]["step"] < 80  # the metric log stops short of the run
    listed = hookfit_cli("runs", str(folder.parent), "--json", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    (info,) = json.loads(listed.stdout)
    assert (info["status"], info["steps"], info["epochs"]) == ("completed", 80, 40)
    assert info["best"]["epoch"] == 40 and info["best"]["value"] == pytest.approx(1.5 / 40)  # the run's, not the log's

    shown = hookfit_cli("show", "--text", str(folder), cwd=tmp_path)  # the run's steps, and where its log stops
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[1].startswith("hookfit: training completed (max_epochs=40 reached) after ") and lines[1].endswith(
        "s, 80 steps"), lines
    assert lines[2] == (f"  metrics recorded up to step {kept[-1]['step']} of 80: metrics.jsonl holds nothing later; "
                        "the warning below says why"), lines
    assert lines[3].startswith("  warning: FileWarning: metrics_log: could not write "), lines
    (folder / "metrics.jsonl").write_text("")  # a disk full from the log's first line
    lines = hookfit_cli("show", "--text", str(folder), cwd=tmp_path).stdout.splitlines()
    assert lines[1].endswith("s, 80 steps") and lines[2] == (
        "  metrics not recorded: metrics.jsonl holds none of the run's 80 steps; the warning below says why"), lines


@pytest.mark.bad_input
@pytest.mark.parametrize("pid", [0, -1, True, "12"])
def test_a_pid_that_names_no_single_process_is_no_live_run(tmp_path: Path, pid: object) -> None:
    """``kill(0)`` and ``kill(-1)`` ask about process groups, which are alive: such a pid in a
    hand-edited run.jsonl made a dead run "running"."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "run.jsonl").write_text(json.dumps({"event": "run", "pid": pid, "host": os.uname().nodename,
                                                  "started": "2026-01-01T00:00:00"}) + "\n")
    assert runs.load(folder).status == "unfinished"


@pytest.mark.bad_input
def test_runs_json_stays_json_when_a_text_field_holds_a_non_finite_number(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A damaged line can hold ``NaN`` or ``Infinity`` (Python's json reads and writes them)
    where hookfit writes a text or a number of seconds: those values are left out, said in the
    run's note, and ``hookfit runs --json`` writes JSON, which has no such constants."""
    from hookfit.tools import cli

    folder = tmp_path / "runs" / "demo" / "1"
    folder.mkdir(parents=True)
    (folder / "run.jsonl").write_text(
        json.dumps({"event": "run", "name": float("nan"), "started": "2026-01-01T00:00:00"}) + "\n"
        + json.dumps({"event": "end", "status": "interrupted", "reason": float("nan"), "by": float("inf"),
                      "duration": float("inf"), "epochs": 1, "steps": 2}) + "\n")
    (folder / "metrics.jsonl").write_text(
        json.dumps({"event": "epoch", "stage": "train", "epoch": 1, "step": 2, "loss": 0.5}) + "\n"
        + json.dumps({"event": "end", "status": "interrupted", "reason": float("-inf"), "time": 3.0}) + "\n")
    with pytest.warns(hookfit.HookfitWarning, match=r"run.jsonl: line 1: 'name' of its run line is NaN, not a text "
                                                    r"or null: left out; line 2: 'reason' of its end line is NaN"):
        assert cli.main(["runs", str(tmp_path / "runs"), "--json"]) == 0

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    (listed,) = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert (listed["status"], listed["reason"], listed["duration"]) == ("interrupted", None, None)
    assert listed["name"] == "demo"  # the name left out: the folder's
    assert listed["best"] == {"metric": "train/loss", "value": 0.5, "epoch": 1}


def test_a_killed_run_s_steps_are_at_least_those_of_its_last_checkpoint(tmp_path: Path) -> None:
    """`kill -9` in the first epoch, after a checkpoint at step 25: hookfit runs said 0 steps (no epoch
    row yet). Its steps are what its log last recorded, a checkpoint or a resume included."""
    from hookfit.tools import runs

    (tmp_path / "run.jsonl").write_text(json.dumps({"event": "run", "name": "killed", "mode": "fit", "resume": None,
                                                    "started": "2026-11-29T10:00:00+0000", "pid": -1}) + "\n")
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"event": "checkpoint", "step": 25, "reason": "steps", "file": "epoch0001-step000000025.pt"}) + "\n")
    info = runs.load(tmp_path)
    assert (info.status, info.steps) == ("unfinished", 25)


def test_a_checkpoint_announced_after_a_later_row_does_not_lower_the_steps(tmp_path: Path) -> None:
    """The writer announces a checkpoint once written, possibly after rows of later steps: the steps are
    the most the log records since the last resume, not its last line's."""
    from hookfit.tools import runs

    rows = [{"event": "resume", "from": "a.pt", "epoch": 1, "batch": 0, "step": 40},
            {"event": "epoch", "stage": "train", "epoch": 2, "step": 60, "batches": 20, "loss": 1.0},
            {"event": "checkpoint", "step": 50, "reason": "steps", "file": "epoch0002-step000000050.pt"}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert runs.load(tmp_path).steps == 60
