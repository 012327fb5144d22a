"""The dashboard while a debugger has the terminal: :class:`Debugging`, the part of
:class:`~hookfit.plugins.tui.renderer.TuiRenderer` that ``breakpoint()`` reaches. The UI
thread parks, the screen stops, descriptors 1 and 2 and ``warnings.showwarning`` go back to the
terminal before the previous hook (pdb) runs; the dashboard comes back once the debugger lets
go of the thread that called it."""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    import urwid

    from hookfit.plugins.tui.terminal import OutputCapture
    from hookfit.plugins.tui.warned import WarningLog

__all__ = ["Debugging"]


class Debugging:
    """``sys.breakpointhook`` while the dashboard is up, and the suspension and return of the
    dashboard around a debugger (a part of the renderer's class)."""

    # the renderer's, read and set here
    active: bool
    warned: WarningLog
    _screen: urwid.display.raw.Screen | None
    _capture: OutputCapture | None
    _thread: threading.Thread | None
    _go: threading.Event
    _parked: threading.Event
    _suspended: bool
    _debugger: Any
    _debug_thread: int | None
    _previous_breakpointhook: Any

    def _breakpointhook(self, *args: Any, **kwargs: Any) -> Any:
        """``sys.breakpointhook`` while the dashboard is up: the terminal and descriptors 1 and
        2 are given back before the previous hook (pdb, by default) runs; the dashboard comes
        back once the debugger lets go (at the next publication of metrics, the next stage or
        the end of the run) or at once if no debugger took over."""
        previous = self._previous_breakpointhook or sys.__breakpointhook__
        if not self.active or self._suspended:
            return previous(*args, **kwargs)
        tracer = sys.gettrace()
        self._suspend()
        frame = sys._getframe()
        try:
            # On one line, so that no line event of this frame reaches a debugger that starts
            # tracing in previous() (pdb stops at the next line event): untraced from there on,
            # this frame calls no Python function while it is attached, and the debugger stops
            # at the line after breakpoint() in the caller, as without a dashboard.
            result = previous(*args, **kwargs); attached = sys.gettrace() is not tracer; frame.f_trace = None if attached else frame.f_trace  # noqa: E501,E702
        except BaseException:
            self._resume()
            raise
        del frame
        if not attached:  # no debugger is tracing (PYTHONBREAKPOINT=0, or one that is done)
            self._resume()
            return result
        self._debugger = sys.gettrace()  # (C calls and attributes only: nothing to step into)
        self._debug_thread = threading.get_ident()
        return result

    def _suspend(self) -> None:
        """Park the UI thread (it must not read the keys the debugger reads), stop the screen
        and give the descriptors back."""
        self._parked.clear()
        self._go.clear()
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._parked.wait(timeout=2.0)  # a tick of get_input() and a frame at most
        self._suspended = True
        self.warned.remove()  # the debugger's terminal shows them as usual
        if self._screen is not None:
            self._screen.stop()
        if self._capture is not None:
            self._capture.suspend()

    def _resume_if_let_go(self) -> None:
        """On the thread that hit the breakpoint: back to the dashboard once the debugger no
        longer traces it (``continue`` in pdb)."""
        if self._debug_thread == threading.get_ident() and sys.gettrace() is not self._debugger:
            self._resume()

    def _resume(self) -> None:
        if not self._suspended:
            return
        self._debugger = self._debug_thread = None
        if self._capture is not None:
            self._capture.resume()
        if self._screen is not None:
            self._screen.start()
        self.warned.install()
        self._suspended = False
        self._go.set()  # the UI thread redraws the whole screen
