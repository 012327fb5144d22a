"""Where a run that did not complete continues from, as the console and the dashboard say it: the newest
checkpoint the checkpoint role announced (``checkpoint_saved``; a ``"failure"`` checkpoint, a ``failed-*``
file, is not one: it holds the failed batch's state), else the one the run resumed from (``resumed``), and
how to resume from it (:data:`RESUME`, the words both print). The path, not ``resume="latest"``: a run
resumed from an older checkpoint of its folder leaves newer ones there, which "latest" would take. Every
checkpoint is named alike, whatever form it was announced in (a one-file checkpoint's path is as the run
folder was given, a sharded one's absolute): relative to the current folder where it lies inside it,
else absolute (:func:`shown`)."""

from __future__ import annotations

from pathlib import Path

RESUME = "run again with Loop(..., resume=<this path>)"
"""How to continue from the checkpoint named: the console's ``resume=`` field, the dashboard's words after the path."""

ENDS = ("interrupted", "failed")
"""The statuses of a run that ends by naming its checkpoint to resume from."""


def shown(path: str) -> str:
    """``path`` as a run's end names it: relative to the current folder where it lies inside it
    (``runs/train/1/checkpoints/...``), else absolute."""
    whole = Path(path).absolute()
    try:
        return str(whole.relative_to(Path.cwd()))
    except (ValueError, OSError):  # outside the current folder (or none: removed)
        return str(whole)


class LastCheckpoint:
    """The newest checkpoint a run can be resumed from, fed every ``checkpoint_saved`` in order."""

    def __init__(self) -> None:
        self.saved: tuple[str, str] | None = None
        """``(path, reason)`` of the newest announced, ``None`` before one (or after :meth:`clear`)."""

    def clear(self) -> None:
        self.saved = None

    def announced(self, path: str, reason: str) -> None:
        """A checkpoint written (``reason`` as ``checkpoint_saved`` gives it), or ``"resumed"``: the run's own."""
        if reason != "failure":  # (the state a failing batch ran from, kept apart: "latest" never takes it)
            self.saved = (shown(path), reason)

    def to_resume(self, status: str) -> tuple[str, str] | None:
        """``(path, reason)`` of the checkpoint a run that ended ``status`` continues from: for an
        interrupted or failed run that saved one; ``None`` for a completed run, or none saved."""
        return self.saved if status in ENDS else None

    def sentence(self, status: str) -> str | None:
        """``checkpoint to resume from: <path> (<reason>): run again with ...`` (:data:`RESUME`), the
        dashboard's words for :meth:`to_resume`; ``None`` where it gives none."""
        if (found := self.to_resume(status)) is None:
            return None
        return f"checkpoint to resume from: {found[0]} ({found[1]}): {RESUME}"
