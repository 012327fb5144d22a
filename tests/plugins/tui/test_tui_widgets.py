"""The dashboard's widgets and plots, rendered headlessly with urwid's own testing helpers."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

urwid = pytest.importorskip("urwid")
from urwid.testing import render_text  # noqa: E402

import hookfit  # noqa: E402
from hookfit.payloads import MetricsSnapshot, ModelSummary, ModuleRow, ResumeInfo, Value  # noqa: E402
from hookfit.plugins.tui import TuiRenderer, interactive_terminal, summary  # noqa: E402
from hookfit.plugins.tui.dashboard import Dashboard  # noqa: E402
from hookfit.plugins.support.plot import Series, text_plot  # noqa: E402


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


def test_an_evaluation_s_dashboard_and_summary_say_evaluation_not_training() -> None:
    """Loop.validate() with the dashboard said "training completed (validation done) ... 0 steps"."""
    d = fed()
    d.evaluation = True
    d.receive("end", "completed", "validation done", False)
    state = hookfit.State(step=0, status="completed", stop_reason="validation done", started_at=0, ended_at=2)
    assert summary(d, state)[0] == "hookfit: evaluation completed (validation done) after 2.0s"
    banner = d.banner()
    assert banner is not None and banner[1].startswith(" evaluation completed: validation done")


def test_a_torchrun_worker_on_a_terminal_is_told_why_it_has_no_dashboard(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun starts its workers in a process group of their own, so none owns the terminal
    it was started from: the main process says why there is no dashboard, once, at the
    script's fit() line (another background process stays silent, as before)."""
    import sys
    import warnings

    from hookfit.plugins.tui import terminal

    class Tty:
        def isatty(self) -> bool:
            return True

        def fileno(self) -> int:
            return 1

        def write(self, text: str) -> int:
            return len(text)

        def flush(self) -> None:
            pass

    for name in ("CI", "HOOKFIT_NO_TUI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setattr(sys, "stdin", Tty())
    monkeypatch.setattr(sys, "stdout", Tty())
    monkeypatch.setattr(terminal.os, "tcgetpgrp", lambda fd: os.getpgrp() + 1)  # another group owns it
    assert interactive_terminal() == "the process runs in the background"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert interactive_terminal() == terminal.UNDER_TORCHRUN
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hookfit.Loop(lambda loop, b: None, [1], plugins=[TuiRenderer()]).fit(); line = sys._getframe().f_lineno
    monkeypatch.undo()
    said = [w for w in caught if "no dashboard" in str(w.message)]
    assert [str(w.message) for w in said] == [
        f"tui: no dashboard: {terminal.UNDER_TORCHRUN}; the console prints instead (HOOKFIT_NO_TUI=1 leaves the "
        f"dashboard out without this warning)"]
    assert (said[0].filename, said[0].lineno) == (__file__, line)


def test_a_dashboard_given_by_name_without_a_terminal_says_why_it_does_not_show(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A notebook or piped output: ``plugins=[TuiRenderer()]`` asked for the dashboard, so its stepping aside is
    said once, at the script's ``fit()`` line, with the reason; a discovered one, and one the run switched off
    (``CI``, ``HOOKFIT_NO_TUI``), say nothing."""
    import warnings

    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.delenv("HOOKFIT_NO_TUI", raising=False)

    def said(env: dict[str, str], given: bool) -> list[warnings.WarningMessage]:
        for name in ("CI", "HOOKFIT_NO_TUI"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("HOOKFIT_PLUGINS", "tui,console")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loop = hookfit.Loop(lambda loop, b: None, [1], plugins=[TuiRenderer()] if given else [])
            loop.fit()
        return [w for w in caught if "no dashboard" in str(w.message)]

    given = said({}, True)
    assert [str(w.message) for w in given] == [
        f"tui: no dashboard: {interactive_terminal()}; the console prints instead (HOOKFIT_NO_TUI=1 leaves the "
        f"dashboard out without this warning)"]
    assert given[0].filename == __file__
    assert said({}, False) == []
    assert said({"CI": "true"}, True) == []
    assert said({"HOOKFIT_NO_TUI": "1"}, True) == []
    # a project's hookfit.toml that configures the dashboard is no request for one in a piped job
    (tmp_path / "hookfit.toml").write_text("[plugins.tui]\npersistent = false\n")
    monkeypatch.chdir(tmp_path)
    assert said({}, False) == []


def test_a_discovered_dashboard_without_a_terminal_takes_no_part_and_is_not_listed(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Output piped (pytest captures it): the discovered dashboard leaves the run before ``configure``, so the
    start line does not list ``tui`` (it listed a dashboard that never showed); ``hookfit plugins``, whose output
    is not a run's, lists it active. Given to the run it stays (it decides at ``fit_start``); on a terminal it
    takes part."""
    from hookfit.plugins.console import Console
    from hookfit.plugins.tui import terminal

    monkeypatch.setenv("HOOKFIT_PLUGINS", "tui,console")
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("HOOKFIT_NO_TUI", raising=False)
    loop = hookfit.Loop(lambda loop, b: None, [1])
    loop.fit()
    assert loop.run.pm.participants() == ["console"]
    assert "plugins=console\n" in capsys.readouterr().out
    assert terminal.without_terminal(TuiRenderer(), False, loop) in (
        "a terminal to draw on (here stdin is not a terminal)", "a terminal to draw on (here stdout is not a terminal)")
    assert terminal.without_terminal(TuiRenderer(), False) is None  # hookfit plugins: its output is not a run's
    given = hookfit.Loop(lambda loop, b: None, [1], plugins=[TuiRenderer(), Console()])
    given.fit()
    assert sorted(given.run.pm.participants()) == ["console", "tui"]
    monkeypatch.setattr(terminal, "interactive_terminal", lambda: None)
    assert terminal.without_terminal(TuiRenderer(), False, loop) is None


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


@pytest.mark.bad_input
@pytest.mark.parametrize("option, value", [("fps", 0), ("fps", -5.0), ("fps", "5"), ("fps", float("inf")),
                                           ("persistent", "yes")])
def test_options_are_checked_when_the_renderer_is_built(option: str, value) -> None:
    with pytest.raises(ValueError, match=rf"^tui: {option} must be .*, got {re.escape(repr(value))}$"):
        TuiRenderer(**{option: value})


@pytest.mark.fault
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


# -- resumes, the stopped clock --------------------------------------------------------------

RESUMED = ResumeInfo("runs/exp/checkpoints/epoch0002-step000000057.pt", 1, 57, 7, "train")


def test_the_dashboard_shows_where_the_run_resumed_from() -> None:
    d = Dashboard(3, 1, on_stop=lambda: None, on_leave=lambda: None)
    d.receive("resumed", RESUMED)
    text = "\n".join(screen(d, (120, 30)))
    assert "hookfit: resumed from runs/exp/checkpoints/epoch0002-step000000057.pt (epoch 2, after 7 training " \
           "batches, step 57)" in text
    assert "│ epoch 2/3 │ step 57 │" in text  # where it continues, before the first metrics arrive
    tui = TuiRenderer()
    tui.active = True
    tui.resumed(RESUMED)
    assert list(tui._inbox) == [("resumed", RESUMED, RESUMED.source)]  # handed to the UI thread (with the file, live)
    tui.checkpoint_saved(path="runs/exp/checkpoints/epoch0003-step000000090.pt", reason="interrupt", step=90)
    assert list(tui._inbox)[-1] == ("checkpoint", 90, "interrupt", "runs/exp/checkpoints/epoch0003-step000000090.pt")
    state = hookfit.State(step=90, status="completed", stop_reason="done", started_at=0, ended_at=2,
                          resumed_from=RESUMED)
    assert summary(d, state, "runs/exp/output.log")[1:3] == [
        f"  resumed from {RESUMED}", "  output printed during the run: runs/exp/output.log"]


def test_the_clock_stops_when_the_run_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    import hookfit.plugins.tui.dashboard as dashboard_module

    now = [1000.0]
    monkeypatch.setattr(dashboard_module.time, "monotonic", lambda: now[0])
    d = fed()
    d.started = now[0] - 100
    assert "│ 00:01:40 │ running" in screen(d)[0]
    # the run's own duration (state.elapsed: a persistent hold is not part of it)
    d.receive("end", "completed", "max_epochs=3 reached", True, None, 3.4)
    now[0] += 3600
    assert "│ 00:00:03 │ completed" in screen(d)[0]
    d2 = fed()  # without a duration, the clock stops when the end arrives
    d2.started = now[0] - 5
    d2.receive("end", "completed", "max_epochs=3 reached", True)
    now[0] += 60
    assert "│ 00:00:05 │ completed" in screen(d2)[0]


# -- the model's size --------------------------------------------------------------------------

MODEL = ModelSummary(1_234_567, 1_200_000, 4_938_268, 0, (
    ModuleRow("encoder", "Sequential", 1_000_000, 965_433, 4_000_000), ModuleRow("act", "ReLU", 0, 0, 0),
    ModuleRow("decoder", "Linear", 234_567, 234_567, 938_268), ModuleRow("norm", "LayerNorm", 2, 2, 8)))


def test_the_dashboard_shows_the_models_size_under_the_status_line() -> None:
    d = fed()
    d.receive("model", MODEL)
    line = (" model 1.23M params (1.2M trainable), 4.71 MB │ encoder Sequential 81% · decoder Linear 19% · "
            "norm LayerNorm <1%")  # modules without parameters left out
    rows = screen(d, (120, 24))
    assert rows[1] == line.ljust(120)
    assert rows[0].startswith(" hookfit │ train │ epoch 2/3") and "metric" in rows[2]
    rows = screen(d)  # 80 columns: ellipsized, every other panel still there
    assert len(rows) == 24 and all(len(r) == 80 for r in rows)
    assert rows[1] == line[:79] + "…"
    assert "40/50" in "\n".join(rows) and "printed by the step" in "\n".join(rows)
    assert rows[-1].startswith(" q stop") or rows[-2].startswith(" q stop")
    without = screen(fed())
    assert not any(" model " in r for r in without) and "metric" in without[1]  # no model: no line
    state = hookfit.State(step=90, status="completed", stop_reason="done", started_at=0, ended_at=2)
    assert "  model: 1.23M params (1.2M trainable), 4.71 MB" in summary(d, state)
    assert not any("model:" in line for line in summary(fed(), state))


def test_the_renderer_sends_the_model_summary_at_the_start(monkeypatch, capsys, tmp_path) -> None:
    """A real run with the dashboard's screen and UI thread left out: the renderer counts the model
    at fit_start, and the summary printed afterwards says it."""
    torch = pytest.importorskip("torch")
    import hookfit.plugins.tui.renderer as renderer_module
    from hookfit.plugins.support.summary import summarize

    def no_screen(self):
        self._screen = self._capture = None

    def ui(self):  # what the UI thread does with the messages, once the run is over
        self._quit.wait()
        while self._inbox:
            self._dashboard.receive(*self._inbox.popleft())

    monkeypatch.setattr(renderer_module, "interactive_terminal", lambda: None)
    monkeypatch.setattr(TuiRenderer, "_start_screen", no_screen)
    monkeypatch.setattr(TuiRenderer, "_ui", ui)
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 1))
    model[0].requires_grad_(False)
    tui = TuiRenderer()
    state = hookfit.Loop(lambda l, b: None, [1, 2], model=model, run_dir=tmp_path, plugins=[tui]).fit()
    assert state.status == "completed" and not tui.active
    assert tui._dashboard.model == summarize(model)
    assert (tui._dashboard.model.parameters, tui._dashboard.model.trainable) == (241, 21)
    assert "  model: 241 params (21 trainable), 964 B" in capsys.readouterr().out.splitlines()
    tui = TuiRenderer()
    hookfit.Loop(lambda l, b: None, [1], run_dir=tmp_path, plugins=[tui]).fit()
    assert tui._dashboard.model is None  # no model: nothing to show


def headless(monkeypatch: pytest.MonkeyPatch, ui: Any = None) -> None:
    """The renderer without its screen and UI thread: ``ui`` runs in the thread's place (by default,
    the messages fed to the dashboard once the run is over)."""
    import hookfit.plugins.tui.renderer as renderer_module

    def fed(self: TuiRenderer) -> None:
        self._quit.wait()
        while self._inbox:
            self._dashboard.receive(*self._inbox.popleft())

    monkeypatch.setattr(renderer_module, "interactive_terminal", lambda: None)
    monkeypatch.setattr(TuiRenderer, "_start_screen", lambda self: setattr(self, "_screen", None))
    monkeypatch.setattr(TuiRenderer, "_ui", fed if ui is None else ui)


def test_the_best_epoch_mark_never_sits_on_a_validation_a_stop_cut_short(monkeypatch, tmp_path) -> None:
    """A real run whose last validation a stop cut short after its first batch, the easy one (the
    lowest loss of the run): the dashboard's ``*`` (``best_step``) stays on the first, whole
    validation, live and replayed from ``metrics.jsonl`` (its row says ``"stopped"``)."""
    torch = pytest.importorskip("torch")
    from conftest import StopAfter
    from hookfit.plugins.metrics import Metrics
    from hookfit.plugins.metrics_log import MetricsLog
    from hookfit.plugins.tui.replay import Follower

    headless(monkeypatch)

    def val_step(loop, batch):
        return {"loss": torch.tensor(0.1 if batch == 0 else 5.0 - loop.state.epoch)}

    tui = TuiRenderer()
    state = hookfit.Loop(lambda loop, batch: {"loss": torch.tensor(1.0)}, [1, 2], val_step=val_step,
                         val_data=[0, 1, 2], max_epochs=3, run_dir=tmp_path,
                         plugins=[Metrics(), MetricsLog(), StopAfter(8), tui]).fit()  # epoch 2's first validation batch
    assert state.status == "interrupted" and not tui.active
    live = tui._dashboard
    assert live.series[("valid", "loss")].points()[-1][1] == pytest.approx(0.1)  # drawn, as it was
    assert live.best_step("loss") == 2  # epoch 1's validation, after its 2 training batches
    replayed = Dashboard(max_epochs=3, val_every=None, on_stop=lambda: None, on_leave=lambda: None)
    Follower(tmp_path, replayed, 3).poll()
    assert replayed.best_step("loss") == 2 and replayed.series[("valid", "loss")].points()[-1][1] == pytest.approx(0.1)


# -- the captured output: output.log, the replay, the file policy, fatal errors ----------------

CAPTURE_CHILD = r"""
import faulthandler, json, os, resource, signal, sys, time, warnings
from hookfit.plugins.tui import OutputCapture

path, limit, fault = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "on"
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, as a full disk answers ENOSPC
if fault:
    faulthandler.enable()
else:
    faulthandler.disable()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    if limit:
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    capture = OutputCapture(path)
    during = faulthandler.is_enabled()
    for i in range(200):
        print(f"line {i:03d} " + "x" * 40)  # never raises, whatever the disk says
    os.write(2, b"from C, on stderr\n")
    print("no end of line yet", end="", flush=True)
    lines, deadline = [], time.monotonic() + 30
    while len(lines) < 201 and time.monotonic() < deadline:
        lines += capture.lines()
        time.sleep(0.01)
    capture.warn_failure()  # (the dashboard's UI thread does this)
    capture.restore()
    capture.warn_failure()  # once only
print()
print(json.dumps({"lines": lines, "during": during, "after": faulthandler.is_enabled(),
                  "failed": repr(capture.failed),
                  "warnings": [(w.category.__name__, str(w.message)) for w in caught]}))
"""


def capture_child(tmp_path, limit=0, fault="off"):
    import json
    import subprocess
    import sys

    tmp_path.mkdir(exist_ok=True)
    script = tmp_path / "child.py"
    script.write_text(CAPTURE_CHILD)
    path = tmp_path / "run" / "output.log"
    done = subprocess.run([sys.executable, str(script), str(path), str(limit), fault], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    return path, done.stdout, result


PRINTED = [f"line {i:03d} " + "x" * 40 for i in range(200)] + ["from C, on stderr"]


def test_what_the_run_prints_is_kept_in_output_log_and_replayed(tmp_path) -> None:
    path, stdout, result = capture_child(tmp_path)
    assert result["lines"] == PRINTED  # for the log pane
    assert path.read_text() == "\n".join(PRINTED) + "\nno end of line yet"
    replayed = stdout.splitlines()
    assert replayed[:201] == PRINTED and replayed[201] == "no end of line yet"
    assert result["warnings"] == [] and result["failed"] == "None"
    # faulthandler wrote to the terminal while the capture was up; off again afterwards
    assert (result["during"], result["after"]) == (True, False)
    _, _, result = capture_child(tmp_path / "again", fault="on")
    assert (result["during"], result["after"]) == (True, True)  # the previous setting is back


@pytest.mark.fault
def test_a_full_disk_loses_only_the_file_never_a_print(tmp_path) -> None:
    path, stdout, result = capture_child(tmp_path, limit=2000)
    assert result["lines"] == PRINTED  # the log pane
    assert stdout.splitlines()[:201] == PRINTED  # the replay: nothing lost
    written = path.read_text()
    assert 0 < len(written) <= 2000 and ("\n".join(PRINTED)).startswith(written)  # what fitted
    assert "File too large" in result["failed"]
    assert [category for category, _ in result["warnings"]] == ["FileWarning"]  # once
    message = result["warnings"][0][1]
    assert message.startswith(f"tui: could not write {path} (OSError: [Errno 27] File too large)")


# -- a debugger gets the terminal ------------------------------------------------------------

def test_a_breakpoint_without_a_debugger_gives_the_screen_back_at_once() -> None:
    """PYTHONBREAKPOINT=0 (or a hook that returns without tracing): suspended and resumed in the
    same call. With pdb, the tmux tests see the prompt and the dashboard come back."""
    events = []

    class Fake:
        def __init__(self, name):
            self.name = name

        def __getattr__(self, method):
            return lambda *a: events.append(f"{self.name}.{method}")

    tui = TuiRenderer()
    tui.active, tui._screen, tui._capture = True, Fake("screen"), Fake("capture")
    tui._go.set()
    tui._thread = None  # no UI thread to park
    tui._previous_breakpointhook = lambda *a, **k: events.append(f"hook{a}{k}") or "answer"
    assert tui._breakpointhook(1, x=2) == "answer"
    assert events == ["screen.stop", "capture.suspend", "hook(1,){'x': 2}", "capture.resume", "screen.start"]
    assert tui._go.is_set() and not tui._suspended


# -- the truth at every size; tmux reads the same in test_tui_truth.py ------------------------------

def rich() -> Dashboard:
    """A finished run with everything a screen can hold: 23 metrics (a long name, a NaN one, a
    validation-only one), checkpoints and skipped steps, the model, the time line, output."""
    d = fed()
    d.receive("model", MODEL)
    d.receive("time", {"train": hookfit.payloads.TimeSplit("train", 0.1, 2.0, 0.1, 90)})
    for i in range(20):
        d.receive("update", snap("train", 1, 91 + i, 41, 50, {f"metric_{i:02d}": (1.0, 1.0, 1.0)}))
    d.receive("update", snap("train", 1, 91, 41, 50, {"x" * 63: (0.25, 0.25, 0.25), "gone": (math.nan,) * 3}))
    d.receive("epoch", snap("valid", 1, 100, 10, 10, {"val_only": (0.75, 0.75, 0.75)}, final=True))
    for step in range(5, 100, 5):
        d.receive("checkpoint", step, "step")
    for step in range(45, 100):  # more than half of the run's 100 steps
        d.receive("skipped", step, "default", f"non-finite loss at epoch 1, batch {step - 50}")
    d.receive("end", "completed", "max_epochs=3 reached", True, None, 3.0, 100, 2)
    return d


@pytest.mark.parametrize("cols", [40, 41, 47, 55, 64, 80, 99, 120, 200])
@pytest.mark.parametrize("rows", [12, 13, 15, 16, 19, 24, 30, 50])
def test_every_size_from_40x12_holds_the_layout(cols: int, rows: int) -> None:
    d = rich()
    lines = screen(d, (cols, rows))
    text = "\n".join(lines)
    assert len(lines) == rows and all(len(line) == cols for line in lines)
    assert lines[0].rstrip().endswith("│ completed · mostly skipped") or lines[0].rstrip().endswith("…")
    assert lines[-1].startswith(" q leave") and lines[-1].rstrip().endswith("? help")  # the keys, on their line
    assert re.search(r"^ (train|valid) +\d+/\d+ ", text, re.M) and re.search(r"^ run +epoch 3/3 +completed", text, re.M)
    title = next(i for i, line in enumerate(lines) if line.startswith(" loss ━ train ━ valid"))
    assert lines[title + 1][9:11].endswith("│")  # the legend on one line: the plot follows
    axis = next(i for i, line in enumerate(lines) if "└" in line)
    assert re.search(r"step 1 … 100\b", "\n".join(lines[axis:axis + 2]))  # whole, never under a mark
    assert re.search(r"metrics · n/p more|^\d+/25 n/p", text, re.M)  # the table says what it left out
    # cut text is ellipsized: the banner, the 63-character name, the time line
    banner = [line.rstrip() for line in lines[1:3]]
    assert banner[0].endswith(("…", "(non-finite loss)", "Ctrl-C to leave", "q leaves")), banner
    assert any(line.endswith(("— q leaves", "Ctrl-C to leave")) for line in banner), banner
    assert all(re.match(r"x+…", line) for line in lines if line.startswith("xx"))
    assert all(re.search(r"(…|plugins \d+%)$", line.rstrip()) for line in lines if line.startswith(" time "))


def test_a_validation_only_metric_is_listed_and_its_legend_says_valid() -> None:
    d = fed()
    d.receive("epoch", snap("valid", 1, 100, 10, 10, {"val_only": (0.75, 0.75, 0.75)}, final=True))
    assert "val_only" in d.names
    d.selected = d.names.index("val_only")
    text = "\n".join(screen(d, (100, 30)))
    assert " val_only ━ valid · full history" in text and "━ train" not in text
    assert re.search(r"^val_only +- +- +- +0\.75", text, re.M)


def test_nan_and_inf_show_as_they_are_and_the_curve_reaches_the_last_step() -> None:
    d = fed()
    for step in range(91, 121):
        d.receive("update", snap("train", 1, step, step - 50, 50, {"loss": (math.nan, math.nan, math.nan),
                                                                  "accuracy": (math.inf, -math.inf, 0.7)}))
    text = "\n".join(screen(d, (100, 30)))
    assert re.search(r"^loss +nan +nan +nan +0\.25", text, re.M)
    assert re.search(r"^accuracy +inf +-inf +0\.7 +0\.8", text, re.M)
    assert " loss ━ train ━ valid · full history · × nan" in text
    assert re.search(r"step 1 … 120\b", text)
    top = next(line for line in text.split("\n") if line[10:11] == "│")
    assert top.rstrip().endswith("×")
    state = hookfit.State(step=120, status="completed", stop_reason="done", started_at=0, ended_at=2)
    lines = summary(d, state)
    assert any(line.split() == ["loss", "nan", "0.25"] for line in lines)
    assert "  × where loss was nan: steps 91–120" in lines


def test_the_bars_follow_the_run_counters_and_end_where_the_run_did() -> None:
    d = Dashboard(100000, None, on_stop=lambda: None, on_leave=lambda: None, max_steps=2000)
    d.receive("stage", "train", 0, 90, 0)
    d.receive("tick", "train", 0, 40, 40, 1000.0)
    d.receive("tick", "train", 0, 60, 60, 1001.0)
    assert (d.progress.batches, d.progress.rate) == (60, 20.0)
    d.receive("update", snap("train", 0, 30, 30, 90, {"loss": (1.0, 1.0, 1.0)}))  # a publication behind them
    text = "\n".join(screen(d, (100, 30)))
    assert re.search(r"^ train +60/90 20\.0 it/s ETA", text, re.M)
    assert re.search(r"^ run +step 60/2000  ETA \d\d:\d\d:\d\d", text, re.M) and "│ step 60/2000 │" in text
    d.receive("tick", "train", 22, 20, 1999, 1100.0)
    d.receive("end", "completed", "max_steps=2000 reached", True, None, 100.0, 2000, 22)
    text = "\n".join(screen(d, (100, 30)))
    assert "│ epoch 23 │ step 2000/2000 │" in text and "ETA" not in text
    assert re.search(r"^ run +step 2000/2000  completed +100 %", text, re.M)


def test_the_recent_window_is_the_last_quarter_of_a_short_run() -> None:
    """``w``'s recent window is the last quarter of the steps a curve covers (the last 300
    publications would be the whole history of any run under about 150 s)."""
    from hookfit.plugins.support.plot import Series

    series = Series()
    for step in range(101):
        series.add(float(step), 1.0 / (step + 1))
    assert series.x_range() == (0.0, 100.0)
    assert series.x_range(recent=True) == (75.0, 100.0)
    recent = series.points(recent=True)
    assert [x for x, _, _ in recent] == [float(s) for s in range(75, 101)]
    long = Series()
    for step in range(2000):
        long.add(float(step), 1.0)
    assert long.x_range(recent=True) == (1700.0, 1999.0)  # at most the last recent_size points
    assert len(long.points(recent=True)) == 300


def test_the_epoch_and_valid_columns_are_the_running_epochs_means_so_far() -> None:
    """``Value.epoch`` is the mean over the stage's batches so far: mid-epoch the ``epoch`` column
    is this epoch's, never the mean the previous epoch ended with, and ``valid`` likewise."""
    d = Dashboard(4, 1, on_stop=lambda: None, on_leave=lambda: None)
    d.receive("stage", "train", 0, 12)
    d.receive("update", snap("train", 0, 6, 6, 12, {"loss": (20.0, 21.0, 21.0)}))
    d.receive("epoch", snap("train", 0, 12, 12, 12, {"loss": (9.0, 12.0, 16.85)}, final=True), True)
    d.receive("stage_end", "train")
    d.receive("stage", "valid", 0, 4)
    d.receive("epoch", snap("valid", 0, 12, 4, 4, {"loss": (4.5, 4.5, 4.51)}, final=True), True)
    d.receive("stage_end", "valid")
    assert re.search(r"^loss +9 +12 +16\.85 +4\.51 *$", "\n".join(screen(d, (100, 30))), re.M)  # epoch 1 ended
    d.receive("stage", "train", 1, 12)  # epoch 2: nothing of it published yet, no mean of it to show
    text = "\n".join(screen(d, (100, 30)))
    assert re.search(r"^metric +train last +running +epoch +valid *$", text, re.M)
    assert re.search(r"^loss +9 +12 +- +4\.51 *$", text, re.M), text
    d.receive("update", snap("train", 1, 20, 8, 12, {"loss": (5.0197, 11.3266, 11.3266)}))  # 8 batches in
    assert re.search(r"^loss +5\.02 +11\.33 +11\.33 +4\.51 *$", "\n".join(screen(d, (100, 30))), re.M)
    d.receive("epoch", snap("train", 1, 24, 12, 12, {"loss": (3.0, 8.0, 9.5)}, final=True), True)
    d.receive("stage_end", "train")
    d.receive("stage", "valid", 1, 4)
    d.receive("update", snap("valid", 1, 24, 2, 4, {"loss": (3.0, 3.0, 3.25)}))  # a validation half done
    assert re.search(r"^loss +3 +8 +9\.5 +3\.25 *$", "\n".join(screen(d, (100, 30))), re.M)
    state = hookfit.State(step=24, status="completed", stop_reason="done", started_at=0, ended_at=2)
    d.receive("epoch", snap("valid", 1, 24, 4, 4, {"loss": (3.0, 3.0, 3.5)}, final=True), True)
    assert any(line.split() == ["loss", "9.5", "3.5"] for line in summary(d, state))  # the summary: the last epoch


def test_several_validation_sets_count_their_batches_in_the_bars(monkeypatch, tmp_path) -> None:
    """A real run with two validation sets (2 and 1 batches): the validation bar counts the
    batches of both, 3, and the run's bar stays under 100 % until the last of them. Read after
    every validation batch, as the UI thread reads the messages and the counters."""
    torch = pytest.importorskip("torch")
    from hookfit import hookimpl
    from hookfit.plugins.metrics import Metrics

    headless(monkeypatch, ui=lambda self: None)
    tui, seen = TuiRenderer(), []

    class Reader:  # the UI thread's reading, on the training thread: one frame a validation batch
        @hookimpl
        def batch_end(self, loop) -> None:
            state, d = loop.state, tui._dashboard
            if state.stage == "valid":
                while tui._inbox:
                    d.receive(*tui._inbox.popleft())
                d.receive("tick", state.stage, state.epoch, state.batch_idx, state.step, 0.0)
                seen.append((d.stage_label().split()[1], round(d.run_fraction(), 3)))

    state = hookfit.Loop(lambda loop, b: {"loss": torch.tensor(1.0)}, [1, 2, 3, 4],
                         val_step=lambda loop, b: {"acc": torch.tensor(0.5)},
                         val_data={"clean": [1, 2], "noisy": [3]}, max_epochs=1, run_dir=tmp_path,
                         plugins=[Metrics(), tui, Reader()]).fit()
    assert state.status == "completed"
    assert [label for label, _ in seen] == ["0/3", "1/3", "2/3"]  # (batch_idx: the batch in progress)
    fractions = [fraction for _, fraction in seen]
    assert fractions == sorted(set(fractions)) and fractions[-1] < 1.0  # a batch still to go: not 100 %


def test_a_resumed_runs_dashboard_draws_the_history_it_continues(monkeypatch, tmp_path) -> None:
    """A real run stopped in its second epoch, resumed (``resume="latest"``) with the dashboard:
    its curves start where the run began, as ``hookfit show`` of the folder draws them, not at the
    resume step; the earlier fit's end is not the resumed run's, nor its resume line a second resume."""
    torch = pytest.importorskip("torch")
    from conftest import StopAfter
    from hookfit.plugins.checkpoint import Checkpoint
    from hookfit.plugins.metrics import Metrics
    from hookfit.plugins.metrics_log import MetricsLog
    from hookfit.plugins.tui.replay import Follower, earlier

    headless(monkeypatch)

    def fit(*plugins, resume=None):
        return hookfit.Loop(lambda loop, b: {"loss": torch.tensor(10.0 - loop.state.step)}, [1, 2, 3],
                            val_step=lambda loop, b: {"loss": torch.tensor(5.0 - loop.state.epoch)}, val_data=[0],
                            model=torch.nn.Linear(1, 1), max_epochs=3, run_dir=tmp_path, resume=resume,
                            plugins=[Metrics(interval=0), MetricsLog(every_n_steps=1), Checkpoint(background=False),
                                     *plugins]).fit()

    assert fit(StopAfter(6)).status == "interrupted"  # epoch 1 and its validation, 2 batches of epoch 2
    tui = TuiRenderer()
    state = fit(tui, resume="latest")
    assert state.status == "completed" and state.resumed_from.step < 6
    live = tui._dashboard
    replayed = Dashboard(max_epochs=3, val_every=None, on_stop=lambda: None, on_leave=lambda: None)
    Follower(tmp_path, replayed, 3).poll()
    assert live.series[("valid", "loss")].points() == replayed.series[("valid", "loss")].points()
    assert [x for x, _, _ in live.series[("valid", "loss")].points()] == [3.0, 6.0, 9.0]
    assert live.series[("train", "loss")].points()[0][0] == replayed.series[("train", "loss")].points()[0][0] <= 3.0
    assert [step for step, mark in live.marks if mark == "R"] == [state.resumed_from.step]  # this resume, once
    assert live.status == "completed" and "completed" in screen(live, (100, 30))[0]
    # the history (a row every step: a stage message each) leaves no stage open: the epoch's validation,
    # once over, is not taken for one nested in its training, whose bar would come back
    again = Dashboard(max_epochs=3, val_every=None, on_stop=lambda: None, on_leave=lambda: None)
    for message in [*earlier(tmp_path, state.resumed_from, 3), ("resumed", state.resumed_from),
                    ("stage", "train", 1, 3, 2), ("stage_end", "train"), ("stage", "valid", 1, 1, 0),
                    ("stage_end", "valid")]:
        again.receive(*message)
    assert again.stage_label().startswith(" valid 0/1"), again.stage_label()
