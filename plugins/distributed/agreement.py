"""What several processes must agree on: the stop, from every rank's pending request (who asked, on which
ranks, and a reason a person reads: ``"stop requested on ranks 0-3: SIGTERM"``), and the plugins they run."""

from __future__ import annotations

from hookfit.payloads import StopRequest

__all__ = ["agreed", "unlike"]


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
