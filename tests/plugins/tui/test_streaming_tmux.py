"""The dashboard over data without a length, in a real terminal (tmux), and drawn
headlessly: the stage's progress row shows the batches done and a rate, and no total, ETA or
percentage; the run's row no ETA; the run goes on and stops on ``q`` as any other."""

from __future__ import annotations

import re
import sys
from types import MappingProxyType

import pytest

from conftest import TESTS
from terminal import PLUGINS, STATUS_LINE, Terminal, term  # noqa: F401 - term: the tmux fixture

SCRIPT = TESTS / "scripts" / "streaming_dashboard.py"
STAGE = re.compile(r"^ train (\d+) batches (\d+\.\d) it/s\b(.*)$", re.M)


def test_the_progress_rows_of_a_stream_drawn_headlessly_have_no_total_eta_or_percentage() -> None:
    """A training stage without a length between validations with one: its row counts, the
    validation's row and the rows of data with a length keep their total, ETA and percentage."""
    pytest.importorskip("urwid")
    from urwid.testing import render_text

    from hookfit.payloads import MetricsSnapshot, Value
    from hookfit.plugins.tui.dashboard import Dashboard

    def snap(stage: str, step: int, batches: int, total: int | None) -> MetricsSnapshot:
        return MetricsSnapshot(stage, 0, 3, step, batches, total, batches * 4, batches * 0.01,
                               MappingProxyType({"loss": Value(0.5, 0.5, 0.5)}), MappingProxyType({}), False)

    def rows(d: Dashboard) -> list[str]:
        d._refresh(80, 24)
        drawn = render_text(d.widget(80, 24), (80, 24))
        return [line for line in drawn if line.startswith((" train", " valid", " run"))]

    d = Dashboard(3, 1, on_stop=lambda: None, on_leave=lambda: None)
    d.receive("stage", "train", 0, None)
    for i in range(1, 31):
        d.receive("update", snap("train", i, i, None))
    stage, run = rows(d)
    assert re.match(r" train 30 batches \d+\.\d it/s +no length: batches counted *$", stage), stage
    assert "ETA" not in run and "%" in run and "epoch 1/3" in run, run  # the run's epochs are known
    d.receive("stage", "valid", 0, 10)  # a validation with a length: its total, ETA and percentage
    d.receive("update", snap("valid", 30, 4, 10))
    stage, _ = rows(d)
    assert " valid 4/10 " in stage and "ETA" in stage and "%" in stage, stage
    d.receive("stage", "train", 1, None)  # back to the stream: no percentage left over from it
    d.receive("update", snap("train", 31, 1, None))
    stage, _ = rows(d)
    assert "%" not in stage and "/" not in stage.replace("it/s", ""), stage


@pytest.mark.slow
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
