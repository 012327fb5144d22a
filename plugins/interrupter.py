"""interrupter: graceful stops on request, on SIGINT and on SIGTERM.

* ``loop.request_stop(reason)`` from any plugin, the step, or another thread: the current batch
  finishes, then ``should_stop`` answers the reason and the run ends ``interrupted``.
* First SIGINT (Ctrl-C) or SIGTERM: the same, with the reason ``"SIGINT"``/``"SIGTERM"`` and a
  line on stderr saying what happens. A second SIGINT aborts at once with
  ``KeyboardInterrupt`` (``fit_end`` still runs, with status ``interrupted``).
* Handlers are installed at ``fit_start`` only on the main thread and the previous ones are put
  back at ``fit_end``, so a notebook or a host application keeps its own.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

from hookfit import hookimpl


class Interrupter:
    """Answers ``should_stop`` after a stop request or a termination signal."""

    name = "interrupter"

    def __init__(self, signals: bool = True) -> None:
        self.signals = signals
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._previous: dict[int, Any] = {}
        self._loop: Any = None

    @hookimpl
    def fit_start(self, loop: Any) -> None:
        self._loop = loop
        self._reason = None
        if self.signals and threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._on_signal)

    @hookimpl
    def request_stop(self, reason: str) -> None:
        with self._lock:
            if self._reason is None:
                self._reason = reason

    @hookimpl
    def should_stop(self, loop: Any) -> str | None:  # every argument: called without an adapter
        return self._reason

    @hookimpl
    def fit_end(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        self._loop = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self._reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt(f"second {name}: aborting")
        self._loop.request_stop(name)  # the event, so every plugin (the dashboard) hears of it
        hint = "; press Ctrl-C again to abort" if signum == signal.SIGINT else ""
        print(f"hookfit: {name} received, stopping after this batch{hint}", file=sys.stderr, flush=True)
