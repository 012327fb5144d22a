"""hookfit-sam-optim: Sharpness-Aware Minimization in hookfit's optimizer role.

A test fixture written from hookfit's ``README.md`` and ``core/hooks.md`` (the optimizer role)
alone. Run it with the built-in ``optim`` disabled (``HOOKFIT_DISABLE_PLUGINS=optim``), or give
``SamOptim(...)`` to ``Loop(plugins=[...])`` with ``optim`` disabled.

A batch has two passes: the step's own (``loop.backward(loss)``), whose gradients ``g`` say where
the loss rises fastest, and the closure's (``loop.optimizers.step(closure)``), run with the
weights moved by ``rho * g / ||g||``; the optimizer steps with the closure's gradients, from the
weights as they were. With ``accumulate=N`` every batch is perturbed by its own gradients and the
closures' gradients are summed over the window, each loss divided by the window's size.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from hookfit import hookimpl

__all__ = ["SamOptim", "SamStepper"]

EPS = 1e-12  # added to ||g||: a zero gradient perturbs nothing instead of dividing by zero


class SamStepper:
    """What the step function drives as ``loop.optimizers`` (or ``loop.optimizers[name]``).

    ``step(closure)`` runs the SAM step; ``zero_grad()`` clears gradients after a real step
    and waits inside an accumulation window; ``param_groups`` is the optimizer's own list.
    """

    def __init__(self, plugin: SamOptim, name: str, optimizer: torch.optim.Optimizer) -> None:
        self._plugin = plugin
        self.name = name
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The torch optimizer's parameter groups, live (learning rates are read here)."""
        return self.optimizer.param_groups

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The SAM step of this batch: perturb, run ``closure`` (which recomputes the loss and
        calls ``loop.backward``), restore, and step the optimizer if the window ends here.
        Returns what the closure returned."""
        return self._plugin._sam_step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients once the optimizer has stepped; inside a window they are the
        window's sum so far, and stay."""
        self._plugin._zero_grad(set_to_none)

    def __repr__(self) -> str:
        return f"SamStepper({self.name!r}, {type(self.optimizer).__name__})"


def _check_rho(rho: Any) -> float:
    if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not math.isfinite(rho) or rho <= 0:
        raise ValueError(f"sam_optim: rho must be a positive finite number, got {rho!r}")
    return float(rho)


def _check_accumulate(accumulate: Any) -> int:
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"sam_optim: accumulate must be a positive integer, got {accumulate!r}")
    return accumulate


class SamOptim:
    """Sharpness-Aware Minimization around one torch optimizer (``rho``: the radius of the
    perturbation; ``accumulate``: batches per optimizer step)."""

    name = "sam_optim"

    def __init__(self, rho: float = 0.05, accumulate: int = 1) -> None:
        self.rho = _check_rho(rho)
        self.accumulate = _check_accumulate(accumulate)
        self._reset()

    def _reset(self) -> None:
        self._loop: Any = None
        self._name = "default"
        self._optimizer: torch.optim.Optimizer | None = None
        self._params: list[torch.Tensor] = []
        self._length: int | None = None  # training batches of the stage, when the data says
        self._stash: list[torch.Tensor | None] | None = None  # the window's gradients during a first pass
        self._stash_step = -1  # the global step whose first pass made the stash
        self._in_closure = False
        self._pending = False  # closures' gradients summed in .grad, not stepped yet
        self._stepped = False  # a real step since the last zero_grad()

    # -- the run's set-up ----------------------------------------------------------------------
    @hookimpl
    def configure(self, loop: Any) -> None:
        """Put a :class:`SamStepper` around the ``Loop``'s optimizer into ``loop.optimizers``
        (a plain ``configure``: a distributed plugin's ``tryfirst`` one has run)."""
        self._reset()
        given = loop.optimizers
        if given is None:  # Loop.validate(): nothing to step
            return
        if isinstance(given, Mapping):
            if len(given) != 1:
                raise ValueError(f"sam_optim: one optimizer is stepped with SAM, got {len(given)} "
                                 f"({', '.join(map(repr, given))}); give Loop(optimizers=...) one")
            name, optimizer = next(iter(given.items()))
        else:
            name, optimizer = "default", given
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"sam_optim: optimizer {name!r} is a {type(optimizer).__name__}, not a "
                            "torch.optim.Optimizer (is another optimizer plugin enabled? disable optim)")
        self._loop, self._name, self._optimizer = loop, str(name), optimizer
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        stepper = SamStepper(self, self._name, optimizer)
        loop.optimizers = MappingProxyType({self._name: stepper}) if isinstance(given, Mapping) else stepper

    @hookimpl
    def stage_start(self, loop: Any, stage: str) -> None:
        """Note the training stage's length: its last batch ends a (partial) window."""
        if stage == "train":
            try:
                self._length = len(loop.train_data)
            except TypeError:
                self._length = None

    # -- the two passes ------------------------------------------------------------------------
    @hookimpl
    def backward(self, loop: Any, loss: torch.Tensor) -> bool:
        """``loop.backward(loss)``: the step's pass (its gradients alone in ``.grad``, the
        window's set aside) or the closure's (divided by the window's size, added to the
        window's)."""
        if (before := loop.hooks.before_backward) is not None:
            before(loop, loss)
        if self._in_closure:
            size = self._window_size(loop)
            (loss / size if size > 1 else loss).backward()
        else:
            step = loop.state.step
            if self._stash is None:
                self._stash, self._stash_step = [p.grad for p in self._params], step
                for p in self._params:
                    p.grad = None
            elif self._stash_step != step:
                raise RuntimeError(f"sam_optim: loop.backward(loss) ran at step {self._stash_step} without "
                                   "loop.optimizers.step(closure) after it; every training batch calls it")
            loss.backward()
        if (after := loop.hooks.after_backward) is not None:
            after(loop, loss)
        return True

    def _sam_step(self, closure: Callable[[], Any] | None) -> Any:
        if closure is None or not callable(closure):
            raise TypeError("sam_optim: loop.optimizers.step(closure) needs a closure that recomputes the "
                            "loss and calls loop.backward on it (SAM's second pass); got "
                            f"{type(closure).__name__}")
        if self._stash is None:
            raise RuntimeError("sam_optim: loop.optimizers.step(closure) before loop.backward(loss) in this "
                               "batch: SAM's first pass finds where to perturb the weights")
        loop = self._loop
        present = [p for p in self._params if p.grad is not None]
        with torch.no_grad():
            saved = [p.detach().clone() for p in present]
            if present:
                norms = torch.stack([torch.linalg.vector_norm(p.grad).float() for p in present if p.grad is not None])
                scale = self.rho / (torch.linalg.vector_norm(norms) + EPS)
                for p in present:
                    p.add_(p.grad * scale.to(p.dtype))
        for p, grad in zip(self._params, self._stash):  # the window's sum so far, for the closure to add to
            p.grad = grad
        self._stash = None
        self._in_closure = True
        try:
            with torch.enable_grad():
                result = closure()
        finally:
            self._in_closure = False
            with torch.no_grad():
                for p, weights in zip(present, saved):
                    p.copy_(weights)
        self._pending = True
        if self.accumulate == 1 or (loop.state.batch_idx + 1) % self.accumulate == 0:
            self._really_step()
        return result

    def _window_size(self, loop: Any) -> int:
        """Batches in the window of the running batch (the stage's last window may be short)."""
        index = int(loop.state.batch_idx)
        if self._length is None:
            return self.accumulate
        return max(1, min(self.accumulate, self._length - (index - index % self.accumulate)))

    def _really_step(self) -> None:
        loop, optimizer = self._loop, self._optimizer
        assert optimizer is not None
        if (before := loop.hooks.before_optimizer_step) is not None:
            before(loop, self._name, optimizer)
        optimizer.step()
        self._pending, self._stepped = False, True
        if (after := loop.hooks.after_optimizer_step) is not None:
            after(loop, self._name, optimizer)

    def _zero_grad(self, set_to_none: bool) -> None:
        if self._stepped and self._optimizer is not None:
            self._optimizer.zero_grad(set_to_none=set_to_none)
            self._stepped = False

    @hookimpl
    def should_sync_gradients(self, loop: Any) -> bool:
        """The step's pass: never (each process perturbs by its own gradients). The closure's:
        when the optimizer steps with what it leaves: a window's last batch, the stage's last
        (a partial window; every batch when the length is unknown) and the ``max_steps``-th."""
        if not self._in_closure:
            return False
        index, state = loop.state.batch_idx, loop.state
        return (self.accumulate == 1 or (index + 1) % self.accumulate == 0
                or self._length is None or index + 1 >= self._length
                or (loop.max_steps is not None and state.step + 1 >= loop.max_steps))

    @hookimpl(tryfirst=True)
    def stage_end(self, loop: Any, stage: str) -> None:
        """Step the training stage's last, partial window (before the metrics report on it)."""
        if stage == "train" and self._pending:
            self._really_step()
            self._zero_grad(set_to_none=True)

    # -- checkpoints ---------------------------------------------------------------------------
    @hookimpl
    def save_state(self) -> dict[str, Any] | None:
        """The optimizer's state and, when any is held, the parameters' gradients (an open
        window's sum): copies, so that training goes on without changing them."""
        if self._optimizer is None:
            return None
        grads = [None if p.grad is None else p.grad.detach().clone() for p in self._params]
        return {
            "optimizer": copy.deepcopy(self._optimizer.state_dict()),
            "name": self._name,
            "pending": self._pending,
            "stepped": self._stepped,
            "grads": grads if any(g is not None for g in grads) else None,
        }

    @hookimpl
    def load_state(self, state: Any) -> None:
        """Restore :meth:`save_state`'s answer; refuse one that does not fit this run's
        optimizer before changing anything."""
        if self._optimizer is None:  # a run that does not train loads nothing
            return
        if not isinstance(state, Mapping) or not {"optimizer", "pending", "grads"} <= set(state):
            raise ValueError(f"sam_optim: the saved state is not sam_optim's (got {type(state).__name__} "
                             f"with keys {sorted(state) if isinstance(state, Mapping) else '-'})")
        saved_groups = state["optimizer"].get("param_groups", [])
        sizes = [len(group["params"]) for group in self._optimizer.param_groups]
        if [len(group["params"]) for group in saved_groups] != sizes:
            raise ValueError(f"sam_optim: the saved optimizer has parameter groups of "
                             f"{[len(g['params']) for g in saved_groups]} parameters, this run's {sizes}")
        grads = state["grads"]
        if grads is not None:
            if len(grads) != len(self._params):
                raise ValueError(f"sam_optim: the saved state has {len(grads)} gradients, this run "
                                 f"{len(self._params)} parameters")
            for index, (p, grad) in enumerate(zip(self._params, grads)):
                if grad is not None and tuple(grad.shape) != tuple(p.shape):
                    raise ValueError(f"sam_optim: saved gradient {index} has shape {tuple(grad.shape)}, "
                                     f"its parameter {tuple(p.shape)}")
        self._optimizer.load_state_dict(state["optimizer"])
        for p, grad in zip(self._params, grads or [None] * len(self._params)):
            p.grad = None if grad is None else grad.to(device=p.device, dtype=p.dtype).clone()
        self._pending = bool(state["pending"])
        self._stepped = bool(state.get("stepped", False))

    @hookimpl
    def fit_end(self) -> None:
        """Let go of the run (the weights are back as they were, even after an error in a
        closure)."""
        self._loop = None
        self._stash = None
        self._in_closure = False
