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
from types import FrameType
from typing import TYPE_CHECKING, Any

from hookfit import HookfitWarning, StopRequest, hookimpl
from hookfit.config import records_options
from hookfit.data import stage_length
from hookfit.errors import user_level
from hookfit.files import FileWarning
from hookfit.loop import end_with
from hookfit.payloads import MetricsSnapshot, ResumeInfo
from hookfit.plugins.support import flag, positive_number, skips
from hookfit.plugins.tui import hookspecs
from hookfit.plugins.tui.debugging import Debugging
from hookfit.plugins.tui.replay import earlier
from hookfit.plugins.tui.terminal import (ENV_OFF, NO_URWID, OUTPUT_LOG, UNDER_TORCHRUN, OutputCapture,
                                          interactive_terminal, output_file, without_terminal)
from hookfit.plugins.tui.text import summary, terminal_width
from hookfit.plugins.tui.warned import WarningLog

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    import argparse
    from pathlib import Path

    import urwid

    from hookfit.plugins.tui.dashboard import Dashboard
    from hookfit.run import Run

ENV_PERSISTENT = "HOOKFIT_TUI_PERSISTENT"
PROGRESS_EVERY = 0.5
"""Seconds between frames drawn for the progress bars alone (the batches counted on)."""

__all__ = ["ENV_PERSISTENT", "OUTPUT_LOG", "TuiRenderer", "summary"]


@records_options
class TuiRenderer(Debugging):
    """The urwid dashboard. ``persistent`` keeps the final screen until the user leaves."""

    name = "tui"
    observer = True  # a renderer: its failures switch it off, never the run
    hookspecs = hookspecs  # the events it declares, added to every run (core/hooks.md)
    inert = without_terminal  # merely discovered, it leaves a run no terminal shows (hookfit.discovery.inert)

    def __init__(self, persistent: bool | None = None, fps: float = 5.0) -> None:
        self.persistent = flag(self.name, "persistent", persistent, none=True)
        self.fps = positive_number(self.name, "fps", fps, meaning="frames a second")
        self.active = False
        self.loop: Run | None = None
        self._inbox: collections.deque[tuple[Any, ...]] = collections.deque()  # (message, *its arguments)
        self._quit = threading.Event()
        self._thread: threading.Thread | None = None
        self._screen: urwid.display.raw.Screen | None = None
        self._dashboard: Dashboard | None = None
        self._capture: OutputCapture | None = None
        self.warned = WarningLog(self._logged)
        """The run's warnings while the dashboard was up: its log pane showed them, the summary lists them."""
        self._saved_signals: dict[int, Any] = {}
        self._ui_error: BaseException | None = None
        self._failed = False
        self._ended_by: int | None = None  # a termination signal that ended the hold
        self.output: Path | None = None
        """The file that keeps what the run printed while the dashboard was up, or ``None``."""
        # a debugger has the terminal: the UI thread is parked, the screen stopped
        self._go = threading.Event()  # cleared: the UI thread parks at the top of its loop
        self._parked = threading.Event()
        self._suspended = False
        self._debugger: Any = None  # the trace function of the debugger that has the terminal
        self._debug_thread: int | None = None
        self._previous_breakpointhook: Any = None

    # -- who prints ---------------------------------------------------------------------------
    @hookimpl
    def add_commands(self, commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
        """``hookfit show`` and ``hookfit compare`` (:mod:`hookfit.plugins.tui.replay`)."""
        from hookfit.plugins.tui.replay import add_commands

        add_commands(commands)

    @hookimpl
    def claim_output(self, loop: Run) -> str | None:
        if self.active or (not self._failed and interactive_terminal() is None):
            return self.name
        return None

    # -- start --------------------------------------------------------------------------------
    @hookimpl(tryfirst=True)
    def fit_start(self, loop: Run) -> None:
        self.loop = loop
        self._failed = False
        reason = interactive_terminal()
        asked = (info := loop.pm.infos.get(self.name)) is not None and info.source == "given"
        # said where there is a terminal and no way to draw on it, or where the script gave the dashboard
        # (a notebook, output piped) without switching it off for this run (the variable, CI); an options
        # table in hookfit.toml only configures it
        if loop.is_main and (reason in (NO_URWID, UNDER_TORCHRUN) or asked and reason is not None
                             and not reason.startswith((ENV_OFF, "CI "))):
            warnings.warn(f"tui: no dashboard: {reason}; the console prints instead ({ENV_OFF}=1 leaves the "
                          f"dashboard out without this warning)", HookfitWarning, stacklevel=user_level())
        if reason is not None:
            return
        from hookfit.plugins.tui.dashboard import Dashboard  # urwid is imported only from here

        persistent = self.persistent
        if persistent is None:
            persistent = os.environ.get(ENV_PERSISTENT, "") not in ("", "0", "false", "no")
        self.persistent = persistent
        self._inbox.clear()
        self._quit.clear()
        self._go.set()
        self._parked.clear()
        self._suspended = False
        self._ui_error = None
        self.output = output_file(loop, self.name)
        self._dashboard = Dashboard(
            loop.max_epochs,
            loop.val_every_n_epochs if loop.val_step is not None else None,
            on_stop=lambda: loop.request_stop("q pressed in the dashboard"),
            on_leave=self._quit.set,
            max_steps=loop.max_steps,
        )
        self._dashboard.evaluation = loop.mode != "fit"  # Loop.validate(): "evaluation completed", no steps
        self._inbox.append(("attempted", skips.attempted(loop.optimizers), True))  # the run's steps count from here
        if loop.model is not None:
            from hookfit.plugins.support.summary import summarize  # imports torch, which a run has loaded

            self._inbox.append(("model", summarize(loop.model)))
        self.active = True
        atexit.register(self._restore)
        try:
            self._start_screen()
        except Exception as exc:  # a renderer that cannot start is switched off, not fatal
            self._restore()
            self._failed = True
            self.output = None
            warnings.warn(f"tui: the dashboard could not start and is switched off "
                          f"({type(exc).__name__}: {exc}); the console prints instead",
                          HookfitWarning, stacklevel=user_level())
            return
        self.warned = WarningLog(self._logged)
        self.warned.install()  # removed by _restore, in every outcome
        self._thread = threading.Thread(target=self._ui, name="hookfit-tui", daemon=True)
        self._thread.start()
        self._previous_breakpointhook = sys.breakpointhook
        sys.breakpointhook = self._breakpointhook

    def _start_screen(self) -> None:
        import urwid

        from hookfit.plugins.tui.dashboard import PALETTE

        self._capture = capture = OutputCapture(self.output, owner=self.name)

        class Screen(urwid.display.raw.Screen):
            """urwid's screen without its SIGWINCH/SIGTSTP handlers: the UI thread polls the size,
            Ctrl-Z is ignored while the dashboard is up, and urwid's suspend path (which stops the
            screen from the input thread) can never run."""

            def signal_init(self) -> None:
                pass

            def signal_restore(self) -> None:
                pass

        terminal = capture.terminal
        assert terminal is not None  # open until the capture is restored
        screen = Screen(input=sys.stdin, output=terminal, bracketed_paste_mode=False, focus_reporting=False)
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
    def _logged(self, lines: list[str]) -> None:
        """Lines for the log pane (the warnings of :class:`WarningLog`), from any thread."""
        self._inbox.append(("log", lines))

    @hookimpl
    def resumed(self, info: ResumeInfo) -> None:
        if self.active:
            loop = self.loop  # a fit that continues its folder's records: the curves start where they began
            if loop is not None and loop.mode == "fit" and loop.state.continues and loop.state.run_dir is not None:
                self._inbox.extend(earlier(loop.state.run_dir, info, loop.max_epochs))  # (read once)
            self._inbox.append(("resumed", info, str(info.source)))
            if loop is not None:  # the steps counted before the run resumed are not its own
                self._inbox.append(("attempted", skips.attempted(loop.optimizers), True))

    @hookimpl
    def step_skipped(self, optimizer: str, reason: str, step: int) -> None:
        if self.active:
            self._inbox.append(("skipped", step, optimizer, reason))

    @hookimpl
    def checkpoint_saved(self, path: str, reason: str, step: int) -> None:
        if self.active:
            self._inbox.append(("checkpoint", step, reason, path))

    @hookimpl
    def stage_start(self, loop: Run, stage: str) -> None:
        if self.active:
            if self._suspended:
                self._resume_if_let_go()
            data = loop.train_data if stage == "train" else loop.val_data
            state = loop.state  # (batch_idx: the stage's first batch, later than 0 in a resumed epoch)
            self._inbox.append(("stage", stage, state.epoch, stage_length(data), state.batch_idx))

    @hookimpl
    def stage_end(self, stage: str) -> None:
        if self.active:
            self._inbox.append(("stage_end", stage))

    @hookimpl
    def metrics_update(self, loop: Run, metrics: MetricsSnapshot) -> None:
        if self.active:
            if self._suspended:
                self._resume_if_let_go()
            self._inbox.append(("update", metrics))
            self._inbox.append(("time", loop.state.time_split))  # an immutable mapping

    @hookimpl
    def epoch_metrics(self, loop: Run, metrics: MetricsSnapshot) -> None:
        if self.active:
            if self._suspended:
                self._resume_if_let_go()
            self._inbox.append(("epoch", metrics, loop.state.status != "interrupted"))
            self._inbox.append(("time", loop.state.time_split))

    @hookimpl
    def stop_requested(self, request: StopRequest) -> None:
        if self.active:
            self._inbox.append(("stopping", request.reason))

    # -- the UI thread ------------------------------------------------------------------------
    def _ui(self) -> None:
        screen, dashboard, capture, loop = self._screen, self._dashboard, self._capture, self.loop
        size, last_draw, idle, moved = None, 0.0, 0, False
        counters: tuple[Any, ...] = ()
        try:
            assert screen is not None and dashboard is not None and capture is not None  # set before this thread
            assert loop is not None
            while not self._quit.is_set():
                if not self._go.is_set():  # a debugger has the terminal
                    self._parked.set()
                    self._go.wait()
                    size = None  # the screen was restarted: draw it all again
                    continue
                if capture.failed is not None:
                    capture.warn_failure()  # from here: the pipe's reader cannot warn
                keys = screen.get_input(raw_keys=False)
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
                lines = capture.lines()
                if lines:
                    dashboard.receive("log", lines)
                    dirty = True
                current = screen.get_cols_rows()
                if current != size:
                    size = current
                    screen.clear()
                    dirty = True
                now = time.monotonic()
                # The run's counters, read here, after the messages (which they are ahead of):
                # the bars follow the batches at no cost to the training thread.
                state = loop.state
                read = (state.stage, state.epoch, state.batch_idx, state.step)
                if read != counters:
                    counters, moved = read, True
                    dashboard.receive("tick", *read, now)
                    if dashboard.skipped:  # the skipped share follows each optimizer's own steps (at no batch's cost)
                        dashboard.receive("attempted", skips.attempted(loop.optimizers))
                # the clock shows whole seconds; the progress alone redraws at most every PROGRESS_EVERY
                if dirty or now - last_draw >= 1.0 or (moved and now - last_draw >= PROGRESS_EVERY):
                    screen.draw_screen(size, dashboard.render(size))
                    last_draw, moved = now, False
        except BaseException as exc:  # an observer: the run goes on without it
            self._ui_error = exc
            self._quit.set()

    # -- end ----------------------------------------------------------------------------------
    @hookimpl(trylast=True)
    def fit_end(self, loop: Run) -> None:
        if not self.active:
            return
        state = loop.state
        if self._suspended:
            self._resume_if_let_go()
        # no hold while a debugger still has the terminal, nor when the stop's asker ends the process (a SIGTERM)
        stop = loop.stop_requested
        hold = bool(self.persistent) and self._ui_error is None and not self._suspended and not (
            stop is not None and stop.ends_process)
        # the run's own duration (state.elapsed ends before fit_end: the clock stops there), the steps attempted
        self._inbox.extend([("time", state.time_split), ("attempted", skips.attempted(loop.optimizers))])
        self._inbox.append(("end", state.status, state.stop_reason, hold, state.stopped_by, state.elapsed,
                            state.step, state.epoch))
        try:
            if hold:
                self._hold()
        finally:
            self._quit.set()
            self._go.set()  # a UI thread parked for a debugger ends too
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._restore()
            if self._dashboard is not None and (self._thread is None or not self._thread.is_alive()):
                while self._inbox:  # what came after the UI thread's last frame (the summary reads it)
                    self._dashboard.receive(*self._inbox.popleft())
        if self._ui_error is not None:
            warnings.warn(f"tui: the dashboard failed and was closed: {type(self._ui_error).__name__}: "
                          f"{self._ui_error}", HookfitWarning, stacklevel=user_level())
        output = self.output if self.output is not None and self.output.exists() else None
        print("\n".join(summary(self._dashboard, state, output, warned=self.warned.lines(), width=terminal_width())),
              flush=True)
        if self._ended_by is not None:  # end as the signal asks, once the run's records are written
            signum, self._ended_by = self._ended_by, None
            end_with(loop, SystemExit(128 + signum))

    def _hold(self) -> None:
        """Keep the final screen until q, Esc or Ctrl-C; SIGTERM and SIGHUP also end the hold, and
        ``fit()`` then raises ``SystemExit(128 + signal)`` once the run's records are written."""
        def leave(signum: int, frame: FrameType | None) -> None:
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

    def _terminate(self, signum: int, frame: FrameType | None) -> None:
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
        self._quit.set()
        self._go.set()  # a parked UI thread ends
        if sys.breakpointhook == self._breakpointhook:
            sys.breakpointhook = self._previous_breakpointhook
        self._suspended = False
        self.warned.remove()
        try:
            if self._screen is not None:
                self._screen.stop()
                self._screen = None
        finally:
            for signum, handler in self._saved_signals.items():
                signal.signal(signum, handler)
            self._saved_signals.clear()
            if self._capture is not None:
                capture, self._capture = self._capture, None
                capture.restore()
                if capture.failed is not None:
                    self.output = None  # not (all) in the file
                    capture.warn_failure()  # if the UI thread did not: now on the real terminal
