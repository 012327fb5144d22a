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
