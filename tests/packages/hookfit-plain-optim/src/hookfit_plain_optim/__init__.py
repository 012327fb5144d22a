"""hookfit-plain-optim: an optimizer plugin that replaces hookfit's built-in ``optim``.

A test fixture written only against ``core/hooks.md``. Run it with ``optim`` disabled
(``HOOKFIT_DISABLE_PLUGINS=optim``) or select it (``HOOKFIT_PLUGINS=plain_optim,...``). It does
``loop.backward(loss)`` and gradient accumulation over ``accumulate`` batches, nothing more: no
clipping, loss scaling, non-finite checks or schedulers (step a scheduler from your script).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any, Iterator

import torch

from hookfit import hookimpl

__all__ = ["ENV_ACCUMULATE", "PlainOptim"]
ENV_ACCUMULATE = "PLAIN_OPTIM_ACCUMULATE"


class Stepper:
    """One optimizer as the step function drives it: ``step()`` steps at the end of an
    accumulation window, ``zero_grad()`` clears only after a real step."""

    def __init__(self, plugin: PlainOptim, name: str, optimizer: torch.optim.Optimizer) -> None:
        self.plugin, self.name, self.optimizer = plugin, name, optimizer
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.pending = False  # step() was called inside the open window
        self.stepped = False  # a real step since the last effective zero_grad()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups, live (learning rates are read here)."""
        return self.optimizer.param_groups

    def step(self) -> bool:
        """Step if this batch closes the window; else defer. Returns whether it stepped."""
        if self.plugin.accumulate > 1 and (self.plugin.loop.state.batch_idx + 1) % self.plugin.accumulate:
            self.pending = True
            return False
        self.really_step()
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients once after each real step (inside a window they accumulate)."""
        if self.stepped:
            self.optimizer.zero_grad(set_to_none=set_to_none)
            self.stepped = False

    def really_step(self) -> None:
        loop = self.plugin.loop
        if (call := loop.hooks.before_optimizer_step) is not None:
            call(loop, self.name, self.optimizer)
        self.optimizer.step()
        self.pending, self.stepped = False, True
        if (call := loop.hooks.after_optimizer_step) is not None:
            call(loop, self.name, self.optimizer)


class Steppers(Mapping):
    """``loop.optimizers`` during a run: name -> :class:`Stepper`; with one optimizer,
    ``step()``, ``zero_grad()`` and ``param_groups`` work without a name."""

    def __init__(self, steppers: dict[str, Stepper]) -> None:
        self._steppers = steppers

    def __getitem__(self, name: str) -> Stepper:
        return self._steppers[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._steppers)

    def __len__(self) -> int:
        return len(self._steppers)

    def _only(self) -> Stepper:
        if len(self._steppers) != 1:
            raise TypeError(f"plain_optim: {len(self)} optimizers; name one: loop.optimizers[name]")
        return next(iter(self._steppers.values()))

    def step(self) -> bool:
        return self._only().step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._only().zero_grad(set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._only().param_groups


class PlainOptim:
    """Gradient accumulation over ``accumulate`` batches (default: ``$PLAIN_OPTIM_ACCUMULATE``,
    else 1): the loss is divided by it, the optimizers step on a window's last batch and, for
    a stage that ends inside a window, at ``stage_end``."""

    name = "plain_optim"

    def __init__(self, accumulate: int | None = None) -> None:
        if accumulate is None:
            accumulate = int(os.environ.get(ENV_ACCUMULATE) or 1)
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"plain_optim: accumulate must be a positive integer, got {accumulate!r}")
        self.accumulate = accumulate
        self.loop: Any = None
        self.optimizers: Steppers | None = None
        self.length: int | None = None  # training batches per epoch, when the data says

    @hookimpl
    def configure(self, loop: Any) -> None:
        """Put :class:`Steppers` around ``Loop(optimizers=...)`` into ``loop.optimizers``
        (at ``configure``, as hooks.md asks, so every plugin sees them from ``fit_start`` on)."""
        given = loop.optimizers
        named = dict(given) if isinstance(given, Mapping) else ({} if given is None else {"default": given})
        for name, opt in named.items():
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"plain_optim: optimizer {name!r} is a {type(opt).__name__}, not a "
                                "torch.optim.Optimizer (is another optimizer plugin enabled?)")
        self.loop = loop
        self.optimizers = loop.optimizers = Steppers({n: Stepper(self, n, o) for n, o in named.items()})

    @hookimpl
    def backward(self, loop: Any, loss: torch.Tensor) -> bool:
        """Back-propagate ``loss / accumulate``; first result, so answer ``True``."""
        if (call := loop.hooks.before_backward) is not None:
            call(loop, loss)
        (loss / self.accumulate if self.accumulate > 1 else loss).backward()
        if (call := loop.hooks.after_backward) is not None:
            call(loop, loss)
        return True

    @hookimpl
    def stage_start(self, loop: Any, stage: str) -> None:
        """Note the training stage's length: its last batch closes a (partial) window."""
        if stage == "train":
            data = loop.train_data
            self.length = len(data) if hasattr(data, "__len__") else None

    @hookimpl
    def should_sync_gradients(self, loop: Any) -> bool:
        """True for the batches after which the optimizers step: a window's last, the stage's
        last and the ``max_steps``-th. With data of unknown length, always True (the last batch
        cannot be told apart)."""
        state = loop.state
        return (self.accumulate == 1 or (state.batch_idx + 1) % self.accumulate == 0
                or self.length is None or state.batch_idx + 1 >= self.length
                or (loop.max_steps is not None and state.step + 1 >= loop.max_steps))

    @hookimpl(tryfirst=True)  # hooks.md: finishes the stage's work before reports on it
    def stage_end(self, loop: Any, stage: str) -> None:
        """Step the last, partial window of a training stage, then clear its gradients."""
        if stage == "train" and self.optimizers is not None:
            for stepper in self.optimizers.values():
                if stepper.pending:
                    stepper.really_step()
                    stepper.zero_grad()

    @hookimpl
    def save_state(self) -> dict[str, Any] | None:
        """A copy of every optimizer's state, with the open window's gradients if any."""
        if self.optimizers is None:
            return None
        steppers = self.optimizers._steppers
        pending = [n for n, s in steppers.items() if s.pending]
        return copy.deepcopy({
            "optimizers": {n: s.optimizer.state_dict() for n, s in steppers.items()},
            "pending": pending,
            "grads": {n: [p.grad for p in s.params] for n, s in steppers.items()} if pending else None,
        })

    @hookimpl
    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`save_state` returned; the optimizers must have the same names."""
        steppers = self.optimizers._steppers
        if sorted(state["optimizers"]) != sorted(steppers):
            raise ValueError(f"plain_optim: the checkpoint has optimizers {sorted(state['optimizers'])}, "
                             f"this run {sorted(steppers)}")
        for name, stepper in steppers.items():
            stepper.optimizer.load_state_dict(state["optimizers"][name])
            stepper.pending = name in state["pending"]
            for p, grad in zip(stepper.params, (state["grads"] or {}).get(name, [])):
                p.grad = None if grad is None else grad.to(p.device).clone()

    @hookimpl
    def fit_end(self) -> None:
        """Let go of the run."""
        self.loop = None
