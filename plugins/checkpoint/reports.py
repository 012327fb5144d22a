"""checkpoint reports: how saves that were not written are reported, on the training thread.
A failed write (full disk, read-only folder) is counted and, with ``on_save_error="warn"``,
warned about once a run, at the first, or, with ``"raise"``, raised. The warning (a
:class:`CheckpointWarning`) names the save's step and, for a write in the background, the later
step its failure was found at, where the run's record of its warnings puts it; it says the
previous checkpoints are kept and training goes on, or, for a save of a run that is ending (a
failed run's, the last one of a run), how the run ends. One cause fails every later save alike,
so later failures are only counted. A save skipped because the writer was busy
(``when_busy="skip"``) is counted and warned about once a run. Only the main process warns."""

from __future__ import annotations

import warnings
from pathlib import Path

from hookfit.errors import user_level
from hookfit.plugins.checkpoint.storage import CheckpointWarning

__all__ = ["Reports"]


class Reports:
    """Counts and reports failed and skipped saves (see the module)."""

    def __init__(self, on_save_error: str) -> None:
        self.on_save_error = on_save_error
        self.failed = 0
        """Writes that failed, over every run of the plugin."""
        self.skipped = 0
        """Saves skipped because the writer was busy, over every run of the plugin."""
        self._warned: set[str] = set()
        self.run_failed, self.run_skipped = 0, 0  # this run's (results: failed_saves, skipped_saves)
        self.skipped_step: int | None = None  # the step of this run's last skipped save (the run's end writes it)

    def reset(self) -> None:
        """A new run: its first failed and first skipped save are warned about again."""
        self._warned, self.run_failed, self.run_skipped, self.skipped_step = set(), 0, 0, None

    def failure(self, path: Path, error: BaseException, main: bool, step: int | None = None,
                found: int | None = None, status: str = "running") -> BaseException | None:
        """Count a failed write of ``path`` and warn (on the main process, ``main``) at the run's
        first; the error when it is to be raised. ``step``: the step of the save; ``found``: the
        run's step when its outcome was taken, later than ``step`` for a write in the background,
        which the warning then says (it is recorded at ``found``, the step it is shown at);
        ``status``: the run's then, which the warning says in place of "training goes on" once
        the run is ending (a failed run's save, the last save of a completed one)."""
        self.failed, self.run_failed = self.failed + 1, self.run_failed + 1
        if self.on_save_error == "raise" or not isinstance(error, Exception):
            return error
        if "failed" not in self._warned and main:
            self._warned.add("failed")
            which = "" if step is None else f", the save at step {step}" + (
                f" (written in the background, its failure found at step {found})"
                if found is not None and found != step else "")
            then = "training goes on" if status == "running" else f"the run ends ({status})"
            warnings.warn(
                f"checkpoint: could not write {path}{which} ({type(error).__name__}: {error}); the "
                f"previous checkpoints are kept and {then}", CheckpointWarning, stacklevel=user_level())
        return None

    def skip(self, step: int, main: bool = True) -> None:
        """Count a save at ``step`` skipped because the writer was busy; warn once a run (on the
        main process, ``main``)."""
        self.skipped, self.run_skipped, self.skipped_step = self.skipped + 1, self.run_skipped + 1, step
        if "skipped" not in self._warned and main:
            self._warned.add("skipped")
            warnings.warn(
                f"checkpoint: the save at step {step} was skipped: the writer was still busy with "
                f"earlier checkpoints (when_busy='skip'; skipped saves are counted in skipped_saves). Save "
                f"less often, or pass when_busy='wait' to wait for the write instead",
                CheckpointWarning, stacklevel=user_level())
