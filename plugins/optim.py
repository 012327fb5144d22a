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
  at the end of the training stage.
* ``clip_norm`` / ``clip_value``: gradients are clipped (after unscaling) before each step.
* ``amp=True``: the loss is scaled with ``torch.amp.GradScaler`` (autocast in the forward pass
  is the step's own ``torch.autocast`` block).
* ``nonfinite="skip"`` (default): a non-finite loss is not back-propagated and its window's step
  is skipped; the first skip is warned about at once, the total at the end of the run.
  ``"raise"`` raises ``FloatingPointError``; ``None`` checks nothing. Gradients are checked
  too when clipping by norm (the norm is computed anyway) or with ``check_grads=True``. On the
  CPU the check reads the loss (no synchronisation); on an accelerator it waits for the loss,
  one host-device synchronisation per ``backward`` (as AMP's GradScaler does per step): pass
  ``nonfinite=None`` where that matters more than the check.
* ``schedulers``: one scheduler, or a dict keyed like the optimizers, stepped after every real
  step of its optimizer (``scheduler_interval="step"``) or at each epoch end (``"epoch"``).
* ``loop.optimizers.toggle("gen")``: a context in which the parameters of every other optimizer
  are frozen (for alternating GAN updates); their ``requires_grad`` flags are restored after.
* Counters: ``loop.optimizers[name].steps`` (real steps) and ``.skipped``; the loop's global step
  counts batches, not optimizer steps.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, Iterator, Literal, Mapping

import torch

from hookfit import HookfitWarning, hookimpl


class OptimWarning(HookfitWarning):
    """A step was skipped because of a non-finite loss or gradient."""


class UnknownOptimizer(KeyError):
    """``loop.optimizers[name]`` with a name the run does not have."""

    def __str__(self) -> str:
        return str(self.args[0])


class ManagedOptimizer:
    """One of the run's optimizers, stepped under the plugin's rules."""

    def __init__(self, plugin: Optim, name: str, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        self.plugin = plugin
        self.name = name
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.steps = 0
        self.skipped = 0
        self._deferred = False  # step() was called inside an accumulation window
        self._stepped = False  # a real step happened since the last effective zero_grad()
        self._fast = False  # step() can step at once: no window, poison, scaling, clipping,
        # step-wise scheduler or hook around it (kept by Optim._set_fast_paths)
        self._each_batch = plugin.accumulate == 1  # zero_grad() always takes effect
        if self._each_batch:  # then it is the optimizer's own, with no call in between
            self.zero_grad = optimizer.zero_grad  # type: ignore[method-assign]
        self._params = [p for group in optimizer.param_groups for p in group["params"]]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (learning rates live here)."""
        return self.optimizer.param_groups

    def step(self) -> bool:
        """Step now if this batch closes an accumulation window; return whether it stepped
        (``False`` inside a window or when the step was skipped for a non-finite value)."""
        if self._fast:
            self.optimizer.step()
            self.steps += 1
            self._stepped = True
            return True
        if not self._each_batch and not self.plugin._window_closes():
            self._deferred = True
            return False
        return self._step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients, unless they are being accumulated for a later step: with
        accumulation it takes effect only once after each step, so calling it before
        ``backward`` or after ``step()`` in every batch both work."""
        if self._stepped or self._each_batch:
            self.optimizer.zero_grad(set_to_none=set_to_none)
            self._stepped = False

    def _step(self) -> bool:
        plugin, loop = self.plugin, self.plugin.loop
        self._deferred = False
        scaler = plugin.scaler
        if plugin._poisoned:
            plugin._expire_poison()
        if plugin._poisoned:  # a non-finite loss in this window: its gradients are incomplete
            return self._skip("non-finite loss")
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        finite = True
        if plugin.clip_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self._params, plugin.clip_norm)
            finite = bool(torch.isfinite(norm)) if plugin.nonfinite is not None else True
        elif plugin.check_grads and plugin.nonfinite is not None:
            finite = all(bool(torch.isfinite(p.grad).all()) for p in self._params if p.grad is not None)
        if plugin.clip_value is not None:
            torch.nn.utils.clip_grad_value_(self._params, plugin.clip_value)
        if not finite and scaler is None:  # with a scaler, scaler.step() skips by itself
            return self._skip("non-finite gradient")
        if (call := loop.hooks.before_optimizer_step) is not None:
            call(loop, self.name, self.optimizer)
        if scaler is not None:
            scaler.step(self.optimizer)  # skips by itself on inf/NaN gradients
            plugin._scaler_used = True
        else:
            self.optimizer.step()
        self.steps += 1
        self._stepped = True
        if self.scheduler is not None and plugin.scheduler_interval == "step":
            self.scheduler.step()
        if (call := loop.hooks.after_optimizer_step) is not None:
            call(loop, self.name, self.optimizer)
        return True

    def _skip(self, why: str) -> bool:
        self.plugin._nonfinite(why, self)
        self._clear()
        return False

    def _clear(self) -> None:
        """Drop the gradients now; the window starts afresh."""
        self.optimizer.zero_grad(set_to_none=True)
        self._stepped = False

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, scheduler and counters, for checkpoints."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "steps": self.steps,
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.steps, self.skipped = state["steps"], state["skipped"]


class Optimizers(Mapping[str, ManagedOptimizer]):
    """``loop.optimizers`` during a run: named :class:`ManagedOptimizer` objects; with exactly
    one, ``step()``, ``zero_grad()`` and ``param_groups`` work without a name."""

    def __init__(self, managed: dict[str, ManagedOptimizer]) -> None:
        self._managed = managed
        self._single = next(iter(managed.values())) if len(managed) == 1 else None
        if self._single is not None:  # one optimizer: no lookup on the hot path
            self.step = self._single.step  # type: ignore[method-assign]
            self.zero_grad = self._single.zero_grad  # type: ignore[method-assign]

    def __getitem__(self, name: str) -> ManagedOptimizer:
        try:
            return self._managed[name]
        except KeyError:
            raise UnknownOptimizer(
                f"unknown optimizer {name!r}; this run's optimizers are: "
                f"{', '.join(map(repr, self._managed)) or 'none'}"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._managed)

    def __len__(self) -> int:
        return len(self._managed)

    def _only(self) -> ManagedOptimizer:
        if self._single is not None:
            return self._single
        if len(self._managed) != 1:
            raise TypeError(
                f"this run has {len(self._managed)} optimizers "
                f"({', '.join(map(repr, self._managed)) or 'none'}); name one: "
                f"loop.optimizers[name]"
            )
        return next(iter(self._managed.values()))

    def step(self) -> bool:
        """Step the only optimizer (see :meth:`ManagedOptimizer.step`)."""
        return (self._single or self._only()).step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the only optimizer's gradients (see :meth:`ManagedOptimizer.zero_grad`)."""
        (self._single or self._only()).zero_grad(set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The only optimizer's parameter groups."""
        return self._only().param_groups

    @contextlib.contextmanager
    def toggle(self, name: str) -> Iterator[ManagedOptimizer]:
        """Freeze the parameters of every optimizer but ``name`` for the ``with`` block."""
        active = self[name]
        own = {id(p) for p in active._params}
        frozen = [
            (p, p.requires_grad)
            for other in self._managed.values() if other is not active
            for p in other._params if id(p) not in own
        ]
        for p, _ in frozen:
            p.requires_grad_(False)
        try:
            yield active
        finally:
            for p, flag in frozen:
                p.requires_grad_(flag)


class Optim:
    """Manual optimizer stepping with accumulation, clipping, AMP and non-finite policies."""

    name = "optim"

    def __init__(
        self,
        accumulate: int = 1,
        clip_norm: float | None = None,
        clip_value: float | None = None,
        amp: bool | torch.amp.GradScaler = False,
        nonfinite: Literal["skip", "raise"] | None = "skip",
        check_grads: bool = False,
        schedulers: Any = None,
        scheduler_interval: Literal["step", "epoch"] = "step",
    ) -> None:
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"optim: accumulate must be a positive integer, got {accumulate!r}")
        if nonfinite not in ("skip", "raise", None):
            raise ValueError(f"optim: nonfinite must be 'skip', 'raise' or None, got {nonfinite!r}")
        if scheduler_interval not in ("step", "epoch"):
            raise ValueError(f"optim: scheduler_interval must be 'step' or 'epoch', got {scheduler_interval!r}")
        self.accumulate = accumulate
        self.clip_norm = clip_norm
        self.clip_value = clip_value
        self.amp = amp
        self.nonfinite = nonfinite
        self.check_grads = check_grads
        self.schedulers = schedulers
        self.scheduler_interval = scheduler_interval
        self.scaler: torch.amp.GradScaler | None = None
        self.loop: Any = None
        self.optimizers: Optimizers | None = None
        self._poisoned = False  # a non-finite loss in the current window: its steps are skipped
        self._poisoned_at = 0  # the global step of the batch that poisoned it
        self._scaler_used = False
        self._first_skip: str | None = None
        self._plain = False  # set at fit_start: a step needs no window, unscaling, clipping or scheduler
        self._scales = False  # set at fit_start: backward scales the loss (accumulation or AMP)
        self._bare = False  # backward needs only the finiteness check (kept by _set_fast_paths)
        self._stage_len: int | None = None  # batches in the training stage, when known
        self._unwatch: Any = None

    # -- events ---------------------------------------------------------------------------
    @hookimpl
    def fit_start(self, loop: Any) -> None:
        self.loop = loop
        optimizers = _named(loop.optimizers, "optimizers")
        schedulers = _named(self.schedulers, "schedulers") if self.schedulers is not None else {}
        if len(schedulers) == 1 and len(optimizers) == 1:
            schedulers = {next(iter(optimizers)): next(iter(schedulers.values()))}
        unknown = set(schedulers) - set(optimizers)
        if unknown:
            raise ValueError(
                f"optim: schedulers {sorted(unknown)} name no optimizer; optimizers are {sorted(optimizers)}"
            )
        for name, opt in optimizers.items():
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"optim: optimizer {name!r} is a {type(opt).__name__}, not a torch.optim.Optimizer")
        self.optimizers = Optimizers(
            {n: ManagedOptimizer(self, n, o, schedulers.get(n)) for n, o in optimizers.items()}
        )
        if isinstance(self.amp, torch.amp.GradScaler):
            self.scaler = self.amp
        elif self.amp:
            self.scaler = torch.amp.GradScaler("cuda" if torch.cuda.is_available() else "cpu")
        loop.optimizers = self.optimizers
        self._plain = (
            self.accumulate == 1 and self.scaler is None and self.clip_norm is None
            and self.clip_value is None and not (self.check_grads and self.nonfinite is not None)
            and not (schedulers and self.scheduler_interval == "step")
        )
        self._scales = self.accumulate > 1 or self.scaler is not None
        self._poison(False)
        self._unwatch = loop.pm.on_change(self._set_fast_paths)

    @hookimpl
    def backward(self, loop: Any, loss: torch.Tensor) -> bool:
        if self._bare:  # no scaling, no hook around it, no poisoned window: the common case
            if self.nonfinite is not None and not (  # _finite(loss), its CPU case inlined
                math.isfinite(loss.item()) if loss.is_cpu and loss.numel() == 1 else _finite(loss)
            ):
                return self._nonfinite_loss(loop, loss)
            loss.backward()
            return True
        if self._poisoned:
            self._expire_poison()
        if self.nonfinite is not None and not _finite(loss):
            return self._nonfinite_loss(loop, loss)
        if (call := loop.hooks.before_backward) is not None:
            call(loop, loss)
        if self._scales:
            scaled = loss / self.accumulate if self.accumulate > 1 else loss
            if self.scaler is not None:
                scaled = self.scaler.scale(scaled)
            scaled.backward()
        else:
            loss.backward()
        if (call := loop.hooks.after_backward) is not None:
            call(loop, loss)
        return True

    def _nonfinite_loss(self, loop: Any, loss: torch.Tensor) -> bool:
        """A non-finite loss: not back-propagated, and its window's steps skipped."""
        self._poison(True)
        self._poisoned_at = loop.state.step
        if self.nonfinite == "raise":
            raise FloatingPointError(
                f"optim: non-finite loss {loss.detach().flatten()[:4].tolist()} at epoch "
                f"{loop.state.epoch}, batch {loop.state.batch_idx}"
            )
        return True

    @hookimpl
    def configure(self, loop: Any) -> None:
        if self.accumulate > 1 or self.amp:
            # a per-batch hook only where a batch can close a window or update a loss scale;
            # a plain run's batches cost optim nothing outside the step function
            loop.pm.register(_BatchEnd(self), name="optim.batch_end")

    def _batch_end(self) -> None:
        if self._scaler_used:
            self.scaler.update()  # once per batch, after every optimizer of the batch stepped
            self._scaler_used = False
        if self._window_closes():
            self._close_window()

    @hookimpl
    def stage_start(self, loop: Any, stage: str) -> None:
        if stage == "train":
            data = loop.train_data
            self._stage_len = len(data) if hasattr(data, "__len__") else None

    @hookimpl
    def should_sync_gradients(self, loop: Any) -> bool:
        """Whether the optimizers step after this training batch: the window's last batch,
        or the stage's (or ``max_steps``') last, where the partial window is stepped."""
        if self._window_closes():
            return True
        state = loop.state
        if self._stage_len is not None and state.batch_idx >= self._stage_len - 1:
            return True
        return loop.max_steps is not None and state.step + 1 >= loop.max_steps

    @hookimpl(tryfirst=True)  # finishes the stage's work before plugins report on it (metrics)
    def stage_end(self, loop: Any, stage: str) -> None:
        if stage != "train" or self.optimizers is None:
            return
        for managed in self.optimizers.values():  # the last, partial window of the epoch
            if managed._deferred:
                managed._step()
                managed._clear()
        self._close_window()
        if self._scaler_used:
            self.scaler.update()
            self._scaler_used = False

    @hookimpl
    def epoch_end(self) -> None:
        if self.scheduler_interval == "epoch" and self.optimizers is not None:
            for managed in self.optimizers.values():
                if managed.scheduler is not None:
                    managed.scheduler.step()

    @hookimpl
    def fit_end(self, loop: Any) -> None:
        if self.optimizers is not None:
            skipped = sum(m.skipped for m in self.optimizers.values())
            if skipped > 1:
                warnings.warn(
                    f"optim: {skipped} optimizer steps were skipped in this run because of "
                    f"non-finite values (first: {self._first_skip})",
                    OptimWarning,
                    stacklevel=2,
                )
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        self.loop = None

    # -- accumulation windows ---------------------------------------------------------------
    def _window_closes(self) -> bool:
        return self.accumulate == 1 or (self.loop.state.batch_idx + 1) % self.accumulate == 0

    def _close_window(self) -> None:
        if self._poisoned:
            self._skip_window()
        self._poison(False)

    def _poison(self, poisoned: bool) -> None:
        """Mark the current window as having (or not) a non-finite loss: its steps are
        skipped, so the fast paths are off meanwhile."""
        self._poisoned = poisoned
        self._set_fast_paths()

    def _set_fast_paths(self) -> None:
        """Decide whether ``backward`` and ``step()`` may skip everything but the work itself;
        run when a window is poisoned or closed, and whenever the run's plugins change (a
        plugin that implements ``before_optimizer_step``... turns them off)."""
        hooks = self.loop.hooks
        stepped = hooks.before_optimizer_step is not None or hooks.after_optimizer_step is not None
        backward = hooks.before_backward is not None or hooks.after_backward is not None
        clean = not self._poisoned
        for managed in self.optimizers.values():  # type: ignore[union-attr]
            managed._fast = self._plain and clean and not stepped
        self._bare = not self._scales and clean and not backward

    def _expire_poison(self) -> None:
        """Close a poisoned window that a batch_end did not: without accumulation or AMP
        optim has no per-batch hook, so the next batch's first backward or step does it."""
        if self.accumulate == 1 and self.loop.state.step != self._poisoned_at:
            self._close_window()

    def _skip_window(self) -> None:
        """A poisoned window closed: drop the gradients of optimizers that did not step."""
        for managed in self.optimizers.values():  # type: ignore[union-attr]
            if managed._deferred:
                managed._deferred = False
                managed._skip("non-finite loss")
            else:
                managed._clear()

    def _nonfinite(self, what: str, managed: ManagedOptimizer) -> None:
        """Count a skipped step; warn about the first, or raise under ``nonfinite="raise"``."""
        managed.skipped += 1
        state = self.loop.state
        where = f"{what} at epoch {state.epoch}, batch {state.batch_idx}"
        if self.nonfinite == "raise":
            raise FloatingPointError(f"optim: {where}")
        if self._first_skip is None:
            self._first_skip = where
            warnings.warn(
                f"optim: skipped the step of optimizer {managed.name!r}: {where}; further skips "
                f"are counted and reported at the end of the run",
                OptimWarning,
                stacklevel=4,
            )

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every optimizer, scheduler and counter, and the gradient scaler; inside an open
        accumulation window also the gradients accumulated so far, so a run resumed mid-window
        steps with the same gradients as an uninterrupted one."""
        assert self.optimizers is not None
        window_open = self.accumulate > 1 and any(m._deferred for m in self.optimizers.values())
        return {
            "optimizers": {n: m.state_dict() for n, m in self.optimizers.items()},
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "window": {
                "poisoned": self._poisoned,
                "deferred": [n for n, m in self.optimizers.items() if m._deferred],
                "grads": {n: [None if p.grad is None else p.grad.detach().clone() for p in m._params]
                          for n, m in self.optimizers.items()},
            } if window_open else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        assert self.optimizers is not None
        saved, here = set(state["optimizers"]), set(self.optimizers)
        if saved != here:
            raise ValueError(f"optim: the checkpoint has optimizers {sorted(saved)}, this run {sorted(here)}")
        for name, managed in self.optimizers.items():
            managed.load_state_dict(state["optimizers"][name])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        window = state.get("window")
        if window is not None:
            self._poison(window["poisoned"])
            for name, managed in self.optimizers.items():
                managed._deferred = name in window["deferred"]
                for p, grad in zip(managed._params, window["grads"][name]):
                    p.grad = None if grad is None else grad.to(p.device).clone()

    @hookimpl
    def save_state(self) -> dict[str, Any] | None:
        return self.state_dict() if self.optimizers is not None else None

    @hookimpl
    def load_state(self, state: Mapping[str, Any]) -> None:
        self.load_state_dict(state)


class _BatchEnd:
    """optim's per-batch part, registered only when a batch can close an accumulation window
    or must update the AMP loss scale."""

    def __init__(self, owner: Optim) -> None:
        self.owner = owner

    @hookimpl
    def batch_end(self, loop: Any) -> None:
        if loop.training:
            self.owner._batch_end()


def _finite(loss: torch.Tensor) -> bool:
    """Whether every value of ``loss`` is finite. A CPU scalar is read with ``item()`` (no
    synchronisation there, the cheapest check; ``Optim.backward`` inlines this case); on an
    accelerator this synchronises once."""
    if loss.is_cpu and loss.numel() == 1:
        return math.isfinite(loss.item())
    return bool(torch.isfinite(loss).all())


def _named(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, Optimizers):
        return {n: m.optimizer for n, m in value.items()}
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, (list, tuple)):
        raise TypeError(f"optim: give several {what} as a dict of names, not a {type(value).__name__}")
    return {"default": value}


