"""Events of the optim plugin, and the optimizer role: what a plugin that owns the backward pass
and the optimizer steps does, the built-in ``optim`` or a replacement (an optimizer with several
forward/backward passes per batch, as Sharpness-Aware Minimization). It must:

* Own the backward pass: implement the core's ``backward(loop, loss)`` and fire ``before_backward`` and
  ``after_backward`` around the pass, through ``loop.hooks.handlers(event)`` (taken once) or ``loop.hooks.<event>``.
* Fill ``loop.optimizers`` in a plain ``configure`` (the distributed plugin's ``tryfirst`` one first
  points the torch optimizers' parameter groups at FSDP2's sharded parameters, in place) with what
  the step drives (see the core's events reference), from what the ``Loop`` was given: a
  ``torch.optim.Optimizer``, a mapping of names to them, or ``None`` (``Loop.validate()`` needs
  none); ``loop.config.optimizers`` stays the user's. Every plugin reads ``loop.optimizers`` from
  ``fit_start`` on: EMA tells a managed run by ``loop.hooks.backward`` implemented and
  ``loop.optimizers`` not being ``loop.config.optimizers``; the metrics role publishes each one's
  learning rates (``MetricsSnapshot.lr``), those of its latest step where an item has ``used_lrs`` (the
  built-in's, with schedulers: one per group); ``hookfit.testing``'s default step calls ``loop.backward``,
  ``loop.optimizers.step()`` and ``zero_grad()`` when a plugin implements ``backward``.
* Announce every real step of optimizer ``name`` (its name in ``loop.optimizers``) with
  ``before_optimizer_step`` and ``after_optimizer_step`` (EMA averages after it, gradient-norm
  loggers read before), and a skipped one with ``step_skipped``; a call that does not step (inside
  an accumulation window) announces nothing.
* Answer ``should_sync_gradients``: too often and a run is slower; too rarely and the processes
  step with gradients of their own, and their models drift apart.
* Finish the training stage in a ``tryfirst`` ``stage_end`` (a partial accumulation window
  stepped), before the metrics role's ``trylast`` one publishes the epoch with the learning rates.
* Save and resume: ``save_state()`` returns all a resumed run needs to step exactly as an
  uninterrupted one (optimizer and scheduler states, counters, the loss scale, an open window's
  gradients), stored under the plugin's name (``loop.plugin_states()``); ``load_state(loop,
  state)`` restores it, and refuses a state that does not fit (other optimizer names, classes,
  parameter groups) before it changes anything. Leave tensors as they are: with FSDP2 optimizer
  states are sharded (``DTensor``) and written from every process. A run that does not train
  (``loop.mode == "validate"``) may have no optimizers: it loads nothing.
* Keep the code a step calls (``loop.backward``, a managed ``step()``) in the plugin's own package,
  so that an error raised there names the plugin. Leave out the loop's per-batch events a run does not
  need (``batch_events``), and do no host-device synchronisation per step.

Replace the built-in with a plugin named ``"optim"`` given to ``Loop(plugins=[...])``, an entry point
named ``optim``, or by disabling it (``HOOKFIT_DISABLE_PLUGINS=optim``). Accumulation, clipping, mixed
precision, schedulers and the non-finite policy are the built-in's features, not the role's. A
replacement fires these events with ``loop.hooks.<event>``: they are declared for every run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hookfit import hookspec

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    import torch

    from hookfit.run import Run


@hookspec
def before_backward(loop: Run, loss: torch.Tensor) -> None:
    """The backward pass is about to run on ``loss`` as the step passed it (not yet divided or scaled),
    inside the step function, on the training thread. The return value is ignored."""


@hookspec
def after_backward(loop: Run, loss: torch.Tensor) -> None:
    """The backward pass on ``loss`` is done: gradients are accumulated, maybe still scaled and not
    clipped (``before_optimizer_step`` sees them final). The return value is ignored."""


@hookspec
def before_optimizer_step(loop: Run, name: str, optimizer: torch.optim.Optimizer) -> None:
    """Optimizer ``name`` is about to step: gradients are final (unscaled and clipped).

    Fires only for real steps (not inside an accumulation window, nor for a step skipped for a non-finite value known
    on the host), also for one the optimizer's kernel or the ``GradScaler`` then skips on the device (the built-in
    ``optim`` on an accelerator). A gradient-norm logger reads the gradients here (on an accelerator, as a tensor: no
    host read per step); one reading some steps returns at once on the others, a Python call per step
    (``batch_events`` leaves a plugin out of the loop's per-batch events, not the optimizer steps). Return ignored; do
    not replace the optimizer. ``lr_find``'s sweep steps fire it (and ``after_optimizer_step``) outside any stage
    (``loop.state.stage is None``: a per-step schedule returns then); its rate is set after them.

    ``loop.state.batch_idx`` is the batch that closes the step; ``loop.state.step`` counts the training batches
    done: inside the step function (the usual case, an epoch's last partial window included when the data has a
    ``len()``) it is the running batch's global number (from 0), but a partial window stepped at the stage's end
    (optim's ``tryfirst`` ``stage_end``, data without a ``len()``) sees the last batch done too (6 after a first
    epoch of batches 0-5). Keep ``step`` from ``batch_start`` for the closing batch's number in both;
    ``loop.optimizers[name].steps`` counts real steps before this."""


@hookspec
def after_optimizer_step(loop: Run, name: str, optimizer: torch.optim.Optimizer) -> None:
    """Optimizer ``name`` and its per-step learning-rate schedulers have stepped (where a plugin acts "after the
    optimizer step": averages, masks): once per step announced by ``before_optimizer_step``, after it, with the same
    ``loop.state`` (see there: ``lr_find``'s sweep too), and ``loop.optimizers[name].steps`` counting this step."""


@hookspec
def step_skipped(loop: Run, optimizer: str, reason: str, step: int) -> None:
    """An optimizer step was skipped: ``optimizer`` names it, ``reason`` says why and where
    (``"non-finite loss at epoch 2, batch 7"``: epochs and batches counted from 1, as the console counts them;
    ``batch 7`` is ``loop.state.batch_idx == 6``), ``step`` is the global step the run was at when the skip
    became known on the host.

    Fired once per skipped step, on the training thread: at once where the check reads the host (the
    CPU), at the next host read where it stays on the device (an accelerator: the stage's end, a
    checkpoint...; ``reason`` then names the batch). Not fired for a step that raises
    (``nonfinite="raise"``). The dashboard marks it, loggers count it. The return value is ignored."""


@hookspec(firstresult=True)
def should_sync_gradients(loop: Run) -> bool | None:
    """Should the backward pass of the training forward pass about to run synchronise its gradients
    over the processes (DDP's all-reduce, FSDP2's reduce-scatter)?

    Asked by the plugin that runs a data-parallel model (distributed), from a forward pre-hook of
    that model, before every forward pass while ``loop.training`` with gradients enabled: inside the
    step function, on the training thread, once per pass, in order (the step's own, then those of a
    closure it gives ``loop.optimizers.step(closure)``). ``loop.state.batch_idx`` is the running
    batch, ``loop.state.step`` counts the training batches before it. Not asked in validation,
    ``predict``, under ``torch.no_grad()``, nor without a data-parallel model. Several forwards that
    feed one backward are each asked: answer alike.

    ``True`` when the optimizers will step with the gradients this pass leaves (alone, or summed
    with those of earlier passes answered ``False``): every pass of a plain batch; an accumulation
    window's last micro-batch, and the training stage's last batch (a partial window is stepped);
    the pass whose gradients a Sharpness-Aware Minimization step takes (the closure's). ``False``
    when they are not yet what the step takes: micro-batches inside a window, a pass that only
    prepares the step (SAM's first). A pass answered ``False`` costs no communication and leaves
    each process gradients of its own:

    * with DDP in the parameters' ``.grad``; the next pass answered ``True`` all-reduces what
      ``.grad`` then holds (its own added), so what must not count is taken out first: SAM without
      accumulation zeroes them; with accumulation, set the window's gradients aside before the
      local pass and add them back after the synchronised one;
    * with FSDP2 inside the model, unsharded (the sharded ``.grad`` stays as it was) until the next
      synchronised pass adds its own and reduce-scatters the sum: neither readable nor zeroable
      through the optimizers, so answer ``False`` only for passes summed with the next synchronised
      one (accumulation), ``True`` for a pass whose gradients the optimizer reads (SAM's first).

    Synchronising a pass that need not be is harmless (the average is linear), only slower. When
    in doubt, answer ``True``; ``None`` (or no implementation) means ``True``. First result. The
    built-in ``optim``'s answer: ``plugins/optim/README.md``, "The accumulation window"."""
