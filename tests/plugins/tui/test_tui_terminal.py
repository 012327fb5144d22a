"""The tui dashboard end to end, in a real terminal: tmux on a private socket per test (the
terminal itself is ``tests/terminal.py``, shared with the run commands' tests)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from terminal import (  # noqa: F401 - term: the tmux fixture
    DEADLINE,
    HOLD_BANNER,
    PLUGINS,
    PRINTED,
    SCRIPT,
    STATUS_LINE,
    STTY,
    TMUX,
    Terminal,
    after,
    clean_env,
    term,
)

pytestmark = pytest.mark.slow


def test_dashboard_appears(term: Terminal) -> None:
    term.train(steps=300, delay=0.1)
    screen = term.wait_dashboard()
    assert term.alternate()
    lines = screen.splitlines()
    assert lines[0].lstrip().startswith(STATUS_LINE) and "running" in lines[0]
    assert re.search(r"^metric\s+train last\s+running\s+epoch\s+valid", screen, re.M)
    assert re.search(r"^loss\s+\d", screen, re.M) and re.search(r"^accuracy\s+0\.5\s+0\.5", screen, re.M)
    assert re.search(r"train\s+\d+/300 +\d+\.\d it/s ETA \d\d:\d\d:\d\d", screen)
    assert "q stop" in lines[-1]
    # the script's print went to the log pane (just above the keys), not over the frame
    assert screen.count(PRINTED) == 1 and any(PRINTED in line for line in lines[-7:-1])
    assert term.flag("cursor_flag") == "0"  # urwid hides the cursor while it draws
    # it keeps redrawing: the step counter moves
    def step() -> int:
        found = re.search(r"│ step (\d+) │", term.screen())
        return int(found.group(1)) if found else -1

    first = step()
    assert first >= 0
    term.wait_until(lambda: step() > first, "the step counter to advance")


def test_q_stops_gracefully_and_restores_the_terminal(term: Terminal) -> None:
    term.train(steps=300, delay=0.1)
    term.wait_dashboard()
    term.keys("q")
    code, flags, text = term.wait_exit()
    result = term.outcome()
    assert code == 0
    assert result["outcome"] == "returned" and result["status"] == "interrupted"
    assert result["reason"] == "q pressed in the dashboard" and result["fit_end"] == ["interrupted"]
    assert result["restored"] and 3 <= result["step"] < 300
    term.assert_restored(flags)
    # what the run printed is replayed once, before the summary, on the normal screen
    assert text.count(PRINTED) == 1
    assert after(text, PRINTED, "hookfit: training interrupted (q pressed in the dashboard)")
    assert after(text, "hookfit: training interrupted", "EXIT=0")
    assert "loss over steps (train):" in text
    assert "hookfit │" not in text  # no frame leaked onto the normal screen


def test_non_persistent_run_exits_by_itself_with_a_summary(term: Terminal) -> None:
    term.train(steps=15, delay=0.1)
    term.wait_for(STATUS_LINE)
    assert term.alternate()
    code, flags, text = term.wait_exit()
    assert code == 0
    result = term.outcome()
    assert result["status"] == "completed" and result["reason"] == "max_epochs=1 reached" and result["step"] == 15
    assert result["restored"] and result["fit_end"] == ["completed"]
    term.assert_restored(flags)
    assert re.search(r"^hookfit: training completed \(max_epochs=1 reached\) after \d+\.\ds, 15 steps$", text, re.M)
    assert re.search(r"^  metric\s+train\s+valid$", text, re.M)
    assert re.search(r"^  loss\s+\d+\.\d+\s+-$", text, re.M)
    assert "  loss over steps (train):" in text
    plot = text[text.index("loss over steps"):]
    assert re.search(r"[\u2801-\u28ff]", plot), "the text plot has no points"
    assert after(text, PRINTED, "hookfit: training completed") and after(text, "loss over steps", "EXIT=0")


@pytest.mark.parametrize("key", ["q", "Escape", "C-c"])
def test_persistent_run_holds_until_the_user_leaves(term: Terminal, key: str) -> None:
    term.train(steps=15, delay=0.05, persistent=True)
    screen = term.wait_for(HOLD_BANNER)
    assert "training completed: max_epochs=1 reached" in screen
    assert re.search(r"│ step 15 │.*│ completed", screen)
    assert term.alternate()
    clock = re.search(r"│ (\d\d):(\d\d):(\d\d) │ completed", screen)
    assert clock, screen
    # fit() has not returned (the script writes its result after it) while the other plugins'
    # fit_end already ran: the dashboard's fit_end is the last one and it is the one holding
    assert not term.result.exists()
    assert Path(str(term.result) + ".fit_end").read_text() == "completed"
    time.sleep(2.0 if key == "q" else 0.5)  # the long look once; the other keys only need the hold
    assert term.alternate() and HOLD_BANNER in term.screen() and not term.result.exists()
    assert "EXIT=" not in term.screen()
    # the clock stopped with the run: the hold is not the run's time (it redraws every second)
    assert re.search(r"│ (\d\d:\d\d:\d\d) │ completed", term.screen()).group(1) == ":".join(clock.groups())
    term.keys(key)
    code, flags, text = term.wait_exit()
    assert code == 0
    result = term.outcome()
    assert result["status"] == "completed" and result["outcome"] == "returned" and result["restored"]
    term.assert_restored(flags)
    assert after(text, PRINTED, "hookfit: training completed (max_epochs=1 reached)")
    assert after(text, "loss over steps (train):", "EXIT=0")
    assert HOLD_BANNER not in text
    # the summary's duration is the run's (state.elapsed), the one the stopped clock shows
    seconds = float(re.search(r"training completed \(max_epochs=1 reached\) after (\d+\.\d)s", text).group(1))
    shown = int(clock[1]) * 3600 + int(clock[2]) * 60 + int(clock[3])
    assert shown - 0.05 <= seconds < shown + 1.05, (seconds, shown)


# -- failures -----------------------------------------------------------------------------------

@pytest.mark.fault
def test_step_that_raises_restores_the_terminal_and_shows_the_traceback(term: Terminal) -> None:
    term.train(steps=300, delay=0.1, mode="raise")
    code, flags, text = term.wait_exit()
    assert code == 1
    result = term.outcome()
    assert result["status"] == "failed" and result["reason"] == "RuntimeError: boom from the step"
    assert result["fit_end"] == ["failed"] and result["restored"] and result["step"] == 5
    term.assert_restored(flags)
    assert "hookfit: training failed (RuntimeError: boom from the step)" in text
    assert after(text, "Traceback (most recent call last):", "RuntimeError: boom from the step\n")
    assert re.search(r"^hookfit: raised in step function 'train_step' \(epoch 1, stage train, batch 6\)$", text, re.M)
    # the summary comes first, the traceback after it (printed once the screen was closed)
    assert after(text, "hookfit: training failed", "Traceback (most recent call last):")
    assert after(text, "raised in step function", "EXIT=1")


@pytest.mark.fault
def test_a_step_that_raises_after_a_checkpoint_names_it_to_resume_from(term: Terminal) -> None:
    """The summary after the dashboard names the newest checkpoint (step 4's, of every 2 steps), as the console does."""
    term.train(steps=300, delay=0.1, mode="raise-saved")
    code, flags, text = term.wait_exit()
    assert code == 1 and term.outcome()["status"] == "failed"
    saved = term.tmp / "run" / "checkpoints" / "epoch0001-step000000004.pt"
    assert saved.is_file()
    # (a path longer than the terminal's line wraps: the words before it and after it, and the path unwrapped)
    flat = re.sub(r"\s+", "", text)
    shown = saved.relative_to(term.tmp)  # (the run's current folder: named relative to it, as the console names it)
    said = f"checkpoint to resume from: {shown} (step): run again with Loop(..., resume=<this path>)"
    assert re.sub(r"\s+", "", said) in flat, text
    assert after(text, "hookfit: training failed", "checkpoint to resume from:")


# -- signals with the dashboard up -------------------------------------------------------------

@pytest.mark.fault
@pytest.mark.parametrize("name, hint", [("SIGINT", "; press Ctrl-C again to abort"), ("SIGTERM", "")])
def test_one_signal_stops_gracefully(term: Terminal, name: str, hint: str) -> None:
    term.train(steps=300, delay=0.1)
    term.wait_dashboard()
    if name == "SIGINT":
        term.keys("C-c")  # Ctrl-C typed into the terminal
    else:
        os.kill(term.pid(), signal.SIGTERM)
    code, flags, text = term.wait_exit()
    result = term.outcome()
    # once the graceful stop is over, fit() ends the process as the signal would: KeyboardInterrupt
    # for SIGINT (the script catches it, and exits 0), SystemExit(143) for SIGTERM (the script's
    # `except KeyboardInterrupt` lets it through: its result says "returned")
    if name == "SIGINT":
        assert code == 0 and result["outcome"] == "KeyboardInterrupt"
    else:
        assert code == 143 and result["outcome"] == "returned"
    assert result["status"] == "interrupted" and result["reason"] == name
    assert result["fit_end"] == ["interrupted"] and result["restored"] and result["step"] < 300
    term.assert_restored(flags)
    # the interrupter's message on stderr was captured and replayed, not drawn over the frame
    assert f"hookfit: {name} received, stopping after this batch{hint}" in text
    assert f"hookfit: training interrupted ({name})" in text
    # ... and kept in the run folder, with what the script printed
    output = (term.tmp / "run" / "output.log").read_text()
    assert after(output, PRINTED, f"hookfit: {name} received, stopping after this batch{hint}")


@pytest.mark.fault
def test_a_sigterm_stop_ends_a_persistent_dashboard_without_waiting_for_a_key(term: Terminal) -> None:
    """A scheduler's SIGTERM with persistent=True: the screen waited for q, the process stayed alive and
    run.jsonl had no end line until then (a SIGKILL after the grace period lost it)."""
    term.train(steps=300, delay=0.1, persistent=True)
    term.wait_dashboard()
    os.kill(term.pid(), signal.SIGTERM)
    code, flags, text = term.wait_exit()
    assert code == 143 and term.outcome()["status"] == "interrupted"
    term.assert_restored(flags)
    ends = [line for line in (term.tmp / "run" / "run.jsonl").read_text().splitlines() if '"event": "end"' in line]
    assert len(ends) == 1 and '"status": "interrupted"' in ends[0]


def test_a_stop_whose_asker_ends_the_process_does_not_hold_a_persistent_dashboard(term: Terminal) -> None:
    """Any plugin's request with ``ends_process=True`` (not only the interrupter's SIGTERM) ends the
    hold: the dashboard told a SIGTERM by its reason's last word before."""
    term.train(steps=300, delay=0.05, mode="preempt", persistent=True)
    code, flags, text = term.wait_exit()
    result = term.outcome()
    assert code == 0 and result["status"] == "interrupted" and result["reason"] == "preempted by the scheduler"
    assert result["step"] == 6
    term.assert_restored(flags)


@pytest.mark.fault
def test_second_sigint_aborts_after_fit_end(term: Terminal) -> None:
    # long steps: both Ctrl-C land in the first batch, and the abort cuts its sleep short
    term.train(steps=50, delay=5.0)
    term.wait_for(STATUS_LINE)
    term.keys("C-c")
    # the interrupter's message, captured and shown in the log pane: the first SIGINT was handled
    term.wait_for("hookfit: SIGINT received, stopping after this batch", timeout=10)
    term.keys("C-c")
    code, flags, text = term.wait_exit()
    assert code == 0
    result = term.outcome()
    assert result["outcome"] == "KeyboardInterrupt" and result["status"] == "interrupted"
    assert result["reason"] == "KeyboardInterrupt" and result["fit_end"] == ["interrupted"]
    assert result["restored"] and result["step"] < 50
    term.assert_restored(flags)
    assert "hookfit: training interrupted (KeyboardInterrupt)" in text


@pytest.mark.fault
def test_sigterm_during_the_persistent_hold_restores_the_terminal_then_terminates(term: Terminal) -> None:
    term.train(steps=15, delay=0.05, persistent=True)
    term.wait_for(HOLD_BANNER)
    os.kill(term.pid(), signal.SIGTERM)
    code, flags, text = term.wait_exit()
    assert code == 128 + signal.SIGTERM  # it ends as asked, as a process the signal ended ...
    term.assert_restored(flags)  # ... once the terminal is back,
    assert after(text, PRINTED, "hookfit: training completed (max_epochs=1 reached)")  # output and summary shown
    assert after(text, "loss over steps (train):", f"EXIT={128 + signal.SIGTERM}")
    assert Path(str(term.result) + ".fit_end").read_text() == "completed"
    # fit() never returned: it raised SystemExit(143) (the script's `finally` wrote its result) after
    # the run's records, the end line included (the process killed itself with the signal before that line)
    assert term.outcome()["status"] == "completed"
    ends = [json.loads(line) for line in (term.tmp / "run" / "run.jsonl").read_text().splitlines()
            if '"event": "end"' in line]
    assert [end["status"] for end in ends] == ["completed"]


# -- found by these tests, fixed, kept as regressions ------------------------------------------

@pytest.mark.fault
def test_ctrl_z_is_ignored_while_the_dashboard_is_up(term: Terminal) -> None:
    """urwid >= 5.1 installs a SIGTSTP handler in start(); its suspend path stopped the screen
    from the UI thread and froze the dashboard. The plugin's screen installs no handlers."""
    # batches of 2 s: the stopping banner stays up until the current one ends, long enough for
    # the screen to be read on a loaded machine (with 0.1 s batches the run could end first)
    term.train(steps=30, delay=2.0)
    term.wait_dashboard()
    term.keys("C-z")
    time.sleep(0.5)
    term.keys("q")
    term.wait_for("stopping after this batch (q pressed in the dashboard)", timeout=10)
    code, flags, text = term.wait_exit()
    term.assert_restored(flags)
    assert "the dashboard failed" not in text
    assert term.outcome()["reason"] == "q pressed in the dashboard"


def test_sigint_shows_the_stopping_banner(term: Terminal) -> None:
    """A signal becomes a stop request, whose stop_requested event the dashboard hears."""
    term.train(steps=50, delay=5.0)
    term.wait_for(STATUS_LINE)
    term.keys("C-c")
    term.wait_for("hookfit: SIGINT received", timeout=10)
    screen = term.wait_for("stopping after this batch (SIGINT); Ctrl-C again aborts", timeout=1.5)
    assert "│ stopping" in screen


def test_resizes_redraw_the_whole_layout(term: Terminal) -> None:
    term.train(steps=400, delay=0.05)
    term.wait_dashboard()
    term.tmux("resize-window", "-t", "main", "-x", "80", "-y", "24")
    def fits() -> bool:
        rows = term.screen().split("\n")
        return rows[0].startswith(" hookfit │") and any(r.startswith(" q stop") for r in rows[:24]) \
            and all(len(r) <= 80 for r in rows)
    term.wait_until(fits, "the dashboard redrawn at 80x24", timeout=10)
    term.tmux("resize-window", "-t", "main", "-x", "140", "-y", "45")
    term.wait_until(lambda: sum("│" in r[:12] for r in term.screen().split("\n")) > 20,
                    "a taller plot at 140x45", timeout=10)
    term.keys("q")
    code, flags, _ = term.wait_exit()
    assert code == 0
    term.assert_restored(flags)


def test_q_is_answered_while_a_long_step_runs(term: Terminal) -> None:
    term.train(steps=10, delay=3.0)
    term.wait_for(STATUS_LINE)
    asked = time.monotonic()
    term.keys("q")
    term.wait_for("stopping after this batch (q pressed in the dashboard)", timeout=1.5)  # mid-step
    assert time.monotonic() - asked < 1.5
    code, flags, _ = term.wait_exit()
    assert term.outcome()["status"] == "interrupted"
    term.assert_restored(flags)


def test_without_the_interrupter_q_still_stops(term: Terminal) -> None:
    """Stopping is the core's: the dashboard's q needs no other plugin."""
    term.train(steps=300, delay=0.1, plugins="console,metrics,optim,tui")
    term.wait_dashboard()
    term.keys("q")
    code, flags, text = term.wait_exit()
    assert code == 0
    assert term.outcome()["status"] == "interrupted"
    assert term.outcome()["reason"] == "q pressed in the dashboard"
    assert "hookfit: training interrupted (q pressed in the dashboard)" in text
    assert "stop asked by tui" in text
    term.assert_restored(flags)


@pytest.mark.fault
def test_without_the_interrupter_sigterm_still_restores_the_terminal(term: Terminal) -> None:
    term.train(steps=300, delay=0.1, plugins="console,metrics,optim,tui")
    term.wait_dashboard()
    os.kill(term.pid(), signal.SIGTERM)
    code, flags, text = term.wait_exit()
    assert code == 128 + signal.SIGTERM  # terminated, as asked ...
    term.assert_restored(flags)  # ... with the terminal put back first
    assert not term.result.exists()


# -- what the run printed, fatal errors and debuggers -------------------------------------------

@pytest.mark.fault
def test_kill_9_leaves_what_the_run_printed_in_output_log(term: Terminal) -> None:
    term.train(steps=300, delay=0.1)
    term.wait_dashboard()  # the line is in the log pane: it was read from the pipe and written
    os.kill(term.pid(), signal.SIGKILL)
    code, _, _ = term.wait_exit()
    assert code == 128 + signal.SIGKILL
    output = (term.tmp / "run" / "output.log").read_text()
    assert output.count(PRINTED) == 1


@pytest.mark.fault
def test_a_fatal_error_shows_in_the_real_terminal(term: Terminal) -> None:
    """A segmentation fault ends the process at once: no code restores the screen, so the
    fatal error must have been written to the terminal itself, not into the captured output."""
    term.train(steps=300, delay=0.05, mode="segv")
    code, _, text = term.wait_exit()
    assert code == 128 + signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in text
    assert re.search(r'File ".*train\.py", line \d+ in train_step', text), text
    output = (term.tmp / "run" / "output.log").read_text()
    assert PRINTED in output and "Fatal Python error" not in output


def test_breakpoint_gives_the_terminal_to_pdb_and_the_dashboard_comes_back(term: Terminal) -> None:
    term.train(steps=30, delay=0.1, mode="debug")
    screen = term.wait_for("(Pdb)")
    assert not term.alternate(), "the debugger's prompt is on the dashboard's screen"
    # pdb stops in the step, at the line after breakpoint(), as it would without a dashboard
    assert "train_step()" in screen and "-> loss = torch.nn.functional.mse_loss(model(x), y)" in screen
    assert "hookfit │" not in screen
    term.keys("p 'step', loop.state.step", "Enter")
    term.wait_for("('step', 3)")  # the typed command and pdb's answer are on the terminal
    term.keys("c", "Enter")
    term.wait_until(lambda: term.alternate() and STATUS_LINE in term.screen(), "the dashboard to come back")
    code, flags, text = term.wait_exit()
    assert code == 0
    result = term.outcome()
    assert (result["outcome"], result["status"], result["step"]) == ("returned", "completed", 30)
    assert result["restored"]
    term.assert_restored(flags)
    assert after(text, "(Pdb) c", "hookfit: training completed (max_epochs=1 reached)")
    assert text.count(PRINTED) == 1


# -- not a terminal -----------------------------------------------------------------------------

def test_piped_run_prints_plain_console_lines(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    result = tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(script), "12", "0.01", "ok", str(result)], cwd=tmp_path,
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          env=clean_env(), timeout=120)
    out = done.stdout.decode("utf-8")
    assert done.returncode == 0, out
    for bad in ("\x1b", "\r", "\x08"):
        assert bad not in out, f"{bad!r} in piped output:\n{out!r}"
    lines = out.splitlines()
    assert lines[0].startswith("hookfit start epochs=1 batches_per_epoch=12 plugins=")
    assert "tui" not in lines[0]  # discovered, the dashboard takes no part where no terminal shows it
    assert PRINTED in lines
    assert any(line.startswith('hookfit end status=completed reason="max_epochs=1 reached"') for line in lines)
    assert any(line.startswith("hookfit result stage=train metric=loss") for line in lines)
    assert "hookfit: training" not in out  # the dashboard's summary is printed only after a dashboard
    assert json.loads(result.read_text())["status"] == "completed"
