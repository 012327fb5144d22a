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
  on a schedule and its last save is of an earlier step, or a busy writer skipped it
  (``when_busy="skip"``).
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from hookfit.plugins.checkpoint import ranks
from hookfit.plugins.checkpoint.scores import settle
from hookfit.plugins.checkpoint.storage import CheckpointError

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.plugins.checkpoint.plugin import Checkpoint
    from hookfit.position import Position
    from hookfit.run import Run

__all__ = ["NOTICE_AFTER", "end_save", "finish", "inside_training"]

NOTICE_AFTER = 2.0
"""Seconds the run's end waits for the writes in flight before it says so (a person's patience,
not a limit: the wait goes on)."""


def end_save(checkpoint: Checkpoint, loop: Run) -> str | None:
    """The ``reason`` of the checkpoint the end of ``loop`` (a fit) writes, or ``None``: none."""
    state, position = loop.state, loop.position
    if state.status == "failed":
        return "failure" if checkpoint.on_failure else None
    if position == checkpoint.began:  # nothing trained: the state it began from
        return None
    if state.status == "interrupted":
        return "interrupt" if checkpoint.on_interrupt and state.stop_reason != "KeyboardInterrupt" else None
    skipped = checkpoint.reports.skipped_step
    if state.status == "completed" and (inside_training(position) or (checkpoint.scheduled and ranks.from_main(
            loop, checkpoint.saved_step != state.step or skipped == state.step))):
        # inside an epoch (max_steps: a longer run goes on from here), or newer than the last save asked or
        # written (a busy writer skipped the save of this step), as the main process knows it
        return "max_steps" if loop.max_steps is not None and state.step >= loop.max_steps else "completed"
    return None


def inside_training(position: Position) -> bool:
    """Whether the run stands inside an epoch's training stage (not at an epoch's start)."""
    return position.stage == "train" and (position.batch > 0 or position.val_due)


def finish(checkpoint: Checkpoint, loop: Run, ran: bool) -> None:
    """The end of ``checkpoint``'s part of a fit (``ran``: it saved in this run, so every process
    takes part in what follows): the end's save (:func:`end_save`), then, whatever its outcome, wait
    for every write in flight, saying so when it is long, take their outcomes
    (:meth:`~hookfit.plugins.checkpoint.plugin.Checkpoint.collect`: a failure reported as
    ``on_save_error`` says), then tell every process what the main one knows, and the error it
    ends with, if any (:func:`agree`)."""
    failure: Exception | None = None
    try:
        try:
            if ran:
                settle(checkpoint, loop, None)  # a validation cut short scored nothing
                if (reason := end_save(checkpoint, loop)) is not None:  # none where the run began
                    checkpoint.save(loop, reason, must=True)
        finally:
            wait(checkpoint, loop)
            checkpoint.collect(loop, checkpoint.shards.take())
    except Exception as error:  # (on_save_error="raise"): every other process fails with it too
        failure = error
        raise
    finally:
        if ran and together(loop):
            agree(checkpoint, loop, failure)


def wait(checkpoint: Checkpoint, loop: Run) -> None:
    """Wait for every write in flight; after :data:`NOTICE_AFTER` seconds, one line on stderr
    (the main process) names them. Then the line of :func:`bottleneck`, if any."""
    writer, shards = checkpoint.writer, checkpoint.shards
    deadline = time.monotonic() + NOTICE_AFTER
    if not (writer.wait(NOTICE_AFTER) and shards.join(max(0.0, deadline - time.monotonic()))):
        files = [*writer.in_flight, *shards.writing]
        if loop.is_main and files:
            count = f"{len(files)} write{'s' if len(files) > 1 else ''}"
            print(f"hookfit checkpoint: waiting for {count} in flight to {', '.join(map(str, files))}",
                  file=sys.stderr, flush=True)
        writer.wait()
        shards.wait()
    state = loop.state
    if loop.is_main and state.started_at is not None and state.ended_at is not None:
        note = bottleneck(writer.waited + shards.waited, state.ended_at - state.started_at)
        if note is not None:
            print(f"hookfit checkpoint: {note}", file=sys.stderr, flush=True)
    writer.waited = shards.waited = 0.0  # (the next run's own)


def bottleneck(waited: float, seconds: float) -> str | None:
    """What a run of ``seconds`` whose saves waited ``waited`` seconds for the writer's writes in
    flight says of it: that writing checkpoints held the training back, when the saves waited more
    than half its time (and more than :data:`NOTICE_AFTER` seconds); else ``None``."""
    if waited <= NOTICE_AFTER or waited <= seconds / 2:
        return None
    return (f"saves waited {waited:.1f} s of the run's {seconds:.1f} s for checkpoint writes in flight "
            f"(when_busy='wait'): writing checkpoints held training back; save less often, write to a faster "
            f"folder, or pass when_busy='skip' to skip a save while the writer is busy")


def together(loop: Run) -> bool:
    """Whether the processes of a run of several ended at one point, able to work together: it
    completed, or stopped where they agreed to (a stop request, not a ``KeyboardInterrupt`` of
    one process; a failed run's process group may be gone)."""
    state = loop.state
    return state.world_size > 1 and (
        state.status == "completed" or (state.status == "interrupted" and state.stopped_by is not None))


def agree(checkpoint: Checkpoint, loop: Run, failure: BaseException | None = None) -> None:
    """Every process takes the main process's last and best checkpoints, the files kept and the
    run's failed and skipped saves (one broadcast): the results are one mapping on every process.
    A ``failure`` the main process ends with (``on_save_error="raise"``: a write only it made) is
    raised on every process not failing already, which would otherwise go on to the run's end alone
    and wait there."""
    catalog, reports = checkpoint.catalog, checkpoint.reports
    raised = f"{type(failure).__name__}: {failure}" if isinstance(failure, Exception) else None
    known = ranks.from_main(loop, (catalog.last, catalog.best, list(catalog.saved), dict(catalog.scores),
                                   reports.run_failed, reports.run_skipped, raised))
    if loop.is_main:
        return
    catalog.last, catalog.best, catalog.saved, catalog.scores, failed, skipped, raised = known
    reports.failed += failed - reports.run_failed
    reports.skipped += skipped - reports.run_skipped
    reports.run_failed, reports.run_skipped = failed, skipped
    if raised is not None and failure is None:
        raise CheckpointError(f"checkpoint: the main process's checkpoint plugin failed as the run ended ({raised}); "
                              f"every process of the run fails with it")
