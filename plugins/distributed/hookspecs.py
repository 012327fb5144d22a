"""Events of the distributed plugin: what a run on several processes offers the other plugins.

Declared by :class:`hookfit.plugins.distributed.Distributed` (its ``hookspecs`` attribute) and
added to every run whether ``distributed`` is enabled, disabled or replaced: the plugin that
runs the loop on several processes answers ``all_reduce``, and the plugins that need global
numbers (metrics) ask it, or use their own value when nothing answers (one process). Stopping
every process at the same boundary is the core's ``agree_stop``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hookfit import hookspec

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    import torch

    from hookfit.run import Run


@hookspec(firstresult=True)
def all_reduce(loop: Run, tensor: torch.Tensor) -> torch.Tensor | None:
    """Sum ``tensor`` over every process of the run and return the sum (a tensor of the same
    shape); every process must call it at the same point, as for any collective operation.

    Implemented by the plugin that runs the loop on several processes; when no plugin does,
    the run has one process and callers use their own value. Metrics plugins call it to
    publish global numbers (sums and counts, so that means stay weighted); with several
    processes they therefore publish at the same batch on every process (every N batches),
    never by the clock. In a validation stage processes may run different numbers of batches
    (see ``agree_stop``): call it there only at ``stage_end``, never per batch. First result.
    """
