"""The warnings of a run, kept in its folder: each distinct warning shown while the run ran
(its category and message: a warning repeated is recorded once, the first time) becomes one
line of ``run.jsonl``, ``{"event": "warning", "category": ..., "message": ..., "step": ...,
"where": "file:line"}``, between the run's ``"run"`` line and its ``"end"`` line, so a run
looked at later (``hookfit show``) says what it warned of. ``category`` is the warning's class
(``UserWarning``; ``hookfit.files.FileWarning`` for one not built in), ``step`` the run's
``state.step`` when it was shown.

What is recorded is what was shown: the warnings filters decide, as always (a warning the user
filtered out with ``warnings.filterwarnings("ignore", ...)``, or one raised as an error, is not
recorded). Main process only, and only where the run has a folder (a plugin used ``run_dir``):
one shown before the folder is made is written after the ``"run"`` line; none is written after
the ``"end"`` line. At most :data:`KEPT` distinct warnings are recorded in a ``fit()``; when
more were shown, one ``{"event": "warnings_dropped", "count": N}`` line before the ``"end"`` line
says how many more distinct ones there were (each counted the first time it was shown after the
limit was reached).

:class:`WarningRecorder` wraps :func:`warnings.showwarning` while the run runs and hands every
warning on to the function it wrapped. A plugin that takes :func:`warnings.showwarning` over
while the run runs and does not hand warnings on (the dashboard, which keeps them off the
terminal) tells the run of each through :func:`shown`. A warning is recorded by the innermost
run going on (a run started inside another's step records its own warnings; the outer run does
not). Once its run is over a recorder holds neither the run nor its folder: one still called
through a reference kept elsewhere (``logging.captureWarnings`` turned on during the run and off
after it puts it back) shows the warning as Python's own :func:`warnings.showwarning` would.
"""

from __future__ import annotations

import json
import sys
import threading
import warnings
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:  # pragma: no cover
    from hookfit.files import RunFile
    from hookfit.run import Run

__all__ = ["KEPT", "WarningRecorder", "category_name", "shown"]

KEPT = 100
"""At most this many distinct warnings are recorded in one ``fit()``; later ones are counted."""

DROPPED_KEPT = 100_000
"""At most this many warnings past :data:`KEPT` are told apart (their category and message
kept); any later one is counted each time it is shown."""

_recording: list[WarningRecorder] = []  # the recorders installed in this process (a run each)


def shown(message: Warning | str, category: type[Warning], filename: str, lineno: int) -> None:
    """Tell the innermost run going on in this process of a warning that was shown without
    reaching the function its recorder wrapped (a plugin that took :func:`warnings.showwarning`
    over and keeps the warning to itself). A warning the run already recorded is not recorded again."""
    recording = list(_recording)
    if recording:
        recording[-1].record(message, category, filename, lineno)


def category_name(category: type[Warning]) -> str:
    """How a ``"warning"`` line names ``category``: its name when built in, else its module's and its own."""
    module = getattr(category, "__module__", "builtins")
    return category.__qualname__ if module == "builtins" else f"{module}.{category.__qualname__}"


class WarningRecorder:
    """The recorder of ``run``'s warnings (see the module's documentation). :meth:`opened` gives
    it ``run.jsonl`` once the ``"run"`` line is written there; :meth:`closed` ends the
    recording before the ``"end"`` line."""

    def __init__(self, run: Run) -> None:
        self.run: Run | None = run
        self._lock = threading.RLock()  # (a warning of its own write comes back on the same thread)
        self._previous: Any = None
        self._seen: set[tuple[str, str]] = set()
        self._dropped: set[int] = set()  # hashes of the distinct warnings past KEPT
        self._dropped_more = 0  # those past DROPPED_KEPT
        self._pending: list[str] = []  # lines shown before run.jsonl was there
        self._log: RunFile | None = None
        self._closed = False
        self._writing = False  # a warning of the write itself (a full disk) is not written

    def install(self) -> None:
        """Wrap :func:`warnings.showwarning` (once) and record every warning it is given."""
        if self._previous is None:
            self._previous = warnings.showwarning
            warnings.showwarning = self._show
            _recording.append(self)

    def remove(self) -> None:
        """Put back the wrapped function, unless another replaced ours since (theirs stays).
        Either way the recorder lets go of the run, its folder and the wrapped function: if it
        is still called it shows the warning as Python's own :func:`warnings.showwarning` would."""
        if self in _recording:
            _recording.remove(self)
        previous = self._previous
        if previous is not None and warnings.showwarning == self._show:
            warnings.showwarning = previous
        with self._lock:
            self._previous, self.run, self._log, self._pending, self._closed = None, None, None, [], True

    def opened(self, log: RunFile) -> None:
        """``run.jsonl`` has its ``"run"`` line: the warnings shown so far are written after it,
        later ones as they are shown."""
        with self._lock:
            self._log = log
            pending, self._pending = self._pending, []
            self._write(pending)

    def closed(self) -> None:
        """The ``"end"`` line follows: the count of the warnings past :data:`KEPT` is written,
        if there were any, and no warning after it."""
        with self._lock:
            dropped = len(self._dropped) + self._dropped_more
            if dropped and not self._closed:
                self._write([json.dumps({"event": "warnings_dropped", "count": dropped}) + "\n"])
            self._closed, self._log, self._pending = True, None, []

    def record(self, message: Warning | str, category: type[Warning], filename: str, lineno: int) -> None:
        """Record one warning shown (once for each category and message)."""
        run = self.run
        if run is None or not run.is_main:
            return
        text = str(message)
        key = (category_name(category), text)
        with self._lock:
            if self._closed or self._writing or key in self._seen:
                return
            if len(self._seen) >= KEPT:
                if len(self._dropped) < DROPPED_KEPT:
                    self._dropped.add(hash(key))
                else:
                    self._dropped_more += 1
                return
            self._seen.add(key)
            line = json.dumps({"event": "warning", "category": key[0], "message": text,
                               "step": run.state.step, "where": f"{filename}:{lineno}"}) + "\n"
            if self._log is None:
                self._pending.append(line)
            else:
                self._write([line])

    def _write(self, lines: list[str]) -> None:
        if not lines or self._log is None:
            return
        self._writing = True
        try:
            self._log.write("".join(lines))
            self._log.close()
        finally:
            self._writing = False

    def _show(self, message: Warning | str, category: type[Warning], filename: str, lineno: int,
              file: TextIO | None = None, line: str | None = None) -> None:
        if file is None and self in _recording:  # (a file of the caller's own: not a warning of the run)
            shown(message, category, filename, lineno)
        previous = self._previous
        if previous is not None:
            previous(message, category, filename, lineno, file, line)
            return
        target = file if file is not None else sys.stderr  # removed: as Python's own would
        if target is not None:
            try:
                target.write(warnings.formatwarning(message, category, filename, lineno, line))
            except (OSError, ValueError):  # a closed or broken stream, as Python's own ignores
                pass
