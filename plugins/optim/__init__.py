"""optim: manual optimizer stepping, as Lightning 2's manual optimization (options and design:
``plugins/optim/README.md``); the step drives the optimizers, correctly under gradient
accumulation, clipping, mixed precision and non-finite losses::

    def train_step(loop, batch):
        loss = ...
        loop.backward(loss)                 # scaled for accumulation and AMP, hooks around it
        loop.optimizers.step()              # or loop.optimizers["gen"].step() when named
        loop.optimizers.zero_grad()
        return {"loss": loss}
"""

from hookfit.plugins.optim.managed import ManagedOptimizer, OnlyOptimizer, Optimizers, UnknownOptimizer
from hookfit.plugins.optim.plugin import Optim, OptimWarning

__all__ = ["ManagedOptimizer", "OnlyOptimizer", "Optim", "OptimWarning", "Optimizers", "UnknownOptimizer"]
