"""Runs looked at again: ``hookfit runs`` (a table, ``--json``), ``hookfit show`` (the dashboard
rebuilt from a run folder, read-only, and following a run that is still going) and ``hookfit
compare`` (one metric of several runs in one plot and a table), checked against the runs'
``metrics.jsonl``; ``show`` and ``compare`` in a real terminal (tmux)."""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit.tools import cli, runs
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.metrics_log import MetricsLog
from hookfit.plugins.optim import Optim
from hookfit.plugins.tui.dashboard import Dashboard, _fmt
from hookfit.plugins.tui import TuiRenderer
from hookfit.plugins.support.plot import spans_decades, text_plot
from terminal import Terminal, term  # noqa: F401 - term: the tmux fixture
from conftest import REPO, mse_step

ROOT = REPO


def command(*argv: str) -> int:
    """``hookfit ARGV`` with the tui plugin, which adds ``show`` and ``compare`` (the suite
    loads no installed plugin by itself)."""
    return cli.main(list(argv), plugins=[TuiRenderer()])


def _train(folder: Path, epochs: int, lr: float, stop_at: int | None = None, resume: str | None = None) -> Any:
    """A small regression run with the metrics log in ``folder``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 3, generator=generator), torch.randn(8, 1, generator=generator)) for _ in range(4)]

    def step(loop: Any, batch: Any) -> dict[str, Any]:
        x, y = batch
        loss = torch.nn.functional.mse_loss(loop.model(x), y)
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        if stop_at is not None and loop.state.step == stop_at:
            loop.request_stop("enough")
        return {"loss": loss, "accuracy": 1.0 / (1.0 + loss.item())}

    from hookfit.plugins.checkpoint import Checkpoint

    loop = hookfit.Loop(step, data, val_step=lambda loop, b: {"loss": torch.nn.functional.mse_loss(loop.model(b[0]), b[1])},
                        val_data=data[:2], model=model, optimizers=torch.optim.SGD(model.parameters(), lr=lr),
                        max_epochs=epochs, run_dir=folder, resume=resume,
                        plugins=[Optim(), Metrics(), MetricsLog(), Checkpoint()])
    return loop.fit()


@pytest.fixture
def two_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    monkeypatch.setenv("HOOKFIT_PLUGINS", "metrics,metrics_log,optim,checkpoint")
    fast, slow = tmp_path / "runs" / "demo" / "fast", tmp_path / "runs" / "demo" / "slow"
    assert _train(fast, 6, 0.3).status == "completed"
    assert _train(slow, 3, 0.01, stop_at=6).status == "interrupted"
    assert _train(slow, 3, 0.01, resume="latest").status == "completed"
    return fast, slow


def _final(folder: Path, metric: str) -> float:
    stage, key = metric.split("/")
    return [r[key] for r in runs.epoch_rows(folder) if r["stage"] == stage][-1]


def test_runs_lists_each_run_with_its_status_best_value_and_resume(two_runs: tuple[Path, Path], tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    fast, slow = two_runs
    # a run killed before its end (no end line; its process is gone), and one still running here
    dead = tmp_path / "runs" / "demo" / "killed"
    dead.mkdir()
    (dead / "run.jsonl").write_text(json.dumps({"event": "run", "name": "demo", "started": "2026-01-01T00:00:00+0000",
                                                "pid": 2**22 + 7, "host": socket.gethostname()}) + "\n")
    (dead / "metrics.jsonl").write_text(json.dumps({"event": "epoch", "stage": "train", "epoch": 1, "step": 4,
                                                    "loss": 2.5}) + "\n{\"event\": \"ep")  # torn last line
    live = tmp_path / "runs" / "other" / "live"
    live.mkdir(parents=True)
    (live / "run.jsonl").write_text(json.dumps({"event": "run", "name": "other", "started": "2026-01-02T00:00:00+0000",
                                                "pid": os.getpid(), "host": socket.gethostname()}) + "\n")
    assert cli.main(["runs", str(tmp_path / "runs"), "--json"]) == 0
    listed = {Path(r["folder"]).name: r for r in json.loads(capsys.readouterr().out)}
    assert set(listed) == {"fast", "slow", "killed", "live"}
    assert listed["fast"]["status"] == "completed" and listed["fast"]["reason"] == "max_epochs=6 reached"
    assert (listed["fast"]["epochs"], listed["fast"]["steps"], listed["fast"]["fits"]) == (6, 24, 1)
    valid = [r["loss"] for r in runs.epoch_rows(fast) if r["stage"] == "valid"]
    assert listed["fast"]["best"] == {"metric": "valid/loss", "value": min(valid), "epoch": valid.index(min(valid)) + 1}
    assert listed["slow"]["fits"] == 2 and listed["slow"]["steps"] == 12
    assert listed["slow"]["resumed_from"].endswith("epoch0002-step000000007.pt")
    assert listed["killed"]["status"] == "unfinished" and listed["killed"]["epochs"] == 1
    assert listed["killed"]["best"] == {"metric": "train/loss", "value": 2.5, "epoch": 1}
    assert listed["live"]["status"] == "running"
    # newest first (the fixture's runs started today, after the hand-written ones)
    assert cli.main(["runs", str(tmp_path / "runs"), "--metric", "train/accuracy", "--mode", "max"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["RUN", "STARTED", "TIME", "STATUS", "EPOCHS", "STEPS", "FINAL", "BEST", "RESUMED", "FROM"]
    order = [Path(line.split()[0]).name for line in lines[1:]]
    assert order[-2:] == ["live", "killed"] and set(order[:2]) == {"fast", "slow"}
    best_acc = max(r["accuracy"] for r in runs.epoch_rows(fast) if r["stage"] == "train")
    assert f"train/accuracy {best_acc:.4g}" in next(line for line in lines if "/fast" in line)


@pytest.mark.bad_input
def test_runs_show_and_compare_name_a_missing_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["runs", str(tmp_path / "nothing")]) == 2
    assert "nothing: no such folder" in capsys.readouterr().err
    assert command(*["show", str(tmp_path / "nothing")]) == 2
    assert "nothing: no such run folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert command(*["compare", str(tmp_path / "empty")]) == 2
    assert "empty: not a run folder" in capsys.readouterr().err


def test_show_without_a_terminal_prints_the_runs_summary(two_runs: tuple[Path, Path],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    fast, slow = two_runs
    assert command(*["show", str(slow), "--text"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"run {slow}\nhookfit: training completed (max_epochs=3 reached)")
    assert "resumed from " in out and "epoch0002-step000000007.pt" in out
    table = dict(re.findall(r"^  (loss|accuracy) +([-+.\de]+) +\S+$", out, re.M))
    assert table["loss"] == _fmt(_final(slow, "train/loss"))
    assert table["accuracy"] == _fmt(_final(slow, "train/accuracy"))
    assert "loss over steps (train and valid):" in out
    lines = out.splitlines()
    heading = lines.index("  loss over steps (train and valid):")
    legend = lines.index("  (each curve ends in its name: train, valid)")  # which curve is which
    plot = lines[heading + 1:legend]
    assert len(plot) == 8 + 2 and all("│" in line for line in plot[:8])
    assert any("train" in line for line in plot[:8]) and any("valid" in line for line in plot[:8])


def _log(folder: Path, *lines: dict[str, Any]) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def _epoch(epoch: int, **values: float) -> dict[str, Any]:
    return {"event": "epoch", "stage": "valid", "epoch": epoch, "step": 10 * epoch, **values}


def test_the_best_value_follows_the_configured_direction_never_the_name(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Which value is best is configuration (the log's "best" line, or --mode), and
    a metric without one has no best: "mae" is best low and "acc" high, which no name says."""
    epochs = [_epoch(1, acc=0.5, mae=3.0, loss=2.0), _epoch(2, acc=0.9, mae=1.0, loss=1.0),
              _epoch(3, acc=0.7, mae=2.0, loss=1.5)]
    told = _log(tmp_path / "told", {"event": "best", "metrics": {"valid/acc": "min"}},
                {"event": "best", "metrics": {"valid/acc": "max", "valid/mae": "min"}}, *epochs)
    untold = _log(tmp_path / "untold", *epochs)
    # the log's last "best" line decides; a name that "sounds" one way changes nothing
    assert runs.load(told, metric="valid/acc").best == ("valid/acc", 0.9, 2)
    assert runs.load(told, metric="valid/mae").best == ("valid/mae", 1.0, 2)
    assert runs.load(untold, metric="valid/acc").best is None and runs.load(untold, metric="valid/acc").mode is None
    assert runs.load(untold, metric="valid/acc", mode="min").best == ("valid/acc", 0.5, 1)
    assert runs.load(untold, metric="valid/loss").best == ("valid/loss", 1.0, 2)  # the loss is minimised
    assert runs.load(untold).best == ("valid/loss", 1.0, 2)
    # the listing says why a best is missing, and --mode gives it
    assert cli.main(["runs", str(untold), "--metric", "valid/mae"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("no best for valid/mae: no direction was configured; give Metrics(best={...}) "
                                 "in the run, or --mode min|max here)")
    assert cli.main(["runs", str(untold), "--metric", "valid/mae", "--mode", "min"]) == 0
    assert "valid/mae 1 (epoch 2)" in capsys.readouterr().out
    # compare: the same rule, per run
    assert command("compare", str(told), str(untold), "--metric", "valid/acc", "--width", "40") == 0
    out = capsys.readouterr().out
    rows = {row.split()[0]: row for row in out.splitlines() if re.match(r"^[12] ", row)}
    assert rows["1"].endswith("0.9 (epoch 2)") and rows["2"].endswith("-")
    assert "no best for valid/acc" in out
    # the dashboard marks the best epoch only with a direction, from the snapshots it receives
    from hookfit.plugins.tui.replay import Follower

    for folder, star in ((told, 20.0), (untold, None)):
        dash = Dashboard(max_epochs=3, val_every=None, on_stop=lambda: None, on_leave=lambda: None)
        Follower(folder, dash, 3).poll()
        assert dash.best_step("acc") == star
        assert dash.best_step("loss") == 20.0


def test_compare_draws_every_run_and_tables_final_and_best(two_runs: tuple[Path, Path],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    fast, slow = two_runs
    assert command(*["compare", str(fast), str(slow), "--metric", "train/loss", "--width", "50"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("train/loss over steps")
    plot = lines[1:lines.index("")]
    assert all("│" in line or "└" in line or line.strip()[0].isdigit() for line in plot)
    assert sum(line.count("1") for line in plot[:-2]) >= 1 and sum(line.count("2") for line in plot[:-2]) >= 1
    rows = {row.split()[1]: row.split() for row in lines if re.match(r"^[12] ", row)}
    for folder in (fast, slow):
        assert rows[str(folder)][5] == f"{_final(folder, 'train/loss'):.4g}"
    best = {folder: float(rows[str(folder)][6]) for folder in (fast, slow)}
    worse, better = sorted((fast, slow), key=best.__getitem__, reverse=True)
    assert best[worse] > best[better]
    for order in ((worse, better), (better, worse)):  # ranked by the best loss (lowest first), however given
        assert command(*["compare", *map(str, order), "--metric", "train/loss", "--width", "50"]) == 0
        ranked = [row.split()[:2] for row in capsys.readouterr().out.splitlines() if re.match(r"^[12] ", row)]
        assert ranked == [["1", str(better)], ["2", str(worse)]]
    assert command(*["compare", str(worse), str(better), "--metric", "train/loss", "--mode", "max"]) == 0
    ranked = [row.split()[1] for row in capsys.readouterr().out.splitlines() if re.match(r"^[12] ", row)]
    assert ranked == [str(worse), str(better)]  # the highest first where the highest is best
    assert command(*["compare", str(fast), "--metric", "valid/nothing"]) == 2
    assert "no run has valid/nothing; they have: train/accuracy, train/loss, valid/loss" in capsys.readouterr().err


def test_a_curve_over_decades_is_drawn_on_a_log_scale() -> None:
    falling = [(float(s), 1.4 * 10 ** (-s / 4), 1.4 * 10 ** (-s / 4)) for s in range(20)]  # 1.4 .. ~5e-5
    assert spans_decades([falling]) and not spans_decades([falling[:8]])
    assert not spans_decades([[(0.0, -1.0, -1.0), (1.0, 1000.0, 1000.0)]])
    linear = text_plot({"train": falling}, width=40, height=8)
    logged = text_plot({"train": falling}, width=40, height=8, log=True)
    # linear: most of the curve lies flat on the bottom row; log: a diagonal over every row
    def cells(line: str) -> int:
        return sum(1 for c in line.split("│")[1] if c.strip())

    assert cells(linear[7]) >= 30 and cells(logged[7]) <= 10
    assert all(cells(line) >= 2 for line in logged[:8])
    assert logged[0].split("│")[0].strip() == "1.4"  # the labels are values, not their logarithms
    assert float(logged[7].split("│")[0]) == pytest.approx(falling[-1][1], rel=1e-3)

    dash = Dashboard(max_epochs=1, val_every=None, on_stop=lambda: None, on_leave=lambda: None)
    for x, y, _ in falling:
        dash._series("train", "loss").add(x, y)
    dash._note_name("loss")
    assert dash._log_now()  # chosen by itself
    dash.render((100, 30))
    assert "log scale" in str(dash.w_plot_title.text)
    dash.keypress("l")  # off by hand
    assert not dash._log_now()
    dash.render((100, 30))
    assert "log scale" not in str(dash.w_plot_title.text)
    dash.keypress("l")
    assert dash._log_now()


def test_the_plot_marks_resumes_learning_rate_changes_and_the_best_epoch() -> None:
    from hookfit.payloads import ResumeInfo
    from hookfit.plugins.tui.replay import snapshot

    dash = Dashboard(max_epochs=4, val_every=None, on_stop=lambda: None, on_leave=lambda: None)
    for step, loss, lr in ((10, 3.0, 0.1), (20, 2.0, 0.1), (30, 1.5, 0.01), (40, 1.8, 0.01)):
        dash.receive("update", snapshot({"stage": "train", "epoch": 1, "step": step, "batches": 1, "loss": loss,
                                         "lr_default": lr}, 4, False))
        if step == 20:
            dash.receive("resumed", ResumeInfo("ckpt.pt", 0, 20, 2, "train"))
    assert dash.marks == [(20, "R"), (30, "L")]
    ruler = dash._ruler("loss", 31, 10.0, 40.0)  # 31 cells: step 10 at 0, 20 at 10, 30 at 20
    assert (ruler[10], ruler[20]) == ("R", "L") and "*" not in ruler  # the best is marked once the run ended
    dash.receive("end", "completed", "max_epochs=4 reached", False)
    ruler = dash._ruler("loss", 31, 10.0, 40.0)
    assert ruler[20] == "*" and ruler.replace(" ", "") == "R*"  # the best (1.5 at step 30) over the L


def test_the_dashboard_and_the_summary_say_where_the_time_went() -> None:
    from types import SimpleNamespace

    from hookfit.payloads import TimeSplit
    from hookfit.plugins.tui.renderer import summary

    dash = Dashboard(max_epochs=1, val_every=None, on_stop=lambda: None, on_leave=lambda: None)
    splits = {"train": TimeSplit("train", data=3.0, step=1.0, plugins=0.5, batches=10),
              "valid": TimeSplit("valid", data=0.0, step=0.9, plugins=0.1, batches=2)}
    dash.receive("time", splits)
    text = "\n".join(line.decode() for line in dash.render((160, 30)).text)
    narrow = "\n".join(line.decode() for line in dash.render((80, 30)).text)
    assert " time  the data loader is the bottleneck: 67% of train time " in narrow  # shown first
    assert (" time  the data loader is the bottleneck: 67% of train time  train data 67% · step 22% · plugins 11%  "
            "valid data 0% · step 90% · plugins 10%") in text
    state = SimpleNamespace(status="completed", stop_reason="done", elapsed=5.5, step=10, stopped_by=None,
                            time_split=splits)
    lines = summary(dash, state)
    assert ("  time in train: 4.5s over 10 batches, data=67% step=22% plugins=11%; data loading is 67% of it: "
            "the data loader is the bottleneck") in lines
    assert "  time in valid: 1.0s over 2 batches, data=0% step=90% plugins=10%" in lines


# -- in a real terminal ----------------------------------------------------------------------------


@pytest.mark.slow
def test_show_reopens_a_finished_runs_dashboard_read_only(two_runs: tuple[Path, Path], term: Terminal) -> None:
    fast, _ = two_runs
    term.launch(sys.executable, "-m", "hookfit", "show", fast, env="HOOKFIT_PLUGINS=tui")
    screen = term.wait_for("training completed: max_epochs=6 reached", "q leave")
    assert term.alternate()
    assert re.search(r"hookfit │ \w+ │ epoch 6/6 │ step 24 │", screen), screen
    loss = re.search(r"^loss\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", screen, re.M)
    assert loss is not None, screen
    assert loss.group(3) == _fmt(_final(fast, "train/loss")) and loss.group(4) == _fmt(_final(fast, "valid/loss"))
    title = next(line for line in screen.splitlines() if "━ train ━ valid" in line)
    assert "log scale" not in title  # a linear scale: this loss spans no decades
    assert "R resumed  C checkpoint  L lr changed  ! skipped  * best" in title, screen
    # the marks of the run's checkpoints (one an epoch, from metrics.jsonl: a C at step 4, where
    # the axis starts) and of its best, the step range where no mark is
    axis = next(line for line in screen.splitlines() if "└" in line)
    assert re.search(r"└C step \d+ … 24\b", axis) and "*" in axis and axis.count("C") >= 5, screen
    end = [r for r in runs.read_jsonl(fast / "run.jsonl") if r["event"] == "end"][-1]
    train = end["time_split"]["train"]
    total = train["data"] + train["step"] + train["plugins"]
    # (when the data's share makes the bottleneck note precede it, the line may be cut at the screen's edge)
    assert re.search(rf" time .* train data {train['data'] / total:.0%} · step \d+% · plugins \d+", screen), screen
    term.keys("l")  # the key works on a replayed run too
    term.wait_for("full history · log scale")
    term.keys("q")
    code, flags, text = term.wait_exit()
    assert code == 0
    term.assert_restored(flags)
    assert f"run {fast}" in text and "hookfit: training completed (max_epochs=6 reached)" in text


LIVE = r'''
import os, sys, time
from pathlib import Path
import torch
import hookfit

folder, gate = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
data = [(torch.randn(8, 3), torch.randn(8, 1)) for _ in range(3)]

class Gate:
    @hookfit.hookimpl
    def epoch_end(self, loop, epoch):
        if epoch == 0:  # the second epoch waits until the test has seen the first
            while not gate.exists():
                time.sleep(0.05)

def step(loop, batch):
    loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    return {"loss": loss}

hookfit.Loop(step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1), max_epochs=2,
             run_dir=folder, plugins=[Gate()]).fit()
'''


@pytest.mark.slow
def test_show_follows_a_run_that_is_still_going(tmp_path: Path, term: Terminal) -> None:
    import subprocess

    from terminal import clean_env

    folder, gate = tmp_path / "live-run", tmp_path / "gate"
    script = tmp_path / "live.py"
    script.write_text(LIVE)
    env = {**clean_env(), "HOOKFIT_PLUGINS": "metrics,metrics_log,optim", "CI": "1"}
    run = subprocess.Popen([sys.executable, str(script), str(folder), str(gate)], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        term.wait_until(lambda: len(runs.epoch_rows(folder)) >= 1, "the run's first epoch in metrics.jsonl")
        term.launch(sys.executable, "-m", "hookfit", "show", folder, env="HOOKFIT_PLUGINS=tui")
        screen = term.wait_for("epoch 1/", "q leave")
        assert "running" in screen.splitlines()[0] and "training completed" not in screen
        gate.write_text("go")  # the run goes on: the viewer sees its second epoch and its end
        screen = term.wait_for("training completed: max_epochs=2 reached")
        assert re.search(r"│ step 6 │", screen), screen
        assert run.wait(timeout=60) == 0, run.stderr.read() if run.stderr else ""
    finally:
        if run.poll() is None:
            run.kill()
    term.keys("q")
    code, flags, _ = term.wait_exit()
    assert code == 0
    term.assert_restored(flags)


@pytest.mark.slow
def test_compare_in_a_terminal_shows_the_plot_and_table(two_runs: tuple[Path, Path], term: Terminal) -> None:
    fast, slow = two_runs
    term.launch(sys.executable, "-m", "hookfit", "compare", fast, slow, env="HOOKFIT_PLUGINS=tui")
    code, _, text = term.wait_exit()
    assert code == 0
    assert "valid/loss over steps" in text
    for number, folder in (("1", fast), ("2", slow)):
        row = next(line for line in text.splitlines() if line.startswith(f"{number}  {folder}"))
        assert row.split()[5] == f"{_final(folder, 'valid/loss'):.4g}"
    assert math.isfinite(_final(fast, "valid/loss"))


@pytest.mark.slow
def test_the_demo_keeps_its_final_screen_and_says_how_to_look_again(tmp_path: Path, term: Terminal) -> None:
    term.launch(sys.executable, "-m", "hookfit", "demo", "--epochs", "2",
                env="HOOKFIT_PLUGINS=checkpoint,console,interrupter,metrics,metrics_log,optim,tui")
    screen = term.wait_for("training completed: max_epochs=2 reached", "press q, Esc or Ctrl-C to leave", timeout=120)
    assert term.alternate() and "epoch 2/2" in screen  # held: the run is over, the screen stays
    term.keys("q")
    code, flags, text = term.wait_exit()
    assert code == 0, text
    term.assert_restored(flags)
    said = re.search(r"this run's files are in (\S+); look at it again with: hookfit show (\S+)", text)
    assert said is not None, text
    assert said.group(1) == said.group(2) and (tmp_path / said.group(1) / "metrics.jsonl").is_file()


def test_the_last_fit_decides_the_status_of_a_run_killed_then_resumed(tmp_path: Path) -> None:
    """A fit() killed (a start line, no end) and then resumed to its end is "completed"; a run
    that ended and whose next fit() was killed is "unfinished": the last fit's own lines decide."""
    host = socket.gethostname()

    def record(folder: Path, *events: str) -> Path:
        folder.mkdir(parents=True)
        lines = [{"event": "run", "name": "demo", "started": "2026-01-01T00:00:00+0000", "pid": 2**22 + 7,
                  "host": host} if event == "run" else
                 {"event": "end", "status": event, "reason": f"{event} reason", "duration": 1.0} for event in events]
        (folder / "run.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        return folder

    resumed = runs.load(record(tmp_path / "resumed", "run", "run", "completed"))
    assert (resumed.status, resumed.reason, resumed.fits) == ("completed", "completed reason", 2)
    killed_again = runs.load(record(tmp_path / "again", "run", "interrupted", "run"))
    assert killed_again.status == "unfinished" and killed_again.fits == 2
    stopped = runs.load(record(tmp_path / "stopped", "run", "interrupted", "run", "completed"))
    assert stopped.status == "completed"


def test_the_run_commands_follow_the_resumed_line_not_an_abandoned_one(tmp_path: Path) -> None:
    """A run trained to epoch 3, then resumed from its epoch-1 checkpoint: the rows of epochs 2
    and 3 that the resume abandoned are not the run's (best, epochs, the curve), the rows written
    after the resume are; a partial epoch written again whole counts once."""
    folder = _log(tmp_path / "run",
                  {"event": "best", "metrics": {"valid/loss": "min"}},
                  _epoch(1, loss=0.5), _epoch(2, loss=0.2), _epoch(3, loss=0.1),
                  {"event": "end", "status": "completed", "step": 30, "time": 1.0},
                  {"event": "resume", "from": "epoch0001-step000000010.pt", "epoch": 2, "batch": 0, "step": 10},
                  {**_epoch(2, loss=0.45), "batches": 3, "step": 13, "stopped": True},  # stopped inside epoch 2
                  {"event": "resume", "from": "epoch0002-step000000013.pt", "epoch": 2, "batch": 3, "step": 13},
                  _epoch(2, loss=0.4), _epoch(3, loss=0.35))
    info = runs.load(folder)
    assert info.best == ("valid/loss", 0.35, 3) and info.epochs == 3 and info.steps == 30
    assert [(r["epoch"], r["loss"]) for r in runs.epoch_rows(folder)] == [(1, 0.5), (2, 0.4), (3, 0.35)]


def test_a_resumed_run_keeps_the_validations_inside_the_epoch_before_its_checkpoint(tmp_path: Path) -> None:
    """``val_every_n_steps=4``, stopped at step 10 and resumed: the validations at steps 4 and 8
    are the run's (its best is at step 4), the training means the stop cut short are replaced by
    the epoch's whole ones; resumed at step 8 instead, the validation of step 8 written again
    replaces the first one, and without it the first one stays."""
    def valid(step: int, loss: float) -> dict[str, Any]:
        return {**_epoch(1, loss=loss), "step": step}

    def train(step: int, **cut: bool) -> dict[str, Any]:
        return {**_epoch(1, loss=float(step)), "stage": "train", "step": step, "batches": step, **cut}

    def log(name: str, at: int, *after: dict[str, Any]) -> Path:
        return _log(tmp_path / name, {"event": "best", "metrics": {"valid/loss": "min"}}, valid(4, 30.3),
                    valid(8, 123.0), train(10, stopped=True), {"event": "end", "status": "interrupted", "step": 10},
                    {"event": "resume", "from": "ckpt.pt", "epoch": 1, "batch": at, "step": at}, *after,
                    valid(12, 1e4), valid(16, 1e6), train(16))

    folder = log("stopped", 10)
    assert [(r["stage"], r["step"]) for r in runs.epoch_rows(folder)] == [
        ("valid", 4), ("valid", 8), ("valid", 12), ("valid", 16), ("train", 16)]
    assert runs.load(folder).best == ("valid/loss", 30.3, 1)
    again = [(r["step"], r["loss"]) for r in runs.epoch_rows(log("again", 8, valid(8, 120.0))) if r["stage"] == "valid"]
    assert again == [(4, 30.3), (8, 120.0), (12, 1e4), (16, 1e6)]
    kept = [(r["step"], r["loss"]) for r in runs.epoch_rows(log("kept", 8)) if r["stage"] == "valid"]
    assert kept == [(4, 30.3), (8, 123.0), (12, 1e4), (16, 1e6)]


@pytest.mark.fault
def test_runs_on_hostile_folders_never_hangs_and_notes_each_unreadable_run_once(tmp_path: Path) -> None:
    """``hookfit runs`` among a FIFO as metrics.jsonl and as run.jsonl, a metrics.jsonl that is a
    symlink to /dev/zero, a folder, a symlink out of the run, and a run of damaged lines: it ends
    (in a subprocess with a timeout: it hung before), lists every run, reads the good one right,
    reads nothing out of a run, and says once per run what it skipped and why."""
    root = tmp_path / "runs"
    good = _log(root / "good" / "1", {"event": "best", "metrics": {"valid/loss": "min"}}, _epoch(1, loss=0.3),
                _epoch(2, loss=0.2))
    skipped = {}
    for name in ("fifo", "zero", "folder", "outside", "fifo_record"):
        folder = root / name / "1"
        folder.mkdir(parents=True)
        (folder / "run.jsonl").write_text(json.dumps({"event": "run", "name": name, "started": "2026-01-01T00:00:00"})
                                          + "\n")
        skipped[name] = folder
    os.mkfifo(skipped["fifo"] / "metrics.jsonl")
    (skipped["zero"] / "metrics.jsonl").symlink_to("/dev/zero")
    (skipped["folder"] / "metrics.jsonl").mkdir()
    secret = tmp_path / "secret.jsonl"
    secret.write_text(json.dumps(_epoch(1, loss=0.01)) + "\n")
    (skipped["outside"] / "metrics.jsonl").symlink_to(secret)
    (skipped["fifo_record"] / "run.jsonl").unlink()
    os.mkfifo(skipped["fifo_record"] / "run.jsonl")
    damaged = root / "damaged" / "1"
    damaged.mkdir(parents=True)
    (damaged / "run.jsonl").write_bytes(b'{"event": "run", "started": 5, "pid": "x"}\n\xff\xfe{"event": \n[1, 2]\n')
    (damaged / "metrics.jsonl").write_text(
        json.dumps({"event": "epoch", "stage": "valid", "epoch": "two", "step": "x", "loss": "low"}) + "\n"
        + json.dumps({"event": "resume", "step": None}) + "\n" + json.dumps({"event": "epoch", "loss": True}) + "\n")
    done = subprocess.run([sys.executable, "-m", "hookfit", "runs", str(root), "--json"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    listed = {Path(info["folder"]).parent.name: info for info in json.loads(done.stdout)}
    assert set(listed) == {"good", "damaged", *skipped}
    assert listed["good"]["best"] == {"metric": "valid/loss", "value": 0.2, "epoch": 2}
    assert listed["outside"]["best"] is None and listed["outside"]["epochs"] is None  # the secret was not read
    assert listed["damaged"]["status"] == "unfinished" and listed["damaged"]["best"] is None
    notes = [line for line in done.stderr.splitlines() if "hookfit runs:" in line]
    for name, folder in skipped.items():
        mine = [line for line in notes if f"{folder}:" in line]
        assert len(mine) == 1, (name, done.stderr)
    assert "FIFO" in next(line for line in notes if f"{skipped['fifo']}:" in line)
    assert "a folder" in next(line for line in notes if f"{skipped['folder']}:" in line)
    assert "out of the run" in next(line for line in notes if f"{skipped['outside']}:" in line)
    assert not any(f"{good}:" in line for line in notes)
    # the damaged values are read past, named in one note for that run
    assert len([line for line in notes if f"{damaged}" in line]) == 1, done.stderr
    for name in ("fifo", "zero"):  # hookfit show's text summary (no terminal) reads the log the same way
        shown = subprocess.run([sys.executable, "-m", "hookfit", "show", str(skipped[name])], capture_output=True,
                               text=True, timeout=120, cwd=tmp_path, stdin=subprocess.DEVNULL,
                               env={k: v for k, v in os.environ.items() if k != "HOOKFIT_PLUGINS"})  # with tui
        assert shown.returncode == 0 and "unfinished" in shown.stdout, shown.stderr
        assert " 0.0s" not in shown.stdout  # no end recorded its time: none is said (it said 0.0s)


def test_shows_clock_of_a_resumed_run_is_the_whole_runs_time_as_runs_says(tmp_path: Path) -> None:
    """A run interrupted after 20 s and resumed for 31.1 s took 51.1 s: ``hookfit show``'s
    clock and ``hookfit runs`` say so, not the resumed part's 31.1 s."""
    from hookfit.plugins.tui.replay import _dashboard

    folder = tmp_path / "run"
    row = {"event": "epoch", "stage": "train", "batches": 4, "loss": 1.0}
    _log(folder, {**row, "epoch": 1, "step": 4}, {"event": "end", "status": "interrupted", "epoch": 2, "step": 6,
                                                 "time": 20.0},
         {"event": "resume", "from": "epoch0002-step000000006.pt", "epoch": 2, "batch": 2, "step": 6},
         {**row, "epoch": 2, "step": 8}, {"event": "end", "status": "completed", "epoch": 2, "step": 8, "time": 31.1})
    (folder / "run.jsonl").write_text("".join(json.dumps(line) + "\n" for line in (
        {"event": "run", "name": "run", "started": "2026-01-01T00:00:00", "max_epochs": 2},
        {"event": "end", "status": "interrupted", "duration": 20.0, "epochs": 2, "steps": 6},
        {"event": "run", "name": "run", "started": "2026-01-01T00:01:00", "max_epochs": 2},
        {"event": "end", "status": "completed", "duration": 31.1, "epochs": 2, "steps": 8})))
    model, _, info, _ = _dashboard(folder, draw=False)
    assert info.duration == pytest.approx(51.1) and model.elapsed == pytest.approx(51.1)


def test_a_folder_of_evaluations_alone_is_listed_with_when_it_started(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A run folder that only ``Loop.validate()`` wrote (an evaluation of a checkpoint in a
    folder of its own) has no fit: ``hookfit runs`` still says when it started and its name,
    from the evaluation's own line, where it showed ``-``."""
    monkeypatch.setenv("HOOKFIT_PLUGINS", "metrics,metrics_log")
    folder = tmp_path / "runs" / "evaluated"
    data = [(torch.zeros(1, 1), torch.zeros(1, 1))]
    hookfit.Loop(lambda loop, b: None, data, val_step=lambda loop, b: {"loss": torch.tensor(1.0)}, val_data=data,
                 model=torch.nn.Linear(1, 1), run_dir=folder, name="evaluated").validate()
    info = runs.load(folder)
    assert info.started is not None and info.started[:4].isdigit(), info
    assert info.name == "evaluated", info


def test_an_evaluation_in_the_runs_folder_is_not_a_resume_of_it(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``Loop.validate(resume=<epoch 1's checkpoint>)`` with the training run's ``run_dir``: its
    metric lines say ``"evaluation": true``, and ``hookfit runs`` and ``show`` read the fit's
    three epochs, its best and its end, where they read a resume from epoch 1 that dropped epochs
    2 and 3 and took the evaluation's loss for the run's best."""
    from hookfit.plugins.checkpoint import Checkpoint
    from hookfit.plugins.tui.replay import _dashboard

    monkeypatch.setenv("HOOKFIT_PLUGINS", "optim,metrics,metrics_log")
    folder = tmp_path / "run"
    model = torch.nn.Linear(1, 1)
    data = [(torch.ones(4, 1) * i, torch.ones(4, 1) * 2 * i) for i in range(3)]

    def valid(loop, batch):
        return {"loss": torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])}

    def run(**options: Any) -> Any:
        return hookfit.Loop(mse_step, data, val_step=valid, val_data=data, model=model, max_epochs=3, run_dir=folder,
                            plugins=[Checkpoint(background=False)], **options)

    fitted = run(optimizers=torch.optim.SGD(model.parameters(), lr=0.01)).fit()
    expected = runs.load(folder)
    assert (expected.epochs, expected.steps, expected.resumed_from) == (3, 9, None)
    first = sorted((folder / "checkpoints").glob("*.pt"))[0]
    evaluated = run().validate(resume=str(first))
    assert evaluated.results["metrics"]["valid/loss"] != fitted.results["best"]["valid/loss"][0]
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    mine = lines[[line["event"] for line in lines].index("end") + 1:]  # the evaluation's
    assert mine and all(line.get("evaluation") is True for line in mine), mine
    assert runs.load(folder) == expected
    _, follower, _, _ = _dashboard(folder, draw=False)
    assert follower.resumed is None and follower.ended is not None
    assert (follower.ended["status"], follower.ended["step"]) == ("completed", 9)
    # an evaluation before the fit in a folder (a baseline): both readers leave it out too
    folder = tmp_path / "baseline-first"
    run().validate(resume=str(first))
    run(optimizers=torch.optim.SGD(model.parameters(), lr=0.01)).fit()
    assert runs.load(folder).resumed_from is None
    _, follower, _, _ = _dashboard(folder, draw=False)
    assert follower.resumed is None and follower.ended is not None and follower.ended["status"] == "completed"


def test_a_test_loops_folder_reads_as_an_evaluation_and_show_takes_the_training_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Train, then evaluate the best checkpoint on a test ``Loop(val_step=..., val_data=...,
    model=...)`` without ``run_dir``: its folder of its own is listed ``evaluated`` with the
    checkpoint it read, no epochs, steps nor resume of its own; plain ``hookfit show`` shows the
    training run, and the evaluation, named, is titled an evaluation. They read it as a completed
    training run of the checkpoint's epochs and steps, the newest run, "training completed"."""
    from hookfit.plugins.checkpoint import Checkpoint

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOOKFIT_PLUGINS", "optim,metrics,metrics_log,checkpoint")
    model = torch.nn.Linear(1, 1)
    data = [(torch.ones(4, 1) * i, torch.ones(4, 1) * 2 * i) for i in range(3)]

    def valid(loop: Any, batch: Any) -> dict[str, Any]:
        return {"loss": torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])}

    state = hookfit.Loop(mse_step, data, val_step=valid, val_data=data, model=model, max_epochs=2, name="m",
                         optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
                         plugins=[Checkpoint(background=False, monitor="valid/loss")]).fit()
    checkpoint = state.results["best_checkpoint"]
    assert hookfit.Loop(val_step=valid, val_data=data, model=model, name="m").validate(resume=checkpoint).status \
        == "completed"
    trained = Path("runs") / "m" / Path(checkpoint).parent.parent.name
    (evaluated,) = [folder for folder in runs.run_folders(Path("runs")) if folder != trained]
    os.utime(trained, (0, 0))  # whatever the clock's resolution: the evaluation is the newest folder
    assert runs.run_folders(Path("runs")) == [evaluated, trained]
    info = runs.load(evaluated)
    assert (info.evaluation, info.status, info.evaluated) == (True, "evaluated", str(checkpoint))
    assert (info.epochs, info.steps, info.fits, info.resumed_from) == (None, None, 0, None)
    assert info.best is not None and info.best[0] == "valid/loss"
    assert not runs.load(trained).evaluation and runs.load(trained).status == "completed"
    assert cli.main(["runs"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(str(evaluated)))
    assert f"evaluated {Path(checkpoint).name} of {trained.name}" in row and "completed" not in row, row
    for named in ([], ["m"]):  # the newest run, the name's newest run: the training run's
        assert command("show", "--text", *named) == 0
        assert capsys.readouterr().out.startswith(f"run {trained}\nhookfit: training completed")
    assert command("show", "--text", str(evaluated)) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"run {evaluated}\nhookfit: evaluation completed (validation done) after "), out
    assert f"\n  evaluated {checkpoint} (" in out and "steps" not in out.splitlines()[1], out


@pytest.mark.bad_input
def test_show_of_a_folder_holding_evaluations_only_names_one_to_show(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``hookfit show`` of a folder of runs that holds evaluations alone shows none in the place of
    a training run: it says so, and names the newest evaluation to show."""
    evaluation = tmp_path / "runs" / "test" / "20260101-000000"
    _log(evaluation, {"event": "epoch", "stage": "valid", "epoch": 1, "step": 6, "loss": 0.5, "evaluation": True},
         {"event": "end", "status": "completed", "reason": "validation done", "step": 6, "evaluation": True})
    (evaluation / "run.jsonl").write_text("".join(json.dumps(line) + "\n" for line in (
        {"event": "run", "name": "test", "mode": "validate", "started": "2026-01-01T00:00:00", "resume": "a.pt"},
        {"event": "end", "status": "completed", "reason": "validation done", "duration": 0.5, "steps": 6})))
    assert command("show", "--text", str(tmp_path / "runs")) == 2
    assert f"evaluations only, no training run (name one to show it: {evaluation})" in capsys.readouterr().err
    assert command("show", "--text", str(evaluation)) == 0
    assert capsys.readouterr().out.startswith(f"run {evaluation}\nhookfit: evaluation completed (validation done)")


def test_a_resume_with_nothing_left_to_do_is_not_where_the_run_resumed_from(
        two_runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """A run interrupted, resumed to its end, then run again with ``resume="latest"`` (it resumes
    from its last checkpoint and ends at once): ``hookfit runs`` and ``show`` say it resumed from
    the interruption's checkpoint, where they named the last one, which nothing followed."""
    _, slow = two_runs
    assert _train(slow, 3, 0.01, resume="latest").status == "completed"
    lines = [json.loads(line) for line in (slow / "metrics.jsonl").read_text().splitlines()]
    resumes = [line for line in lines if line["event"] == "resume"]
    assert len(resumes) == 2 and resumes[0]["from"].endswith("epoch0002-step000000007.pt")
    assert [line["event"] for line in lines[-2:]] == ["resume", "end"] and lines[-1]["step"] == resumes[1]["step"]
    info = runs.load(slow)
    assert info.resumed_from == resumes[0]["from"] and (info.status, info.fits, info.steps) == ("completed", 3, 12)
    assert cli.main(["runs", str(slow)]) == 0
    assert capsys.readouterr().out.splitlines()[1].endswith("  epoch0002-step000000007.pt")
    assert command("show", str(slow), "--text") == 0
    out = capsys.readouterr().out
    # the last checkpoint is named by the warning that the run had nothing left to train, never as where it resumed
    assert f"\n  resumed from {resumes[0]['from']} (" in out and f"resumed from {resumes[1]['from']} (" not in out, out
    assert f"the run resumed from {resumes[1]['from']} had already finished" in out


def test_resumed_from_is_the_last_resume_the_run_went_on_from() -> None:
    """A resume counts once the run went on from it: a row after it (a validation a stop had cut
    is one), or an end or a checkpoint past its step (a run without the metrics plugin's rows);
    an end at its step alone is a resume with nothing left to do."""
    def resume(step: int, source: str) -> dict[str, Any]:
        return {"event": "resume", "from": source, "epoch": 1, "batch": 0, "step": step}

    def end(step: int) -> dict[str, Any]:
        return {"event": "end", "status": "completed", "step": step, "time": 1.0}

    assert runs.resumed_from([resume(10, "a"), _epoch(1, loss=1.0), end(10), resume(10, "b"), end(10)]) == "a"
    assert runs.resumed_from([resume(5, "a"), end(8), resume(8, "b"), end(8)]) == "a"
    assert runs.resumed_from([resume(5, "a"), {"event": "checkpoint", "step": 6, "file": "c"}]) == "a"
    assert runs.resumed_from([resume(5, "a"), end(5)]) is None
    assert runs.resumed_from([resume(5, "a"), end(8), resume(8, "b"), end(9)]) == "b"


def test_runs_shortens_a_long_reason_at_a_word(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The STATUS column holds 48 characters: a longer reason ends at a whole word and says it goes on."""
    reason = "ValueError: valid data yielded no batches in epoch 1 (an iterator used up)"
    _log(tmp_path / "run", _epoch(1, loss=1.0), {"event": "end", "status": "failed", "reason": reason, "epoch": 1,
                                                 "step": 10})
    assert cli.main(["runs", str(tmp_path / "run")]) == 0
    row = capsys.readouterr().out.splitlines()[1]
    assert "failed: ValueError: valid data yielded no ..." in row and " batches" not in row



@pytest.mark.bad_input
def test_compare_of_a_missing_metric_names_every_name_it_accepts_and_the_one_meant(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "runs" / "one"
    model = torch.nn.Linear(3, 1)
    groups = [{"params": [model.weight], "name": "decay"}, {"params": [model.bias], "name": "no_decay"}]
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(2)]
    loop = hookfit.Loop(mse_step, data, val_data=data,
                        val_step=lambda loop, b: {"loss": torch.nn.functional.mse_loss(loop.model(b[0]), b[1])},
                        model=model, optimizers=torch.optim.SGD(groups, lr=0.1),
                        max_epochs=1, run_dir=folder, plugins=[Optim(), Metrics(), MetricsLog()])
    assert loop.fit().status == "completed"
    assert command("compare", str(folder), "--metric", "valid/nothing") == 2
    err = capsys.readouterr().err
    assert "no run has valid/nothing; they have: train/loss, valid/loss (and " in err and "did you mean" not in err
    for name in ("train/samples_per_s", "train/lr_default/decay", "valid/lr_default/no_decay", "valid/time"):
        assert name in err, name
    accepted = runs.series_names(runs.epoch_rows(folder))
    assert all(name in err for name in accepted)
    for name in accepted:  # every name the hint lists is one --metric draws
        assert command("compare", str(folder), "--metric", name, "--width", "30") == 0, name
    capsys.readouterr()
    assert command("compare", str(folder), "--metric", "lr_default/decay") == 2
    err = capsys.readouterr().err
    assert "no run has lr_default/decay" in err and "did you mean train/lr_default/decay" in err
    assert command("compare", str(folder), "--metric", "oss") == 2  # a suffix of a name, not of a whole part
    assert "did you mean" not in capsys.readouterr().err
