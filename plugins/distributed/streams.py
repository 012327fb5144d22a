"""distributed streams: training data each process reads itself (``Distributed(shard_data=False)``) and that
has no length, so that no process knows its batch count before its stream runs out. Every process must run
as many batches an epoch as the others: one whose stream runs out first would take the epoch's end-of-stage
collectives (the stop agreement, the metrics' sums) while the others are in the next batch's gradient
all-reduce, and gloo aborts the job on the mismatch or the collectives time out, naming no data.

So a process whose training stream has run out says so in the run's store (its batch count for the epoch)
and waits there, in no collective, until every process has said the same: once an epoch, before any other
plugin's ``stage_end``. Equal counts go on; different counts, or a process that has not run out within the
collective timeout (likely because it went on to another batch), fail the run on the process that waited with
an error naming each process's count. That wait is the collective timeout less :data:`MARGIN` (half of it at
most), so that the process that ran out fails first: the others' collectives then fail at once, naming its error
(:mod:`failures`). A process that fails while another waits (its stream raising as it runs out, say) records
its failure in the same store, which ends the wait within :data:`SLICE`, naming that process and its error.
:class:`StreamEnds` is that part of :class:`~hookfit.plugins.distributed.Distributed`'s class."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

from hookfit import hookimpl
from hookfit.plugins.distributed.sharding import length

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from torch._C._distributed_c10d import Store

    from hookfit.run import Run

__all__ = ["StreamEnds", "compare_ends"]

MARGIN = 5.0
"""Seconds a process whose stream ran out waits less than the collective timeout for the others' ends: the time
it has to fail and say so before their collectives, which began after its wait, time out."""
SLICE = 0.5
"""Seconds of each wait in the store between two looks for a failure another rank recorded there."""
REMEDY = ("every process must give as many batches an epoch: give each process an equal part of the data "
          "(as many samples a rank, drop_last=True on its DataLoader), or give data with a length and "
          "Distributed(shard_data=True) to have it sharded evenly")


class StreamEnds:
    """The check, once an epoch, that the processes' training streams ran out at the same batch."""

    rank: int
    world_size: int
    shard_data: bool
    timeout: float
    _store: Store | None

    def _reset_streams(self) -> None:
        self._streams = False  # the training data is a stream each process reads itself, without a length

    def _watch_streams(self, loop: Run) -> None:
        """Check the ends of this run's training streams when they have no length and are not sharded here
        (the lengths, where known, were compared at configure)."""
        self._streams = not self.shard_data and loop.mode == "fit" and length(loop.train_data) < 0

    @hookimpl(wrapper=True)  # before every stage_end implementation: some take collectives
    def stage_end(self, loop: Run, stage: str) -> Generator[None, Any, Any]:
        state = loop.state
        # max_steps reached: not checked. Here the data ended at that batch too (a rank whose data had more ends
        # the run without a stage_end, so says no count), and streams ending there on some ranks only are not told
        # apart: the ranks' next collectives time out naming no data.
        reached = loop.max_steps is not None and state.step >= loop.max_steps
        if stage == "train" and self._streams and self._store is not None and not reached:
            from hookfit.plugins.distributed.group import timeout_seconds, timeout_text

            seconds = timeout_seconds(self.timeout)
            compare_ends(self._store, self.rank, self.world_size, state.epoch, state.batch_idx + 1,
                         seconds - min(seconds / 2, MARGIN), lambda: timeout_text(self.timeout))
        return (yield)


def compare_ends(store: Store, rank: int, world_size: int, epoch: int, batches: int, seconds: float,
                 timeout_text: Callable[[], str]) -> None:
    """Say in ``store`` that ``rank``'s training stream ran out after ``batches`` batches in ``epoch`` (from 0),
    and wait up to ``seconds`` for every rank to say so; ``ValueError`` naming each rank's count if they differ,
    or naming the ranks that did not run out in that time. A rank that records a failure in ``store`` meanwhile
    (:data:`~hookfit.plugins.distributed.failures.FIRST_FAILURE`: it failed after its last collective operation
    of the epoch, its stream raising as it ran out, say) ends the wait within :data:`SLICE`:
    :class:`~hookfit.plugins.distributed.failures.PeerFailed`, whose note names that rank and its error."""
    from hookfit.plugins.distributed.failures import FIRST_FAILURE, PeerFailed

    prefix = f"train_end/{epoch}/"
    keys = [f"{prefix}{r}" for r in range(world_size)]
    store.set(keys[rank], str(batches))
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        try:
            store.wait(keys, datetime.timedelta(seconds=max(min(SLICE, left), 0.001)))
            break
        except RuntimeError:  # (torch.distributed.DistStoreError: the wait timed out)
            if store.check([FIRST_FAILURE]):
                raise PeerFailed(f"distributed: rank {rank} stopped waiting for the other ranks' training streams "
                                 f"to run out in epoch {epoch + 1} (its own ran out after {batches} batches): "
                                 f"another rank failed") from None
            if left <= SLICE:
                break
    late = [r for r, key in enumerate(keys) if not store.check([key])]  # (all there: one came after the wait)
    counts = {r: int(store.get(key)) for r, key in enumerate(keys) if r not in late}
    if not late and len(set(counts.values())) == 1:
        return
    where = "train_data, a stream each process reads itself (shard_data=False, no length)"
    ended = ", ".join(f"rank {r}: {n}" for r, n in counts.items())
    if late:
        going = ", ".join(map(str, late))
        raise ValueError(
            f"distributed: {where}, ran out on rank {rank} after {batches} batches in epoch {epoch + 1}, but "
            f"rank(s) {going} had not run out {seconds:g} s later (the collective timeout, {timeout_text()}, "
            f"less the time this process has to say so): they probably went on to another batch, whose collective "
            f"operations the processes that ran out never join (batches run out: {ended}); {REMEDY}")
    raise ValueError(f"distributed: {where}, gave the processes different numbers of batches in epoch {epoch + 1} "
                     f"({ended}); {REMEDY}")
