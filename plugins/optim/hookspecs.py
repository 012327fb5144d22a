"""Events of the optim plugin: the backward pass and the optimizer steps, fired by the plugin
that owns them, and ``should_sync_gradients``, which it answers.

Declared by :class:`hookfit.plugins.optim.Optim` (its ``hookspecs`` attribute) and added to
every run whether ``optim`` is enabled, disabled or replaced: an optimizer plugin of another
package fires them with ``loop.hooks.<event>`` (``None`` when nothing listens) and answers
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
    where it stays on the device (an accelerator: a metrics publication, the stage's end...;
    ``reason`` then names the batch it happened in). Not fired for a step that raises
    (``nonfinite="raise"``). Observers mark it (the dashboard puts ``!`` on its curve),
    loggers count it. The return value is ignored.
    """


@hookspec(firstresult=True)
def should_sync_gradients(loop: Run) -> bool | None:
    """Asked before a training batch's step by a plugin that must know (the distributed
    plugin, whose data-parallel wrapper decides in the forward pass whether the backward pass
    all-reduces gradients, or, with FSDP2, reduce-scatters them): do this batch's backward
    passes close a gradient-accumulation window, so that the optimizers will step with the
    gradients they leave?

    Implemented by the plugin that owns the optimizer steps (optim). Answer ``True`` when the
    optimizers step after this batch (every batch without accumulation; the window's last
    batch with it, and the stage's last batch, where a partial window is stepped), and on the
    last batch before ``max_steps``: the run may end there with its window open, and the
    gradients a checkpoint keeps (from the main process) must be those of every process.
    Answer ``False`` inside a window, where gradients are only accumulated locally and need
    no synchronisation yet (synchronising early is harmless: the average is linear). When the
    stage's length is unknown (data without ``len()``) its last batch cannot be told in
    advance: answer ``True``. ``None`` (or no implementation) means ``True``: synchronise.
    Asked from the asking plugin's ``batch_start``, on the training thread:
    ``loop.state.batch_idx`` is the batch about to run and ``loop.state.step`` counts the
    training batches before it. First result.
    """
