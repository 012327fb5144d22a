"""The ``Optim`` plugin: options, events, mixed precision and checkpoints, built from parts (README.md)."""

from __future__ import annotations

import sys
import warnings
from typing import TYPE_CHECKING, Any, Literal, Mapping

import torch

from hookfit import hookimpl
from hookfit.config import records_options
from hookfit.data import length
from hookfit.errors import user_level
from hookfit.handlers import Handlers
from hookfit.modes import modules
from hookfit.payloads import MetricsSnapshot
from hookfit.plugins.support import (check, choice, few_parameters, flag, hparams, kernels, parameter_names,
                                     positive_int)
from hookfit.plugins.support.options import known_names, positive_by_name
from hookfit.plugins.support.sparse import refuse_clip, sparse_parameters
from hookfit.plugins.optim import hookspecs
from hookfit.plugins.optim.clipping import ModelNorm
from hookfit.plugins.optim.managed import ManagedOptimizer, OnlyOptimizer, Optimizers, Rules, note_toggles
from hookfit.plugins.optim.nonfinite import Agreed, Check, Deferred, HostCheck, OptimWarning, Policy
from hookfit.plugins.optim.schedulers import Schedules
from hookfit.plugins.optim.watch import Watch

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

__all__ = ["Optim", "OptimWarning"]


@records_options
class Optim:
    """Manual optimizer stepping; its options are described in plugins/optim/README.md."""

    name = "optim"
    hookspecs = hookspecs  # the events it declares, added to every run (core/hooks.md)

    def __init__(self, accumulate: int = 1, clip_norm: float | Mapping[str, float] | None = None,
                 clip_value: float | Mapping[str, float] | None = None,
                 amp: bool | torch.amp.GradScaler = False, nonfinite: Literal["skip", "raise"] | None = "skip",
                 check_grads: bool = False, schedulers: Any = None,
                 scheduler_interval: Literal["step", "epoch"] | Mapping[str, Literal["step", "epoch"]] | None = None,
                 monitor: str | None = None, precision: Literal["32", "bf16-mixed", "16-mixed"] = "32",
                 defer: bool | None = None, fuse: bool = True,
                 clip_scope: Literal["optimizer", "model"] = "optimizer") -> None:
        name = self.name
        self.accumulate = positive_int(name, "accumulate", accumulate)
        choice(name, "nonfinite", nonfinite, ("skip", "raise"), none=True)
        choice(name, "precision", precision, ("32", "bf16-mixed", "16-mixed"))
        self.defer = flag(name, "defer", defer, none=True)
        self.fuse = flag(name, "fuse", fuse)
        self.check_grads = flag(name, "check_grads", check_grads)
        self.amp = check(name, "amp", amp, lambda v: isinstance(v, (bool, torch.amp.GradScaler)),
                         "be True, False or a torch.amp.GradScaler")
        if precision == "bf16-mixed" and amp is not False:
            raise ValueError("optim: precision='bf16-mixed' needs no loss scaling: leave amp unset "
                             "(precision='16-mixed' scales the loss itself)")
        self.clip_norm, self.clip_value = (positive_by_name(name, n, v) for n, v in (
            ("clip_norm", clip_norm), ("clip_value", clip_value)))  # a dict: only the optimizers it names
        self.clip_scope: str = choice(name, "clip_scope", clip_scope, ("optimizer", "model"))
        if clip_scope == "model" and clip_norm is None:
            raise ValueError("optim: clip_scope='model' is the scope of clip_norm's norm, which is not given: give "
                             "clip_norm=<max norm> too (clip_value clips each value, whatever the scope)")
        if clip_scope == "model" and isinstance(self.clip_norm, dict):
            raise ValueError(f"optim: clip_scope='model' clips one norm over every optimizer's parameters by one "
                             f"clip_norm, got clip_norm={clip_norm!r}: give one number, or leave clip_scope out to "
                             f"clip each optimizer the dict names by its own norm")
        self.nonfinite, self.precision = nonfinite, precision  # (as typed: choice() returns Any)
        self._step_options = {"accumulate": self.accumulate, "clip_norm": self.clip_norm, "clip_value": self.clip_value,
                              "clip_scope": self.clip_scope, "precision": str(precision)}  # saved: a resume warns
        self.schedulers, self.scheduler_interval, self.monitor = schedulers, scheduler_interval, monitor
        self.scaler: torch.amp.GradScaler | None = None
        self.loop: Run | None = None
        self.optimizers: Optimizers | None = None
        self._schedules = Schedules(schedulers, scheduler_interval, monitor)  # checked: see schedulers.py
        self._window, self._watch = Window(accumulate), Watch()
        self._policy = Policy(nonfinite, on_poison=self._poisoned)
        self._deferred, self._check = Deferred(self._policy), Check()
        self._rules: Rules | None = None
        self._closes_always = False  # batch_end closes every window (once one was poisoned)
        self._before_backward, self._after_backward = Handlers(), Handlers()
        self._autocast: tuple[str, torch.dtype] | None = None  # (device type, dtype) when mixed
        self._skipped_total: int | None = None  # the run's skipped steps, at its end (results)

    @hookimpl
    def configure(self, loop: Run) -> None:
        self.loop = loop  # loop.optimizers replaced here: every plugin sees them from fit_start on
        optimizers = _named(loop.optimizers)
        held = parameter_names(loop.model) if loop.model is not None and loop.mode == "fit" else None  # (by id)
        for option in ("clip_norm", "clip_value") if loop.mode == "fit" else ():  # (a validation has none)
            known_names(self.name, option, getattr(self, option), optimizers, "optimizers")
        for name, opt in optimizers.items():
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"optim: optimizer {name!r} is a {type(opt).__name__}, not a torch.optim.Optimizer")
            if held is not None and (outside := [p for g in opt.param_groups for p in g["params"]
                                                 if id(p) not in held]):
                warnings.warn(f"optim: optimizer {name!r} steps {len(outside)} parameter tensor(s) that Loop(model="
                              f"...) does not hold ({few_parameters(outside, {})}): checkpoints do not save them and "
                              f"EMA does not average them. Give the model the module that holds them: Loop(model="
                              f"torch.nn.ModuleList([net, criterion]))", OptimWarning, stacklevel=user_level())
        schedulers = self._schedules.assign(loop, optimizers, self.accumulate)  # checked (none in a validation)
        self._counts = hparams.ScheduleCounts(self.name, OptimWarning)  # schedulers stepped elsewhere too
        device = next((p.device.type for root in modules(loop.model) for p in root.parameters()), None)
        guess = "cuda" if torch.cuda.is_available() else "cpu"
        self._autocast = None
        if self.precision != "32":
            self._autocast = (device or guess, torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16)
            loop.wrap_step(torch.autocast(self._autocast[0], dtype=self._autocast[1]))  # (a decorator of the step)
        if isinstance(self.amp, torch.amp.GradScaler):
            self.scaler = self.amp
        elif self.amp or self.precision == "16-mixed":
            self.scaler = torch.amp.GradScaler(self._autocast[0] if self._autocast else guess)
        self._closes_always = False
        self._policy.start(loop)
        self._deferred.start(self.accumulate, self.scaler is not None)
        if self.nonfinite is None:  # every loss back-propagated
            self._check = Check()
        elif self.defer is True or (self.defer is None and device not in (None, "cpu")):
            self._check = self._deferred
        else:  # defer=None: the first loss on an accelerator takes the device path; Agreed: several processes
            self._check = (Agreed if loop.state.world_size > 1 else HostCheck)(
                self._policy, self._to_device if self.defer is None else None)
        hooks = loop.hooks
        self._before_backward, self._after_backward = hooks.handlers("before_backward"), hooks.handlers("after_backward")
        checks = self.nonfinite is not None and self.scaler is None  # a clip's norm checked (README.md)
        checks_grads = checks and (self.check_grads or self._check is self._deferred and loop.state.world_size > 1)
        rules = self._rules = Rules(
            loop, self._window, self._policy, self._deferred, self._watch, scaler=self.scaler, check_norms=checks,
            clip_norm=self.clip_norm, clip_value=self.clip_value, check_grads=checks_grads, fuse=self.fuse,
            prepares=self.scaler is not None or checks_grads or self.clip_norm is not None
            or self.clip_value is not None, before_step=hooks.handlers("before_optimizer_step"),
            after_step=hooks.handlers("after_optimizer_step"))
        kind = OnlyOptimizer if len(optimizers) == 1 else ManagedOptimizer  # one optimizer is the collection
        managed = {n: kind(rules, n, o, schedulers[n], self._schedules.per_step(schedulers[n]))
                   for n, o in optimizers.items()}
        if self.clip_scope == "model" and isinstance(self.clip_norm, float):
            rules.model_norm = ModelNorm(self.clip_norm, list(managed.values()))
        sparse = sparse_parameters(loop.model) if held is not None else []  # torch's clips refuse their gradients
        for opt, option in ((m, o) for m in managed.values() for o in ("clip_norm", "clip_value")):
            if getattr(opt, option) is not None:
                refuse_clip(self.name, option, opt.name, opt.optimizer, opt.params, sparse, held or {}, list(managed),
                            getattr(opt, option))
        only = next(iter(managed.values()), None)
        self.optimizers = loop.optimizers = only if isinstance(only, OnlyOptimizer) else Optimizers(managed, loop)
        why = [f"accumulate={self.accumulate} (each loss must be divided by the window)"] if self.accumulate > 1 else []
        if self.scaler is not None:
            why.append("loss scaling (precision='16-mixed' or amp: the loss must be scaled)")
        self._watch.start(loop, self.optimizers, why, lambda: self._counts.check(  # schedulers stepped in the step
            loop, self.optimizers, self._schedules.per_step, early=True), self._window)

    def batch_events(self, loop: Run) -> tuple[str, ...]:
        """``batch_end`` where a batch can close a window, update the loss scale or close a poisoned window."""
        return ("batch_end",) if self.accumulate > 1 or self.scaler is not None or self._closes_always else ()

    def _poisoned(self) -> None:
        """Once a window is poisoned, ``batch_end`` closes windows for the rest of the run (never leaves the lists)."""
        if self._policy.poisoned and not self._closes_always and self.loop is not None:
            self._closes_always = True
            self.loop.hooks.resolve()

    def _to_device(self, loop: Run, loss: torch.Tensor) -> bool:
        """``defer=None``: the first loss not on the CPU chooses the device path for the run."""
        self._check = self._deferred
        return self._check.admits(loop, loss)

    @hookimpl
    def fit_start(self, loop: Run) -> None:
        self._schedules.sized_in_batches(loop, self.accumulate)  # (the batches the run trains are known from here)

    @hookimpl
    def backward(self, loop: Run, loss: torch.Tensor) -> bool:
        """The check, the events around the pass, the loss divided and scaled; outside autocast, as PyTorch advises."""
        if self._autocast is not None and torch.is_autocast_enabled(self._autocast[0]):
            with torch.autocast(self._autocast[0], enabled=False):
                return self.backward(loop, loss)
        if not self._check.admits(loop, loss):  # a non-finite loss: not back-propagated
            return True
        for call in self._before_backward.calls:
            call(loop, loss)
        scaled = loss
        if self.accumulate > 1 and (divisor := self._window.divisor(loop)) > 1:
            scaled = loss / divisor
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        watch = self._watch
        watch.inside = True
        try:
            scaled.backward()  # type: ignore[no-untyped-call]  # Tensor.backward is unannotated in torch
        except RuntimeError as error:
            note_toggles(self.optimizers, loop, error)  # a toggle froze what the loss needed: say so
            raise
        finally:
            watch.inside = False
        if watch.active:
            watch.passed()
        for call in self._after_backward.calls:
            call(loop, loss)
        return True

    @hookimpl(tryfirst=True)  # the window closed and the scale updated before others see the batch
    def batch_end(self, loop: Run) -> None:
        if loop.training:
            self._update_scale()  # once per batch, after every optimizer of the batch stepped
            if self._window.closes(loop):
                self._close_window()

    def _update_scale(self) -> None:
        if self.scaler is not None and self._rules is not None and self._rules.scaler_used:
            self.scaler.update()
            self._rules.scaler_used = False

    def _close_window(self) -> None:
        """The window's flag is kept for the next read; a poisoned window's steps are skipped."""
        self._deferred.close()
        if self._policy.poisoned and self.optimizers is not None:
            for managed in self.optimizers.values():
                managed.drop_window()
            self._policy.poison(False)

    @hookimpl
    def stage_start(self, loop: Run, stage: str) -> None:
        if stage == "train":
            self._window.measure(loop.train_data)
            self._watch.stage_start(loop.hooks.plugins("backward")[:1] == [loop.pm.get_name(self)])  # optim's pass
            self._counts.start(self.optimizers, self._schedules.per_step)

    @hookimpl(tryfirst=True)  # finishes the stage's work before plugins report on it (metrics)
    def stage_end(self, loop: Run, stage: str) -> None:
        self._schedules.stage_ended(loop, stage)  # a ReduceLROnPlateau steps on this stage's metrics
        if stage != "train" or self.optimizers is None:
            return
        self._counts.check(loop, self.optimizers, self._schedules.per_step)  # (a flush below steps both alike)
        for managed in self.optimizers.values():  # the last, partial window of the epoch
            managed.flush()
        self._close_window()
        self._update_scale()
        self._deferred.read()
        self._deferred.raise_due()
        self._watch.stage_end()

    @hookimpl
    def epoch_metrics(self, loop: Run, stage: str, metrics: MetricsSnapshot) -> None:
        self._schedules.epoch_metrics(stage, metrics)

    @hookimpl
    def epoch_end(self, loop: Run, epoch: int) -> None:
        resumed = loop.state.resumed_from is not None  # (its first epoch-wise step may come before a step)
        self._schedules.epoch_end(epoch, [n for n, opt in (self.optimizers or {}).items() if opt.steps and resumed])

    @hookimpl
    def should_sync_gradients(self, loop: Run) -> bool:
        """Whether the optimizers step after this training batch (see :class:`Window`)."""
        return self._window.should_sync(loop)

    @hookimpl
    def results(self, loop: Run) -> dict[str, Any] | None:
        """``skipped_steps`` (non-finite values, the whole run), ``first_skip`` (where, or ``None``), when training."""
        total = self._skipped_total
        return None if total is None else {"skipped_steps": total, "first_skip": self._policy.first_skip}

    @hookimpl
    def fit_end(self, loop: Run) -> None:
        """The last read of the device's flags, the run's total of skipped steps; the watch ends whatever happened."""
        self._skipped_total = None
        try:
            if self.optimizers is not None:
                self._counts.check(loop, self.optimizers, self._schedules.per_step)  # a stage max_steps or a stop cut
                self._deferred.finish(final=loop.state.status != "completed")
                skipped = self._skipped_total = sum(m.skipped for m in self.optimizers.values())
                if skipped > 1:
                    warnings.warn(f"optim: {skipped} optimizer steps were skipped in this run because of non-finite "
                                  f"values (first: {self._policy.first_skip})", OptimWarning, stacklevel=user_level())
        finally:
            kernels.note_unscaled(loop.state.error, "optim", self.accumulate)  # a scaler.unscale_ kept in the step
            self._watch.release()
            self.loop = None

    def state_dict(self) -> dict[str, Any]:
        """What ``save_state`` stores (README.md, "Checkpoints")."""
        assert self.optimizers is not None
        loop, deferred = self.loop, self._deferred  # (loop None after the run, when no flag is open)
        if deferred.bad is not None and (
                self.accumulate == 1 or (loop is not None and loop.training and self._window.closes(loop))):
            deferred.close()  # this batch's steps are done
        deferred.read(hold=True)  # the counters as they are (an error is raised at optim's next step or read)
        window_open = self.accumulate > 1 and any(m.window_open for m in self.optimizers.values())
        poisoned = self._policy.poisoned or (window_open and deferred.bad is not None and bool(deferred.bad))
        managed = self.optimizers.items()
        hand = loop is not None and loop.state.status != "failed"  # a failed run's may be the failed batch's
        held = window_open or (hand and any(m.holds_grads() for _, m in managed))  # optim's window, or the step's
        return {
            "optimizers": {n: m.state_dict() for n, m in managed},
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "window": {"deferred": [n for n, m in managed if m.window_open],
                       "grads": {n: [None if p.grad is None else p.grad.detach().clone() for p in m.params]
                                 for n, m in managed}} if held else None, "options": dict(self._step_options),
            "nonfinite": {"poisoned": poisoned, "first_skip": self._policy.first_skip}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, refused before anything is restored when it does not fit."""
        assert self.optimizers is not None
        saved, here = set(state["optimizers"]), set(self.optimizers)
        if saved != here:
            raise ValueError(f"optim: the checkpoint has optimizers {sorted(saved)}, this run {sorted(here)}")
        for name, managed in self.optimizers.items():
            managed.check_state(state["optimizers"][name])
        hparams.warn_changed_options(self.name, state.get("options"), self._step_options, OptimWarning)
        for name, managed in self.optimizers.items():
            managed.load_state_dict(state["optimizers"][name])
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        self._deferred.discard()  # the flags of losses the restored state comes before
        self._policy.poison(state["nonfinite"]["poisoned"])
        self._policy.first_skip = state["nonfinite"]["first_skip"]
        if (window := state["window"]) is not None:
            for name, managed in self.optimizers.items():
                managed.window_open = name in window["deferred"]
                for p, grad in zip(managed.params, window["grads"][name]):
                    p.grad = None if grad is None else grad.to(p.device).clone()

    @hookimpl
    def save_state(self) -> dict[str, Any] | None:
        return self.state_dict() if self.optimizers is not None else None

    @hookimpl
    def load_state(self, loop: Run, state: Mapping[str, Any]) -> None:
        if loop.mode == "fit":  # a run that does not train (Loop.validate()) needs no optimizer state
            self.load_state_dict(state)
        elif (saved := (state.get("options") or {}).get("precision", "32")) != "32" and self.precision == "32":
            warnings.warn(f"optim: the checkpoint's run trained with precision={saved!r}, and this evaluation runs "
                          f"in float32: its metrics are not those the run's validations measured. To evaluate as the "
                          f"run did, give Loop(plugins=[Optim(precision={saved!r})])", OptimWarning,
                          stacklevel=user_level())


def _named(value: Any) -> dict[str, Any]:
    """``Loop(optimizers=...)`` by name (one optimizer is ``"default"``; ``Loop()`` refuses a list of them)."""
    if isinstance(value, Optimizers):
        return {n: m.optimizer for n, m in value.items()}
    return {} if value is None else dict(value) if isinstance(value, Mapping) else {"default": value}


class Window:
    """Windows of ``size`` training batches (``Optim(accumulate=size)``): README.md, "The accumulation window"."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.measure(None)  # _stage_len: the stage's batches (None: unknown); _last_window, _last_size: its partial one

    def measure(self, data: Any) -> None:
        """At a training stage's start: its length, and its last window when that is partial."""
        self._stage_len, self._last_window, self._last_size = length(data), sys.maxsize, self.size
        if self._stage_len is not None and self._stage_len % self.size:
            self._last_size = self._stage_len % self.size
            self._last_window = self._stage_len - self._last_size

    def closes(self, loop: Run) -> bool:
        """Whether the running training batch is its window's last (the epoch's last batch closes a partial one)."""
        return self.size == 1 or (done := loop.state.batch_idx + 1) % self.size == 0 or done == self._stage_len

    def divisor(self, loop: Run) -> int:
        """What this batch's loss is divided by (``size`` past the data's length: a wrong ``__len__``)."""
        in_last = self._last_window <= loop.state.batch_idx < self._last_window + self._last_size  # (a partial one)
        return self._last_size if in_last and loop.training else self.size

    def should_sync(self, loop: Run) -> bool:
        """The built-in's answer to ``should_sync_gradients`` (its contract is stated there)."""
        state = loop.state
        return (self.closes(loop) or self._stage_len is None or state.batch_idx >= self._stage_len - 1
                or (loop.max_steps is not None and state.step + 1 >= loop.max_steps))
