"""The warnings of a run while the dashboard owns the terminal: kept, shown in the dashboard's
log pane and again in the plain-text summary printed after it, never written to the terminal
(where they would land in the screen's rows, or in the captured output as two raw lines).

:class:`WarningLog` replaces :func:`warnings.showwarning` while it is installed and puts the
previous one back when removed; the warnings filters decide, as always, which warnings are
shown at all. A warning written to a file of the caller's own (``showwarning(..., file=f)``)
goes to the previous function unchanged. A warning it keeps off the terminal is not handed on,
so the run's record of its warnings in ``run.jsonl`` (:func:`hookfit.runwarnings.shown`) is
told of it."""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any, TextIO

from hookfit import runwarnings

__all__ = ["WarningLog", "describe", "more", "said"]

KEPT = 100
"""At most this many warnings are kept for the summary; the count of the others is."""


class WarningLog:
    """Keeps the warnings shown while installed and hands each to ``deliver`` (the log pane),
    as one line of :func:`describe`."""

    def __init__(self, deliver: Callable[[list[str]], None]) -> None:
        self._deliver = deliver
        self._previous: Any = None
        self._lock = threading.Lock()
        self.kept: list[str] = []
        """The warnings shown while installed (at most :data:`KEPT`), each as :func:`describe` says it."""
        self.dropped = 0
        """How many more there were."""

    def install(self) -> None:
        """Take over :func:`warnings.showwarning` (once; installing again does nothing)."""
        if self._previous is None:
            self._previous = warnings.showwarning
            warnings.showwarning = self._show

    def remove(self) -> None:
        """Put back the function that was there when installed, unless another replaced ours
        since (then theirs stays, and ours is no longer called)."""
        previous, self._previous = self._previous, None
        if previous is not None and warnings.showwarning == self._show:
            warnings.showwarning = previous

    def lines(self) -> list[str]:
        """The summary's lines: one per warning kept, and how many more there were."""
        lines = [f"warning: {text}" for text in self.kept]
        if self.dropped:
            lines.append(f"warning: {more(self.dropped)}")
        return lines

    def _show(self, message: Warning | str, category: type[Warning], filename: str, lineno: int,
              file: TextIO | None = None, line: str | None = None) -> None:
        if file is not None and self._previous is not None:  # a file of the caller's own: not the terminal's
            self._previous(message, category, filename, lineno, file, line)
            return
        if self._previous is None:  # called after removal, through a reference kept elsewhere (a
            # catch_warnings() entered while the dashboard was up and left after): as Python would
            target = file if file is not None else sys.stderr
            if target is not None:
                try:
                    target.write(warnings.formatwarning(message, category, filename, lineno, line))
                except (OSError, ValueError):  # a closed or broken stream, as Python's own ignores
                    pass
            return
        text = describe(message, category, filename, lineno)
        with self._lock:
            if len(self.kept) < KEPT:
                self.kept.append(text)
            else:
                self.dropped += 1
        self._deliver([f"warning: {text}"])
        runwarnings.shown(message, category, filename, lineno)


def describe(message: Warning | str, category: type[Warning], filename: str, lineno: int) -> str:
    """One line for a warning (:func:`said`), where it points: the file and line when that is
    the user's code, else the module of hookfit (which plugin) that issued it."""
    module = _hookfit_module(filename)
    where = f"from {module}" if module is not None else f"{os.path.basename(filename)}:{lineno}"
    return said(category.__name__, message, where)


def more(count: int) -> str:
    """The line that says ``count`` more warnings were shown than are listed."""
    return f"… and {count} more"


def said(category: str, message: Warning | str, where: str) -> str:
    """One line for a warning, as the dashboard and ``hookfit show`` list them: its category's
    name (``category`` without its module), its message on one line, and ``where`` in
    parentheses (when not empty)."""
    text = " ".join(str(message).split())
    return f"{category.rsplit('.', 1)[-1]}: {text}" + (f" ({where})" if where else "")


def _hookfit_module(filename: str) -> str | None:
    """The name of the hookfit module loaded from ``filename``, or ``None`` when it is not one."""
    for name, module in list(sys.modules.items()):
        if (name == "hookfit" or name.startswith("hookfit.")) and getattr(module, "__file__", None) == filename:
            return name
    return None
