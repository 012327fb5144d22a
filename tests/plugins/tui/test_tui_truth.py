"""The dashboard tells the truth about the run, read off a real terminal (tmux): NaN and
infinite values, every skipped step, ``max_steps``, the final screen after ``q`` mid-epoch, short
epochs, a table longer than the screen, and the layout at 80x24, 200x50 and 40x12; ``hookfit
show`` of the same runs; and ``hookfit show`` without urwid, the import blocked by
``tests/scripts/tui_no_urwid.py`` (a throw-away venv would still see urwid: it shares the running
environment's packages).

The runs are ``tests/scripts/tui_run.py``, shaped by its arguments."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from conftest import REPO
from terminal import HOLD_BANNER, Terminal, clean_env, term  # noqa: F401 - term: the tmux fixture

pytestmark = pytest.mark.slow

RUN = REPO / "tests" / "scripts" / "tui_run.py"
NO_URWID = REPO / "tests" / "scripts" / "tui_no_urwid.py"
PLUGINS = "console,interrupter,metrics,metrics_log,optim,tui"  # metrics_log: hookfit show reads its file
LABEL = 11  # the plot's y labels and its axis line: the plot starts in this column


def train(term: Terminal, *args: object, persistent: bool = True) -> None:
    term.launch(sys.executable, RUN, term.result, *args,
                env=f"HOOKFIT_PLUGINS={PLUGINS}" + (" HOOKFIT_TUI_PERSISTENT=1" if persistent else ""))


def resize(term: Terminal, cols: int, rows: int) -> list[str]:
    """The screen's rows once the dashboard was redrawn at ``cols`` x ``rows``."""
    term.tmux("resize-window", "-t", "main", "-x", str(cols), "-y", str(rows))

    def drawn() -> bool:
        lines = term.screen().split("\n")[:rows]
        # the key help as drawn for this width (tmux cuts the old frame's lines when it shrinks)
        return len(lines) == rows and all(len(line) <= cols for line in lines) \
            and lines[-1].startswith(" q ") and lines[-1].rstrip().endswith("? help") \
            and lines[0].rstrip().endswith(("completed", "interrupted"))

    term.wait_until(drawn, f"the dashboard redrawn at {cols}x{rows}", timeout=10)
    return term.screen().split("\n")[:rows]


@pytest.fixture
def viewer(tmp_path: Path) -> Iterator[Terminal]:
    """A second terminal, for ``hookfit show`` of the run the first one made."""
    (tmp_path / "viewer").mkdir()
    terminal = Terminal(tmp_path / "viewer")
    try:
        yield terminal
    finally:
        terminal.kill()


def show(viewer: Terminal, folder: Path) -> str:
    viewer.launch(sys.executable, "-m", "hookfit", "show", folder, env="HOOKFIT_PLUGINS=tui")
    return viewer.wait_for("q leave", "training ")


def column(x: float, x0: float, x1: float, width: int) -> int:
    """The plot's column of step ``x`` on an axis from ``x0`` to ``x1`` (two dots a cell)."""
    return min(width - 1, max(0, int((x - x0) / (x1 - x0) * (width * 2 - 1) + 0.5) // 2))


def line_with(screen: str, text: str) -> str:
    return next(line for line in screen.split("\n") if text in line)


def axis_text(screen: str) -> str:
    """The plot's axis row and the row under it, where the step range goes when marks fill the
    axis (where depends on the steps of the first publication: on the machine's speed)."""
    lines = screen.split("\n")
    at = lines.index(line_with(screen, "└"))
    return "\n".join(lines[at:at + 2])


# -- non-finite values and skipped steps --------------------------------------------------------

def test_a_nan_run_shows_nan_marks_every_skipped_step_and_says_how_many(term: Terminal) -> None:
    # the loss is NaN after step 100 (the optim plugin skips those 124 steps); "blowup" is always inf
    train(term, "--batches", 224, "--nan-after", 100, "--inf-metric-after", 0, "--delay", 0.005)
    screen = term.wait_for(HOLD_BANNER, " q leave")
    lines = screen.split("\n")
    assert re.search(r"^loss +nan +nan +nan +- *$", screen, re.M), screen  # not the dash of "no value yet"
    assert re.search(r"^blowup +inf +inf +inf +- *$", screen, re.M), screen
    assert lines[0].rstrip().endswith("│ completed · mostly skipped"), lines[0]
    assert "training completed: max_epochs=1 reached · 124 of 224 steps skipped (non-finite loss)" in screen
    title = line_with(screen, "━ train")
    assert title.startswith(" loss ━ train · full history · × nan"), title  # no valid curve: no "valid"
    top = lines[lines.index(title) + 1]
    assert "×" in top[LABEL:] and top[LABEL:].rstrip().endswith("×"), top  # non-finite up to the end
    axis = line_with(screen, "└")
    # the step range: on the axis, or on a row of its own under it where the marks fill the axis
    # (the first point is the first publication, whose step depends on the machine's speed)
    below = screen.split("\n")[screen.split("\n").index(axis) + 1]
    span = re.search(r"step (\d+) … (\d+)", axis) or re.search(r"^ +step (\d+) … (\d+) *$", below)
    assert span and span.group(2) == "224", screen  # the axis reaches the run's last step
    marks, width = axis[LABEL:], 100 - LABEL
    x0 = float(span.group(1))
    skipped = {column(x, x0, 224, width) for x in range(101, 224)}
    assert all(marks[c] == "!" for c in skipped), axis  # every skipped step, none hidden
    # a metric that was never finite is drawn as such, not "no points yet"
    term.keys("Tab")
    screen = term.wait_for(" blowup ━ train · full history · × inf")
    assert "no points yet" not in screen
    top = line_with(screen, "━ train")
    top = screen.split("\n")[screen.split("\n").index(top) + 1]
    assert set(top[LABEL:].rstrip()) == {"×"}, top
    term.keys("q")
    code, flags, text = term.wait_exit()
    assert code == 0
    term.assert_restored(flags)
    assert "hookfit: training completed (max_epochs=1 reached) after" in text
    assert "  124 of 224 steps skipped (non-finite loss); most of the run did not train" in text
    assert re.search(r"^  loss +nan +- *$", text, re.M), text
    assert re.search(r"^  × where loss was nan: steps \d+–224$", text, re.M), text


def test_an_accumulating_run_counts_its_skipped_windows_as_its_steps(term: Terminal) -> None:
    # accumulate=8 over 40 batches, the loss NaN after batch 16: 3 of the 5 windows skipped, as the console counts
    train(term, "--batches", 40, "--accumulate", 8, "--nan-after", 16)
    screen = term.wait_for(HOLD_BANNER, " q leave")
    assert screen.split("\n")[0].rstrip().endswith("│ completed · mostly skipped"), screen
    assert "training completed: max_epochs=1 reached · 3 of 5 steps skipped (non-finite loss)" in screen
    term.keys("q")
    code, flags, text = term.wait_exit()
    assert code == 0
    term.assert_restored(flags)
    assert "  3 of 5 steps skipped (non-finite loss); most of the run did not train" in text


# -- max_steps, q mid-epoch: the end as it was ---------------------------------------------------

def test_a_max_steps_run_counts_its_progress_in_steps(term: Terminal, viewer: Terminal) -> None:
    train(term, "--batches", 90, "--epochs", 100000, "--max-steps", 2000, "--valid")
    screen = term.wait_for(HOLD_BANNER, " q leave")
    # 2000 = 22 epochs of 90 and 20 batches of the 23rd
    assert re.search(r"│ epoch 23 │ step 2000/2000 │ \d\d:\d\d:\d\d │ completed", screen), screen
    assert re.search(r"^ run +step 2000/2000 +completed +100 %", screen, re.M), screen
    assert re.search(r"^ train +20/90 ", screen, re.M), screen  # where the last epoch stopped
    assert "ETA" not in screen and "100000" not in screen
    assert re.search(r"step \d+ … 2000\b", axis_text(screen)), screen  # the curve's last point
    term.keys("q")
    code, flags, text = term.wait_exit()
    assert code == 0 and term.outcome()["step"] == 2000
    term.assert_restored(flags)
    screen = show(viewer, term.tmp / "run")
    assert re.search(r"│ epoch 23 │ step 2000/2000 │ \d\d:\d\d:\d\d │ completed", screen), screen
    assert re.search(r"^ run +step 2000/2000 +completed +100 %", screen, re.M), screen
    assert "ETA" not in screen
    assert re.search(r"step \d+ … 2000\b", axis_text(screen)), screen


def test_q_mid_epoch_leaves_the_screen_as_the_run_ended(term: Terminal, viewer: Terminal) -> None:
    train(term, "--batches", 28, "--epochs", 80, "--delay", 0.02, "--checkpoint-every", 50)
    term.wait_until(lambda: (m := re.search(r"│ step (\d+) │", term.screen())) is not None and int(m[1]) > 60,
                    "step 60")
    term.keys("q")
    screen = term.wait_for(HOLD_BANNER, " q leave")
    term.keys("q")
    code, flags, _ = term.wait_exit()
    assert code == 0
    term.assert_restored(flags)
    result = term.outcome()
    step, epoch = result["step"], result["epoch"]
    assert result["status"] == "interrupted" and 60 < step < 28 * 80
    checkpoints = sorted((term.tmp / "run" / "checkpoints").glob("*.pt"))
    assert checkpoints[-1].name == f"epoch{epoch + 1:04d}-step{step:09d}.pt"  # saved where it stopped
    for shown in (screen, show(viewer, term.tmp / "run")):
        assert re.search(rf"│ epoch {epoch + 1}/80 │ step {step} │ \d\d:\d\d:\d\d │ interrupted", shown), shown
        assert re.search(rf"^ train +{step - 28 * epoch}/28 ", shown, re.M), shown
        assert re.search(rf"^ run +epoch {epoch + 1}/80 +interrupted ", shown, re.M), shown
        assert "ETA" not in shown
        assert re.search(rf"step \d+ … {step}\b", axis_text(shown)), shown  # the curve's last point
        assert "C" in axis_text(shown).split("\n")[0], shown  # the checkpoints' marks, live and in show


# -- the bars follow the batches ------------------------------------------------------------------

def test_short_epochs_move_the_bars_with_the_batches(term: Terminal) -> None:
    # epochs of about 45 ms: a stage starts and ends between two publications of the metrics
    train(term, "--batches", 90, "--epochs", 5000, "--valid", "--delay", 0.0004, persistent=False)
    term.wait_for("it/s", "│ step")
    # the training bar shows batches done and a rate in frame after frame (before, it stayed at
    # 0/90 with 0.0 it/s for the whole run): wait for three frames, at three different steps,
    # that show it moving (a frame may also catch an epoch's start or its validation)
    moving: list[tuple[str, int, float]] = []

    def moving_frame() -> bool:
        screen = term.screen()
        step = re.search(r"│ step (\d+) │", screen)
        bar = re.search(r"^ train +(\d+)/(\d+) +([\d.]+) it/s", screen, re.M)
        if step is None or bar is None or int(bar[1]) == 0 or float(bar[3]) == 0:
            return False
        if any(step[1] == seen for seen, _, _ in moving):
            return False
        moving.append((step[1], int(bar[1]), float(bar[3])))
        return True

    for _ in range(3):
        term.wait_until(moving_frame, "a frame with the training bar moving")
    term.keys("q")
    code, flags, _ = term.wait_exit()
    term.assert_restored(flags)
    assert len(moving) == 3, moving


# -- the table --------------------------------------------------------------------------------------

def test_the_table_says_what_it_left_out_and_pages_through_it(term: Terminal) -> None:
    train(term, "--batches", 40, "--epochs", 2, "--valid", "--metrics", 20, "--long-name")
    screen = term.wait_for(HOLD_BANNER, " q leave")
    footer = re.search(r"^1–(\d+) of 23 metrics · n/p more", screen, re.M)
    assert footer, screen
    per_page = int(footer[1])
    lines = screen.split("\n")
    head = next(i for i, line in enumerate(lines) if line.startswith("metric "))
    assert lines[head + per_page + 1].startswith(footer[0])  # right under the rows it counts
    # the 63-character name is cut with an ellipsis, its values kept
    assert re.search(r"^a_metric_with_a_very_long_name\w*… +0\.25 +0\.25 +0\.25 +- *$", screen, re.M), screen
    assert "n/p table" in lines[-1] or "n/p table" in screen.split("\n")[-2]
    seen = set(re.findall(r"^(\w+) +[-\d.]", screen, re.M))
    pages = -(-23 // per_page)
    for page in range(2, pages + 1):
        term.keys("n")
        first = (page - 1) * per_page + 1
        screen = term.wait_for(f"{first}–")
        seen |= set(re.findall(r"^(\w+) +[-\d.]", screen, re.M))
    assert "val_only_score" in seen  # a validation-only metric is listed
    assert {f"metric_{i:02d}" for i in range(1, 21)} <= seen
    term.keys("n")  # and round again
    term.wait_for(f"1–{per_page} of 23 metrics")
    term.keys("q")
    code, flags, _ = term.wait_exit()
    term.assert_restored(flags)


# -- sizes ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cols, rows", [(80, 24), (200, 50), (40, 12)])
def test_the_final_screen_holds_at_common_and_small_sizes(term: Terminal, cols: int, rows: int) -> None:
    # a checkpoint every 7 steps: marks all along the axis
    train(term, "--batches", 60, "--epochs", 3, "--valid", "--checkpoint-every", 7, "--delay", 0.002)
    term.wait_for(HOLD_BANNER, " q leave")
    lines = resize(term, cols, rows)
    screen = "\n".join(lines)
    assert lines[-1].startswith(" q leave"), screen  # the key help on its line
    assert lines[0].rstrip().endswith("│ completed"), screen
    # how to leave: in the banner, whole, or (under 16 rows: one row for it) shortened beside the reason
    assert "press q, Esc or Ctrl-C to leave" in screen if rows >= 16 else "training completed: max" in lines[1]
    assert lines[1].rstrip().endswith("Ctrl-C to leave" if rows >= 16 else "— q leaves"), screen
    assert re.search(r"^ train +60/60 |^ valid +15/15 ", screen, re.M), screen
    assert re.search(r"^ run +epoch 3/3 +completed", screen, re.M), screen
    title = next(line for line in lines if line.startswith(" loss ━ train ━ valid"))
    below = lines[lines.index(title) + 1]
    assert below[LABEL - 1] == "│", screen  # the legend kept to one line: the plot follows
    axis = next(i for i, line in enumerate(lines) if "└" in line)
    # the step range whole, on the axis where no mark is, else on the row under it
    assert re.search(r"step \d+ … 180", "\n".join(lines[axis:axis + 2])), screen
    assert "C" in lines[axis], screen


def test_the_summary_after_the_dashboard_fits_a_narrow_terminal(term: Terminal) -> None:
    # a long metric name, more metrics, a validation and NaN losses from step 30: the summary's every part
    train(term, "--batches", 24, "--epochs", 2, "--valid", "--long-name", "--metrics", 2, "--nan-after", 30)
    term.wait_for(HOLD_BANNER, " q leave")
    resize(term, 40, 12)
    term.keys("q")
    code, flags, text = term.wait_exit()
    assert code == 0
    term.assert_restored(flags)
    lines = text[text.index("hookfit: training completed"):text.index("EXIT=")].rstrip("\n").split("\n")
    # (read joined: a line the terminal wrapped reads whole) every line fits, but for a path, whole on its own
    assert all(len(line) <= 40 or " " not in line.strip() for line in lines), text
    words = " ".join(" ".join(lines).split())
    assert words.startswith("hookfit: training completed (max_epochs=2 reached) after"), text
    assert re.search(r"^  loss +nan +[\d.]+$", text, re.M), text  # the second epoch's mean: NaN from step 30
    assert re.search(r"^  a_metric_with\w*… +0\.25 +-$", text, re.M), text
    assert re.search(r"^  metric_02 +2\.0\d* +-$", text, re.M), text
    assert "loss over steps (train and valid):" in text and "× where loss was nan: steps" in words
    assert all(len(line) == 40 for line in lines if line[13:14] == "│"), text  # the plot as wide as there is room


# -- without urwid ------------------------------------------------------------------------------------

@pytest.fixture
def finished_run(tmp_path: Path) -> Path:
    done = subprocess.run([sys.executable, str(RUN), str(tmp_path / "result.json"), "--batches", "12", "--valid"],
                          env={**clean_env(), "HOOKFIT_PLUGINS": "console,metrics,metrics_log,optim"},
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
    return tmp_path / "run"


@pytest.mark.parametrize("text", [True, False])
def test_show_without_urwid_prints_the_text_summary(finished_run: Path, text: bool) -> None:
    done = subprocess.run([sys.executable, str(NO_URWID), "-m", "hookfit", "show", str(finished_run),
                           *(["--text"] if text else [])], env={**clean_env(), "HOOKFIT_PLUGINS": "tui"},
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"run {finished_run}\nhookfit: training completed (max_epochs=1 reached)")
    assert re.search(r"^  loss +[\d.]+ +[\d.]+$", done.stdout, re.M), done.stdout
    assert done.stderr == ""  # not a terminal: nothing to say about the dashboard


def test_show_on_a_terminal_without_urwid_says_what_to_install(finished_run: Path, term: Terminal) -> None:
    term.launch(sys.executable, NO_URWID, "-m", "hookfit", "show", finished_run, env="HOOKFIT_PLUGINS=tui")
    code, _, text = term.wait_exit()
    assert code == 0, text
    assert ("hookfit show: no dashboard: urwid is not installed (pip install urwid, or the tui extra: "
            "pip install 'hookfit[tui]'); the text summary follows") in text
    assert "hookfit: training completed (max_epochs=1 reached)" in text and "Traceback" not in text
