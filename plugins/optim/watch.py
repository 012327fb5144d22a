"""optim's watch for steps that bypass it: a step function that steps its own optimizer
variable (``opt.step()``) instead of ``loop.optimizers.step()`` skips optim's clipping,
accumulation, loss scaling, non-finite policy, schedulers and counters. During the run's first
training stage a torch step pre-hook on each managed optimizer
(:meth:`~hookfit.plugins.optim.ManagedOptimizer.watch`) notices such a step, and one
:class:`~hookfit.plugins.optim.OptimWarning` names the optimizer and the call to make instead.
:class:`Watch` is that part of the plugin's class."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from hookfit.plugins.optim.nonfinite import OptimWarning

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.plugins.optim.managed import ManagedOptimizer, Optimizers
    from hookfit.run import Run


class Watch:
    """The watch for steps that bypass :class:`~hookfit.plugins.optim.Optim` (a part of its
    class)."""

    # the plugin's, read here
    loop: Run | None
    optimizers: Optimizers | None

    def __init__(self) -> None:
        self._watching = False  # steps that bypass loop.optimizers are being watched for
        self._watched = False  # this run's first training stage was (is) watched
        self._bypass_seen = False  # the warning about such a step was given in this run

    def _set_fast_paths(self) -> None:
        """The plugin's (``Optim._set_fast_paths``): the fast path marks optim's own steps
        while they are watched."""
        raise NotImplementedError

    def _watch(self, on: bool) -> None:
        """Watch (or stop watching) for steps of the managed optimizers that do not go through
        ``loop.optimizers`` (a step function stepping its own optimizer variable), which would
        bypass clipping, accumulation, loss scaling, the non-finite policy, schedulers and the
        counters. A torch step pre-hook on each optimizer tells, with a flag optim sets only
        while it steps (``ManagedOptimizer._own``; on the fast path that is a variant of it,
        ``_fast_watched``). Only the run's first training stage is watched (such a step happens
        in every batch): afterwards the hooks are removed and ``step()`` takes the plain fast
        path again, with no per-batch cost left."""
        assert self.optimizers is not None
        self._watching = on
        for managed in self.optimizers.values():
            if on:
                managed.watch()
            else:
                managed.unwatch()
        self._set_fast_paths()

    def _bypassed(self, managed: ManagedOptimizer) -> None:
        """A managed optimizer was stepped by someone else than optim: warn, once a run."""
        if self._bypass_seen:
            return
        self._bypass_seen = True
        several = self.optimizers is not None and len(self.optimizers) > 1
        call = f"loop.optimizers[{managed.name!r}].step()" if several else "loop.optimizers.step()"
        state = self.loop.state if self.loop is not None else None
        where = f" (epoch {state.epoch}, batch {state.batch_idx})" if state is not None else ""
        warnings.warn(
            f"optim: optimizer {managed.name!r} ({type(managed.optimizer).__name__}) was stepped "
            f"directly{where}, not through loop.optimizers: such a step bypasses optim's "
            f"gradient clipping, accumulation, loss scaling, non-finite checks, schedulers and "
            f"step counters. Call {call} in the step function instead of the optimizer's own "
            f"step()",
            OptimWarning,
            stacklevel=4,  # the step function's line: here, the hook, torch's step wrapper
        )
