"""checkpoint's end of a run: which checkpoint ``fit_end`` writes, the rule written here once.

* A failure writes ``"failure"`` with ``on_failure`` (a ``failed-*`` file, which ``"latest"``
  never takes), wherever the run stands: the record of the state the failing batch ran from.
* Any other end that stands where the run began writes none: its position
  (:attr:`hookfit.run.Run.position`) is the one the run started at, or the one it resumed at;
  it trained no batch and ended no epoch (stopped before its first batch, as
  ``LRFinder(then="stop")`` stops it; resumed, then stopped at once; resumed at its end). Such
  a checkpoint would hold the state the run began from, already on disk as the checkpoint it
  resumed from or, for a new run, a fresh start; being the newest, it is what
  ``resume="latest"`` takes: the next run of the name would continue it, with the old run's
  optimizer settings, instead of starting anew.
* Else a graceful stop (a stop request, SIGTERM; not ``KeyboardInterrupt``) writes
  ``"interrupt"`` with ``on_interrupt``; a completed run writes ``"max_steps"`` (``max_steps``
  ended it) or ``"completed"`` when it ends inside an epoch's training stage, or when it saves
  on a schedule and its last save is of an earlier step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.plugins.checkpoint.plugin import Checkpoint
    from hookfit.position import Position
    from hookfit.run import Run

__all__ = ["end_save", "inside_training"]


def end_save(checkpoint: Checkpoint, loop: Run) -> str | None:
    """The ``reason`` of the checkpoint the end of ``loop`` (a fit) writes, or ``None``: none."""
    state, position = loop.state, loop.position
    if state.status == "failed":
        return "failure" if checkpoint.on_failure else None
    if position == checkpoint.began:  # nothing trained: the state it began from
        return None
    if state.status == "interrupted":
        return "interrupt" if checkpoint.on_interrupt and state.stop_reason != "KeyboardInterrupt" else None
    if state.status == "completed" and (inside_training(position) or (
            checkpoint.scheduled and checkpoint.saved_step != state.step)):
        # inside an epoch (max_steps: a longer run goes on from here), or newer than the last save
        return "max_steps" if loop.max_steps is not None and state.step >= loop.max_steps else "completed"
    return None


def inside_training(position: Position) -> bool:
    """Whether the run stands inside an epoch's training stage (not at an epoch's start)."""
    return position.stage == "train" and (position.batch > 0 or position.val_due)
