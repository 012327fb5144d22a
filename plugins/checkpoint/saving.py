"""checkpoint saving: one save asked now (:meth:`Checkpoint.save
<hookfit.plugins.checkpoint.plugin.Checkpoint.save>`), from the state copied to the write submitted: the
run's position and the score of its weights now, a step already written not written again
(:mod:`~hookfit.plugins.checkpoint.repeats`), a sharded run's parts written by every rank
(:mod:`~hookfit.plugins.checkpoint.shardwriter`), and off the main process the file the main one
writes, followed for best and last."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hookfit.plugins.checkpoint import sharded
from hookfit.plugins.checkpoint.shardwriter import save_sharded

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.plugins.checkpoint.plugin import Checkpoint
    from hookfit.run import Run

__all__ = ["save"]


def save(checkpoint: Checkpoint, loop: Run, reason: str, must: bool = False) -> Path | None:
    """``checkpoint``'s save of the run as it is now, as :meth:`Checkpoint.save
    <hookfit.plugins.checkpoint.plugin.Checkpoint.save>` documents it."""
    if checkpoint.off:
        return None
    checkpoint.unsaved.check()  # (the first save: a module the step changed outside the checkpoints)
    checkpoint.clock.saved()
    checkpoint.collect(loop)
    position = loop.position
    metric = checkpoint.scores.current(loop)
    if reason != "failure" and not checkpoint.written.again(loop, position.step, metric):
        return checkpoint.destination(loop, position, reason) if loop.is_main else None  # written, or in flight
    checkpoint.saved_step = position.step
    checkpoint.scores.asked(metric)
    with checkpoint.writer.aside():  # the writer steps aside while this thread copies
        payload = checkpoint.payload(loop, reason=reason, metric=metric)  # also on other ranks: collectives
        rest, shards = sharded.split(payload)
        if shards:  # a sharded run: every rank writes its part
            checkpoint.written.wrote(position.step, metric)
            return save_sharded(checkpoint, loop, position, rest, shards, (reason, position.step, metric, must))
        path = checkpoint.destination(loop, position, reason)
        if not loop.is_main:
            if path is not None:  # the file the main process writes, for best and last
                checkpoint.catalog.follow(path, metric, reason)
            return None
        assert path is not None  # (the main process's own folder)
        submitted = checkpoint.writer.submit(payload, path, (reason, position.step, metric, True), must=must)
    if not submitted:
        checkpoint.reports.skip(position.step)
        return None
    checkpoint.written.wrote(position.step, metric)
    if not checkpoint.background:
        checkpoint.collect(loop)
    return path
