"""tui: a live training dashboard in the terminal, drawn with urwid, optionally persistent.

Panels: a metrics table (train last / running / epoch mean, valid), a Braille plot of any
metric over steps with train and valid series (full history or a recent window, downsampled by
min/max per bucket), progress of the stage and of the run with rate and ETA (validation time
included), a log pane with whatever the run printed, a status line and the keys. ``q`` asks
for a graceful stop with ``loop.request_stop``, which the core honours whatever other plugins
are installed; the dashboard knows no other plugin.

How it stays out of training's way: the training thread only appends the snapshots the metrics
plugin publishes (a few per second) to a queue; a daemon UI thread drains it, reads keys, follows
resizes and redraws when something changed, at most ``fps`` times a second, and otherwise once a
second for the clock (a frame costs about 5 ms of Python at 120x40, time the training thread
waits for the interpreter lock: five frames a second would take 2.5 % of it). urwid's screen is started and stopped on the
main thread, which also owns the signal handlers (urwid's own SIGWINCH/SIGTSTP handling is not
installed: the UI thread polls the size, and Ctrl-Z is ignored while the dashboard is up).

Output: file descriptors 1 and 2 are redirected to a temporary file while the dashboard is up,
so ``print``, logging, warnings and C libraries cannot scribble over it; the lines show in the
log pane and everything is written back to the terminal once it is restored.

Persistent mode (``TuiRenderer(persistent=True)`` or ``HOOKFIT_TUI_PERSISTENT=1``): when the run
ends, however it ends, the final dashboard stays with a banner until ``q``, Esc or Ctrl-C. In
both modes a plain-text summary (metrics table and curves) is printed to the normal terminal
after it is restored, so the result stays in the scrollback.

It starts only on an interactive terminal: stdin and stdout are TTYs, ``TERM`` is set and not
``dumb``, ``CI`` and ``HOOKFIT_NO_TUI`` are unset, the process is in the terminal's foreground
process group and ``fit()`` runs on the main thread. Otherwise it steps aside and the console
renderer prints instead (through the ``claim_output`` event). If the process is killed with
SIGKILL no code can run to restore the terminal: ``reset`` (or ``stty sane``) fixes it.
"""

from __future__ import annotations

import atexit
import collections
import importlib.util
import os
import signal
import sys
import tempfile
import threading
import time
import warnings
from typing import Any

from hookfit import HookfitWarning, StopRequest, hookimpl

ENV_PERSISTENT = "HOOKFIT_TUI_PERSISTENT"
ENV_OFF = "HOOKFIT_NO_TUI"


def interactive_terminal() -> str | None:
    """``None`` when a dashboard can run here, else the reason it cannot."""
    if os.environ.get(ENV_OFF):
        return f"{ENV_OFF} is set"
    if os.environ.get("CI"):
        return "CI is set"
    term = os.environ.get("TERM", "")
    if not term or term == "dumb":
        return f"TERM is {term or 'unset'}"
    for name, stream in (("stdin", sys.stdin), ("stdout", sys.stdout)):
        try:
            if stream is None or not stream.isatty():
                return f"{name} is not a terminal"
        except (AttributeError, ValueError):
            return f"{name} is not a terminal"
    try:
        if os.tcgetpgrp(sys.stdout.fileno()) != os.getpgrp():
            return "the process runs in the background"
    except OSError:
        return "the terminal's process group is unknown"
    if threading.current_thread() is not threading.main_thread():
        return "fit() does not run on the main thread"
    if importlib.util.find_spec("urwid") is None:
        return "urwid is not installed (pip install 'hookfit[tui]')"
    return None


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
        self._saved_fds: tuple[int, int] | None = None
        self._capture: Any = None
        self._screen_out: Any = None
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

        sys.stdout.flush()
        sys.stderr.flush()
        self._saved_fds = (os.dup(1), os.dup(2))
        self._screen_out = os.fdopen(os.dup(self._saved_fds[0]), "w", encoding="utf-8", errors="replace")
        self._capture = tempfile.TemporaryFile()
        os.dup2(self._capture.fileno(), 1)
        os.dup2(self._capture.fileno(), 2)
        class Screen(urwid.display.raw.Screen):
            """urwid's screen without its SIGWINCH/SIGTSTP handlers: the UI thread polls the size,
            Ctrl-Z is ignored while the dashboard is up, and urwid's suspend path (which stops the
            screen from the input thread) can never run."""

            def signal_init(self) -> None:
                pass

            def signal_restore(self) -> None:
                pass

        screen = Screen(input=sys.stdin, output=self._screen_out, bracketed_paste_mode=False, focus_reporting=False)
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
        screen, dashboard = self._screen, self._dashboard
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
                read, lines = self._captured_lines(read)
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

    def _captured_lines(self, offset: int) -> tuple[int, list[str]]:
        data = os.pread(self._capture.fileno(), 65536, offset)
        if not data:
            return offset, []
        end = data.rfind(b"\n") + 1
        if end == 0 and len(data) < 65536:
            return offset, []
        end = end or len(data)
        text = data[:end].decode("utf-8", errors="replace")
        return offset + end, [line for line in text.splitlines() if line.strip()]

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
            if self._saved_fds is not None:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(self._saved_fds[0], 1)
                os.dup2(self._saved_fds[1], 2)
                for fd in self._saved_fds:
                    os.close(fd)
                self._saved_fds = None
            if self._screen_out is not None:
                self._screen_out.close()
                self._screen_out = None
            if self._capture is not None:
                self._capture.seek(0)
                captured = self._capture.read()
                self._capture.close()
                self._capture = None
                if captured:
                    os.write(1, captured)


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
