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
  :class:`ManagedOptimizer`, and with one optimizer ``loop.optimizers.step()`` needs no name.
* ``accumulate=N``: the loss is divided by N; ``step()`` and ``zero_grad()`` take effect only on
  every N-th training batch of an epoch; a partial window at the end of the epoch is stepped
  at the end of the training stage, its losses divided by the batches it holds when the
  training data has a length (by N when it has none). See :class:`Optim`.
* ``clip_norm`` / ``clip_value``: gradients are clipped (after unscaling) before each step;
  each must be a positive finite number (or ``None``), checked when ``Optim`` is built.
* ``precision="bf16-mixed"`` or ``"16-mixed"`` (default ``"32"``): the step functions run under
  ``torch.autocast`` on the model's device (through ``loop.wrap_step``), so their forward pass
  computes in bfloat16 or float16 while the weights stay float32, with the step unchanged;
  ``loop.backward`` leaves autocast for the backward pass. ``"16-mixed"`` also scales the loss
  with a ``torch.amp.GradScaler``.
* ``amp=True``: the loss is scaled with ``torch.amp.GradScaler`` (autocast in the forward pass
  is then the step's own ``torch.autocast`` block).
* ``nonfinite="skip"`` (default): a non-finite loss is not back-propagated and its window's step
  is skipped; the first skip is warned about at once, the total at the end of the run.
  ``"raise"`` raises ``FloatingPointError``; ``None`` checks nothing. Gradients are checked
  too when clipping by norm (the norm is computed anyway) or with ``check_grads=True``. On the
  CPU the check reads the loss (no synchronisation there). On an accelerator (``defer``, by
  default whenever the loss is not on the CPU; ``defer=True`` takes that path on the CPU too,
  ``defer=False`` never) it never waits for the device: the loss's finiteness is kept in a flag
  there, a step skips on it where its kernel can (torch's fused kernels, to which ``fuse=True``,
  the default, switches torch's Adam, AdamW and SGD where they take the parameters), and the
  skip is counted, warned about or raised for at optim's next host read (the training stage's
  end, a checkpoint, every ``READ_EVERY`` windows); see :mod:`hookfit.plugins.optim.nonfinite`,
  and ``benchmarks/syncs.py`` for the host reads per step, counted.
* ``schedulers``: one scheduler (a chain too: torch's ``ChainedScheduler``, ``SequentialLR``), a
  list of them, or a dict keyed like the optimizers; each drives the optimizer it was built on.
  Each steps after every real step of its optimizer (by default, or ``scheduler_interval="step"``)
  or at each epoch end (``"epoch"``); a ``ReduceLROnPlateau`` steps on ``monitor``
  (``Optim(schedulers=ReduceLROnPlateau(opt), monitor="valid/loss")``), the epoch mean the
  metrics plugin publishes once that stage is complete. All of it is checked when ``Optim`` is
  built, and against the run's optimizers when the run starts: see
  :mod:`hookfit.plugins.optim.schedulers`.
* ``loop.optimizers.toggle("gen")``: a context in which the parameters of every other optimizer
  are frozen (for alternating GAN updates); their ``requires_grad`` flags are restored after. A
  backward pass that fails because a toggle froze what it needed (a generator's output computed
  inside the discriminator's toggle, back-propagated later) gets a note naming the toggle and
  the parameters it froze (:mod:`hookfit.plugins.optim.toggles`).
* Counters: ``loop.optimizers[name].steps`` (real steps) and ``.skipped``; the loop's global step
  counts batches, not optimizer steps.
* A step function that steps its own optimizer variable (``opt.step()``) instead of
  ``loop.optimizers.step()`` bypasses all of the above: during the run's first training stage
  a torch step pre-hook on each optimizer notices such a step and one ``OptimWarning`` names
  the optimizer and the call to make instead. The hooks are then removed, so later batches
  pay nothing for it.
* Without ``Loop(optimizers=...)``, ``loop.optimizers.step()`` says that no optimizer was given.
* A run that does not train (``Loop.validate(resume=...)``) restores no optimizer or scheduler
  state from the checkpoint and steps no scheduler: it needs no ``optimizers=``, and any it is
  given keep their own state. A training run resumed with other optimizers is refused.
* Checkpoints record each optimizer's class: resuming a state into an optimizer of another
  class (Adam's into SGD), or with other parameter groups, is a ``ValueError`` naming the
  optimizer and both, before anything is restored.
"""

from __future__ import annotations

from hookfit.plugins.optim.managed import ManagedOptimizer, Optimizers, UnknownOptimizer
from hookfit.plugins.optim.plugin import Optim, OptimWarning

__all__ = ["ManagedOptimizer", "Optim", "OptimWarning", "Optimizers", "UnknownOptimizer"]
