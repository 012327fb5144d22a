"""metrics_log: metrics.jsonl written from the metrics role's events alone: the same
file from the built-in metrics plugin and from a replacement that only publishes snapshots;
directions, resumes, step lines, the main process only, a full disk and a read-only folder."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from conftest import StopAfter, saved_run, squeeze
from hookfit.files import FileWarning
from hookfit.payloads import MetricsSnapshot, Value
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.metrics_log import MetricsLog
from hookfit.tools import runs


def lines(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def loss_step(loop, batch):
    return {"loss": torch.tensor(float(batch)), "acc": 0.25 * batch}


class Medians:
    """A metrics replacement that writes nothing: it publishes snapshots of the median of
    each stage's losses, nothing else (as a third-party package would)."""

    name = "metrics"

    def __init__(self) -> None:
        self.seen: list[float] = []
        self.history: dict[str, list[dict[str, Any]]] = {"train": [], "valid": []}

    @hookfit.hookimpl
    def stage_start(self) -> None:
        self.seen = []

    @hookfit.hookimpl
    def batch_end(self, loop, output) -> None:
        self.seen.append(float(output["loss"]))
        if loop.training and (call := loop.hooks.metrics_update) is not None:
            call(loop, "train", self.snapshot(loop, "train", final=False))

    @hookfit.hookimpl(trylast=True)
    def stage_end(self, loop, stage) -> None:
        snapshot = self.snapshot(loop, stage, final=True)
        self.history[stage].append({"epoch": loop.state.epoch, "median": snapshot.values["median"].epoch})
        loop.hooks.epoch_metrics(loop, stage, self.snapshot(loop, stage, final=True))

    def snapshot(self, loop, stage: str, final: bool) -> MetricsSnapshot:
        median = sorted(self.seen)[len(self.seen) // 2]
        return MetricsSnapshot(stage=stage, epoch=loop.state.epoch, max_epochs=loop.max_epochs,
                               step=loop.state.step, batches=len(self.seen), total=4, samples=len(self.seen),
                               elapsed=1.0, values={"median": Value(median, median, median)}, final=final,
                               history=tuple(self.history[stage]), best={"median": "min"})


def test_a_replacement_that_only_publishes_snapshots_gets_the_log(tmp_path: Path) -> None:
    """metrics.jsonl is the metrics_log plugin's, not the metrics plugin's: a replacement of the
    metrics plugin still leaves `hookfit runs/show/compare` their metrics."""
    state = hookfit.Loop(loss_step, [1, 2, 3, 4], val_step=loss_step, val_data=[5, 6], max_epochs=2,
                         run_dir=tmp_path, plugins=[Medians(), MetricsLog()]).fit()
    got = lines(tmp_path)
    assert [(line["event"], line.get("stage"), line.get("epoch")) for line in got] == [
        ("best", None, None), ("epoch", "train", 1), ("best", None, None), ("epoch", "valid", 1),
        ("epoch", "train", 2), ("epoch", "valid", 2), ("end", None, 2)]
    assert got[0] == {"event": "best", "metrics": {"train/median": "min"}}
    assert got[2] == {"event": "best", "metrics": {"train/median": "min", "valid/median": "min"}}
    assert got[1] == {"event": "epoch", "stage": "train", "epoch": 1, "step": 4, "batches": 4, "samples": 4,
                      "time": 1.0, "samples_per_s": 4.0, "median": 3.0}
    assert got[-1] == {"event": "end", "status": "completed", "reason": "max_epochs=2 reached", "by": None,
                       "epoch": 2, "step": 8, "time": pytest.approx(state.elapsed, abs=0.002),
                       "skipped": 0, "skipped_reason": None}
    # what `hookfit runs` reads of it: the metric, its direction from the log, its best epoch
    info = runs.load(tmp_path, metric="valid/median")
    assert (info.status, info.epochs, info.mode, info.best) == ("completed", 2, "min", ("valid/median", 6.0, 1))


def test_the_built_in_metrics_plugin_gives_the_same_lines(tmp_path: Path) -> None:
    hookfit.Loop(loss_step, [1, 2, 3, 4], val_step=loss_step, val_data=[5, 6], max_epochs=2, run_dir=tmp_path,
                 plugins=[Metrics(best={"valid/acc": "max"}), MetricsLog()]).fit()
    got = lines(tmp_path)
    assert [line["event"] for line in got] == ["best", "epoch", "best", "epoch", "epoch", "epoch", "end"]
    # loss is "min" unless configured otherwise; acc has a direction only where configured
    assert got[0]["metrics"] == {"train/loss": "min"}
    assert got[2]["metrics"] == {"train/loss": "min", "valid/loss": "min", "valid/acc": "max"}
    train = got[1]
    assert (train["stage"], train["epoch"], train["step"], train["batches"], train["loss"], train["acc"]) == (
        "train", 1, 4, 4, 2.5, 0.625)
    assert runs.directions(got) == {"train/loss": "min", "valid/loss": "min", "valid/acc": "max"}


def test_every_checkpoint_written_has_its_line_for_hookfit_shows_marks(tmp_path: Path) -> None:
    from hookfit.plugins.checkpoint import Checkpoint

    model = torch.nn.Linear(1, 1)
    hookfit.Loop(lambda loop, batch: {"loss": model(torch.ones(1)).sum()}, [1, 2, 3], model=model, max_epochs=2,
                 run_dir=tmp_path, plugins=[Metrics(), MetricsLog(), Checkpoint(background=False)]).fit()
    saved = [line for line in lines(tmp_path) if line["event"] == "checkpoint"]
    assert [(line["step"], line["reason"], line["file"]) for line in saved] == [
        (3, "epoch", "epoch0001-step000000003.pt"), (6, "epoch", "epoch0002-step000000006.pt")]
    assert all((tmp_path / "checkpoints" / line["file"]).is_file() for line in saved)


def test_without_the_log_plugin_nothing_is_written(tmp_path: Path) -> None:
    hookfit.Loop(loss_step, [1, 2], run_dir=tmp_path, plugins=[Metrics()]).fit()
    assert not (tmp_path / "metrics.jsonl").exists()


def test_the_log_is_a_discovered_plugin_on_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HOOKFIT_PLUGINS")
    monkeypatch.setenv("HOOKFIT_DISABLE_PLUGINS", "console,tui,checkpoint,interrupter")
    loop = hookfit.Loop(loss_step, [1, 2], run_dir=tmp_path / "on")
    loop.fit()
    assert isinstance(loop.run.pm.get_plugin("metrics_log"), MetricsLog)
    assert [line["event"] for line in lines(tmp_path / "on")] == ["best", "epoch", "end"]
    hookfit.Loop(loss_step, [1, 2], run_dir=tmp_path / "off", disable=["metrics_log"]).fit()
    assert not (tmp_path / "off" / "metrics.jsonl").exists()


def test_the_metrics_plugin_has_no_log_option_the_log_plugin_is_left_out_by_name(tmp_path: Path) -> None:
    """metrics.jsonl is the metrics_log plugin's alone: Metrics takes no ``log`` option, and a run
    without the log plugin (disabled by name) writes no file and warns nothing."""
    with pytest.raises(TypeError, match="log"):
        Metrics(log=False)  # type: ignore[call-arg]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hookfit.Loop(loss_step, [1, 2], run_dir=tmp_path / "alone", plugins=[Metrics()],
                     disable=["metrics_log"]).fit()
    assert not (tmp_path / "alone" / "metrics.jsonl").exists()


def test_step_lines_every_n_training_steps(tmp_path: Path) -> None:
    hookfit.Loop(loss_step, [1, 2, 3, 4], val_step=loss_step, val_data=[1], max_epochs=2, run_dir=tmp_path,
                 plugins=[Metrics(interval=0), MetricsLog(every_n_steps=3)]).fit()
    got = [(line["event"], line.get("stage"), line.get("step")) for line in lines(tmp_path) if line["event"] != "best"]
    assert got == [("step", "train", 3), ("epoch", "train", 4), ("epoch", "valid", 4), ("step", "train", 6),
                   ("epoch", "train", 8), ("epoch", "valid", 8), ("end", None, 8)]
    step_line = lines(tmp_path)[1]
    assert step_line["loss"] == 2.0 and step_line["batches"] == 3  # the epoch mean so far


@pytest.mark.bad_input
@pytest.mark.parametrize("bad", [0, -2, 1.5, "10", True])
def test_a_bad_step_cadence_is_refused_at_construction(bad: Any) -> None:
    with pytest.raises((TypeError, ValueError), match=r"^metrics_log: every_n_steps must be a positive integer "
                                                       r"\(training steps between step lines"):
        MetricsLog(every_n_steps=bad)


def test_a_resumed_run_records_where_it_continued(tmp_path: Path) -> None:
    data = [torch.ones(2, 1)] * 4
    step = lambda l, b: {"loss": b.mean()}  # noqa: E731
    saved: dict[str, Any] = {}

    class Save:
        name = "save"

        @hookfit.hookimpl(trylast=True)
        def batch_end(self, loop):
            if loop.state.step == 6:  # epoch 2 (from 1), 2 of its 4 batches done
                saved.update(loop.plugin_states())

    class FakeResume:
        name = "fake_resume"

        @hookfit.hookimpl
        def resume(self, loop):
            loop.load_plugin_states(saved, strict=False)
            loop.load_state_dict(saved_run(1, 6, 2))
            return "earlier/ckpt.pt"

    first, second = tmp_path / "first", tmp_path / "second"
    hookfit.Loop(step, data, max_epochs=3, run_dir=first, plugins=[Metrics(), MetricsLog(), Save()]).fit()
    hookfit.Loop(step, data, max_epochs=3, run_dir=second, resume="earlier/ckpt.pt",
                 plugins=[Metrics(), MetricsLog(), FakeResume()]).fit()
    records = [r for r in lines(second) if r["event"] != "best"]
    assert records[0] == {"event": "resume", "from": "earlier/ckpt.pt", "epoch": 2, "batch": 2, "step": 6}
    assert [(r["event"], r["epoch"]) for r in records[1:]] == [("epoch", 2), ("epoch", 3), ("end", 3)]
    whole = [r for r in lines(first) if r["event"] != "best"]
    assert [(r["event"], r["epoch"]) for r in whole] == [("epoch", 1), ("epoch", 2), ("epoch", 3), ("end", 3)]
    assert records[1]["batches"] == 4 and records[-1]["step"] == whole[-1]["step"] == 12


def test_a_fresh_fit_in_a_used_folder_begins_a_history_the_readers_take_alone(tmp_path: Path) -> None:
    """A script run again in its run_dir without resume: the log keeps the earlier history and marks
    where the new one begins; `hookfit runs` and `show` read the new one alone (before, the listing
    gave the first fit's epochs with the second's steps, and a best of either)."""
    data = [torch.ones(2, 1)] * 4

    def fit(epochs: int, loss: float, **kwargs: Any) -> None:
        hookfit.Loop(lambda l, b: {"loss": b.mean() * loss}, data, max_epochs=epochs, run_dir=tmp_path,
                     plugins=[Metrics(), MetricsLog()], **kwargs).fit()

    fit(3, 0.5)
    assert not any(r["event"] == "start" for r in lines(tmp_path))  # a first history needs no mark
    fit(1, 2.0)
    got = [r["event"] for r in lines(tmp_path)]
    assert got.count("start") == 1 and got.count("end") == 2 and got.index("start") == got.index("end") + 1
    info = runs.load(tmp_path)
    assert (info.epochs, info.steps, info.fits, info.best[1:] if info.best else None) == (1, 4, 1, (2.0, 1))
    assert [r["epoch"] for r in runs.epoch_rows(tmp_path)] == [1]
    duration = [r for r in runs.read_jsonl(tmp_path / "run.jsonl") if r.get("event") == "end"][-1]["duration"]
    assert info.duration == pytest.approx(duration)  # the last history's fit alone

    from hookfit.plugins.tui.replay import _dashboard

    dash, follower, _, _ = _dashboard(tmp_path, draw=False)
    assert [y for _, y in dash.series[("train", "loss")].recent] == [2.0]  # the first history's 0.5s left out


def test_only_the_main_process_writes(tmp_path: Path) -> None:
    class Rank1:
        name = "rank1"

        @hookfit.hookimpl(tryfirst=True)
        def configure(self, loop):
            loop.state.rank, loop.state.world_size = 1, 1  # as a distributed plugin on a worker

    state = hookfit.Loop(loss_step, [1, 2], run_dir=tmp_path, plugins=[Metrics(), MetricsLog(), Rank1()]).fit()
    assert state.status == "completed" and not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.fault
def test_a_run_that_fails_before_it_started_leaves_no_log(tmp_path: Path) -> None:
    class Broken:
        name = "broken"

        @hookfit.hookimpl
        def configure(self):
            raise RuntimeError("broken at configure")

    with pytest.raises(RuntimeError, match="broken at configure"):
        hookfit.Loop(loss_step, [1], run_dir=tmp_path / "run", plugins=[Metrics(), MetricsLog(), Broken()]).fit()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.fault
def test_a_stage_a_stop_cut_short_is_marked_and_hookfit_runs_takes_no_best_from_it(tmp_path: Path) -> None:
    """The row of the validation a stop cut short after its first batch (the easy one: the
    lowest loss of the run) says ``"stopped": true``; ``hookfit runs``' best is a whole
    validation's, and the row still counts as the run's last."""
    def val_step(loop, batch):
        return {"loss": torch.tensor(0.1 if batch == 0 else 5.0 - loop.state.epoch)}

    state = hookfit.Loop(loss_step, [1, 2], val_step=val_step, val_data=[0, 1, 2], max_epochs=3, run_dir=tmp_path,
                         plugins=[Metrics(), MetricsLog(), StopAfter(8)]).fit()  # epoch 2's first validation batch
    assert state.status == "interrupted"
    valid = [r for r in lines(tmp_path) if r["event"] == "epoch" and r["stage"] == "valid"]
    assert [(r["epoch"], r["batches"], r.get("stopped")) for r in valid] == [(1, 3, None), (2, 1, True)]
    info = runs.load(tmp_path)
    assert info.best == ("valid/loss", pytest.approx((0.1 + 5 + 5) / 3), 1)
    damaged: list[tuple[int, str]] = []
    assert runs.checked(valid[-1], damaged)["stopped"] is True and damaged == []  # a known field, not a metric


def test_a_failed_run_ends_its_log_with_the_error(tmp_path: Path) -> None:
    def step(loop, batch):
        if loop.state.step == 3:
            raise ValueError("bad batch")
        return {"loss": torch.tensor(1.0)}

    with pytest.raises(ValueError, match="bad batch"):
        hookfit.Loop(step, [1, 2], max_epochs=3, run_dir=tmp_path, plugins=[Metrics(), MetricsLog()]).fit()
    got = [r for r in lines(tmp_path) if r["event"] != "best"]
    # a failed run publishes no partial epoch: it ended at no boundary
    assert [(r["event"], r["epoch"]) for r in got] == [("epoch", 1), ("end", 2)]
    assert (got[-1]["status"], got[-1]["reason"], got[-1]["step"]) == ("failed", "ValueError: bad batch", 3)


FULL_DISK_CHILD = r'''
import json, os, resource, signal, sys, warnings
import torch
import hookfit
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.metrics_log import MetricsLog

run_dir = sys.argv[1]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the kernel answers EFBIG instead of the signal
log = os.path.join(run_dir, "metrics.jsonl")


''' + squeeze('log', 10) + r'''

def step(loop, batch):
    return {"loss": torch.tensor(float(batch))}

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    state = hookfit.Loop(step, [1, 2, 3, 4], max_epochs=3, run_dir=run_dir,
                         plugins=[Metrics(), MetricsLog(), Squeeze()]).fit()
print(json.dumps({"status": state.status, "step": state.step,
                  "warnings": [(w.category.__name__, str(w.message)) for w in caught]}))
'''


@pytest.mark.slow
@pytest.mark.fault
def test_a_full_disk_warns_once_and_training_completes(tmp_path: Path) -> None:
    """RLIMIT_FSIZE makes the kernel refuse the writes as a full disk would (EFBIG for ENOSPC),
    in a child process, so that the limit cannot touch the test's own files."""
    script = tmp_path / "child.py"
    script.write_text(FULL_DISK_CHILD)
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, str(script), str(run_dir)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HOOKFIT_PLUGINS": ""})
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert (result["status"], result["step"]) == ("completed", 12)
    # the core's own end line in run.jsonl may hit the limit too: its warning is the core's
    core = [text for _, text in result["warnings"] if text.startswith("hookfit: could not write ")]
    assert all("run.jsonl" in text for text in core)
    mine = [(category, text) for category, text in result["warnings"] if text not in core]
    assert [category for category, _ in mine] == ["FileWarning"]  # once, for 3 refused lines
    message = mine[0][1]
    assert message.startswith("metrics_log: could not write ") and "metrics.jsonl" in message
    assert "File too large" in message and "training goes on" in message
    kept = runs.read_jsonl(run_dir / "metrics.jsonl")  # a torn last line (10 bytes of slack) is skipped
    # what was written before the disk filled is kept
    assert [(r["event"], r.get("epoch"), r.get("loss")) for r in kept] == [("best", None, None), ("epoch", 1, 2.5)]


@pytest.mark.fault
def test_a_read_only_run_folder_warns_once_and_training_completes(read_only_folder: Path) -> None:
    published = []

    class Collect:
        name = "collect"

        @hookfit.hookimpl
        def epoch_metrics(self, metrics):
            published.append(metrics)

    with pytest.warns(FileWarning) as caught:
        state = hookfit.Loop(loss_step, [1, 2], max_epochs=3, run_dir=read_only_folder,
                             plugins=[Metrics(), MetricsLog(), Collect()]).fit()
    assert (state.status, state.step) == ("completed", 6)
    # each warning names who writes the file: the core (its run record), and the metric log,
    # once though every epoch writes to it
    owners = [str(w.message).split(":")[0] for w in caught if w.category is FileWarning]
    assert set(owners) == {"hookfit", "metrics_log"} and owners.count("metrics_log") == 1, owners
    files = [re.search(r"could not \w+ (\S+)", str(w.message))[1] for w in caught if w.category is FileWarning]
    assert len(files) == len(set(files))  # once a file, though every epoch writes to metrics.jsonl
    assert any(f.endswith("run.jsonl") for f in files) and any(f.endswith("metrics.jsonl") for f in files)
    (mine,) = [str(w.message) for w in caught if str(w.message).startswith("metrics_log: ")]
    assert mine.startswith("metrics_log: could not write") and "metrics.jsonl" in mine
    assert "Read-only" in mine or "Permission denied" in mine
    assert len(published) == 3  # the snapshots were published all the same


def test_step_lines_come_with_publications_which_the_metrics_interval_bounds(tmp_path: Path) -> None:
    """A step line is written at a publication, which the built-in metrics plugin makes at most
    every Metrics(interval=0.5) seconds: a run of a few milliseconds gets fewer lines than
    every_n_steps asks, and Metrics(interval=0) gets every one. The option says so where it is
    documented."""
    import hookfit.plugins.metrics_log as module

    for folder, metrics in (("bounded", Metrics()), ("every", Metrics(interval=0))):
        hookfit.Loop(loss_step, list(range(40)), run_dir=tmp_path / folder,
                     plugins=[metrics, MetricsLog(every_n_steps=5)]).fit()
    steps = {folder: [line["step"] for line in lines(tmp_path / folder) if line["event"] == "step"]
             for folder in ("bounded", "every")}
    assert steps["every"] == [5, 10, 15, 20, 25, 30, 35, 40] and len(steps["bounded"]) < 8
    for doc in (module.__doc__, MetricsLog.__doc__):
        assert "Metrics(interval=0.5)" in doc and "Metrics(interval=0)" in doc
