"""optim's watch for steps and backward passes that bypass it, in the first training stage (README.md)."""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch

from hookfit.errors import user_level
from hookfit.plugins.support import Accumulation, GradientWatch, StepOrder, Untouched, changed_in_window
from hookfit.plugins.optim.nonfinite import OptimWarning, at
from hookfit.stopping import qualname

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from torch.utils.hooks import RemovableHandle

    from hookfit.plugins.optim.managed import Optimizers
    from hookfit.plugins.optim.plugin import Window
    from hookfit.run import Run

_TORCH = os.path.dirname(torch.__file__)

WATCHED_PASSES = 16
"""Backward passes through ``loop.backward`` after which the watch ends (about 2 µs a pass while it lasts)."""


class Watch:
    """The watch for steps and passes that bypass optim, which marks its own: :attr:`stepping`, :attr:`inside`."""

    def __init__(self) -> None:
        self.active = self.stepping = self.inside = False  # active: steps and gradients bypassing optim are watched
        self._handles: list[RemovableHandle] = []  # the step pre-hooks
        self._grad_hooks, self._outside = GradientWatch((), self._grad_arrived), Accumulation((), self._bypassed)
        self._own_backward = True  # loop.backward runs optim's pass
        self._passes = self._steps_at = self._at = 0  # watched passes; steps (taken, skipped) and batches at its start
        self.start(None, None, [])

    def start(self, loop: Run | None, optimizers: Optimizers | None, why: list[str],
              counts: Callable[[], None] = lambda: None, window: Window | None = None) -> None:
        """A run begins (``configure``); ``why``: what a bypassed ``loop.backward`` breaks in it; ``counts``: the
        check of schedulers stepped elsewhere, made before each watched optimizer step; ``window``: optim's, whose
        gradients the step function must leave between its passes (:class:`Untouched`) where it spans batches."""
        self.loop, self._optimizers, self._why, self._counts, self._window = loop, optimizers, why, counts, window
        self._watched = self._first_stage = False  # this run's first training stage was watched; is running
        self._bypass_seen = self._backward_bypassed = False  # said: a step, a backward pass bypassing optim
        self._grads: bool | None = None  # whether a torch step while watched had a gradient (None: no step)
        self._order, self._passing = StepOrder(), False  # the step function's order; this pass has begun
        self._said: set[str] = set()  # what _check_order warned of

    def stage_start(self, own_backward: bool) -> None:
        """A training stage begins: the run's first is watched (gradients only where ``own_backward``)."""
        if not self._watched and self._optimizers is not None:
            self._watched, self._first_stage, self._own_backward = True, True, own_backward
            self._watch(True)

    def stage_end(self) -> None:
        """A training stage ended: the first one says whether any optimizer stepped, then the watch ends."""
        if self._first_stage:
            self._first_stage = False
            self._check_stepped()
            self._watch(False)

    def release(self) -> None:
        """The run ends, whatever way: nothing stays hooked."""
        if self.active:
            self._watch(False)

    def passed(self) -> None:
        """optim's ``backward`` ran a pass while watching: the watch ends after :data:`WATCHED_PASSES`."""
        if not self._passing:  # (a pass that reached no watched parameter: it counts, and added onto none of them)
            self._order.passing(judge=False)
        self._passes, self._passing = self._passes + 1, False  # (noted: the gradients of open windows, not a step's)
        if (window := self._window) and self.loop and self._optimizers and (how := self._untouched.passed(
                [] if window.closes(self.loop) else [m.params for m in self._optimizers.values() if m.holds_grads()])):
            warnings.warn(changed_in_window("optim", self._step_name(), how, window.size, self._where()),
                          OptimWarning, stacklevel=user_level(_TORCH))  # the step function's loop.backward line
        if self._passes >= WATCHED_PASSES:
            self._watch(False)

    def _watch(self, on: bool) -> None:
        """Watch (or stop watching) the managed optimizers' steps and their parameters."""
        assert self._optimizers is not None
        self.active = on
        for handle in self._handles:
            handle.remove()
        self._grad_hooks.remove()
        self._outside, self._untouched = Accumulation((), self._bypassed), Untouched()  # (nothing held once it ends)
        managed = list(self._optimizers.values()) if on else []
        self._handles = [m.optimizer.register_step_pre_hook(self._step_seen) for m in managed]
        if not on:
            return
        self._passes, self._steps_at, self._at = 0, self._stepped(), self.loop.state.step if self.loop else 0
        if not self._backward_bypassed and self._own_backward:
            watched = {id(p): p for m in managed for p in m.params if p.requires_grad and p.is_leaf}
            self._grad_hooks = GradientWatch(watched.values(), self._grad_arrived)
            self._outside = Accumulation(watched.values(), self._bypassed)  # (torch.autograd.grad accumulates none)
            self._order = StepOrder(watched.values())  # (the gradients its hooks see arriving are judged)
            self._untouched = Untouched(watched.values() if self._window and self._window.size > 1 else ())

    def _stepped(self) -> int:
        """The managed optimizers' steps so far, taken or skipped (a non-finite loss)."""
        return sum(m.steps + m.skipped for m in (self._optimizers or {}).values())

    def _check_stepped(self) -> None:
        """Warn, once a run, when nothing stepped in the first stage's batches (through ``loop.backward`` or with no
        backward pass), or when its optimizers stepped and none of their parameters had a gradient at any step."""
        if self._grads is False:
            warnings.warn(f"optim: the optimizers stepped without a gradient on any of their parameters in the first "
                          f"epoch: call loop.backward(loss) in {self._step_name()!r} on a loss of the model they hold"
                          f" (the parameters do not change)", OptimWarning, stacklevel=user_level())
        idle = self._passes == 0 and not self._backward_bypassed and (  # (passes past optim's backward: uncounted)
            not self._own_backward or self.loop is None or self.loop.state.step == self._at)
        if idle or self._bypass_seen or self._stepped() != self._steps_at or not (self._optimizers or self._passes):
            return  # (no optimizer and no backward pass: a step that trains by other means, or none)
        asked = ("called loop.backward(loss)" if self._passes else "called loss.backward() itself"
                 if self._backward_bypassed else "made no loop.backward(loss) (a loss returned is reported)")
        advice = ("optim steps when the step function asks: call loop.optimizers.step() and loop.optimizers.zero_grad()"
                  " after loop.backward(loss)" if self._optimizers else "The run has no optimizer: give Loop(optimizers=...)")
        warnings.warn(f"optim: step function {self._step_name()!r} {asked} in the first training epoch and no optimizer "
                      f"stepped in all of it: the parameters do not change. {advice}", OptimWarning,
                      stacklevel=user_level())

    def _grad_arrived(self, tensor: torch.Tensor) -> None:
        """A gradient arrived: in optim's pass, the pass's first begins it; outside, judged as its call ends."""
        if self.inside and not self._passing:  # the pass's first gradient: none is accumulated yet
            self._passing = True
            self._order.passing()
            self._untouched.passing()
        elif not (self.inside or self._backward_bypassed):
            self._outside.arrived(tensor)

    def _bypassed(self) -> None:
        """A call outside optim's pass accumulated gradients: warn once a run, or raise where it trains another
        model."""
        self._backward_bypassed = True
        loop, step = self.loop, self._step_name()
        why = self._why + ([f"{loop.state.world_size} processes"] if loop and loop.state.world_size > 1 else [])
        message = (f"optim: gradients appeared on the parameters of the run's optimizers outside loop.backward"
                   f"{self._where()}: step function {step!r} calls loss.backward() itself, which bypasses optim's")
        if why:
            raise RuntimeError(f"{message} handling of {', '.join(why)}; the run would train another "
                               f"model than the script means. Call loop.backward(loss) in {step!r} instead")
        warnings.warn(f"{message} hooks around the backward pass (before_backward/after_backward) and "
                      f"its non-finite-loss check. Call loop.backward(loss) in {step!r} instead",
                      OptimWarning, stacklevel=user_level(_TORCH))  # the step function's line

    def _step_seen(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A managed optimizer steps (torch's step pre-hook): whether it had a gradient; by someone else, warn."""
        if not (self._grads or args[1:] or kwargs):  # (args: self first; a closure makes its gradient inside)
            self._grads = any(p.grad is not None for g in optimizer.param_groups for p in g["params"])
        if self._optimizers is None:
            return
        self._counts()  # (a scheduler.step() in the step function has shown by now: the stage's end is late)
        managed = next(m for m in self._optimizers.values() if m.optimizer is optimizer)
        call = f"loop.optimizers[{managed.name!r}]" if len(self._optimizers) > 1 else "loop.optimizers"
        if self._own_backward and not self._backward_bypassed:  # (every pass is seen beginning)
            self._check_order(managed.name, optimizer, call)
        if self.stepping or self._bypass_seen:
            return
        self._bypass_seen, why = True, "; ".join(self._why)  # what the run is made of: raised, as for a pass
        said = (f"optim: optimizer {managed.name!r} ({type(managed.optimizer).__name__}) was stepped directly"
                f"{self._where()}, not through loop.optimizers: such a step bypasses optim's gradient clipping, "
                f"accumulation, loss scaling, non-finite checks, schedulers and step counters. Call "
                f"{call}.step({'closure' if args[1:] or kwargs else ''}) in the step function instead of the "
                f"optimizer's own step()" + (f"; with {why}, the run would train another model" if why else ""))
        if why:  # (before the step: the parameters are those of the last step optim took)
            raise RuntimeError(said)
        warnings.warn(said, OptimWarning, stacklevel=user_level(_TORCH))  # (past torch's)

    def _check_order(self, name: str, optimizer: torch.optim.Optimizer, call: str) -> None:
        """Warn, once a run each, of a step on gradients a pass added onto those of the previous step, and of two
        steps with no backward pass between (README.md, "The watch")."""
        piled, twice = self._order.stepping(optimizer)
        head, step = f"optim: optimizer {name!r} ({type(optimizer).__name__})", self._step_name()
        if piled and "piled" not in self._said:
            self._said.add("piled")
            warnings.warn(f"{head} stepped{self._where()} on gradients added onto those of its previous step, never "
                          f"cleared: step function {step!r} calls no {call}.zero_grad(), so the gradients add up "
                          f"across batches. Call {call}.zero_grad() in {step!r} after {call}.step() (or before "
                          f"loop.backward(loss))", OptimWarning, stacklevel=user_level(_TORCH))
        if twice and "twice" not in self._said:
            self._said.add("twice")
            warnings.warn(f"{head} stepped twice{self._where()} with no backward pass between: step function {step!r}"
                          f" calls {call}.step() twice on the same gradients, which steps its per-step schedulers "
                          f"twice too. Call {call}.step() once after each loop.backward(loss)",
                          OptimWarning, stacklevel=user_level(_TORCH))

    def _step_name(self) -> str:
        return qualname(self.loop.train_step) if self.loop is not None else "the training step"

    def _where(self) -> str:
        return f" ({at(self.loop)})" if self.loop is not None else ""

