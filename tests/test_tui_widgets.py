"""The dashboard's widgets and plots, rendered headlessly with urwid's own testing helpers."""

from __future__ import annotations

import math
import os
from types import MappingProxyType

import pytest

urwid = pytest.importorskip("urwid")
from urwid.testing import render_text  # noqa: E402

import hookfit  # noqa: E402
from hookfit.payloads import MetricsSnapshot, Value  # noqa: E402
from hookfit.plugins.tui import TuiRenderer, interactive_terminal, summary  # noqa: E402
from hookfit.plugins.tui.dashboard import Dashboard  # noqa: E402
from hookfit.plugins.tui.plot import Series, text_plot  # noqa: E402


def snap(stage, epoch, step, batches, total, values, final=False):
    return MetricsSnapshot(stage, epoch, 3, step, batches, total, batches * 16, batches * 0.01,
                           MappingProxyType({k: Value(*v) for k, v in values.items()}),
                           MappingProxyType({"default": 0.1}), final)


def fed(stopped=None, left=None) -> Dashboard:
    d = Dashboard(3, 1, on_stop=lambda: stopped.append(1) if stopped is not None else None,
                  on_leave=lambda: left.append(1) if left is not None else None)
    d.receive("stage", "train", 0, 50)
    for i in range(1, 51):
        d.receive("update", snap("train", 0, i, i, 50, {"loss": (1 / i, 1 / math.sqrt(i), 0.5), "accuracy": (0.5, 0.6, 0.7)}))
    d.receive("stage", "valid", 0, 10)
    d.receive("epoch", snap("valid", 0, 50, 10, 10, {"loss": (0.3, 0.3, 0.25), "accuracy": (0.8, 0.8, 0.8)}, final=True))
    d.receive("stage", "train", 1, 50)  # epoch 2 of 3, 40 of its 50 batches done
    for i in range(51, 91):
        d.receive("update", snap("train", 1, i, i - 50, 50, {"loss": (1 / i, 1 / math.sqrt(i), 0.5), "accuracy": (0.5, 0.6, 0.7)}))
    d.receive("log", ["printed by the step"])
    return d


def screen(d: Dashboard, size=(80, 24)) -> list[str]:
    d._refresh(*size)
    return render_text(d.widget(*size), size)


def test_layout_at_80x24_has_every_panel() -> None:
    rows = screen(fed())
    text = "\n".join(rows)
    assert len(rows) == 24 and all(len(r) == 80 for r in rows)
    assert rows[0].startswith(" hookfit │ train │ epoch 2/3 │ step 90")
    assert "metric" in rows[1] and "valid" in rows[1]
    loss_row = next(r for r in rows if r.startswith("loss "))
    assert "0.01111" in loss_row and "0.25" in loss_row  # last train value, valid epoch mean
    assert " loss ━ train ━ valid · full history" in text
    assert any(ch in text for ch in "⣀⠉⠒⡇")  # Braille plot drawn
    assert "40/50" in text and "it/s" in text and "ETA" in text
    assert "printed by the step" in text
    assert rows[-1].startswith(" q stop") or rows[-2].startswith(" q stop")


def test_larger_terminal_gives_the_plot_the_room() -> None:
    small = sum(1 for r in screen(fed(), (80, 24)) if "│" in r[:12])
    large = sum(1 for r in screen(fed(), (160, 50)) if "│" in r[:12])
    assert large > small + 15


def test_keys_switch_metric_window_and_help() -> None:
    d = fed()
    assert d.plotted == "loss"
    d.keypress("tab")
    assert d.plotted == "accuracy" and " accuracy ━ train" in "\n".join(screen(d))
    d.keypress("left")
    assert d.plotted == "loss"
    d.keypress("w")
    assert "recent" in "\n".join(screen(d))
    d.keypress("?")
    assert "ask for a graceful stop" in "\n".join(screen(d))
    d.keypress("x")  # any key closes the help
    assert "ask for a graceful stop" not in "\n".join(screen(d))


def test_q_asks_for_a_stop_once_then_leaves_after_the_end() -> None:
    stopped, left = [], []
    d = fed(stopped, left)
    d.keypress("q")
    d.keypress("q")
    assert stopped == [1] and left == []
    assert "stopping after this batch (q pressed)" in "\n".join(screen(d))
    d.receive("end", "interrupted", "q pressed in the dashboard", True)
    text = "\n".join(screen(d))
    assert "training interrupted: q pressed in the dashboard" in text and "press q, Esc or Ctrl-C" in text
    d.keypress("esc")
    assert left == [1]


def test_eta_counts_validation_still_to_come() -> None:
    d = fed()
    d.progress.step_time = {"train": 0.1, "valid": 0.2}
    # epoch 2 of 3 at batch 40/50: 10 train batches left now, 1 more epoch of 50, 2 validations of 10
    assert d.eta() == pytest.approx(10 * 0.1 + 1 * 50 * 0.1 + 2 * 10 * 0.2)


def test_series_stays_bounded_and_keeps_spikes() -> None:
    s = Series(capacity=100)
    for i in range(200_000):
        s.add(i, 1.0 if i != 123_457 else 50.0)
    assert len(s) <= 100
    assert max(hi for _, _, hi in s.points()) == 50.0
    assert len(s.points(recent=True)) == 300 and s.points(recent=True)[-1][0] == 199_999


def test_text_plot_draws_two_series_with_labels() -> None:
    lines = text_plot({"train": [(0, 2, 2), (10, 1, 1)], "valid": [(0, 3, 3), (10, 0, 0)]}, width=20, height=5)
    assert lines[0].strip().startswith("3 │") and lines[4].strip().startswith("0 │")
    assert lines[-1].strip() == "0" + " " * 17 + "10"  # the x range spans the plot width
    assert all(len(line) == len(lines[0]) for line in lines[:5])


def test_summary_has_the_table_and_the_loss_curve() -> None:
    d = fed()
    state = hookfit.State(step=90, status="completed", stop_reason="max_epochs=3 reached", started_at=0, ended_at=2)
    lines = summary(d, state)
    assert lines[0] == "hookfit: training completed (max_epochs=3 reached) after 2.0s, 90 steps"
    assert any(l.split() == ["loss", "0.5", "0.25"] for l in lines)
    assert any("loss over steps (train and valid)" in l for l in lines)


def test_no_terminal_means_no_dashboard_and_no_claim(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    # pytest captures stdout: not a terminal
    assert interactive_terminal() in ("stdin is not a terminal", "stdout is not a terminal")
    monkeypatch.setenv("TERM", "dumb")
    assert interactive_terminal() == "TERM is dumb"
    monkeypatch.setenv("CI", "true")
    assert interactive_terminal() == "CI is set"
    monkeypatch.setenv("HOOKFIT_NO_TUI", "1")
    assert interactive_terminal() == "HOOKFIT_NO_TUI is set"
    tui = TuiRenderer()
    seen = []

    class Ask:
        @hookfit.hookimpl
        def fit_start(self, loop):
            seen.append(loop.hooks.claim_output(loop))

    hookfit.Loop(lambda l, b: None, [1], plugins=[tui, Ask()]).fit()
    assert seen == [None] and not tui.active


def test_a_dashboard_that_cannot_start_is_switched_off_and_the_console_prints(monkeypatch, capfd) -> None:
    import hookfit.plugins.tui.renderer as renderer_module
    from hookfit.plugins.console import Console
    from hookfit.plugins.tui import OutputCapture

    monkeypatch.setattr(renderer_module, "interactive_terminal", lambda: None)
    fd1_before = os.fstat(1)

    def broken_start(self):
        self._capture = OutputCapture()  # half-way: fds redirected, then it fails
        raise OSError("no terminal after all")

    monkeypatch.setattr(TuiRenderer, "_start_screen", broken_start)
    tui = TuiRenderer()
    with pytest.warns(hookfit.HookfitWarning, match="tui: the dashboard could not start.*no terminal after all"):
        state = hookfit.Loop(lambda l, b: None, [1, 2], plugins=[tui, Console()]).fit()
    assert state.status == "completed" and not tui.active
    assert os.fstat(1).st_ino == fd1_before.st_ino  # stdout is the original again
    assert "hookfit end status=completed" in capfd.readouterr().out
