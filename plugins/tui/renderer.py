"""The dashboard's renderer: the ``tui`` plugin (:class:`TuiRenderer`) and the plain-text
summary printed after it; see :mod:`hookfit.plugins.tui` for what it shows and how it stays out
of training's way."""

from __future__ import annotations

import atexit
import collections
import os
import signal
import sys
import threading
import time
import warnings
from typing import Any

from hookfit import HookfitWarning, StopRequest, hookimpl
from hookfit.plugins.tui.terminal import OutputCapture, interactive_terminal

ENV_PERSISTENT = "HOOKFIT_TUI_PERSISTENT"


class TuiRenderer:
    """The urwid dashboard. ``persistent`` keeps the final screen until the user leaves."""

    name = "tui"
    observer = True  # a renderer: its failures switch it off, never the run

    def __init__(self, persistent: bool | None = None, fps: float = 5.0) -> None:
        self.persistent = persistent
        self.fps = fps
        self.active = False
        self.loop: Any = None
        self._inbox: collections.deque = collections.deque()
        self._quit = threading.Event()
        self._thread: threading.Thread | None = None
        self._screen: Any = None
        self._dashboard: Any = None
        self._capture: OutputCapture | None = None
        self._saved_signals: dict[int, Any] = {}
        self._ui_error: BaseException | None = None
        self._failed = False
        self._ended_by: int | None = None  # a termination signal that ended the hold

    # -- who prints ---------------------------------------------------------------------------
    @hookimpl
    def claim_output(self, loop: Any) -> str | None:
        if self.active or (not self._failed and interactive_terminal() is None):
            return self.name
        return None

    # -- start --------------------------------------------------------------------------------
    @hookimpl(tryfirst=True)
    def fit_start(self, loop: Any) -> None:
        self.loop = loop
        self._failed = False
        if interactive_terminal() is not None:
            return
        from hookfit.plugins.tui.dashboard import Dashboard  # urwid is imported only from here

        persistent = self.persistent
        if persistent is None:
            persistent = os.environ.get(ENV_PERSISTENT, "") not in ("", "0", "false", "no")
        self.persistent = persistent
        self._inbox.clear()
        self._quit.clear()
        self._ui_error = None
        self._dashboard = Dashboard(
            loop.max_epochs,
            loop.val_every_n_epochs if loop.val_step is not None else None,
            on_stop=lambda: loop.request_stop("q pressed in the dashboard"),
            on_leave=self._quit.set,
        )
        self.active = True
        atexit.register(self._restore)
        try:
            self._start_screen()
        except Exception as exc:  # a renderer that cannot start is switched off, not fatal
            self._restore()
            self._failed = True
            warnings.warn(f"tui: the dashboard could not start and is switched off "
                          f"({type(exc).__name__}: {exc}); the console prints instead",
                          HookfitWarning, stacklevel=2)
            return
        self._thread = threading.Thread(target=self._ui, name="hookfit-tui", daemon=True)
        self._thread.start()

    def _start_screen(self) -> None:
        import urwid

        from hookfit.plugins.tui.dashboard import PALETTE

        self._capture = capture = OutputCapture()

        class Screen(urwid.display.raw.Screen):
            """urwid's screen without its SIGWINCH/SIGTSTP handlers: the UI thread polls the size,
            Ctrl-Z is ignored while the dashboard is up, and urwid's suspend path (which stops the
            screen from the input thread) can never run."""

            def signal_init(self) -> None:
                pass

            def signal_restore(self) -> None:
                pass

        screen = Screen(input=sys.stdin, output=capture.terminal, bracketed_paste_mode=False, focus_reporting=False)
        screen.register_palette(PALETTE)
        screen.set_input_timeouts(max_wait=1.0 / self.fps)
        for signum in (signal.SIGTSTP, signal.SIGTTOU, signal.SIGTTIN):
            self._saved_signals[signum] = signal.signal(signum, signal.SIG_IGN)
        for signum in (signal.SIGTERM, signal.SIGHUP):
            # A plugin that stops gracefully (the interrupter) installs its handler over this one
            # at its own fit_start; without one, the terminal is restored before the process ends.
            self._saved_signals[signum] = signal.signal(signum, self._terminate)
        screen.start()
        self._screen = screen

    # -- the training thread hands over, in O(1) -----------------------------------------------
    @hookimpl
    def stage_start(self, loop: Any, stage: str) -> None:
        if self.active:
            data = loop.train_data if stage == "train" else loop.val_data
            self._inbox.append(("stage", stage, loop.state.epoch, len(data) if hasattr(data, "__len__") else None))

    @hookimpl
    def metrics_update(self, metrics: Any) -> None:
        if self.active:
            self._inbox.append(("update", metrics))

    @hookimpl
    def epoch_metrics(self, metrics: Any) -> None:
        if self.active:
            self._inbox.append(("epoch", metrics))

    @hookimpl
    def stop_requested(self, request: StopRequest) -> None:
        if self.active:
            self._inbox.append(("stopping", request.reason))

    # -- the UI thread ------------------------------------------------------------------------
    def _ui(self) -> None:
        screen, dashboard, capture = self._screen, self._dashboard, self._capture
        size = None
        last_draw = 0.0
        read = 0
        idle = 0
        try:
            while not self._quit.is_set():
                keys = screen.get_input()
                idle = 0 if keys else idle + 1
                if idle >= 2:
                    # get_input() without an event loop never resolves a lone Esc (it waits for
                    # the rest of an escape sequence forever); after a whole idle tick, take
                    # whatever is pending as complete.
                    keys, _ = screen.parse_input(None, None, screen.get_available_raw_input(), wait_for_more=False)
                dirty = False
                for key in keys:
                    if isinstance(key, str):
                        dashboard.keypress(key)
                        dirty = True
                while self._inbox:
                    dashboard.receive(*self._inbox.popleft())
                    dirty = True
                read, lines = capture.lines(read)
                if lines:
                    dashboard.receive("log", lines)
                current = screen.get_cols_rows()
                if current != size:
                    size = current
                    screen.clear()
                    dirty = True
                now = time.monotonic()
                if dirty or now - last_draw >= 1.0:  # the clock shows whole seconds
                    screen.draw_screen(size, dashboard.render(size))
                    last_draw = now
        except BaseException as exc:  # an observer: the run goes on without it
            self._ui_error = exc
            self._quit.set()

    # -- end ----------------------------------------------------------------------------------
    @hookimpl(trylast=True)
    def fit_end(self, loop: Any) -> None:
        if not self.active:
            return
        state = loop.state
        hold = bool(self.persistent) and self._ui_error is None
        self._inbox.append(("end", state.status, state.stop_reason, hold, state.stopped_by))
        try:
            if hold:
                self._hold()
        finally:
            self._quit.set()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._restore()
        if self._ui_error is not None:
            warnings.warn(f"tui: the dashboard failed and was closed: {type(self._ui_error).__name__}: "
                          f"{self._ui_error}", HookfitWarning, stacklevel=2)
        print("\n".join(summary(self._dashboard, state)), flush=True)
        if self._ended_by is not None:  # terminate as asked, now that the terminal is back
            signum, self._ended_by = self._ended_by, None
            signal.raise_signal(signum)

    def _hold(self) -> None:
        """Keep the final screen until q, Esc or Ctrl-C; SIGTERM and SIGHUP also end the hold,
        so the terminal is restored before the process goes."""
        def leave(signum: int, frame: Any) -> None:
            if signum != signal.SIGINT:
                self._ended_by = signum
            self._quit.set()

        previous = {sig: signal.signal(sig, leave) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            while not self._quit.wait(0.1):
                pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _terminate(self, signum: int, frame: Any) -> None:
        """A termination signal with no graceful handler installed: restore, then go as asked."""
        previous = self._saved_signals.get(signum, signal.SIG_DFL)
        self._quit.set()
        self._restore()
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.raise_signal(signum)  # _restore put the previous (default) disposition back

    def _restore(self) -> None:
        """Put the terminal back as it was and replay what the run printed. Idempotent."""
        if not self.active:
            return
        self.active = False
        atexit.unregister(self._restore)
        try:
            if self._screen is not None:
                self._screen.stop()
                self._screen = None
        finally:
            for signum, handler in self._saved_signals.items():
                signal.signal(signum, handler)
            self._saved_signals.clear()
            if self._capture is not None:
                self._capture.restore()
                self._capture = None


def summary(dashboard: Any, state: Any) -> list[str]:
    """The plain-text record printed after the dashboard closes: status, table and curves."""
    from hookfit.plugins.tui.dashboard import _fmt
    from hookfit.plugins.tui.plot import text_plot

    asked = f"; stop asked by {state.stopped_by}" if state.stopped_by else ""
    lines = [f"hookfit: training {state.status} ({state.stop_reason}) after {state.elapsed:.1f}s, "
             f"{state.step} steps{asked}"]
    if dashboard is None or not dashboard.names:
        return lines
    width = max(len(n) for n in dashboard.names)
    lines.append(f"  {'metric':<{width}}  {'train':>10}  {'valid':>10}")
    for name in dashboard.names:
        row = dashboard.table.get(name, {})
        train = row.get("train_final", row.get("train_epoch"))
        valid = row.get("valid_final", row.get("valid_epoch"))
        lines.append(f"  {name:<{width}}  {_fmt(train):>10}  {_fmt(valid):>10}")
    for name in dashboard.names:
        if "loss" not in name:
            continue
        groups = {s: dashboard.series[(s, name)].points() for s in ("train", "valid") if (s, name) in dashboard.series}
        plot = text_plot(groups, width=60, height=8)
        if plot:
            lines.append(f"  {name} over steps ({' and '.join(groups)}):")
            lines.extend("  " + line for line in plot)
    return lines
