"""optim's watch for steps that bypass it: a step function that steps its own optimizer
variable (``opt.step()``) instead of ``loop.optimizers.step()`` skips optim's clipping,
accumulation, loss scaling, non-finite policy, schedulers and counters. During the run's first
training stage a torch step pre-hook on each managed optimizer
(:meth:`~hookfit.plugins.optim.ManagedOptimizer.watch`) notices such a step, and one
:class:`~hookfit.plugins.optim.OptimWarning` names the optimizer and the call to make instead.

The same stage watches for a backward pass that bypasses it: a step function calling
``loss.backward()`` instead of ``loop.backward(loss)`` skips the loss's division for
accumulation and its scaling. A hook on each parameter of the managed optimizers
(:class:`~hookfit.plugins.support.GradientWatch`) tells gradients that appear outside
``loop.backward`` (which a wrapper of the ``backward`` event marks). One ``OptimWarning`` names the step function and
``loop.backward``; where the bypass trains another model than the script means (accumulation,
loss scaling, several processes) it is a ``RuntimeError`` instead, raised from that
``loss.backward()`` call, before the first optimizer step. The hooks and the wrapper are gone
after :data:`WATCHED_PASSES` passes through ``loop.backward`` (a step that bypasses it does so
at once, in every batch) or at the end of the first training stage, leaving nothing in the
backward pass, and the steps' pre-hooks with them (a step function that steps its own optimizer does so within as many batches, unless
it steps less often than every :data:`WATCHED_PASSES` batches): no per-step cost is left.

At the end of the first training stage, a stage whose batches went through ``loop.backward``
and in which no managed optimizer stepped (taken or skipped) gets one ``OptimWarning``: optim
steps when the step function asks (``loop.optimizers.step()``), and a step function that never
asks trains nothing.

:class:`Watch` is that part of the plugin's class."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import torch

from hookfit import hookimpl
from hookfit.plugins.support import GradientWatch
from hookfit.plugins.optim.nonfinite import OptimWarning
from hookfit.stopping import qualname

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.plugins.optim.managed import ManagedOptimizer, Optimizers
    from hookfit.run import Run

_TORCH = os.path.dirname(torch.__file__)

WATCHED_PASSES = 16
"""Backward passes through ``loop.backward`` after which the watch for ``loss.backward()``
ends (it costs about 2 µs a pass while it lasts)."""


class Watch:
    """The watch for steps that bypass :class:`~hookfit.plugins.optim.Optim` (a part of its
    class)."""

    # the plugin's, read here
    loop: Run | None
    optimizers: Optimizers | None

    def __init__(self) -> None:
        self._watching = False  # steps that bypass loop.optimizers are being watched for
        self._watched = False  # this run's first training stage was (is) watched
        self._first_stage = False  # this run's first training stage is running
        self._bypass_seen = False  # the warning about such a step was given in this run
        self._in_backward = False  # inside loop.backward (marked by _BackwardMark)
        self._grad_hooks = GradientWatch((), self._grad_arrived)  # while watching for loss.backward()
        self._mark: _BackwardMark | None = None
        self._backward_bypassed = False  # the warning (or error) about it was given in this run
        self._passes = 0  # backward passes through loop.backward while watched
        self._steps_at = 0  # the optimizers' steps (taken or skipped) when the watch began
        self._unstepped_said = False  # the warning that no optimizer steps was given in this run

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
        ``_fast_watched``). Only the run's first training stage is watched, and only its first
        :data:`WATCHED_PASSES` passes through ``loop.backward`` when the step function makes them
        (such a step happens in every batch, or every few): afterwards the hooks are removed and
        ``step()`` takes the plain fast path again, with no per-batch cost left."""
        assert self.optimizers is not None
        self._watching = on
        for managed in self.optimizers.values():
            if on:
                managed.watch()
            else:
                managed.unwatch()
        self._watch_grads(on)
        self._set_fast_paths()

    def _watch_grads(self, on: bool) -> None:
        """Watch (or stop watching) for gradients that appear on the managed optimizers'
        parameters outside ``loop.backward``: a hook on each parameter that requires a
        gradient, and a wrapper of the ``backward`` event that marks optim's own passes."""
        assert self.optimizers is not None
        self._grad_hooks.remove()
        if self._mark is not None:
            if self.loop is not None and self.loop.pm.is_registered(self._mark):
                self.loop.pm.unregister(self._mark)
            self._mark = None
        if not on or self.loop is None or self._backward_bypassed:
            return
        watched: dict[int, torch.Tensor] = {}
        for managed in self.optimizers.values():
            for param in managed._params:
                if param.requires_grad and param.is_leaf:
                    watched.setdefault(id(param), param)
        self._grad_hooks = GradientWatch(watched.values(), self._grad_arrived)
        self._mark = _BackwardMark(self)
        self._passes = 0
        self._steps_at = self._stepped()
        self.loop.pm.register(self._mark, name="optim.backward_watch")

    def _stepped(self) -> int:
        """The managed optimizers' steps so far, taken or skipped (a non-finite loss)."""
        return sum(m.steps + m.skipped for m in self.optimizers.values()) if self.optimizers is not None else 0

    def _check_stepped(self, passes: int) -> None:
        """At the end of the first training stage, ``passes`` backward passes through
        ``loop.backward`` were made and no optimizer stepped: the step function never calls
        ``loop.optimizers.step()``, and the model does not train. One
        :class:`~hookfit.plugins.optim.OptimWarning` a run says so (a step function that steps
        every k batches, k within the epoch, is not warned about)."""
        if self._unstepped_said or passes == 0 or self._bypass_seen or self._stepped() != self._steps_at:
            return
        self._unstepped_said = True
        step = qualname(self.loop.train_step) if self.loop is not None else "the training step"
        warnings.warn(f"optim: step function {step!r} called loop.backward(loss) in the first training epoch and no "
                      f"optimizer stepped in all of it: the parameters do not change. optim steps when the step function asks: call "
                      f"loop.optimizers.step() and loop.optimizers.zero_grad() after loop.backward(loss)",
                      OptimWarning, stacklevel=2)

    def _grad_arrived(self, tensor: torch.Tensor) -> None:
        if not self._in_backward and not self._backward_bypassed:
            self._grad_bypassed()

    def _grad_bypassed(self) -> None:
        """Gradients appeared without ``loop.backward``: warn once a run, or raise where the
        run would train another model than the script means."""
        self._backward_bypassed = True
        loop = self.loop
        step = qualname(loop.train_step) if loop is not None else "the training step"
        why = []
        accumulate = getattr(self, "accumulate", 1)
        if accumulate > 1:
            why.append(f"accumulate={accumulate} (each loss must be divided by the window)")
        if getattr(self, "scaler", None) is not None:
            why.append("loss scaling (precision='16-mixed' or amp: the loss must be scaled)")
        if loop is not None and loop.state.world_size > 1:
            why.append(f"{loop.state.world_size} processes")
        where = f" (epoch {loop.state.epoch}, batch {loop.state.batch_idx})" if loop is not None else ""
        message = (f"optim: gradients appeared on the parameters of the run's optimizers outside "
                   f"loop.backward{where}: step function {step!r} calls loss.backward() itself, "
                   f"which bypasses optim's")
        if why:
            raise RuntimeError(f"{message} handling of {', '.join(why)}; the run would train another "
                               f"model than the script means. Call loop.backward(loss) in {step!r} instead")
        warnings.warn(f"{message} hooks around the backward pass (before_backward/after_backward) and "
                      f"its non-finite-loss check. Call loop.backward(loss) in {step!r} instead",
                      OptimWarning, stacklevel=_caller_level())

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


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside this module and torch (the line of the
    step function that called ``loss.backward()``), for ``warnings.warn`` called from here."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and (frame.f_code.co_filename == __file__
                                        or frame.f_code.co_filename.startswith(_TORCH)):
        frame, level = frame.f_back, level + 1
    return level


class _BackwardMark:
    """A wrapper of the ``backward`` event, registered during the first training stage only:
    it marks the backward passes that go through ``loop.backward`` (whoever implements it)."""

    def __init__(self, owner: Watch) -> None:
        self.owner = owner

    @hookimpl(wrapper=True, tryfirst=True)
    def backward(self, loop: Run, loss: torch.Tensor) -> Generator[None, Any, Any]:
        owner = self.owner
        owner._in_backward = True
        try:
            return (yield)
        finally:
            owner._in_backward = False
            owner._passes += 1
            if owner._passes >= WATCHED_PASSES:  # seen enough: the rest of the run pays nothing
                owner._watch(False)  # (the steps' watch too: a bypassing step happens as early)
