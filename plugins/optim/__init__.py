"""optim: manual optimizer stepping, as Lightning 2's manual optimization: the step drives the optimizers,
correctly under gradient accumulation, clipping, mixed precision and non-finite losses (the step function,
the options and the design: ``plugins/optim/README.md``)."""

from hookfit.plugins.optim.managed import ManagedOptimizer, OnlyOptimizer, Optimizers, UnknownOptimizer
from hookfit.plugins.optim.plugin import Optim, OptimWarning

__all__ = ["ManagedOptimizer", "OnlyOptimizer", "Optim", "OptimWarning", "Optimizers", "UnknownOptimizer"]
