"""The plain-text summary printed after the dashboard (:func:`hookfit.plugins.tui.text.summary`):
it fits the terminal's width, and its ranges of non-finite values say what the published
values can tell of where they began. Built from the dashboard's model alone (no urwid)."""

from __future__ import annotations

import fcntl
import math
import os
import re
import struct
import sys
import termios
from types import MappingProxyType, SimpleNamespace

import pytest

from hookfit.payloads import MetricsSnapshot, ModelSummary, ModuleRow, ResumeInfo, TimeSplit, Value
from hookfit.plugins.tui.model import DashboardModel
from hookfit.plugins.tui.text import summary, terminal_width

LONG = "a_really_quite_extraordinarily_long_metric_name_for_the_dashboard_zz"
OUTPUT = "/home/someone/projects/experiments/runs/train/20261129-224212/output.log"  # longer than 40


def snap(stage: str, epoch: int, step: int, batches: int, values: dict[str, tuple[float, float, float]],
         final: bool = False) -> MetricsSnapshot:
    return MetricsSnapshot(stage, epoch, 2, step, batches, 12, batches * 64, batches * 0.01,
                           MappingProxyType({k: Value(*v) for k, v in values.items()}),
                           MappingProxyType({"default": 0.01}), final)


def model() -> DashboardModel:
    return DashboardModel(2, 1, on_stop=lambda: None, on_leave=lambda: None)


def state(step: int, **more: object) -> SimpleNamespace:
    return SimpleNamespace(status="completed", stop_reason="max_epochs=2 reached", elapsed=3.0, step=step,
                           stopped_by=None, **more)


def run_of_two_epochs() -> DashboardModel:
    """Two epochs of 12 batches with a validation each: a loss curve, a 68-character metric
    name and others, the model's size, skipped steps and the end."""
    d = model()
    d.receive("model", ModelSummary(321, 321, 1284, 0, (ModuleRow("0", "Linear", 288, 288, 1152),)))
    for epoch in range(2):
        d.receive("stage", "train", epoch, 12)
        for batch in range(1, 13):
            step = 12 * epoch + batch
            loss = 20.0 / step
            d.receive("update", snap("train", epoch, step, batch, {"loss": (loss, loss, loss), LONG: (loss,) * 3,
                                                                   "m00": (0.0,) * 3, "m01": (loss,) * 3}))
        d.receive("epoch", snap("train", epoch, 12 * epoch + 12, 12, {"loss": (1.0, 1.0, 9.568)}, final=True))
        d.receive("stage_end", "train")
        d.receive("stage", "valid", epoch, 4)
        d.receive("epoch", snap("valid", epoch, 12 * epoch + 12, 4, {"loss": (4.51,) * 3}, final=True))
        d.receive("stage_end", "valid")
    d.receive("skipped", 7, "default", "non-finite gradient at epoch 1, batch 6")
    d.receive("end", "completed", "max_epochs=2 reached", False, None, 3.0, 24, 1)
    return d


TIME = {"train": TimeSplit("train", 0.01, 2.4, 0.01, 24), "valid": TimeSplit("valid", 0.0, 0.1, 0.0, 8)}
WARNED = ["warning: UserWarning: train.py:12: a warning the run issued while the dashboard was up, long enough"]


@pytest.mark.parametrize("width", [40, 41, 47, 55, 64, 80, 120])
def test_the_summary_fits_the_terminals_width(width: int) -> None:
    lines = summary(run_of_two_epochs(), state(24, time_split=TIME), OUTPUT, warned=WARNED, width=width)
    text = "\n".join(lines)
    # every line fits, but for a path longer than a line: whole, on a line of its own
    assert all(len(line) <= width or line.strip() == OUTPUT for line in lines), text
    assert " ".join(text.split()).startswith("hookfit: training completed (max_epochs=2 reached) after 3.0s, 24 steps")
    words = " ".join(text.split())
    assert f"output printed during the run: {OUTPUT}" in words and any(OUTPUT in line for line in lines)
    assert f"{WARNED[0]} model: 321 params" in words and "time in train: 2.4s over 24 batches, data=" in words
    # the table: every metric, its values whole; the long name cut with an ellipsis where it does not fit
    assert re.search(r"^  metric +train +valid$", text, re.M), text
    assert re.search(r"^  loss +9\.568 +4\.51$", text, re.M), text
    assert re.search(r"^  m00 +0 +-$", text, re.M) and re.search(r"^  m01 +0\.8333 +-$", text, re.M), text
    name = LONG if width >= 26 + len(LONG) else r"a_really\w+…"
    assert re.search(rf"^  {name} +0\.8333 +-$", text, re.M), text
    # the loss curve drawn in the room there is, its axis from the first step to the last
    plot = [line for line in lines if line.startswith("  ") and line[13:14] == "│"]
    assert len(plot) == 8 and {len(line) for line in plot} == {min(74, width)}, text
    axis = lines.index(next(line for line in lines if "└" in line))
    assert len(lines[axis]) == min(74, width) and lines[axis + 1].split() == ["1", "24"], text


def test_without_a_width_the_summary_is_as_long_as_it_comes() -> None:
    """``hookfit show --text`` into a file or a pipe: no terminal, nothing to fit."""
    lines = summary(run_of_two_epochs(), state(24, time_split=TIME), OUTPUT, warned=WARNED)
    assert f"  output printed during the run: {OUTPUT}" in lines and f"  {WARNED[0]}" in lines
    assert any(line.startswith(f"  {LONG}  ") for line in lines)
    assert {len(line) for line in lines if line.startswith("  ") and line[13:14] == "│"} == {74}  # 60 wide


def test_the_terminals_width_is_that_of_standard_output(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    with open(tmp_path / "out.txt", "w") as file:
        monkeypatch.setattr(sys, "stdout", file)
        assert terminal_width() is None  # a file has no width
    leader, follower = os.openpty()
    try:
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 12, 47, 0, 0))
        with os.fdopen(os.dup(follower), "w") as terminal:
            monkeypatch.setattr(sys, "stdout", terminal)
            assert terminal_width() == 47
    finally:
        os.close(leader)
        os.close(follower)


# -- where a range of non-finite values began --------------------------------------------------------

def nan_run(every: int, first_nan: int, last: int = 36, resumed: ResumeInfo | None = None) -> DashboardModel:
    """Training published every ``every`` steps (and at the end), NaN from ``first_nan`` on."""
    d = model()
    start = 0
    if resumed is not None:
        d.receive("resumed", resumed)
        start = resumed.step
    d.receive("stage", "train", 0, last)
    for step in [s for s in range(start + 1, last + 1) if s % every == 0 or s == last]:
        loss = math.nan if step >= first_nan else 1.0 / step
        d.receive("update", snap("train", 0, step, step, {"loss": (loss, loss, loss)}))
    return d


def nan_lines(d: DashboardModel, width: int | None = None) -> list[str]:
    lines = summary(d, state(36), width=width)
    at = lines.index(next(line for line in lines if line.startswith("  × where loss was nan")))
    return lines[at:]


def test_a_range_from_values_published_every_step_is_exact() -> None:
    assert nan_lines(nan_run(every=1, first_nan=16)) == ["  × where loss was nan: steps 16–36"]


def test_a_range_from_sampled_values_says_where_it_may_have_begun() -> None:
    """Published every 5 steps, the NaN from step 16 first shows at step 20: the summary says
    steps 20–36 (where the values it has were NaN) and that the range began after step 15."""
    assert nan_lines(nan_run(every=5, first_nan=16)) == [
        "  × where loss was nan: steps 20–36",
        "    (published every few steps: the range began after step 15, by step 20)"]
    # a NaN from the first publication on: from the run's start, or from the step it resumed at
    assert nan_lines(nan_run(every=5, first_nan=1))[1] == (
        "    (published every few steps: the range began after step 0, by step 5)")
    resumed = ResumeInfo("runs/x/checkpoints/last.pt", 0, 12, 12, "train")
    assert nan_lines(nan_run(every=5, first_nan=1, resumed=resumed))[1] == (
        "    (published every few steps: the range began after step 12, by step 15)")
    # wrapped, like every line, where the terminal is narrow
    narrow = nan_lines(nan_run(every=5, first_nan=16), width=40)
    assert all(len(line) <= 40 for line in narrow) and " ".join(" ".join(narrow).split()) == (
        "× where loss was nan: steps 20–36 (published every few steps: the range began after step 15, by step 20)")


def test_later_ranges_say_how_far_before_they_show_they_may_begin() -> None:
    d = model()
    d.receive("stage", "train", 0, 60)
    for step in range(1, 61):  # every step until 30, then every 4: NaN at 10-12 and from 41 on
        if step <= 30 or step % 4 == 0:
            loss = math.nan if 10 <= step <= 12 or step >= 41 else 1.0
            d.receive("update", snap("train", 0, step, step, {"loss": (loss, loss, loss)}))
    assert nan_lines(d) == ["  × where loss was nan: steps 10–12, 44–60",
                            "    (published every few steps: a range may begin up to 3 steps before it shows)"]


@pytest.mark.parametrize("status", ["interrupted", "failed", "completed"])
def test_a_run_that_did_not_complete_names_the_checkpoint_to_resume_from_in_the_consoles_words(status: str) -> None:
    """The newest checkpoint announced that ``resume="latest"`` takes (a failure's ``failed-*`` file is not one)
    is named by the summary and, on the screen held after the run, in the log pane; a completed run names none."""
    from hookfit.plugins.support.resumable import RESUME

    epoch = "runs/train/1/checkpoints/epoch0001-step000000012.pt"
    d = model()
    d.receive("checkpoint", 6, "step", "runs/train/1/checkpoints/epoch0001-step000000006.pt")
    d.receive("checkpoint", 12, "epoch", epoch)
    d.receive("checkpoint", 13, "failure", "runs/train/1/checkpoints/failed-epoch0002-step000000013.pt")
    d.receive("end", status, "why", True, None, 3.0, 13, 1)
    lines = summary(d, SimpleNamespace(status=status, stop_reason="why", elapsed=3.0, step=13, stopped_by=None))
    named = [line for line in lines if "checkpoint" in line]
    logged = [line for line in d.log if "checkpoint" in line]
    if status == "completed":
        assert named == [] and logged == []
        return
    said = f"checkpoint to resume from: {epoch} (epoch): {RESUME}"
    assert RESUME == "run again with Loop(..., resume=<this path>)"
    assert named == [f"  {said}"] and lines[1] == named[0]
    assert logged == [f"hookfit: {said}"]


def test_a_resumed_run_that_failed_before_its_own_checkpoint_names_the_one_it_resumed_from() -> None:
    """Live, the resumed event carries the file (a replay's does not): it is the checkpoint to resume from
    until the run saves one of its own."""
    from hookfit.payloads import ResumeInfo

    source = "runs/train/1/checkpoints/epoch0001-step000000003.pt"
    ended = SimpleNamespace(status="failed", stop_reason="why", elapsed=3.0, step=3, stopped_by=None)
    for path, named in ((None, None), (source, source)):
        d = model()
        d.receive("resumed", ResumeInfo(source, 1, 3, 0, "train"), *([path] if path else []))
        d.receive("end", "failed", "why", True, None, 3.0, 3, 1)
        said = [line for line in summary(d, ended) if "checkpoint to resume from" in line]
        assert said == ([] if named is None else [f"  checkpoint to resume from: {named} (resumed): run again with "
                                                  f"Loop(..., resume=<this path>)"])
