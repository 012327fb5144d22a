"""optim: manual optimizer stepping, the way Lightning 2's manual optimization works. The step
function drives the optimizers; this plugin makes that correct under gradient accumulation,
clipping, mixed precision and non-finite losses::

    def train_step(loop, batch):
        loss = ...
        loop.backward(loss)                 # scaled for accumulation and AMP, hooks around it
        loop.optimizers.step()              # or loop.optimizers["gen"].step() when named
        loop.optimizers.zero_grad()
        return {"loss": loss}

``Optim(accumulate, clip_norm, clip_value, amp, nonfinite, check_grads, schedulers,
scheduler_interval, monitor, precision, defer, fuse)``: what each option does, and the design
behind them, is ``plugins/optim/README.md`` (its section "Options" first).
"""

from __future__ import annotations

from hookfit.plugins.optim.managed import ManagedOptimizer, Optimizers, UnknownOptimizer
from hookfit.plugins.optim.plugin import Optim, OptimWarning

__all__ = ["ManagedOptimizer", "Optim", "OptimWarning", "Optimizers", "UnknownOptimizer"]
