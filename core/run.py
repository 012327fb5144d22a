"""One ``fit()`` of a :class:`hookfit.Loop`: the per-run object that step functions and hooks
receive as ``loop``, and the loop itself: iterate the data, call the steps, emit the events.

:class:`hookfit.Loop` is configuration and the entry point; everything that exists only while a
run does lives here: the plugin manager (``pm``), the resolved events (``hooks``), the bound
``backward``, the run's own ``model``/``optimizers``/data (which plugins may replace at
``configure``/``fit_start`` without touching the user's configuration), the :class:`State`,
and the pending stop request.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import json
import os
import socket
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Literal

import torch

import hookfit
from hookfit import manager, smoke
from hookfit.dispatch import Dispatch
from hookfit.files import RunFile
from hookfit.manager import HookfitWarning, PluginManager, StateMismatch
from hookfit.payloads import ResumeInfo, StopRequest, TimeSplit
from hookfit.position import Cursor, Position, check_position, check_rng, rng_state, set_rng_state
from hookfit.reproducibility import Deterministic, seed_everything
from hookfit.state import State
from hookfit.valsets import ValSets, per_set

if TYPE_CHECKING:  # pragma: no cover
    from hookfit.loop import Loop

Step = Callable[["Run", Any], Any]
_Tensor = torch.Tensor

__all__ = ["Run", "modules"]


class _Stop(Exception):
    """Internal: the run stops at this boundary, as ``request`` asked."""

    def __init__(self, request: StopRequest) -> None:
        super().__init__(request.reason)
        self.request = request


class _Budget(Exception):
    """Internal: ``max_steps`` training batches are done, inside an epoch."""


ENV_RESUME = "HOOKFIT_RESUME"
RUNS = Path("runs")
"""Where runs keep their folders unless ``Loop(run_dir=...)`` says otherwise:
``runs/<name>/<date>-<time>``."""


def script_name() -> str:
    """The name of the script being run (``train`` for ``python train.py``), ``"run"`` when
    there is none (an interactive session, ``python -c``)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None) or (sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c") else None)
    stem = Path(path).stem if path else ""
    if stem == "__main__" and path:  # python -m package: the package's name
        stem = Path(path).parent.name
    return stem or "run"


_END = object()


def _stateful(data: Any) -> bool:
    """Whether ``data`` keeps a state of its own (``state_dict`` and ``load_state_dict``)."""
    return hasattr(data, "state_dict") and hasattr(data, "load_state_dict")


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


class Run:
    """A run of a :class:`hookfit.Loop`, made by ``Loop.fit()``; step functions and hooks get
    it as their ``loop`` argument.

    What a step or a plugin uses:

    * ``state`` (:class:`hookfit.State`), ``training`` (``True`` in the training stage);
    * ``model``, ``optimizers``, ``train_data``, ``val_data``: what the ``Loop`` was given,
      unless a plugin replaced them for this run (a distributed plugin wraps the model and
      shards the data at ``configure``; an optimizer plugin puts managed optimizers in
      ``optimizers`` at ``fit_start``). The ``Loop``'s own configuration is never changed;
    * the configuration, read-only: ``train_step``, ``val_step``, ``max_epochs``,
      ``max_steps``, ``val_every_n_epochs``, ``val_every_n_steps``, ``val_grad_mode``,
      ``seed``, ``deterministic``, ``smoke``, ``mode`` (``"fit"`` or ``"validate"``),
      ``config`` (the ``Loop``);
    * ``backward(loss)``, ``request_stop(reason)``, ``stop_requested``, ``run_dir``,
      ``is_main``, ``plugin_states()`` / ``load_plugin_states(states)``, ``wrap_step(wrapper)``;
    * ``pm``, the run's plugin manager, and ``hooks``, its resolved events
      (:class:`hookfit.dispatch.Dispatch`): fire events through ``hooks``, never
      ``pm.hook``, so that hookfit's guarantees (observers switched off, not fatal; every
      ``fit_end`` implementation runs) hold.

    Where the time goes: the loop measures, per stage, the seconds spent waiting for the next
    batch, inside the step function and in plugins (``state.time_split``, stage name ->
    :class:`hookfit.payloads.TimeSplit`), with clock reads only, never a device sync. What an
    optimizer plugin does inside the step (``loop.backward``, ``loop.optimizers.step()``)
    counts as step. When a run has a folder, its ``run.jsonl`` gets an ``"end"`` line with the
    status, the duration and the split.
    """

    TIME_SPLIT_INTERVAL = 0.5
    """The most seconds ``state.time_split`` lags behind a running stage (it is stored at most
    this often while a stage runs, and always at the stage's end)."""

    def __init__(self, config: Loop, mode: Literal["fit", "validate"] = "fit",
                 resume: str | os.PathLike[str] | None = None) -> None:
        self.config = config
        self.mode = mode
        """``"fit"`` (``Loop.fit()``), or ``"validate"`` (``Loop.validate()``: the validation
        stage alone, no ``epoch_start``/``epoch_end``; a plugin that saves training progress,
        such as checkpoints, saves nothing in it)."""
        self.train_step = config.train_step
        self.val_step = config.val_step
        self.max_epochs = config.max_epochs
        self.max_steps = config.max_steps
        self.val_every_n_epochs = config.val_every_n_epochs
        self.val_every_n_steps = config.val_every_n_steps
        self.val_grad_mode = config.val_grad_mode
        self.seed = config.seed
        self.deterministic = config.deterministic
        self.smoke = smoke.wanted(config.smoke)
        """A smoke run (``Loop(smoke=True)`` or ``HOOKFIT_SMOKE=1``): two batches a stage, one
        epoch, a temporary run folder, a report (:mod:`hookfit.smoke`). A plugin that writes
        files where it chooses keeps them in :attr:`run_dir` instead during one."""
        self._smoke = smoke.Smoke() if self.smoke else None
        if self._smoke is not None:  # one epoch, validated: inside training too when asked
            self.max_epochs, self.max_steps = 1, None
            if self.val_every_n_epochs is not None:
                self.val_every_n_epochs = 1
            if self.val_every_n_steps is not None:
                self.val_every_n_steps = 1
        if resume is None:
            resume = config.resume if config.resume is not None else os.environ.get(ENV_RESUME) or None
        if self.smoke:
            resume = None  # a smoke run keeps nothing and continues nothing
        self.resume: str | None = None if resume is None else os.fspath(resume)
        """What to resume from (``Loop(resume=...)``, else ``HOOKFIT_RESUME``), known from
        ``configure`` on, or ``None``."""
        self.name = config.name or (config.run_dir.name if config.run_dir is not None else script_name())
        """The run's identity: ``Loop(name=...)``, else the name of ``run_dir``, else the
        script's name. Runs of one name share ``runs/<name>/``, and resuming ``"latest"``
        never crosses to another name's checkpoints."""
        self.model = config.model
        self.optimizers = config.optimizers
        self.train_data = config.train_data
        self.val_data = config.val_data
        self.state = State()
        self.training = False
        self.pm: PluginManager | None = None
        self.hooks: Dispatch | None = None
        self._run_dir = config.run_dir if self._smoke is None else self._smoke.folder
        self._run_dir_used = False
        self._run_log: RunFile | None = None  # run.jsonl, once the run has a folder
        self.run_dir_given = self._run_dir is not None
        """Whether ``Loop(run_dir=...)`` was given (else each run gets a new folder)."""
        self._stop: StopRequest | None = None
        self._first_epoch = 0
        self._cursor = Cursor(self.state)
        self._start: Position | None = None  # where load_state_dict() put the run, until it starts there
        self._restored: set[str] = set()  # the data ("train", "valid") that restored its own state
        self._valid_data_state: Any = None  # the validation data's own state as the validation began
        self._batches_started = False  # past configure and fit_start: see wrap_step
        # re-entrant: a signal handler (the interrupter's) runs on the main thread, possibly
        # while the step function itself is inside request_stop
        self._stop_lock = threading.RLock()

    # -- what steps and plugins use ---------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        """The folder this run's files go to, created on first access: ``Loop(run_dir=...)``;
        else the folder of the run this one resumes (see :meth:`continue_in`); else a new
        ``runs/<name>/<date>-<time>``."""
        if self._run_dir is None:
            self._run_dir = self.new_run_dir()
        if not self._run_dir_used:
            self._run_dir.mkdir(parents=True, exist_ok=True)
            self._run_dir_used = True
            self._record_run(self._run_dir)
        return self._run_dir

    def _record_run(self, folder: Path) -> None:
        """One line in ``run.jsonl`` of the run folder for this ``fit()`` (a resumed run adds
        its own): what made the run, for a person or a tool looking at it later, with the
        ``pid`` and ``host`` of the process, so a reader can tell a live run from a dead one
        (:mod:`hookfit.runs`). Its ``"end"`` line comes when the run ends (:meth:`_record_end`)."""
        if not self.is_main:
            return
        pm = self.pm
        record = {
            "event": "run", "name": self.name, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "argv": list(sys.argv), "seed": self.seed, "deterministic": self.deterministic,
            "resume": self.resume, "max_epochs": self.max_epochs, "max_steps": self.max_steps,
            "pid": os.getpid(), "host": socket.gethostname(),
            "plugins": pm.participants() if pm else [],
            "versions": {"hookfit": hookfit.__version__, "torch": torch.__version__, "python": sys.version.split()[0]},
        }
        self._run_log = log = RunFile(folder / "run.jsonl", "hookfit")
        log.write(json.dumps(record) + "\n")
        log.close()

    def _record_end(self) -> None:
        """The ``"end"`` line of this ``fit()`` in ``run.jsonl``, after ``fit_end`` (so the
        status is final): ``status``, ``reason``, ``by``, ``duration`` (seconds, as
        ``state.elapsed``), ``epochs`` (counted from 1, as printed), ``steps``, ``time_split``
        (``{stage: {"data": s, "step": s, "plugins": s, "batches": n}}``, see
        :class:`hookfit.payloads.TimeSplit`) and ``pid``. Main process only, and only when the
        run has a folder (a plugin used :attr:`run_dir`): a run that wrote nothing gets no
        folder for it. Written through the same :class:`hookfit.files.RunFile` as the start
        line, so a folder that cannot be written warns once, not twice."""
        log = self._run_log
        if log is None or not self.is_main:
            return
        state = self.state
        record = {
            "event": "end", "status": state.status, "reason": state.stop_reason, "by": state.stopped_by,
            "duration": round(state.elapsed, 3), "epochs": state.epoch + 1, "steps": state.step,
            "time_split": {stage: split.as_dict() for stage, split in state.time_split.items()},
            "pid": os.getpid(),
        }
        log.write(json.dumps(record) + "\n")
        log.close()

    def new_run_dir(self) -> Path:
        """A folder for a new run of this name that does not exist yet:
        ``runs/<name>/<date>-<time>`` (with ``-2``, ``-3``... if that one is taken)."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        base = (RUNS / self.name / stamp).absolute()
        candidate, n = base, 1
        while candidate.exists():
            n += 1
            candidate = base.with_name(f"{stamp}-{n}")
        return candidate

    def continue_in(self, folder: str | os.PathLike[str]) -> None:
        """Make ``folder`` (an earlier run's folder) this run's folder: a resume plugin calls it
        at ``configure``, so the resumed run goes on writing where the run it continues did.
        Refused once a plugin has used :attr:`run_dir`, and when ``Loop(run_dir=...)`` names
        another folder."""
        folder = Path(folder)
        if self.run_dir_given and self._run_dir is not None and folder.resolve() != self._run_dir.resolve():
            raise ValueError(f"continue_in({str(folder)!r}): this run's folder is run_dir={str(self._run_dir)!r}")
        if self._run_dir_used and (self._run_dir is None or folder.resolve() != self._run_dir.resolve()):
            raise RuntimeError(f"continue_in({str(folder)!r}): the run already writes to {self._run_dir}; "
                               "call it at configure, before any plugin uses loop.run_dir")
        self._run_dir = folder

    @property
    def is_main(self) -> bool:
        """Whether this is the process that writes files and renders (rank 0)."""
        return self.state.rank == 0

    @property
    def stop_requested(self) -> StopRequest | None:
        """The stop request waiting for the next boundary, if any (the first one asked)."""
        return self._stop

    def request_stop(self, reason: str = "stop requested", by: str | None = None, *,
                     complete: bool = False) -> StopRequest:
        """Ask for a graceful stop, from any thread, any hook or the step function.

        The loop honours it at the next boundary it reaches: after the current batch, or at a
        stage or epoch boundary (so a stop asked in ``epoch_end`` runs no further batch). The
        run then ends with status ``"interrupted"`` (``"completed"`` with ``complete=True``:
        the run ended by a rule, such as early stopping, not by an interruption),
        ``state.stop_reason == reason`` and
        ``state.stopped_by`` naming who asked: ``by`` if given, else the plugin or step
        function that called this (found on the caller's stack), else ``None``. No plugin is
        needed for a stop. The first request wins; later ones return it unchanged. The
        ``stop_requested`` event fires once, on the calling thread."""
        if not isinstance(reason, str):
            raise TypeError(f"request_stop: reason must be a string, got {type(reason).__name__}")
        if self.pm is None:
            raise RuntimeError("request_stop() needs a running loop: call it during fit()")
        new = StopRequest(reason, by if by is not None else self._asker(), bool(complete))
        with self._stop_lock:
            if self._stop is None:
                self._stop = new
            request = self._stop
        if request is new and self.hooks is not None and (call := self.hooks.stop_requested) is not None:
            call(self, request)
        return request

    def _asker(self) -> str | None:
        """Who is calling :meth:`request_stop`: the innermost registered plugin (a method of
        it, or a function of a plugin module) or step function on the calling stack."""
        steps = {getattr(s, "__code__", None): s for s in (self.train_step, self.val_step) if s is not None}
        names = {id(p): n for n, p in self.pm.list_name_plugin() if p is not None}  # type: ignore[union-attr]
        modules_ = {id(vars(p)): n for n, p in self.pm.list_name_plugin()  # type: ignore[union-attr]
                    if p is not None and isinstance(p, type(sys))}
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code in steps:
                return f"step function {_name(steps[frame.f_code])!r}"
            owner = frame.f_locals.get("self") if frame.f_code.co_argcount else None
            if owner is not None and id(owner) in names:
                return names[id(owner)]
            if id(frame.f_globals) in modules_:
                return modules_[id(frame.f_globals)]
            frame = frame.f_back
        return None

    def backward(self, loss: Any) -> Any:
        """Run the backward pass on ``loss`` through the plugin that owns it (``backward``
        event), so gradient accumulation, loss scaling and the hooks around it apply.

        While a plugin implements the event, ``loop.backward`` is the resolved event bound to
        this run (one call less on the hot path); this method only says what is missing."""
        if self.pm is None or self.state.status != "running":
            raise RuntimeError("backward() needs a running loop: call it from a step function")
        raise RuntimeError(
            "loop.backward() needs a plugin that implements the 'backward' event and no "
            f"enabled plugin does (disabled plugins: {self._disabled()}); "
            "enable it, or call loss.backward() yourself"
        )

    def _bind_backward(self) -> None:
        call = self.hooks.backward  # type: ignore[union-attr]
        if call is None:
            self.__dict__.pop("backward", None)
        else:
            self.backward = functools.partial(call, self)  # type: ignore[method-assign]

    def wrap_step(self, wrapper: Callable[[Step], Step]) -> None:
        """Replace this run's step functions (training and validation) with
        ``wrapper(step)``: for what must surround every call of a step, such as
        ``torch.autocast`` for mixed precision or a profiler's record. Called at ``configure``
        or ``fit_start``, before the first batch; the wrapped functions keep the steps' names
        in messages. Wrappers of several plugins nest, the first given innermost. The
        ``Loop``'s own step functions are not changed."""
        if self._batches_started:
            raise RuntimeError("wrap_step() must be called at configure or fit_start, before the first batch")
        for attr in ("train_step", "val_step"):
            step = getattr(self, attr)
            if step is None:
                continue
            wrapped = wrapper(step)
            if not callable(wrapped):
                raise TypeError(f"wrap_step: the wrapper returned {wrapped!r} for {attr} "
                                f"{_name(step)!r}, not a function step(loop, batch)")
            if wrapped is not step:
                try:
                    functools.update_wrapper(wrapped, step)  # its name, for messages
                except (AttributeError, TypeError):
                    pass  # an object that takes no attributes: messages name it as it is
            setattr(self, attr, wrapped)

    @property
    def position(self) -> Position:
        """Where a run resumed from a state dict taken now would continue
        (:class:`hookfit.position.Position`)."""
        return self._cursor.position()

    def state_dict(self) -> dict[str, Any]:
        """The run's own state, as a checkpoint stores it (beside the model's and
        :meth:`plugin_states`): ``{"loop": position, "rng": random state, "data": the data's
        own states}``, plain data and tensors (see :mod:`hookfit.position`). Taken at any
        moment of the run; ``batch_checkpoint`` and ``epoch_checkpoint`` are the moments after
        everything else of a batch or an epoch. Inside a validation it describes the moment
        the validation began (a resumed run runs it again from its start)."""
        cursor = self._cursor
        data: dict[str, Any] = {}
        if _stateful(self.train_data):
            data["train"] = self.train_data.state_dict()
        if _stateful(self.val_data):
            inside = cursor.valid_rng is not None and self._valid_data_state is not None
            data["valid"] = self._valid_data_state if inside else self.val_data.state_dict()
        saved = {"loop": cursor.position().as_dict(), "rng": cursor.rng(), "data": data}
        if cursor.training and cursor.iter_rng is not None:
            saved["data_rng"] = cursor.iter_rng
        return saved

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Put the run where :meth:`state_dict` was taken (a ``resume`` implementation calls
        it, after ``fit_start`` and before the first epoch): the position, the random state and
        the data's own states. The loop then starts there: it skips the training batches of
        the epoch already done (not for data whose own restored state says where it is), runs
        first a validation that was due, or goes straight to the epoch's validation when its
        training stage was complete. A ``ValueError`` names what is not possible (a position
        beyond this run's training data, a random state of another kind)."""
        if self._batches_started:
            raise RuntimeError("load_state_dict() must be called before the first epoch (from a resume implementation)")
        for key in ("loop", "rng"):
            if key not in saved:
                raise ValueError(f"load_state_dict: the run's state lacks {key!r} (it has {', '.join(map(repr, saved))})")
        check_position(saved["loop"], self.train_data)
        check_rng(saved["rng"])
        if saved.get("data_rng") is not None:
            check_rng(saved["data_rng"])
        position = Position.from_dict(saved["loop"])
        data = saved.get("data") or {}
        self._restored = set()
        for key, target in (("train", self.train_data), ("valid", self.val_data)):
            if key in data and hasattr(target, "load_state_dict"):
                target.load_state_dict(data[key])
                self._restored.add(key)
        set_rng_state(saved["rng"])
        state = self.state
        state.epoch, state.step, state.val_due = position.epoch, position.step, position.val_due
        self._cursor.epoch_begins(position.epoch, position.batch, position.stage)
        self._cursor.iter_rng = saved.get("data_rng")
        self._start = position

    def plugin_states(self) -> dict[str, Any]:
        """Every plugin's ``save_state`` answer, keyed by plugin name (for checkpoints); a
        plugin that answered ``None`` (no state now) has the entry ``None``, so a resumed run
        knows it took part."""
        hooks = self._running("plugin_states()")
        states: dict[str, Any] = dict.fromkeys(hooks.plugins("save_state"))
        states.update(hooks.call_each("save_state", self))
        return states

    def load_plugin_states(self, states: Mapping[str, Any], strict: bool = True) -> None:
        """Give each plugin its entry of ``states`` (from :meth:`plugin_states`) through its
        ``load_state`` implementation; an entry ``None`` restores nothing.

        Two mismatches, named: a plugin of this run that has a state to save but no entry (a
        plugin new to the run, which then starts fresh; one whose ``save_state`` answers
        ``None`` has nothing to miss), and an entry that no plugin of this
        run restores (a plugin since removed). With ``strict`` they raise :class:`StateMismatch`;
        without, one :class:`HookfitWarning` names them and the rest is restored."""
        hooks = self._running("load_plugin_states()")
        loaders = hooks.plugins("load_state")
        savers = hooks.plugins("save_state")
        # a plugin new to the run misses a state only if it has one to keep (an inert plugin,
        # whose save_state answers None now, has nothing to restore)
        missing = sorted(name for name in savers if name not in states
                         and hooks.call_plugin("save_state", name, self) is not None)
        extra = sorted(name for name in states if name not in loaders and states[name] is not None)
        if missing or extra:
            problems = []
            if missing:
                problems.append(f"no saved state for {', '.join(map(self.pm.describe, missing))} "  # type: ignore[union-attr]
                                f"(new to the run: it starts fresh)")
            if extra:
                problems.append(f"saved state of plugin(s) {', '.join(map(repr, extra))} that "
                                "no enabled plugin of this run restores (left unused)")
            message = "plugin states do not match this run: " + "; ".join(problems)
            if strict:
                raise StateMismatch(message, missing, extra)
            warnings.warn(message + "; restoring the rest", HookfitWarning, stacklevel=2)
        for name in loaders:
            if states.get(name) is not None:
                hooks.call_plugin("load_state", name, self, states[name])

    def _running(self, what: str) -> Dispatch:
        if self.hooks is None:
            raise RuntimeError(f"{what} needs a running loop: call it during fit()")
        return self.hooks

    def _disabled(self) -> str:
        disabled = [i.name for i in self.pm.infos.values() if not i.enabled]  # type: ignore[union-attr]
        return ", ".join(disabled) or "none"

    # -- the run ----------------------------------------------------------------------------
    def execute(self) -> State:
        """Discover and register the plugins, then run to the end (``Loop.fit()``)."""
        self.pm = pm = manager.build(self.config._given, self.config._disable)
        self.state.silenced = pm.silenced
        self.hooks = Dispatch(pm)
        self._bind_backward()
        unbind = pm.on_change(self._bind_backward)
        state = self.state
        state.status = "running"
        state.started_at = time.perf_counter()
        with Deterministic() if self.deterministic else contextlib.nullcontext():
            try:
                if self.seed is not None:
                    seed_everything(self.seed)  # before configure: plugins draw from it too
                self._fire("configure")
                if self._smoke is not None:
                    self._smoke.start(self)  # the data as configure left it, cut short
                self._fire("fit_start")
                self._resume()
                self._run()
            except BaseException as error:
                self._record_failure(error)
                self._finish(failed=True, unbind=unbind)
                raise
            else:
                self._finish(failed=False, unbind=unbind)
            finally:
                if self._smoke is not None:
                    self._smoke.finish(self)
        return state

    def _fire(self, event: str, *args: Any) -> None:
        """Fire an event whose results the loop ignores."""
        call = getattr(self.hooks, event)
        if call is not None:
            call(self, *args)

    def _resume(self) -> None:
        source = self.resume
        if source is None:
            return
        call = self.hooks.resume  # type: ignore[union-attr]
        if call is None:
            raise RuntimeError(
                f"resume={source!r} needs a plugin that implements the 'resume' event "
                f"(checkpoint) and no enabled plugin does (disabled plugins: {self._disabled()})"
            )
        resumed_from = call(self, source)
        if not resumed_from:
            return
        at = self._start
        if at is None:
            raise RuntimeError(
                f"resume={source!r}: plugin {', '.join(self.hooks.plugins('resume'))} returned "  # type: ignore[union-attr]
                f"{resumed_from!r} but never gave the run its position: a resume implementation "
                f"calls loop.load_state_dict(saved) with what loop.state_dict() returned")
        where = os.fspath(resumed_from) if isinstance(resumed_from, (str, os.PathLike)) else source
        info = ResumeInfo(where, at.epoch, at.step, at.batch, at.stage)
        self.state.resumed_from = info
        self._fire("resumed", info)

    def _run(self) -> None:
        state = self.state
        self._batches_started = True
        try:
            if self.mode == "validate":  # Loop.validate(): the validation stage alone
                self._boundary("start")
                self._validate()
                state.stop_reason = "validation done"
                state.status = "completed"
                return
            if self.max_steps is not None and state.step >= self.max_steps:  # resumed at the end
                state.stop_reason = f"max_steps={self.max_steps} reached"
                state.status = "completed"
                return
            self._boundary("start")
            self._first_epoch = state.epoch
            at, self._start = self._start, None
            for epoch in range(state.epoch, self.max_epochs):
                state.epoch = epoch
                sets = self.val_data.values() if isinstance(self.val_data, Mapping) else (self.val_data,)
                for data in (self.train_data, *sets):
                    if hasattr(data, "set_epoch"):
                        data.set_epoch(epoch)
                start, first = (at.batch, at.stage) if at is not None else (0, "train")
                at = None
                self._cursor.epoch_begins(epoch, start, first)
                self._fire("epoch_start", epoch)
                self._boundary("epoch_start")
                if first == "train":
                    if epoch == self._first_epoch:
                        self._warn_eval_mode()
                    self._stage("train", self.train_step, self.train_data, start)
                every = self.val_every_n_epochs
                if self.val_step is not None and every is not None and (epoch + 1) % every == 0:
                    self._validate()
                self._fire("epoch_end", epoch)
                self._cursor.epoch_ends()
                self._fire("epoch_checkpoint", epoch)
                self._boundary("epoch_end")
                if self.max_steps is not None and state.step >= self.max_steps:
                    state.stop_reason = f"max_steps={self.max_steps} reached"
                    break
            else:
                state.stop_reason = f"max_epochs={self.max_epochs} reached"
            state.status = "completed"
        except _Budget:  # max_steps inside an epoch: the rest of it is for a longer run
            state.stop_reason = f"max_steps={self.max_steps} reached"
            state.status = "completed"
        except _Stop as stop:
            state.status = "completed" if stop.request.complete else "interrupted"
            state.stop_reason = stop.request.reason
            state.stopped_by = stop.request.by
        finally:
            self.training = False

    def predict(self, data: Iterable[Any], step: Step) -> Iterator[Any]:
        """What :meth:`hookfit.Loop.predict` returns: the step's output per batch, in eval
        mode, each call without autograd (only the call: code between two batches runs in the
        caller's own grad mode), the modes restored when the generator ends or is closed."""
        with self._eval_modes():
            for batch in data:
                with self._grad_mode():
                    output = step(self, batch)
                yield output

    def _grad_mode(self) -> contextlib.AbstractContextManager[Any]:
        return torch.inference_mode() if self.val_grad_mode == "inference" else torch.no_grad()

    @contextlib.contextmanager
    def _eval_modes(self) -> Iterator[None]:
        """Every module of the model in eval mode; each module's own training flag back
        afterwards, whatever happened."""
        roots = modules(self.model)
        flags = [(m, m.training) for root in roots for m in root.modules()]
        try:
            for root in roots:
                root.eval()
            yield
        finally:
            for module, flag in flags:
                module.training = flag

    def _validate(self) -> None:
        self._cursor.valid_begins()  # a state dict taken during it resumes at its start
        if _stateful(self.val_data):
            self._valid_data_state = self.val_data.state_dict()
        with self._eval_modes(), self._grad_mode():
            if isinstance(self.val_data, Mapping):  # several validation sets: one stage
                self._stage("valid", per_set(self.val_step, self.state), ValSets(self.val_data, self.state))  # type: ignore[arg-type]
            else:
                self._stage("valid", self.val_step, self.val_data)  # type: ignore[arg-type]

    def _stage(self, stage: str, step: Step, data: Iterable[Any], start: int = 0) -> None:
        """Run one stage over ``data`` from batch ``start``. The per-batch body is the hot
        path: every event without an implementation costs one ``is None`` test on a slot of
        :class:`hookfit.dispatch.HotPath`.

        Where the time goes (``state.time_split``) costs three clock reads a batch (four with a
        ``batch_start`` implementation), two sums in locals and one comparison: one read as
        ``next()`` returns, one as the step returns and one as the batch ends, each the start
        of the next phase. ``plugins`` is what is left of the stage's time, so nothing is
        added for it per batch; the split is stored in ``state`` only at the stage's end, or
        when ``TIME_SPLIT_INTERVAL`` seconds have passed since it last was."""
        state = self.state
        hot = self.hooks.hot  # type: ignore[union-attr]
        clock = time.perf_counter
        began = clock()
        waited = stepping = nested = 0.0  # seconds in next(), in the step, in validations inside
        due = began + self.TIME_SPLIT_INTERVAL
        past = state.time_split.get(stage)  # this stage's earlier epochs
        train = stage == "train"
        limit = self.max_steps if train and self.max_steps is not None else sys.maxsize
        every = self.val_every_n_steps if train and self.val_step is not None else None
        state.stage = stage
        state.batch_idx = start
        self.training = train
        batch_idx = start - 1
        if train:
            self._cursor.train_begins(start)
        try:
            self._fire("stage_start", stage)
            self._boundary("stage_start")
            if train and state.val_due:  # resumed where a validation inside training was due
                if self.val_step is not None:
                    inner = clock()
                    try:
                        self._validate_inside(batch_idx)
                    finally:  # its time is the "valid" stage's, even when it stops the run
                        nested += clock() - inner
                state.val_due = False  # (a run resumed without validation has none to run)
            # the next training step at which the loop acts (a validation, max_steps): one test a batch
            mark = self._mark(limit, every)
            whole = data
            t0 = clock()  # from here on, until next() returns, the loop waits for data
            batches = self._iterate(data, start, train)
            checked = False  # the first output of the stage is checked once
            for batch_idx, batch in enumerate(batches, start):
                t1 = clock()
                waited += t1 - t0
                state.batch_idx = batch_idx
                if (call := hot.batch_start) is not None:
                    call(self, batch, batch_idx)
                    t1 = clock()  # the step starts now: batch_start's time is the plugins'
                output = step(self, batch)
                stepping += clock() - t1
                if output is not None:
                    if type(output) is not dict:
                        # a tensor is the common case: test it before the (slower) Mapping ABC
                        output = {"loss": output} if type(output) is _Tensor or isinstance(output, _Tensor) else self._as_mapping(output, step)
                    if not checked:
                        checked = self._check_output(output, step)
                    if (call := hot.step_output) is not None:
                        call(self, output, batch)
                if train:
                    state.step += 1
                    if state.step >= mark and every is not None:
                        state.val_due = state.step % every == 0
                if (call := hot.batch_end) is not None:
                    call(self, output, batch, batch_idx)
                if train and (call := hot.batch_checkpoint) is not None:
                    call(self, batch_idx)
                if hot.asks or self._stop is not None:
                    self._after_batch()
                t0 = clock()  # the batch is done: what follows until next() returns is data
                if t0 >= due:  # a live split, for a dashboard
                    self._split(stage, past, t0 - began - nested, waited, stepping, batch_idx - start + 1)
                    due = t0 + self.TIME_SPLIT_INTERVAL
                if state.step >= mark:
                    if state.val_due:
                        try:
                            self._validate_inside(batch_idx)
                        finally:  # its time is the "valid" stage's, even when it stops the run
                            inner, t0 = t0, clock()
                            nested += t0 - inner
                    if state.step >= limit:
                        if self._more(batches, whole, batch_idx):
                            raise _Budget
                        break
                    mark = self._mark(limit, every)
            waited += clock() - t0  # the last next(), which ended the stage (or _more's)
            if batch_idx < 0:
                raise ValueError(
                    f"{stage} data yielded no batches in epoch {state.epoch}"
                    + (" (an iterator or generator is used up after one pass; pass a list, a "
                       "DataLoader or another re-iterable)" if state.epoch else "")
                )
            # stage_end sees the stage's batches counted; its own time is added after it
            self._split(stage, past, clock() - began - nested, waited, stepping, batch_idx - start + 1)
            self._fire("stage_end", stage)
            if train:
                self._cursor.train_ends()
            else:
                state.val_due = False  # a validation due inside training has run to its end
                self._cursor.valid_ends()
                self._valid_data_state = None
            self._boundary("stage_end")
        finally:
            self._split(stage, past, clock() - began - nested, waited, stepping, batch_idx - start + 1)

    def _iterate(self, data: Iterable[Any], start: int, train: bool) -> Iterator[Any]:
        """The stage's batches from batch ``start``. A fresh training stage notes the random
        state before its iterator is made (a ``DataLoader`` draws its seeds from it). A resumed
        one makes its iterator from that same state and drops the batches already done (data
        with ``iter_from`` starts there; data that restored its own state is already there),
        then gives the random state back as it was: so the rest of the epoch sees the batches,
        the shuffle and the random stream of the run it continues."""
        cursor = self._cursor
        if not start:
            if train:
                cursor.iter_rng = rng_state()
            return iter(data)
        replay = cursor.iter_rng if train else None
        keep = rng_state() if replay is not None else None
        try:
            if replay is not None:
                set_rng_state(replay)
            iter_from = getattr(data, "iter_from", None)
            if iter_from is not None:
                return iter(iter_from(start))
            batches = iter(data)
            if not (train and "train" in self._restored):
                collections.deque(itertools.islice(batches, start), maxlen=0)
            return batches
        finally:
            if keep is not None:
                set_rng_state(keep)

    def _split(self, stage: str, past: TimeSplit | None, elapsed: float, waited: float, stepping: float,
               batches: int) -> None:
        """Store the time split of ``stage`` in ``state.time_split``: ``past`` (its earlier
        epochs) plus this one's, whose ``elapsed`` seconds were ``waited`` in ``next()``,
        ``stepping`` in the step and the rest in plugins. A new read-only mapping each time."""
        if batches <= 0 and past is None:
            return  # the stage drew no batch: nothing to say about it
        split = TimeSplit(stage, waited, stepping, max(elapsed - waited - stepping, 0.0), max(batches, 0))
        if past is not None:
            split = past + split
        state = self.state
        state.time_split = MappingProxyType({**state.time_split, stage: split})

    def _mark(self, limit: int, every: int | None) -> int:
        """The next global step at which the training stage must act: ``max_steps``, or a
        multiple of ``val_every_n_steps`` (``sys.maxsize`` outside training)."""
        if every is None:
            return limit
        return min(limit, (self.state.step // every + 1) * every)

    def _validate_inside(self, batch_idx: int) -> None:
        """The validation due inside the training stage (``val_every_n_steps``), between
        training batch ``batch_idx`` and the next: a ``"valid"`` stage nested in the
        ``"train"`` one, after which the training stage goes on where it was."""
        state = self.state
        self._validate()
        state.stage, state.batch_idx, self.training = "train", batch_idx, True

    @staticmethod
    def _more(batches: Any, data: Any, batch_idx: int) -> bool:
        """Whether the stage has batches after ``batch_idx`` (``max_steps`` was reached):
        the data's length says, else one more batch is drawn (and dropped: the run ends)."""
        try:
            return batch_idx + 1 < len(data)
        except TypeError:
            return next(batches, _END) is not _END

    @staticmethod
    def _check_output(output: Mapping[str, Any], step: Step) -> bool:
        """The first output of a stage: every key must be a string (outputs are read by name)."""
        for key in output:
            if not isinstance(key, str):
                raise TypeError(
                    f"step function {_name(step)!r} returned a mapping with the key {key!r} "
                    f"({type(key).__name__}); keys must be strings, the names of what it reports"
                )
        return True

    def _warn_eval_mode(self) -> None:
        """A model left in eval mode would train with dropout off and frozen batch norm."""
        model = self.model
        if isinstance(model, Mapping):
            roots = [(f"model[{key!r}]", m) for key, value in model.items() for m in modules(value)]
        elif isinstance(model, (list, tuple)):
            roots = [(f"model[{index}]", m) for index, value in enumerate(model) for m in modules(value)]
        else:
            roots = [("the model", m) for m in modules(model)]
        evaluating = [f"{where} ({type(m).__name__})" for where, m in roots if not m.training]
        if evaluating:
            warnings.warn(
                f"{', '.join(evaluating)} {'is' if len(evaluating) == 1 else 'are'} in eval mode "
                f"as training starts: dropout and batch norm will behave as in evaluation. Call "
                f".train() before fit() (validation sets eval mode itself and restores every "
                f"module's own mode); for a module kept in eval mode on purpose, filter this "
                f"HookfitWarning",
                HookfitWarning,
                stacklevel=4,
            )

    @staticmethod
    def _as_mapping(output: Any, step: Step) -> Mapping[str, Any]:
        if isinstance(output, Mapping):
            return output
        raise TypeError(
            f"step function {_name(step)!r} returned {type(output).__name__}; a step must "
            f"return None, a mapping or a tensor"
        )

    # -- stopping ---------------------------------------------------------------------------
    def _after_batch(self) -> None:
        if self.hooks.should_stop is not None:  # type: ignore[union-attr]
            self._ask_should_stop()
        self._boundary("batch")

    def _ask_should_stop(self) -> None:
        """Ask every ``should_stop`` implementation; true answers become a stop request."""
        answers = [(name, answer) for name, answer in self.hooks.call_each("should_stop", self) if answer]  # type: ignore[union-attr]
        if answers and self._stop is None:
            reasons = [answer for _, answer in answers if isinstance(answer, str)]
            self.request_stop("; ".join(reasons) or "a plugin answered should_stop",
                              by=", ".join(name for name, _ in answers))

    def _boundary(self, where: str) -> None:
        """Stop here if a stop was requested (and, with several processes, agreed on)."""
        request = self._stop
        agree = self.hooks.agree_stop  # type: ignore[union-attr]
        if agree is not None:
            decision = agree(self, request, where)
            if isinstance(decision, StopRequest):
                request = decision
            elif decision is False:
                return
            elif decision is not None:
                raise TypeError(
                    f"agree_stop must return a StopRequest, False or None, not {decision!r} "
                    f"(plugins: {', '.join(self.hooks.plugins('agree_stop'))})"  # type: ignore[union-attr]
                )
        if request is not None:
            raise _Stop(request)

    # -- ending -----------------------------------------------------------------------------
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
        for _, secondary in self.hooks.call_all("exception", self, error):  # type: ignore[union-attr]
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
        """Fire ``fit_end`` once: every implementation runs even if one raises; then write the
        run's end line (:meth:`_record_end`) with the final status."""
        state = self.state
        state.stage = None
        state.ended_at = time.perf_counter()  # the run is over: what fit_end does is not its time
        errors = [error for _, error in self.hooks.call_all("fit_end", self)]  # type: ignore[union-attr]
        unbind()
        self.__dict__.pop("backward", None)
        self.hooks.close()  # type: ignore[union-attr]
        if errors and not failed:
            state.status = "failed"
            state.error = errors[0]
            state.stop_reason = f"{type(errors[0]).__name__}: {errors[0]}"
            state.stopped_by = None
        self._record_end()
        if not errors:
            return
        if failed:
            for exc in errors:
                self._warn_secondary(exc, "fit_end")
            return
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
