"""Which processes of a run have a flag set, agreed by all of them: one tiny sum through the ``all_reduce`` event
(declared for every run; answered by the plugin that runs the loop on several processes, distributed)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run


def ranks_where(loop: Run, flag: bool) -> str | None:
    """The ranks whose ``flag`` is set, as messages name them (``"rank 0"``, ``"ranks 0, 2"``), or ``None``. Every
    process of the run calls it at the same point, as any collective operation; with one process (or ``all_reduce``
    unanswered: ``None``) its own flag alone."""
    state, reduce = loop.state, loop.hooks.all_reduce
    mine = torch.arange(state.world_size).eq(state.rank).float().mul_(float(flag))  # 1.0 at this rank's if set
    summed = reduce(loop, mine) if reduce is not None and state.world_size > 1 else None  # (None: not answered)
    ranks = [rank for rank, value in enumerate((mine if summed is None else summed).tolist()) if value]
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}" if ranks else None
