"""Warnings while the dashboard owns the terminal, end to end in a real terminal (tmux): kept
and shown in the dashboard's log pane as one line each, listed again in the summary printed
after it, never written as raw lines into the screen's rows; the previous
``warnings.showwarning`` is back after the run, however it ended; the run's ``run.jsonl`` records
them."""

from __future__ import annotations

import json
import re
import sys

import pytest

from conftest import TESTS
from terminal import HOLD_BANNER, STATUS_LINE, Terminal, after, term  # noqa: F401 - term: the tmux fixture

pytestmark = pytest.mark.slow

SCRIPT = TESTS / "scripts" / "tui_warned.py"

RAW = re.compile(r"\.py:\d+: \w*Warning:")
"""A warning as Python writes it to standard error (``file.py:12: UserWarning: ...``)."""
SCRIPT_WARNING = "warning: UserWarning: THE SCRIPT WARNS AT STEP 5 (tui_warned.py:"
OPTIM_WARNING = "warning: OptimWarning: optim:"


def test_warnings_go_to_the_log_pane_and_the_summary_not_over_the_screen(term: Terminal) -> None:
    term.launch(sys.executable, SCRIPT, term.result,
                env="HOOKFIT_PLUGINS=console,interrupter,metrics,optim,tui HOOKFIT_TUI_PERSISTENT=1")
    screen = term.wait_for(HOLD_BANNER, OPTIM_WARNING)  # the end-of-run warning came in fit_end
    lines = screen.splitlines()
    assert not RAW.search(screen), screen
    assert "self." not in screen and "warnings.warn(" not in screen, screen  # no source line either
    assert lines[0].lstrip().startswith(STATUS_LINE) and "q leave" in lines[-1]  # the frame's rows are its own
    assert any(line.startswith(" time ") for line in lines), screen
    assert any(line.startswith(SCRIPT_WARNING) for line in lines), screen  # the log pane, a line each
    term.keys("q")
    code, flags, text = term.wait_exit()
    assert code == 0
    term.assert_restored(flags)
    assert json.loads(term.result.read_text()) == {"status": "completed", "showwarning": True}
    summary = text[text.index("hookfit: training completed"):]
    assert f"  {SCRIPT_WARNING}" in summary
    assert re.search(r"^  warning: OptimWarning: optim: \d+ optimizer steps were skipped", summary, re.M), summary
    assert not RAW.search(text), text  # nor raw on the normal screen afterwards
    assert after(text, SCRIPT_WARNING, "EXIT=0")


@pytest.mark.fault
def test_a_run_that_fails_puts_showwarning_back_and_lists_its_warnings(term: Terminal) -> None:
    term.launch(sys.executable, SCRIPT, term.result, "raise",
                env="HOOKFIT_PLUGINS=console,interrupter,metrics,optim,tui")
    code, flags, text = term.wait_exit()
    assert code == 1
    term.assert_restored(flags)
    assert json.loads(term.result.read_text()) == {"status": "failed", "showwarning": True}
    assert after(text, "hookfit: training failed (RuntimeError: the step broke at step 15)", SCRIPT_WARNING)
    assert "RuntimeError: the step broke at step 15" in text[text.index(SCRIPT_WARNING):]
    lines = [json.loads(line) for line in (term.result.parent / "run" / "run.jsonl").read_text().splitlines()]
    recorded = [(line["category"], line["message"], line["step"]) for line in lines if line["event"] == "warning"]
    assert ("UserWarning", "THE SCRIPT WARNS AT STEP 5", 5) in recorded, lines  # kept off the terminal, recorded
    assert any(category.endswith(".OptimWarning") for category, _, _ in recorded), lines
    assert lines[-1]["event"] == "end" and lines[-1]["status"] == "failed"
