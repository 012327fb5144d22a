"""What several processes must agree on: the stop, from every rank's pending request (who asked, on which
ranks, and a reason a person reads: ``"stop requested on ranks 0-3: SIGTERM"``), where it lands inside a
validation (:class:`ValidationStop`), and the plugins they run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hookfit.payloads import StopRequest

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from torch._C._distributed_c10d import Store
    from torch.distributed import ProcessGroup

    from hookfit.run import Run

__all__ = ["STOP", "ValidationStop", "agreed", "check_plugins", "unlike"]

STOP, END = "stop", "end"


class ValidationStop:
    """Whether one validation stops, decided without a collective operation: the ranks may have run
    different numbers of its batches, so none can wait in a collective at a batch the others may never
    reach. The first rank to claim the run's store key (``valid_stop/<n>``, the ``n``-th validation of
    the run, the same on every rank) decides: one with a stop request claims :data:`STOP` at its next
    batch, one done with its batches claims ``"end"`` before its ``stage_end``. After a ``"stop"`` every
    rank takes the stop agreement's collective at its next validation batch (it looks every ``every``
    batches) or as its batches end, and none runs ``stage_end`` (whose sums are collectives); after an
    ``"end"`` every rank runs the validation to its end and a request waits for ``stage_end``."""

    __slots__ = ("store", "key", "every", "batches", "decided")

    def __init__(self, store: Store, count: int, every: int) -> None:
        self.store, self.key, self.every = store, f"valid_stop/{count}", every
        self.batches = 0
        self.decided: str | None = None

    def stops(self, request: StopRequest | None, ended: bool) -> bool:
        """Whether this rank, after a validation batch (or after its last: ``ended``), with this pending
        ``request``, takes the stop agreement's collective now."""
        if self.decided is None:
            if ended or request is not None:  # the first claim wins; the store answers the winner
                self.decided = self.store.compare_set(self.key, "", STOP if request is not None else END).decode()
            else:
                self.batches += 1
                if self.batches % self.every == 0 and self.store.check([self.key]):
                    self.decided = self.store.get(self.key).decode()
        return self.decided == STOP


def agreed(asked: list[StopRequest | None]) -> StopRequest:
    """The stop the ranks agree on, from every rank's pending request (``None`` where none): ``by`` names each asker once (the same plugin on every
    rank is named once), ``ranks`` are those that asked, and the reason says it for a person
    (``"stop requested on ranks 0-3: SIGTERM"``; one part per distinct reason)."""
    wanted = [(rank, why) for rank, why in enumerate(asked) if why is not None]
    reasons: dict[str, list[int]] = {}
    for rank, request in wanted:
        reasons.setdefault(request.reason, []).append(rank)
    askers = dict.fromkeys(request.by for _, request in wanted if request.by)
    return StopRequest(
        "; ".join(f"stop requested on {_ranks(ranks)}: {reason}" for reason, ranks in reasons.items()),
        by=", ".join(askers) or None,
        # the run completes only if every rank that asked says so (not if one was signalled)
        complete=all(request.complete for _, request in wanted),
        ranks=tuple(rank for rank, _ in wanted),
        ends_process=any(request.ends_process for _, request in wanted),
    )


def check_plugins(loop: Run, dist: Any, world_size: int, group: ProcessGroup | None) -> None:
    """Every rank must run the plugins the others run, observers aside (one collective of ``dist``, the
    ``torch.distributed`` module, once): a plugin on some ranks only would take collectives the others never
    reach (a ``Checkpoint`` on rank 0: a hang)."""
    mine = [name for name, plugin in loop.pm.list_name_plugin()
            if plugin is not None and getattr(plugin, "observer", False) is not True]
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    if (where := unlike(everyone)) is not None:
        raise ValueError(f"distributed: the processes run different plugins ({where}); give every process the "
                         f"same plugins (observers aside: a plugin that only watches, a logger of yours, says "
                         f"observer = True in its class), or their collective operations would not match and "
                         f"the job would hang. The main process alone decides what a checkpoint writes where")


def unlike(names: list[list[str]]) -> str | None:
    """Where the ranks' plugins differ, from each rank's plugin names in the order they were registered, which is
    the order their hooks run in (``"'checkpoint' on rank 0 only"``, or the orders), or ``None`` where every rank
    runs the same."""
    everywhere = set.intersection(*map(set, names))
    odd = sorted({name for some in names for name in some} - everywhere)
    if not odd and any(some != names[0] for some in names):
        return "the same plugins in other orders: " + "; ".join(f"rank {r}: {', '.join(some)}"
                                                                  for r, some in enumerate(names))
    return "; ".join(f"{name!r} on {_ranks([r for r, some in enumerate(names) if name in some])} only"
                     for name in odd) or None


def _ranks(ranks: list[int]) -> str:
    """``"rank 1"``, ``"ranks 0, 1"``, ``"ranks 0-3, 6"``: sorted ranks, runs of three or more
    as ranges."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    parts = [f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs]
    return "ranks " + ", ".join(parts)
