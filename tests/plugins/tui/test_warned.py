"""WarningLog: the dashboard's keeper of warnings, without a terminal."""

from __future__ import annotations

import io
import warnings

import pytest

import hookfit.plugins.support as support
from hookfit.plugins.tui.warned import KEPT, WarningLog


def test_warnings_are_kept_and_delivered_as_one_line_and_the_previous_function_comes_back() -> None:
    delivered: list[list[str]] = []
    log = WarningLog(delivered.append)
    before = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        log.install()
        try:
            warnings.warn("two\nlines", RuntimeWarning)
            # a warning whose location is hookfit's own code names the module instead
            warnings.warn_explicit("optim: said by a plugin", UserWarning, support.__file__, 1)
        finally:
            log.remove()
        assert warnings.showwarning is before
    assert log.kept[0].startswith("RuntimeWarning: two lines (test_warned.py:")
    assert log.kept[1] == "UserWarning: optim: said by a plugin (from hookfit.plugins.support)"
    assert delivered == [[f"warning: {text}"] for text in log.kept]
    assert log.lines() == [f"warning: {text}" for text in log.kept]


def test_a_warning_written_to_a_file_of_its_own_goes_there_unchanged() -> None:
    log = WarningLog(lambda lines: None)
    written: list[tuple[object, ...]] = []

    def previous(*args: object) -> None:
        written.append(args)

    with warnings.catch_warnings():
        warnings.showwarning = previous
        log.install()
        file = io.StringIO()
        warnings.showwarning("to a file", UserWarning, "x.py", 3, file)
        log.remove()
        assert warnings.showwarning is previous
    assert written == [("to a file", UserWarning, "x.py", 3, file, None)] and log.kept == []


@pytest.mark.slow
def test_a_replacement_installed_after_ours_stays_and_the_count_is_bounded() -> None:
    log = WarningLog(lambda lines: None)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        log.install()
        for i in range(KEPT + 3):
            warnings.warn(f"number {i}")
        theirs = warnings.showwarning = lambda *args, **kwargs: None
        log.remove()
        assert warnings.showwarning is theirs
    assert len(log.kept) == KEPT and log.lines()[-1] == "warning: … and 3 more"


def test_called_after_removal_it_writes_as_python_would(capsys: pytest.CaptureFixture[str]) -> None:
    log = WarningLog(lambda lines: None)
    with warnings.catch_warnings():
        before = warnings.showwarning
        log.install()
        with warnings.catch_warnings():  # entered while it is installed: saves it, and puts it back on leaving
            log.remove()
        assert warnings.showwarning is not before  # ours, stale: what catch_warnings put back
        warnings.simplefilter("always")
        warnings.warn("after the run")
    assert "UserWarning: after the run" in capsys.readouterr().err and log.kept == []


def test_a_warning_the_dashboard_keeps_off_the_terminal_is_recorded_in_the_run_folder(monkeypatch, tmp_path) -> None:
    """A real run with the dashboard's screen and UI thread left out: its WarningLog takes the
    warnings over, and run.jsonl still records them."""
    pytest.importorskip("urwid")
    import json

    import hookfit
    import hookfit.plugins.tui.renderer as renderer_module
    from hookfit.plugins.tui import TuiRenderer

    monkeypatch.setattr(renderer_module, "interactive_terminal", lambda: None)
    monkeypatch.setattr(TuiRenderer, "_start_screen", lambda self: setattr(self, "_screen", None))
    monkeypatch.setattr(TuiRenderer, "_ui", lambda self: self._quit.wait())

    def step(loop, batch) -> None:
        warnings.warn(f"THE STEP WARNS AT STEP {loop.state.step}", UserWarning)

    tui = TuiRenderer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = hookfit.Loop(step, [1, 2], run_dir=tmp_path, plugins=[tui]).fit()
    assert state.status == "completed" and not tui.active
    assert caught == []  # the dashboard kept them off the terminal
    assert [text.split(" (")[0] for text in tui.warned.kept] == [f"UserWarning: THE STEP WARNS AT STEP {n}" for n in (0, 1)]
    lines = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [(line["event"], line.get("message")) for line in lines] == [
        ("run", None), ("warning", "THE STEP WARNS AT STEP 0"), ("warning", "THE STEP WARNS AT STEP 1"), ("end", None)]
