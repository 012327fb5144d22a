"""optim: manual optimizer stepping, the way Lightning 2's manual optimization works.

The step function drives the optimizers itself; this plugin makes that correct under
gradient accumulation, clipping, mixed precision and non-finite losses::

    def train_step(loop, batch):
        loss = ...
        loop.backward(loss)                 # scaled for accumulation and AMP, hooks around it
        loop.optimizers.step()              # or loop.optimizers["gen"].step() when named
        loop.optimizers.zero_grad()
        return {"loss": loss}

* Optimizers come from ``Loop(optimizers=opt)`` or ``Loop(optimizers={"gen": g, "disc": d})``;
  during the run ``loop.optimizers`` is an :class:`Optimizers` mapping of
  :class:`ManagedOptimizer` (``.steps``: real steps, ``.skipped``), and with one optimizer
  ``loop.optimizers.step()`` needs no name. Without any, it says that none was given.
* ``accumulate=N``: each loss divided by its window's batches; ``step()`` and ``zero_grad()``
  take effect on every N-th training batch of an epoch and at its end
  (:mod:`~hookfit.plugins.optim.windows`).
* ``clip_norm`` / ``clip_value``: gradients are clipped (after unscaling) before each step.
* ``precision="bf16-mixed"`` or ``"16-mixed"`` (default ``"32"``): the step functions run under
  ``torch.autocast`` on the model's device (through ``loop.wrap_step``) while the weights stay
  float32; ``loop.backward`` leaves autocast for the backward pass. ``"16-mixed"`` and
  ``amp=True`` (autocast then the step's own) scale the loss with a ``torch.amp.GradScaler``.
* ``nonfinite="skip"`` (default): a non-finite loss is not back-propagated and its window's step
  is skipped, the first skip warned about at once, the total at the end of the run; ``"raise"``
  raises ``FloatingPointError``; ``None`` checks nothing. Gradients are checked too when
  clipping by norm or with ``check_grads=True``. On an accelerator (``defer=None``; ``True``
  takes that path on the CPU too, ``False`` never) the check never waits for the device, and
  ``fuse=True`` lets torch's Adam, AdamW and SGD skip on it in their fused kernel
  (:mod:`~hookfit.plugins.optim.nonfinite`; ``benchmarks/syncs.py`` counts the host reads).
* ``schedulers``, ``scheduler_interval``, ``monitor``: learning-rate schedulers stepped per
  step, per epoch, or on a monitored epoch mean (:mod:`~hookfit.plugins.optim.schedulers`).
* ``loop.optimizers.toggle("gen")``: the parameters of every other optimizer frozen for the
  ``with`` block, for alternating GAN updates (:mod:`~hookfit.plugins.optim.toggles`).
* A step that bypasses optim (``opt.step()``, ``loss.backward()``) is warned about in the first
  training stage (:mod:`~hookfit.plugins.optim.watch`).
* Checkpoints keep optimizers, schedulers, counters, the loss scale and an open window's
  gradients; a state of another optimizer class, parameter groups or schedulers is refused
  before anything is restored. A run that does not train (``Loop.validate(resume=...)``)
  restores none of it and needs no ``optimizers=``.
"""

from __future__ import annotations

from hookfit.plugins.optim.managed import ManagedOptimizer, Optimizers, UnknownOptimizer
from hookfit.plugins.optim.plugin import Optim, OptimWarning

__all__ = ["ManagedOptimizer", "Optim", "OptimWarning", "Optimizers", "UnknownOptimizer"]
