"""The dashboard over data without a length (issue 28), in a real terminal (tmux): the stage's
progress row shows the batches done and a rate, and no total, ETA or percentage; the run's row
no ETA; the run goes on and stops on ``q`` as any other."""

from __future__ import annotations

import re
import sys

import pytest

from conftest import TESTS
from terminal import PLUGINS, STATUS_LINE, Terminal, term  # noqa: F401 - term: the tmux fixture

pytestmark = pytest.mark.slow

SCRIPT = TESTS / "scripts" / "streaming_dashboard.py"
STAGE = re.compile(r"^ train (\d+) batches (\d+\.\d) it/s\b(.*)$", re.M)


def test_a_streams_progress_row_counts_batches_with_a_rate_and_no_total_eta_or_percentage(term: Terminal) -> None:
    term.launch(sys.executable, SCRIPT, term.result, "--delay", "0.05", env=f"HOOKFIT_PLUGINS={PLUGINS}")

    def stage_row() -> re.Match[str] | None:
        found = STAGE.search(term.screen())
        return found if found is not None and int(found.group(1)) > 0 and float(found.group(2)) > 0 else None

    term.wait_until(lambda: stage_row() is not None, "the stage's row with a count and a rate")
    first = stage_row()
    assert first is not None
    screen = term.screen()
    assert STATUS_LINE in screen and "epoch 1/2" in screen
    row = first.group(0)
    assert not re.search(r"\d+/[\d?]", row) and "ETA" not in row and "%" not in row, row  # no "57/120", "57/?"
    assert "no length: batches counted" in row, row
    run_row = next(line for line in screen.splitlines() if line.startswith(" run "))
    assert "ETA" not in run_row and "epoch 1/2" in run_row, run_row
    # the count goes on
    term.wait_until(lambda: (row := stage_row()) is not None and int(row.group(1)) > int(first.group(1)),
                    "the count of batches to advance")
    term.keys("q")
    code, _, text = term.wait_exit()
    assert code == 0, text
    outcome = term.outcome()
    assert outcome["status"] == "interrupted" and outcome["step"] > 0, outcome
    assert "Traceback" not in text
