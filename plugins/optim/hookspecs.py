"""Events of the optim plugin, and the optimizer role: what a plugin that owns the backward pass
and the optimizer steps does, whether it is the built-in ``optim`` or a replacement (an
optimizer with several forward/backward passes per batch, as Sharpness-Aware Minimization).

The optimizer role. What it must do, all of it:

* Own the backward pass: implement the core's ``backward(loop, loss)`` (its contract is the
  core's) and fire ``before_backward`` and ``after_backward`` (below) around the pass, through
  ``loop.hooks.handlers(event)`` (taken once) or ``loop.hooks.<event>``.
* Fill ``loop.optimizers`` at ``configure`` with what the step drives (the core's events
  reference describes it), starting from what the ``Loop`` was given there: a
  ``torch.optim.Optimizer``, a mapping of names to them, or ``None`` (``Loop.validate()`` of a
  test set needs none). Do it in a plain ``configure``, not a ``tryfirst`` one: the distributed
  plugin's ``tryfirst`` ``configure`` finds the ``Loop``'s torch optimizers there and, with
  FSDP2, points their parameter groups at the sharded parameters, in place, before yours runs.
  ``loop.config.optimizers`` stays the user's. Every plugin reads ``loop.optimizers`` from
  ``fit_start`` on: EMA tells a managed run by both ``loop.hooks.backward`` implemented and
  ``loop.optimizers`` no longer being ``loop.config.optimizers`` (whatever their type, a
  subclass of ``torch.optim.Optimizer`` included); the metrics role publishes each one's
  ``param_groups[0]["lr"]`` as ``lr_<name>`` (a single optimizer is named ``"default"``),
  which the console, the dashboard, the loggers, ``metrics.jsonl`` and ``hookfit runs``,
  ``show`` and ``compare`` show; ``hookfit.testing``'s default step calls ``loop.backward``,
  ``loop.optimizers.step()`` and ``zero_grad()`` whenever a plugin implements ``backward``.
* Announce every real step of optimizer ``name`` (its name in ``loop.optimizers``):
  ``before_optimizer_step`` with its gradients final (unscaled, clipped), then
  ``after_optimizer_step`` once it and its per-step scheduler have stepped. EMA updates its
  average after each (with several optimizers, after the one it is told), gradient-norm
  loggers read the gradients before. A call that does not step (inside an accumulation window)
  announces nothing. A step skipped for non-finite values fires ``step_skipped`` instead: the
  dashboard marks its curve, loggers count it.
* Answer ``should_sync_gradients`` (below), asked before every training forward pass of a
  data-parallel model: which passes' backward synchronises gradients over the processes.
  Synchronise too often and a run is slower; too rarely and the processes step with gradients
  of their own, and their models drift apart.
* Finish the training stage in a ``tryfirst`` ``stage_end``: a partial accumulation window is
  stepped there, before the metrics role's ``trylast`` ``stage_end`` publishes the epoch (with
  the learning rates after it).
* Save and resume: ``save_state()`` returns all a resumed run needs to step exactly as an
  uninterrupted one (optimizer and scheduler states, counters, the loss scale, an open
  window's gradients), stored under the plugin's name by the checkpoint role
  (``loop.plugin_states()``); ``load_state(loop, state)`` restores it, and refuses a state that
  does not fit (other optimizer names, classes, parameter groups) before it changes anything.
  Leave tensors as they are: with FSDP2 optimizer states are sharded (``DTensor``), and the
  checkpoint plugin writes them from every process. A run that does not train
  (``loop.mode == "validate"``) may have no optimizers: it loads nothing.
* Errors: code a step calls (``loop.backward``, a managed ``step()``) lives in the plugin's own
  module or package, so that an error raised there names the plugin, with the step that called
  it.
* Speed: nothing per batch that a run does not need (the built-in takes part in no per-batch
  event without accumulation or loss scaling: its ``batch_events``); no host-device
  synchronisation per step.

Replace the built-in by giving ``Loop(plugins=[...])`` a plugin whose ``name`` is ``"optim"``,
by naming your entry point ``optim``, or by disabling it (``HOOKFIT_DISABLE_PLUGINS=optim``).
Accumulation, clipping, mixed precision, schedulers and the non-finite policy are the
built-in's own features (:class:`hookfit.plugins.optim.Optim`), not the role's.

These events are declared by :class:`hookfit.plugins.optim.Optim` (its ``hookspecs``
attribute) and added to every run whether ``optim`` is enabled, disabled or replaced: an
optimizer plugin of another package fires them with ``loop.hooks.<event>`` and answers
``should_sync_gradients``, and the plugins that listen (a gradient-norm logger, EMA, the
dashboard, the console) or ask (distributed) keep working. The backward pass itself is the
core's ``backward`` event (``loop.backward(loss)``); these are the moments around it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hookfit import hookspec

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    import torch

    from hookfit.run import Run


@hookspec
def before_backward(loop: Run, loss: torch.Tensor) -> None:
    """The plugin that owns the backward pass is about to run it on ``loss``.

    ``loss`` is the tensor as the step passed it (before any accumulation or AMP scaling).
    The return value is ignored. Fires inside the step function, on the training thread.
    """


@hookspec
def after_backward(loop: Run, loss: torch.Tensor) -> None:
    """The backward pass on ``loss`` is done: gradients are accumulated on the parameters.

    They may still be scaled for mixed precision and are not clipped yet; read them in
    ``before_optimizer_step`` for their final values. The return value is ignored.
    """


@hookspec
def before_optimizer_step(loop: Run, name: str, optimizer: torch.optim.Optimizer) -> None:
    """Optimizer ``name`` is about to step: gradients are final (unscaled and clipped).

    Fires only for real steps (not for calls skipped inside a gradient-accumulation window or
    because of a non-finite loss known on the host). On an accelerator the built-in ``optim``
    may issue a step that the optimizer's kernel or the ``GradScaler`` then skips on the
    device (a non-finite loss not read yet): it fires for that step too. A gradient-norm
    logger reads the gradients here (on an accelerator, better without a host read per step:
    keep the norm as a tensor). The return value is ignored; a plugin must not replace the
    optimizer.
    """


@hookspec
def after_optimizer_step(loop: Run, name: str, optimizer: torch.optim.Optimizer) -> None:
    """Optimizer ``name`` has stepped; its learning-rate scheduler (per-step) has stepped too.

    Fires once per optimizer step, after ``before_optimizer_step``, including a step skipped
    on the device (see ``before_optimizer_step``). The return value is ignored.
    """


@hookspec
def step_skipped(loop: Run, optimizer: str, reason: str, step: int) -> None:
    """An optimizer step was skipped: ``optimizer`` names it, ``reason`` says why and where
    (``"non-finite loss at epoch 2, batch 7"``), ``step`` is the global step the run was at
    when the skip became known on the host.

    Fired by the plugin that owns the optimizer steps (optim), once per skipped step, on the
    training thread: at once where the check reads the host (the CPU), at the next host read
    where it stays on the device (an accelerator: the stage's end, a checkpoint...;
    ``reason`` then names the batch it happened in). Not fired for a step that raises
    (``nonfinite="raise"``). Observers mark it (the dashboard puts ``!`` on its curve),
    loggers count it. The return value is ignored.
    """


@hookspec(firstresult=True)
def should_sync_gradients(loop: Run) -> bool | None:
    """Should the backward pass of the training forward pass about to run synchronise its
    gradients over the processes (DDP's all-reduce, FSDP2's reduce-scatter)?

    When it is asked: by the plugin that runs a data-parallel model (distributed), from a
    forward pre-hook of that model, before every forward pass of it while ``loop.training``
    with gradients enabled: inside the step function, on the training thread, once per pass.
    A step with several passes is asked before each, in order: the step's own, then those of a
    closure it gives ``loop.optimizers.step(closure)``. ``loop.state.batch_idx`` is the running
    batch and ``loop.state.step`` counts the training batches before it. Validation,
    ``predict`` and forwards under ``torch.no_grad()`` are not asked; nor is anything in a run
    without a data-parallel model (one process). Several forwards that feed one backward are
    each asked: answer them alike.

    What to answer: ``True`` when the optimizers will step with the gradients this pass leaves
    (on their own, or summed with those of earlier passes answered ``False``): every pass of a
    plain batch; the window's last micro-batch with gradient accumulation, and the training
    stage's last batch, where a partial window is stepped; the pass whose gradients a
    Sharpness-Aware Minimization step takes (the closure's). ``False`` when they are not yet
    what the step takes: micro-batches inside a window, a pass that only prepares the step
    (SAM's first, which finds where to perturb the weights). A pass answered ``False`` costs no
    communication and leaves each process gradients of its own:

    * with DDP in the parameters' ``.grad``, different on every process; the next pass
      answered ``True`` all-reduces what ``.grad`` then holds (its own gradients added to
      those left), so what must not count is taken out first: SAM without accumulation zeroes
      them (``zero_grad()``); with accumulation, zeroing would lose the window's sum, so set
      the window's gradients aside before the local pass and add them back after the
      synchronised one;
    * with FSDP2 inside the model, unsharded (the sharded parameters' ``.grad`` stays as it
      was), until the next synchronised pass adds its own and reduce-scatters the sum: they can
      be neither read nor zeroed through the optimizers, so answer ``False`` there only for
      passes whose gradients are to be summed with the next synchronised one (accumulation),
      and ``True`` for a pass whose gradients the optimizer reads itself (SAM's first).

    Synchronising a pass that need not be is harmless (the average is linear), only slower;
    stepping with unsynchronised gradients makes the processes' models drift apart. When in
    doubt, answer ``True``; ``None`` (or no implementation) means ``True``.

    The built-in ``optim`` answers per batch, every pass of a batch alike: ``True`` when the
    optimizers step after this batch, and on the last batch before ``max_steps`` (the run may
    end there with its window open, and the gradients a checkpoint keeps from the main process
    must be those of every process); ``False`` inside a window. When the stage's length is
    unknown (data without ``len()``) its last batch cannot be told in advance: ``True``.
    First result.
    """
