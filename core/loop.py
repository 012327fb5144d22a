"""The training loop: iterate the data, call the step functions, emit events. Nothing else."""

from __future__ import annotations

import functools
import itertools
import os
import sys
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import torch

from hookfit import manager
from hookfit.dispatch import Dispatch, resolve
from hookfit.manager import HookfitWarning, PluginManager

Step = Callable[["Loop", Any], Any]
_Tensor = torch.Tensor
Status = Literal["idle", "running", "completed", "interrupted", "failed"]


@dataclass
class State:
    """Where a run is. ``loop.state``; returned by ``fit()``.

    ``epoch`` counts from 0; ``step`` counts training batches whose step ran (the global step,
    skipped batches included, optimizer steps not); ``batch_idx`` is the position in the
    current stage; ``stage`` is ``"train"``, ``"valid"`` or ``None`` outside a stage.
    ``status`` ends as ``"completed"``, ``"interrupted"`` or ``"failed"`` with ``stop_reason``.
    """

    epoch: int = 0
    step: int = 0
    batch_idx: int = 0
    stage: str | None = None
    status: Status = "idle"
    stop_reason: str | None = None
    error: BaseException | None = None
    started_at: float | None = None
    ended_at: float | None = None
    resume_batch: int = 0
    """Training batches of ``epoch`` already done in an earlier run (set by a ``resume``
    plugin); the loop skips them, then sets this back to 0."""
    resume_stage: Literal["train", "valid"] = "train"
    """Where a resumed ``epoch`` starts: ``"train"`` (at ``resume_batch``) or ``"valid"``
    (its training stage was complete, ``stage_end`` included)."""
    rank: int = 0
    """This process's rank among ``world_size`` processes (set by a distributed plugin)."""
    world_size: int = 1
    silenced: list[Any] = field(default_factory=list)
    """Observer plugins switched off during the run (:class:`hookfit.manager.Silenced`)."""

    @property
    def elapsed(self) -> float:
        """Seconds since ``fit()`` started (until it ended, once it has)."""
        if self.started_at is None:
            return 0.0
        end = self.ended_at if self.ended_at is not None else time.perf_counter()
        return end - self.started_at


class _Stop(Exception):
    """Internal: a plugin answered ``should_stop``."""


def _name(function: Any) -> str:
    return getattr(function, "__qualname__", None) or repr(function)


def modules(model: Any) -> list[torch.nn.Module]:
    """The root modules of ``Loop(model=...)``: a module, or those in a mapping or a list."""
    if model is None:
        return []
    if isinstance(model, torch.nn.Module):
        return [model]
    if isinstance(model, Mapping):
        return [m for v in model.values() for m in modules(v)]
    if isinstance(model, (list, tuple)):
        return [m for v in model for m in modules(v)]
    raise TypeError(
        f"model must be a torch.nn.Module, a mapping or a list of modules, "
        f"not {type(model).__name__}"
    )


def _call(impl: Any, **kwargs: Any) -> Any:
    """Call one hook implementation with the arguments it asks for."""
    return impl.function(*[kwargs[name] for name in impl.argnames])


def _positive_int(value: Any, what: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")


class Loop:
    """A training run: ``Loop(train_step, train_data, ...).fit()``.

    ``train_step(loop, batch)`` and ``val_step(loop, batch)`` are plain functions. They return
    ``None`` (nothing to report for this batch), a mapping with any keys, or a tensor (taken as
    ``{"loss": tensor}``). Optimizers, metrics, output and stopping are plugins: discovered
    through the ``hookfit`` entry-point group, given in ``plugins`` (an instance replaces a
    discovered plugin of the same name), switched off by name in ``disable``.

    Validation runs every ``val_every_n_epochs`` epochs after the training stage, with every
    module of ``model`` in eval mode under ``torch.inference_mode()`` (``val_grad_mode="no_grad"``
    for ``torch.no_grad()``); afterwards each submodule gets back its own previous training flag.

    Files a run writes (metrics logs, checkpoints) go to ``loop.run_dir``: ``run_dir`` if given,
    else a new ``runs/<date>-<time>`` folder, created only when a plugin first asks for it.

    ``resume="latest"`` or a checkpoint path continues an earlier run through the plugin that
    implements the ``resume`` event (the checkpoint plugin); without the argument, the
    ``HOOKFIT_RESUME`` environment variable is used when set. Data that has ``set_epoch(epoch)``
    is told each epoch before it is iterated (for reproducible shuffles); data that has
    ``iter_from(start)`` starts a resumed epoch there instead of skipping batches one by one.
    """

    def __init__(
        self,
        train_step: Step,
        train_data: Iterable[Any],
        *,
        val_step: Step | None = None,
        val_data: Iterable[Any] | None = None,
        model: Any = None,
        optimizers: Any = None,
        max_epochs: int = 1,
        max_steps: int | None = None,
        val_every_n_epochs: int = 1,
        val_grad_mode: Literal["inference", "no_grad"] = "inference",
        run_dir: str | os.PathLike[str] | None = None,
        resume: str | os.PathLike[str] | None = None,
        plugins: Sequence[Any] = (),
        disable: Sequence[str] = (),
    ) -> None:
        for what, fn in (("train_step", train_step), ("val_step", val_step)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{what} must be a function step(loop, batch), got {fn!r}")
        for what, data in (("train_data", train_data), ("val_data", val_data)):
            if data is None or isinstance(data, (str, bytes)) or not isinstance(data, Iterable):
                if what == "val_data" and data is None:
                    continue
                raise TypeError(
                    f"{what} must be an iterable of batches (a list, a DataLoader, ...), "
                    f"got {type(data).__name__}"
                )
        if val_step is not None and val_data is None:
            raise ValueError(f"val_step {_name(val_step)!r} was given without val_data")
        if val_data is not None and val_step is None:
            raise ValueError("val_data was given without a val_step to run on it")
        _positive_int(max_epochs, "max_epochs")
        _positive_int(max_steps, "max_steps", allow_none=True)
        _positive_int(val_every_n_epochs, "val_every_n_epochs")
        if val_grad_mode not in ("inference", "no_grad"):
            raise ValueError(f"val_grad_mode must be 'inference' or 'no_grad', got {val_grad_mode!r}")
        if isinstance(disable, str):
            raise TypeError("disable must be a list of plugin names, not a string")
        modules(model)  # type check now, not mid-run

        self.train_step = train_step
        self.train_data = train_data
        self.val_step = val_step
        self.val_data = val_data
        self.model = model
        self.optimizers = optimizers
        self.max_epochs = max_epochs
        self.max_steps = max_steps
        self.val_every_n_epochs = val_every_n_epochs
        self.val_grad_mode = val_grad_mode
        self.state = State()
        self.training = False
        self.pm: PluginManager | None = None
        """The run's plugin manager (``pm.hook.<event>(...)``: pluggy's ordinary call path)."""
        self._run_dir = Path(run_dir) if run_dir is not None else None
        self.run_dir_given = run_dir is not None
        """Whether ``run_dir`` was given (else each run gets a new ``runs/<date>-<time>``)."""
        self.resume = resume
        self._given = tuple(plugins)
        self._disable = tuple(disable)
        self.hooks: Dispatch | None = None

    # -- public API used by steps and plugins -------------------------------------------
    @property
    def run_dir(self) -> Path:
        """The folder this run's files go to; created on first access."""
        if self._run_dir is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            base = Path("runs") / stamp
            candidate, n = base, 1
            while candidate.exists():
                n += 1
                candidate = base.with_name(f"{stamp}-{n}")
            self._run_dir = candidate
        self._run_dir.mkdir(parents=True, exist_ok=True)
        return self._run_dir

    @property
    def is_main(self) -> bool:
        """Whether this is the process that writes files and renders (rank 0)."""
        return self.state.rank == 0

    def plugin_states(self) -> dict[str, Any]:
        """Every plugin's ``save_state`` answer, keyed by plugin name (for checkpoints)."""
        pm = self._running("plugin_states()")
        return {impl.plugin_name: _call(impl, loop=self) for impl in pm.hook.save_state.get_hookimpls()}

    def load_plugin_states(self, states: Mapping[str, Any], strict: bool = True) -> None:
        """Give each plugin its entry of ``states`` (from :meth:`plugin_states`) through its
        ``load_state`` implementation.

        A plugin that saves state but has no entry, or an entry that no plugin of this run
        restores, is an error naming them (``strict``) or a warning (``strict=False``); the
        rest is restored either way."""
        pm = self._running("load_plugin_states()")
        loaders = {impl.plugin_name: impl for impl in pm.hook.load_state.get_hookimpls()}
        savers = {impl.plugin_name for impl in pm.hook.save_state.get_hookimpls()}
        missing = sorted(name for name in savers if name not in states)
        extra = sorted(name for name in states if name not in loaders and states[name] is not None)
        if missing or extra:
            problems = []
            if missing:
                problems.append(f"no saved state for {', '.join(map(pm.describe, missing))}")
            if extra:
                problems.append(f"saved state of plugin(s) {', '.join(map(repr, extra))} that "
                                "no enabled plugin of this run restores")
            message = "plugin states do not match this run: " + "; ".join(problems)
            if strict:
                raise ValueError(message + " (strict; pass strict=False to restore the rest)")
            warnings.warn(message + "; restoring the rest", HookfitWarning, stacklevel=2)
        for name, impl in loaders.items():
            if states.get(name) is not None:
                _call(impl, loop=self, state=states[name])

    def _running(self, what: str) -> PluginManager:
        if self.pm is None:
            raise RuntimeError(f"{what} needs a running loop: call it during fit()")
        return self.pm

    def request_stop(self, reason: str = "stop requested") -> bool:
        """Ask for a graceful stop after the current batch, from any thread.

        Fires the ``request_stop`` event; a plugin that implements it (the interrupter) makes
        ``should_stop`` answer true after the current batch. Returns whether any enabled plugin
        answers ``should_stop`` (if none does, the request cannot be honoured: a warning says so)."""
        self._running("request_stop()")
        can_stop = bool(self.pm.hook.should_stop.get_hookimpls())
        if not can_stop:
            disabled = [i.name for i in self.pm.infos.values() if not i.enabled]
            warnings.warn(
                f"request_stop({reason!r}) will be ignored: no enabled plugin answers "
                f"should_stop (disabled plugins: {', '.join(disabled) or 'none'})",
                HookfitWarning,
                stacklevel=2,
            )
        self.pm.hook.request_stop(loop=self, reason=reason)
        return can_stop

    def backward(self, loss: Any) -> Any:
        """Run the backward pass on ``loss`` through the plugin that owns it (``backward``
        event), so gradient accumulation, loss scaling and the hooks around it apply.

        During a run whose plugins implement the event, ``loop.backward`` is that
        implementation bound to the loop (one call less on the hot path); this method only
        says what is missing."""
        if self.pm is None or self.state.status != "running":
            raise RuntimeError("backward() needs a running loop: call it from a step function")
        disabled = [i.name for i in self.pm.infos.values() if not i.enabled]
        raise RuntimeError(
            "loop.backward() needs a plugin that implements the 'backward' event and no "
            f"enabled plugin does (disabled plugins: {', '.join(disabled) or 'none'}); "
            "enable it, or call loss.backward() yourself"
        )

    def _bind_backward(self) -> None:
        call = resolve(self.pm, "backward", results=True)  # type: ignore[arg-type]
        if call is None:
            self.__dict__.pop("backward", None)
        else:
            self.backward = functools.partial(call, self)  # type: ignore[method-assign]

    # -- the run --------------------------------------------------------------------------
    def fit(self) -> State:
        """Run training (and validation) to the end; return the final :class:`State`.

        Plugins are discovered, registered and checked first: a broken plugin raises
        :class:`hookfit.PluginError` before any event fires. After ``fit_start`` fired,
        ``fit_end`` fires exactly once whatever happens, and an exception from the data, a
        step or a plugin propagates unchanged after ``exception`` and ``fit_end``."""
        if self.state.status != "idle":
            raise RuntimeError("this Loop has already run; create a new Loop to train again")
        self.pm = pm = manager.build(self._given, self._disable)
        self.state.silenced = pm.silenced
        self.hooks = Dispatch(pm)
        self._bind_backward()
        unbind = pm.on_change(self._bind_backward)
        state = self.state
        state.status = "running"
        state.started_at = time.perf_counter()
        try:
            pm.hook.configure(loop=self)
            pm.hook.fit_start(loop=self)
            self._resume()
            self._run()
        except BaseException as error:
            self._record_failure(error)
            self._finish(failed=True, unbind=unbind)
            raise
        self._finish(failed=False, unbind=unbind)
        return state

    def _resume(self) -> None:
        source = self.resume if self.resume is not None else os.environ.get("HOOKFIT_RESUME") or None
        if source is None:
            return
        caller = self.pm.hook.resume  # type: ignore[union-attr]
        if not caller.get_hookimpls():
            disabled = [i.name for i in self.pm.infos.values() if not i.enabled]  # type: ignore[union-attr]
            raise RuntimeError(
                f"resume={str(source)!r} needs a plugin that implements the 'resume' event "
                f"(checkpoint) and no enabled plugin does (disabled plugins: "
                f"{', '.join(disabled) or 'none'})"
            )
        caller(loop=self, source=os.fspath(source))

    def _run(self) -> None:
        hook = self.pm.hook  # type: ignore[union-attr]
        state = self.state
        try:
            if self.max_steps is not None and state.step >= self.max_steps:  # resumed at the end
                state.stop_reason = f"max_steps={self.max_steps} reached"
                state.status = "completed"
                return
            for epoch in range(state.epoch, self.max_epochs):
                state.epoch = epoch
                for data in (self.train_data, self.val_data):
                    if hasattr(data, "set_epoch"):
                        data.set_epoch(epoch)
                hook.epoch_start(loop=self, epoch=epoch)
                start, state.resume_batch = state.resume_batch, 0
                first, state.resume_stage = state.resume_stage, "train"
                if first == "train":
                    self._stage("train", self.train_step, self.train_data, start)
                if self.val_step is not None and (epoch + 1) % self.val_every_n_epochs == 0:
                    self._validate()
                hook.epoch_end(loop=self, epoch=epoch)
                if self.max_steps is not None and state.step >= self.max_steps:
                    state.stop_reason = f"max_steps={self.max_steps} reached"
                    break
            else:
                state.stop_reason = f"max_epochs={self.max_epochs} reached"
            state.status = "completed"
        except _Stop as stop:
            state.status = "interrupted"
            state.stop_reason = str(stop)
        finally:
            self.training = False

    def _validate(self) -> None:
        roots = modules(self.model)
        flags = [(m, m.training) for root in roots for m in root.modules()]
        grad = torch.inference_mode() if self.val_grad_mode == "inference" else torch.no_grad()
        try:
            for root in roots:
                root.eval()
            with grad:
                self._stage("valid", self.val_step, self.val_data)  # type: ignore[arg-type]
        finally:
            for module, flag in flags:
                module.training = flag

    def _stage(self, stage: str, step: Step, data: Iterable[Any], start: int = 0) -> None:
        """Run one stage over ``data`` from batch ``start``. The per-batch body is the hot
        path: every event without an implementation costs one ``is None`` test."""
        state = self.state
        dispatch = self.hooks
        train = stage == "train"
        limit = self.max_steps if train and self.max_steps is not None else sys.maxsize
        state.stage = stage
        state.batch_idx = start
        self.training = train
        self.pm.hook.stage_start(loop=self, stage=stage)  # type: ignore[union-attr]
        batch_idx = start - 1
        if start:
            iter_from = getattr(data, "iter_from", None)
            data = iter_from(start) if iter_from is not None else itertools.islice(data, start, None)
        for batch_idx, batch in enumerate(data, start):
            state.batch_idx = batch_idx
            if (call := dispatch.batch_start) is not None:
                call(self, batch, batch_idx)
            output = step(self, batch)
            if output is not None:
                if type(output) is not dict:
                    # a tensor is the common case: test it before the (slower) Mapping ABC
                    output = {"loss": output} if type(output) is _Tensor or isinstance(output, _Tensor) else self._as_mapping(output, step)
                if (call := dispatch.step_output) is not None:
                    call(self, output, batch)
            if train:
                state.step += 1
            if (call := dispatch.batch_end) is not None:
                call(self, output, batch, batch_idx)
            if (call := dispatch.stop_answer) is not None and (answer := call(self)):
                self._stop(answer)
            if state.step >= limit:
                break
        if batch_idx < 0:
            raise ValueError(
                f"{stage} data yielded no batches in epoch {state.epoch}"
                + (" (an iterator or generator is used up after one pass; pass a list, a "
                   "DataLoader or another re-iterable)" if state.epoch else "")
            )
        self.pm.hook.stage_end(loop=self, stage=stage)  # type: ignore[union-attr]

    @staticmethod
    def _as_mapping(output: Any, step: Step) -> Mapping[str, Any]:
        if isinstance(output, Mapping):
            return output
        raise TypeError(
            f"step function {_name(step)!r} returned {type(output).__name__}; a step must "
            f"return None, a mapping or a tensor"
        )

    @staticmethod
    def _stop(answer: Any) -> None:
        """Stop if ``answer`` (one plugin's, or a list of several's) holds a true value."""
        truthy = [a for a in (answer if type(answer) is list else [answer]) if a]
        if truthy:
            reasons = [a for a in truthy if isinstance(a, str)]
            raise _Stop("; ".join(reasons) or "a plugin answered should_stop")

    # -- ending ---------------------------------------------------------------------------
    def _record_failure(self, error: BaseException) -> None:
        state = self.state
        if isinstance(error, KeyboardInterrupt):
            state.status = "interrupted"
            state.stop_reason = "KeyboardInterrupt"
            return
        state.status = "failed"
        state.error = error
        state.stop_reason = f"{type(error).__name__}: {error}"
        error.add_note(self._where(error))
        try:
            self.pm.hook.exception(loop=self, error=error)  # type: ignore[union-attr]
        except Exception as secondary:
            self._warn_secondary(secondary, "exception")

    def _where(self, error: BaseException) -> str:
        """A note saying where ``error`` came from: a plugin's hook or a step function."""
        pm = self.pm
        owners: dict[Any, tuple[str, str]] = {}
        for caller in vars(pm.hook).values():  # type: ignore[union-attr]
            for impl in caller.get_hookimpls():
                code = getattr(getattr(impl.function, "__func__", impl.function), "__code__", None)
                owners[code] = (impl.plugin_name, caller.name)
        steps = {getattr(s, "__code__", None): s for s in (self.train_step, self.val_step) if s}
        state = self.state
        at = f"epoch {state.epoch}, stage {state.stage}, batch {state.batch_idx}"
        tb = error.__traceback__
        while tb is not None:
            code = tb.tb_frame.f_code
            if code in owners:
                plugin, hook = owners[code]
                return f"hookfit: raised by {pm.describe(plugin)} in hook {hook!r} ({at})"  # type: ignore[union-attr]
            if code in steps:
                return f"hookfit: raised in step function {_name(steps[code])!r} ({at})"
            tb = tb.tb_next
        return f"hookfit: raised during the run ({at})"

    def _finish(self, failed: bool, unbind: Callable[[], None]) -> None:
        """Fire ``fit_end`` once: every implementation runs even if one raises."""
        state = self.state
        state.stage = None
        pm = self.pm
        errors: list[BaseException] = []
        caller = pm.hook.fit_end  # type: ignore[union-attr]
        impls = caller.get_hookimpls()
        if pm.monitors or any(i.hookwrapper or i.wrapper for i in impls):  # type: ignore[union-attr]
            try:
                caller(loop=self)
            except Exception as exc:
                errors.append(exc)
        else:
            for impl in reversed(impls):
                try:
                    _call(impl, loop=self)
                except Exception as exc:
                    exc.add_note(f"hookfit: raised by {pm.describe(impl.plugin_name)} in hook 'fit_end'")  # type: ignore[union-attr]
                    errors.append(exc)
        state.ended_at = time.perf_counter()
        unbind()
        self.__dict__.pop("backward", None)
        if self.hooks is not None:
            self.hooks.close()
        if not errors:
            return
        if failed:
            for exc in errors:
                self._warn_secondary(exc, "fit_end")
            return
        state.status = "failed"
        state.error = errors[0]
        state.stop_reason = f"{type(errors[0]).__name__}: {errors[0]}"
        for exc in errors[1:]:
            self._warn_secondary(exc, "fit_end")
        raise errors[0]

    @staticmethod
    def _warn_secondary(error: BaseException, hook: str) -> None:
        notes = " ".join(getattr(error, "__notes__", []))
        warnings.warn(
            f"{hook} failed while the run was already ending: "
            f"{type(error).__name__}: {error} {notes}".strip(),
            HookfitWarning,
            stacklevel=3,
        )
