"""The terminal the dashboard runs in: whether there is one to use, and the capture of what the
run prints while the dashboard is up."""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import threading
from typing import Any

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


class OutputCapture:
    """File descriptors 1 and 2 redirected to a temporary file while the dashboard is up, so
    ``print``, logging, warnings and C libraries cannot scribble over it. ``terminal`` is a
    writable copy of the original stdout for the screen to draw on; :meth:`lines` reads what
    was printed so far (for the log pane); :meth:`restore` puts the descriptors back and writes
    everything captured to the terminal. Idempotent."""

    def __init__(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved: tuple[int, int] | None = (os.dup(1), os.dup(2))
        self.terminal: Any = os.fdopen(os.dup(self._saved[0]), "w", encoding="utf-8", errors="replace")
        self._file: Any = tempfile.TemporaryFile()
        os.dup2(self._file.fileno(), 1)
        os.dup2(self._file.fileno(), 2)

    def lines(self, offset: int) -> tuple[int, list[str]]:
        """The complete, non-blank lines captured from byte ``offset`` on, and the offset after
        them (a partial last line waits for its end, unless 64 KiB came without one)."""
        data = os.pread(self._file.fileno(), 65536, offset)
        if not data:
            return offset, []
        end = data.rfind(b"\n") + 1
        if end == 0 and len(data) < 65536:
            return offset, []
        end = end or len(data)
        text = data[:end].decode("utf-8", errors="replace")
        return offset + end, [line for line in text.splitlines() if line.strip()]

    def restore(self) -> None:
        """Put file descriptors 1 and 2 back and replay what was captured."""
        if self._saved is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(self._saved[0], 1)
            os.dup2(self._saved[1], 2)
            for fd in self._saved:
                os.close(fd)
            self._saved = None
        if self.terminal is not None:
            self.terminal.close()
            self.terminal = None
        if self._file is not None:
            self._file.seek(0)
            captured = self._file.read()
            self._file.close()
            self._file = None
            if captured:
                os.write(1, captured)
