"""checkpoint outcomes: what the training thread does with the writes the background writer
(:mod:`~hookfit.plugins.checkpoint.writer`) or a sharded save finished: each checkpoint
written taken (last, best, kept) and announced, older ones pruned, each failed write reported."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hookfit.plugins.checkpoint.writer import Done

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.plugins.checkpoint.plugin import Checkpoint
    from hookfit.run import Run

__all__ = ["collect"]


def collect(checkpoint: Checkpoint, loop: Run, more: list[Done] | None = None) -> None:
    """See :meth:`hookfit.plugins.checkpoint.Checkpoint.collect`."""
    failure: BaseException | None = None
    for outcome in [*checkpoint.writer.outcomes(), *(more or [])]:
        if not isinstance(outcome, Done):  # a file that could not be removed
            checkpoint.catalog.keep(outcome.path)
            continue
        path = outcome.path
        reason, step, metric, main = outcome.tag
        if outcome.error is not None:
            checkpoint.scores.failed()
            checkpoint.written.lost(step)
            failure = failure or checkpoint.reports.failure(path, outcome.error, main, step, loop.state.step,
                                                                loop.state.status)
        elif not main:
            checkpoint.catalog.follow(path, metric, reason)
        else:
            checkpoint.writer.remove(checkpoint.catalog.take(path, metric, reason))
            if (call := loop.hooks.checkpoint_saved) is not None:
                call(loop, str(path), reason, step)
    if failure is not None:
        raise failure
