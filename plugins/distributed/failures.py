"""distributed failures: what a rank says when its run fails, and how its peers learn who
failed first (see the package documentation, "Failures"). The first rank to fail records itself,
with its error, in the c10d store the ranks met through; a rank whose collective operation then
fails reads the record and names that rank and its error. Plain functions of the rank, the
world size and the store; the plugin calls :func:`report` from its ``exception`` hook."""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from torch._C._distributed_c10d import Store

FIRST_FAILURE = "first_failure"
"""The store key (under the run's prefix) where the first rank to fail records who it is."""


class PeerFailed(RuntimeError):
    """Raised on a rank that was waiting for its peers in the run's store (no collective operation) when
    another rank recorded a failure there (:data:`FIRST_FAILURE`): :func:`report` names that rank and its
    error on it as on a rank whose collective operation failed."""
_RUNS = itertools.count()  # this process's distributed runs: the same sequence on every rank


def report(error: BaseException, rank: int, world_size: int, store: Store | None,
           timeout_text: Callable[[], str], streams_apart: bool = False) -> None:
    """Say on stderr that ``rank`` of ``world_size`` failed with ``error`` or, when ``error``
    came from a collective operation, that it stopped because of the rank that failed first
    (read from ``store``, where a rank that failed first records itself), with a note on
    ``error`` saying so; ``timeout_text``: how long collectives wait, for that note.
    ``streams_apart``: the training data is a stream each process reads itself, which a failed
    collective's note names as a likely cause (one process's ran out first)."""
    where = f"rank {rank} of {world_size}"
    notes = " ".join(n for n in getattr(error, "__notes__", []) if n.startswith("hookfit: "))
    text = f"{type(error).__name__}: {_first_line(error)}" + (
        f" ({notes.removeprefix('hookfit: ')})" if notes else "")
    if _collective_error(error):
        # a peer failed, stopped or hangs: the first rank to fail recorded itself (below)
        first = first_failure(store, {"rank": rank, "world_size": world_size, "failed": False, "error": text})
        operation = "a wait for the other ranks" if isinstance(error, PeerFailed) else "a collective operation"
        if first is not None and first["rank"] != rank:
            peer = f"rank {first['rank']} of {first['world_size']}"
            cause = (f"{peer} failed first: {first['error']}" if first["failed"] else
                     f"{peer} stopped first, a collective operation having failed there: "
                     f"{first['error']}")
            error.add_note(
                f"hookfit distributed: {operation} failed on {where} because {cause}; "
                f"collectives time out after {timeout_text()}"
            )
            headline = f"hookfit distributed: {where} stopped: {operation} failed: {cause}; here"
        else:
            error.add_note(
                f"hookfit distributed: a collective operation failed on {where}: another rank "
                f"probably failed, stopped or hung first, and no rank recorded a failure (one "
                f"that hangs or is killed cannot; look for the first 'hookfit distributed: "
                f"rank N of {world_size} failed' message); collectives time out after "
                f"{timeout_text()}"
            )
            headline = (f"hookfit distributed: {where} stopped: a collective operation failed "
                        f"and no other rank recorded a failure (a rank that hangs or is killed "
                        f"cannot)")
        if streams_apart and not isinstance(error, PeerFailed):  # (its cause is known: a peer failed)
            error.add_note("hookfit distributed: the training data is a stream each process reads itself "
                           "(shard_data=False, no length): a process whose stream ran out before the others' leaves "
                           "them in a collective it never joins; every process must give as many batches an epoch")
    else:
        first_failure(store, {"rank": rank, "world_size": world_size, "failed": True, "error": text})
        headline = f"hookfit distributed: {where} failed"
    if "find_unused_parameters" in str(error):
        error.add_note("hookfit distributed: give Distributed(find_unused_parameters=True) in "
                       "Loop(plugins=[...]) to let DDP handle parameters a step does not use")
    print(f"{headline}: {text}", file=sys.stderr, flush=True)


def first_failure(store: Store | None, mine: dict[str, Any]) -> dict[str, Any] | None:
    """Record ``mine`` as the run's first failure in ``store`` unless a rank already recorded
    one, and return the first (``None`` when there is no store to ask, or it does not answer).

    The record goes to the c10d store the ranks met through (torchrun's agent hosts it, so
    it outlives any worker), before this rank closes its process group: the peers' next
    collective fails only then, so the record is there when they look. A rank that hangs or
    is killed records nothing; its peers then say so."""
    if store is None:
        return None
    try:
        first = store.compare_set(FIRST_FAILURE, "", json.dumps(mine))  # first one wins
        record = json.loads(first)
        return record if isinstance(record, dict) and {"rank", "world_size", "failed", "error"} <= record.keys() else None
    except Exception:  # noqa: BLE001 - the store's server may be gone with its host; say less
        return None


def failure_store(dist: Any) -> Store | None:
    """A part of the default process group's store for this run's failure record: its own
    prefix per run of this process (every rank runs the same sequence of runs) and per torchrun
    restart; ``None`` if the group's store cannot be had."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a private accessor: without it, failures name no rank
        return None
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefixed: Store = dist.PrefixStore(f"hookfit/distributed/{restart}/{next(_RUNS)}/", store)
    return prefixed


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def _collective_error(error: BaseException) -> bool:
    """Whether ``error`` came from a collective operation (a peer gone, a timeout)."""
    import torch.distributed as dist

    kinds = tuple(k for k in (getattr(dist, "DistError", None), PeerFailed) if k is not None)
    if kinds and isinstance(error, kinds):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        marker in text for marker in ("gloo", "Gloo", "NCCL", "Connection closed by peer",
                                      "Connection reset by peer", "caused pair closure", "Timed out", "timed out")
    )
