"""One ``fit()`` of a :class:`hookfit.Loop`: the run object that step functions and hooks
receive as ``loop``, what it holds and offers them. The loop it runs, in one sitting::

    configure; fit_start; resume
    for epoch:                                  with scope("epoch"): epoch_start ... epoch_end, after_epoch
        with scope("stage", "train"):           stage_start ... stage_end
            for batch: batch_start, step, step_output, batch_end, after_batch, stop?
        with scope("stage", "valid"): ...       (when validation is due)
    fit_end                                     (whatever happened)
    results                                     each plugin's report: state.results

The loop itself is :mod:`hookfit.training`; everything else has a module of its own: the
position and the random state (:mod:`hookfit.position`), the run's saved state (:mod:`hookfit.states`), stopping
(:mod:`hookfit.stopping`), time accounting (:mod:`hookfit.timing`), the run folder and
``run.jsonl`` (:mod:`hookfit.records`), error attribution (:mod:`hookfit.blame`), train and
eval mode (:mod:`hookfit.modes`). :class:`hookfit.Loop` is configuration and the entry point.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, cast

from hookfit import discovery, errors, modes, stopping, training
from hookfit import states as saved_states
from hookfit.data import bounded_length
from hookfit.dispatch import Dispatch
from hookfit.manager import PluginManager, leave_inert
from hookfit.modes import modules
from hookfit.payloads import StopRequest
from hookfit.position import Cursor, Position
from hookfit.records import RUNS, RunFolder, identify, script_name
from hookfit.state import State
from hookfit.stopping import qualname
from hookfit.timing import INTERVAL

if TYPE_CHECKING:  # pragma: no cover
    from hookfit.loop import Loop

Step = Callable[["Run", Any], Any]
ENV_RESUME = "HOOKFIT_RESUME"
ENV_SMOKE = "HOOKFIT_SMOKE"

__all__ = ["RUNS", "Run", "modules", "script_name"]


class Run:
    """A run of a :class:`hookfit.Loop`, made by ``Loop.fit()``; step functions and hooks get
    it as their ``loop`` argument.

    What a step or a plugin uses:

    * ``state`` (:class:`hookfit.State`), ``training`` (``True`` in the training stage);
    * ``model``, ``optimizers``, ``train_data``, ``val_data``: what the ``Loop`` was given,
      unless a plugin replaced them for this run at ``configure`` (a distributed plugin wraps
      the model and shards the data; an optimizer plugin puts managed optimizers in
      ``optimizers``). The ``Loop``'s own configuration is never changed;
    * the configuration, read-only: ``train_step``, ``val_step``, ``max_epochs``,
      ``max_steps``, ``val_every_n_epochs``, ``val_every_n_steps``, ``val_grad_mode``,
      ``seed``, ``deterministic``, ``smoke``, ``mode`` (``"fit"`` or ``"validate"``),
      ``config`` (the ``Loop``), ``name``, ``resume``; a plugin that makes a smoke run changes
      the bounds and ``resume`` at ``configure`` (see :attr:`smoke`); :attr:`max_train_steps`, :attr:`no_validation`;
    * ``backward(loss)``, ``request_stop(reason)``, ``stop_requested``, ``run_dir``, ``run_dir_given``,
      ``identity`` (:class:`hookfit.records.Identity`: ``name``, ``key``, a ``str``, ``matches(recorded)``),
      ``continue_in(folder)``, ``resumes_apart()``, ``place_run_dir(folder, released)``, ``earlier_run``, ``is_main``,
      ``wrap_step(wrapper)``;
    * ``carry``: what the step carries from one batch to the next (an RNN's hidden state), a
      dict of the current stage that is saved with the run's position and restored on resume
      (see :attr:`carry`);
    * the run's saved state: ``state_dict()``/``load_state_dict(saved)`` (its position, random
      state and data), ``position``, ``plugin_states()``/``load_plugin_states(states)``;
    * ``pm``, the run's plugin manager, and ``hooks``, its resolved events
      (:class:`hookfit.dispatch.Dispatch`), both there from the run's construction: fire
      events through ``hooks``, never ``pm.hook``, so that hookfit's guarantees (observers
      switched off, not fatal; every ``fit_end`` implementation runs) hold.

    Where the time goes: per stage, the seconds spent waiting for the next batch, inside the
    step function and in plugins (``state.time_split``, see :mod:`hookfit.timing`), with
    clock reads only. What an optimizer plugin does inside the step (``loop.backward``,
    ``loop.optimizers.step()``) counts as step. A step reports by returning its values: ``loop.log(...)``
    (Lightning's ``self.log``) is an ``AttributeError`` that says so (:func:`hookfit.errors.no_attribute`).
    """

    TIME_SPLIT_INTERVAL = INTERVAL
    if not TYPE_CHECKING:  # (an attribute that is not there stays a type error)
        __getattr__ = errors.no_attribute

    def __init__(self, config: Loop, pm: PluginManager, mode: Literal["fit", "validate"] = "fit",
                 resume: str | os.PathLike[str] | None = None) -> None:
        self.config = config
        self.mode = mode
        """``"fit"``, or ``"validate"`` (``Loop.validate()``: the validation stage alone, no
        ``epoch_start``/``epoch_end``; a plugin that saves training progress saves nothing)."""
        # (None only in a Loop for validate() alone, whose runs never train: fit() refuses it)
        self.train_step, self.val_step = cast("Step", config.train_step), config.val_step
        self.max_epochs, self.max_steps = config.max_epochs, config.max_steps
        self.val_every_n_epochs, self.val_every_n_steps = config.val_every_n_epochs, config.val_every_n_steps
        self.val_grad_mode, self.seed, self.deterministic = config.val_grad_mode, config.seed, config.deterministic
        self.smoke = smoke_wanted(config.smoke)
        """Whether a smoke run is asked (``Loop(smoke=True)``, else ``HOOKFIT_SMOKE=1``): two
        batches a stage, one epoch, a temporary run folder, a report. A plugin makes it one (the
        built-in :mod:`hookfit.plugins.smoke`): at ``configure`` it sets :attr:`smoke_by`, the
        bounds and ``resume``, and places the folder (:meth:`place_run_dir`); a smoke run that no
        plugin made fails right after ``configure``, before any batch. A plugin that writes
        files where it chooses keeps them in :attr:`run_dir` instead during one."""
        self.smoke_by: str | None = None
        """The name of the plugin that made this run the smoke run asked (set at ``configure``)."""
        if resume is None:
            resume = config.resume if config.resume is not None else os.environ.get(ENV_RESUME) or None
        self.resume: str | None = None if resume is None else os.fspath(resume)
        """What to resume from (``Loop(resume=...)``, else ``HOOKFIT_RESUME``; a smoke run's
        plugin clears it), known from ``configure`` on, or ``None``."""
        self.identity = identify(config)
        """Who the run is (:class:`hookfit.records.Identity`): ``Loop(name=...)``, else
        ``run_dir``, else the notebook's or the script's path; stored in ``run.jsonl``, and
        resuming ``"latest"`` takes only a run of the same identity (see :mod:`hookfit.records`)."""
        self.name = self.identity.name
        """The run's name: ``Loop(name=...)``, else the name of ``run_dir``, else the
        notebook's or the script's name (``train`` for ``python train.py``). Runs of one name
        share ``runs/<name>/``; scripts of one file name in different folders are different
        identities there."""
        self.model, self.optimizers = config.model, config.optimizers
        self.train_data, self.val_data = config.train_data, config.val_data
        self.state = State()
        self.training = False
        self.pm = leave_inert(pm, self)  # before configure: an inert plugin gets no event of this run
        self.hooks = Dispatch(pm, self)
        self._backward = self.hooks.handlers("backward")  # its calls follow the plugins
        self.state.silenced = pm.silenced
        self.folder = RunFolder(self, config.run_dir)
        self.cursor = Cursor(self.state)
        self._carry: dict[str, Any] = {}  # the current stage's loop.carry (the loop sets it for each stage)
        self.stopping = stopping.Stopping(self)
        self.started = False
        """Whether the first epoch has begun (past ``configure``, ``fit_start`` and ``resume``)."""
        self.apart = False  # the resume implementation called resumes_apart()
        self.no_validation: str | None = None
        """Why this fit will run no validation though it has a ``val_step`` (``val_every_n_steps``
        more than :attr:`max_train_steps`), set before ``fit_start`` and warned about by the core after
        it, or ``None``. A plugin that says so at ``fit_start`` in its own words clears it."""

    # -- what steps and plugins use ---------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        """The folder this run's files go to, created on first access (with its
        ``run.jsonl``): one a plugin placed (:meth:`place_run_dir`); else ``Loop(run_dir=...)``;
        else the folder of the run this one resumes (see :meth:`continue_in`); else a new
        ``runs/<name>/<date>-<time>``."""
        return self.folder.path

    @property
    def run_dir_given(self) -> bool:
        """Whether the run's folder was chosen for it, by ``Loop(run_dir=...)`` or a plugin
        (:meth:`place_run_dir`); else each run gets a new folder."""
        return self.folder.given

    def place_run_dir(self, folder: str | os.PathLike[str], released: Callable[[], None] | None = None) -> None:
        """Make ``folder``, which a plugin made for this run (a smoke run's temporary folder),
        the run's folder, instead of ``Loop(run_dir=...)`` or a new one: called at ``configure``,
        before any plugin uses :attr:`run_dir`. The core takes no lock on it (the plugin that made
        it holds what it needs) and writes ``run.jsonl`` there as anywhere. ``released()`` is
        called once the run is over, after ``fit_end``, ``results`` and ``run.jsonl``'s end line,
        in every outcome: the plugin may report and remove the folder then."""
        self.folder.place(folder, released)

    def resumes_apart(self) -> None:
        """Said by a ``resume`` implementation before it returns: the checkpoint it resumed from is not the one the
        records in the run's folder go on from (an earlier run's, which a later run's records there follow), so
        the run sets them aside as a run that did not resume does (``state.continues`` stays ``False``). A resumed
        fit that does not say it continues them. Called after that (once the core has set ``state.continues``: at
        ``resumed`` or later), it raises a ``RuntimeError``, the decision being made and read already."""
        if self.started or self.state.resumed_from is not None:
            raise RuntimeError("loop.resumes_apart() was called after the run resumed (state.continues is set once "
                               "the resume implementation returns, and the loggers have read it): call it from the "
                               "plugin's resume implementation, before it returns")
        self.apart = True

    @property
    def earlier_run(self) -> int:
        """The ``N`` under which this run sets aside what an earlier run left in its folder (``earlier-run-N/``,
        ``<name>.earlier-run-N.<ext>``): one more than the highest ``N`` of those names in the run folder and its
        subfolders, counted once, before any plugin of this run set anything aside, so that every plugin sets one
        earlier run's files aside under the same ``N``. Asking makes no folder (a new one: ``1``)."""
        return self.folder.earlier_run()

    def continue_in(self, folder: str | os.PathLike[str]) -> None:
        """Make ``folder`` (an earlier run's folder) this run's folder: a resume plugin calls it
        at ``configure``, so the resumed run goes on writing where the run it continues did.
        Refused once a plugin has used :attr:`run_dir`, and when ``Loop(run_dir=...)`` names
        another folder. In ``Loop.validate()`` it changes nothing: an evaluation of a run's
        checkpoint leaves that run's folder and record as they were (its own files, if any,
        go to a folder of its own)."""
        self.folder.continue_in(folder)

    @property
    def carry(self) -> dict[str, Any]:
        """State the step carries from one batch to the next, such as an RNN's hidden state:
        a dict the step reads and writes (``h = loop.carry.get("hidden")``, ...,
        ``loop.carry["hidden"] = h.detach()``), the same object for every batch of a stage.

        * Emptied when a stage starts: every epoch's training stage, every validation (which
          has its own: a validation inside the training stage leaves the training's as it was).
        * Saved with the run's position: inside a training stage ``loop.state_dict()`` holds
          it (``"carry"``), so a checkpoint keeps it and a resumed run gives the stage it
          continues the carry it had, on the model's device (the first parameter's): with the
          random state and the data's position, a resumed run then equals one never stopped.
        * What it may hold: tensors (saved detached: carry them detached, as a truncated
          backpropagation through time does), numbers, strings, ``None``, and lists, tuples and
          dicts of them, under string keys; anything else is a ``TypeError`` naming the key
          when the run's state is taken. A validation's carry is never saved (a resumed run
          runs an unfinished validation again from its start).
        * With several processes each has its own, and a checkpoint keeps the main process's:
          a per-process carry is not resumed exactly there.
        """
        return self._carry

    def enter_carry(self, carry: dict[str, Any]) -> dict[str, Any]:
        """Make ``carry`` the current stage's :attr:`carry` and return the one it replaces: the
        loop calls it as each stage begins, and as a validation inside training ends."""
        outer, self._carry = self._carry, carry
        return outer

    @property
    def is_main(self) -> bool:
        """Whether this is the process that writes files and renders (rank 0)."""
        return self.state.rank == 0

    @property
    def stop_requested(self) -> StopRequest | None:
        """The stop request waiting for the next boundary, if any (the first one asked)."""
        return self.stopping.request

    def request_stop(self, reason: str = "stop requested", by: str | None = None, *,
                     complete: bool = False, ends_process: bool = False) -> StopRequest:
        """Ask for a graceful stop, from any thread, any hook or the step function.

        The loop honours it at the next boundary it reaches: after the current batch, or at a
        stage or epoch boundary (so a stop asked in ``epoch_end`` runs no further batch). The
        run then ends with status ``"interrupted"`` (``"completed"`` with ``complete=True``:
        the run ended by a rule, such as early stopping), ``state.stop_reason == reason`` and
        ``state.stopped_by`` naming who asked: ``by`` if given, else the plugin or step
        function that called this (found on the caller's stack), else ``None``. ``ends_process``:
        the asker ends the process after the run (a scheduler's SIGTERM; see :class:`StopRequest`).
        The first request wins; later ones return it unchanged. ``stop_requested`` fires once."""
        if not isinstance(reason, str):
            raise TypeError(f"request_stop: reason must be a string, got {type(reason).__name__}")
        if (status := self.state.status) != "running":
            raise RuntimeError("request_stop() needs a running loop: call it during fit()" if status == "idle" else
                               f"request_stop() needs a running loop, and this run has ended ({status}): in fit_end "
                               "or later a stop changes nothing; ask it by the last batch (should_stop, epoch_end)")
        return self.stopping.ask(reason, by, complete, sys._getframe(1), ends_process)

    def backward(self, loss: Any) -> Any:
        """Run the backward pass on ``loss`` through the plugin that owns it (``backward``
        event, first result), so gradient accumulation, loss scaling and the hooks around it
        apply."""
        if self.state.status != "running":
            raise RuntimeError("backward() needs a running loop: call it from a step function")
        for call in self._backward.calls:
            if (result := call(self, loss)) is not None:
                return result
        if not self._backward.calls:
            raise RuntimeError(
                "loop.backward() needs a plugin that implements the 'backward' event and no "
                f"enabled plugin does ({self.unserved('backward')}); "
                "enable it, or call loss.backward() yourself"
            )
        return None

    def wrap_step(self, wrapper: Callable[[Step], Step]) -> None:
        """Replace this run's step functions (training and validation) with
        ``wrapper(step)``: for what must surround every call of a step, such as
        ``torch.autocast`` or a profiler's record. Called at ``configure`` or ``fit_start``;
        the wrapped functions keep the steps' names in messages. Wrappers of several plugins
        nest, the first given innermost. The ``Loop``'s own step functions are not changed."""
        if self.started:
            raise RuntimeError("wrap_step() must be called at configure or fit_start, before the first batch")
        for attr in ("train_step", "val_step"):
            step = getattr(self, attr)
            if step is None:
                continue
            wrapped = wrapper(step)
            if not callable(wrapped):
                raise TypeError(f"wrap_step: the wrapper returned {wrapped!r} for {attr} "
                                f"{qualname(step)!r}, not a function step(loop, batch)")
            with contextlib.suppress(ValueError):  # (a callable whose signature cannot be read is tried as is)
                try:
                    inspect.signature(wrapped).bind(self, None)
                except TypeError as error:
                    raise TypeError(f"wrap_step: the wrapper returned {qualname(wrapped)!r} for {attr} "
                                    f"{qualname(step)!r}, which cannot be called as step(loop, batch): {error}") from None
            if wrapped is not step:
                with contextlib.suppress(AttributeError, TypeError):  # one that takes no attributes
                    functools.update_wrapper(wrapped, step)  # its name, for messages
            setattr(self, attr, wrapped)

    # -- the run's saved state (hookfit.states) ---------------------------------------------
    @property
    def position(self) -> Position:
        """Where a run resumed from a state dict taken now would continue."""
        return self.cursor.position()

    def state_dict(self) -> dict[str, Any]:
        """The run's own state, as a checkpoint stores it beside the model's and
        :meth:`plugin_states`: ``loop`` (the position), ``rng``, ``data`` (the data's own
        states) and, inside an epoch, ``data_rng`` (see :mod:`hookfit.position`); plain data
        and tensors. Inside a validation it describes the moment the validation began."""
        return saved_states.run_state(self)

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Put the run where :meth:`state_dict` was taken (a ``resume`` implementation calls
        it, before the first epoch): the loop then skips the training batches already done
        (never twice for data that restored its own position), runs first a validation that
        was due, or goes straight to the epoch's validation when its training stage was
        complete. A ``ValueError`` names what is not possible."""
        if self.started:
            raise RuntimeError("load_state_dict() must be called before the first epoch (from a resume implementation)")
        self.cursor.start = saved_states.load_run_state(self, saved)

    def plugin_states(self, *, check: bool = True) -> dict[str, Any]:
        """Every plugin's ``save_state`` answer, keyed by plugin name (for checkpoints); a
        plugin that answered ``None`` has the entry ``None``, so a resumed run knows it took
        part. An answer a checkpoint could not be read back with (``torch.load(weights_only=True)``:
        a numpy scalar, an object) fails the run naming the plugin, or switches an observer off;
        ``check=False`` for states kept in memory only, never written."""
        return saved_states.plugin_states(self, check)

    def load_plugin_states(self, states: Mapping[str, Any], strict: bool = True) -> None:
        """Give each plugin its entry of ``states`` (from :meth:`plugin_states`) through its
        ``load_state`` implementation; an entry ``None`` restores nothing. A plugin with a
        state to keep but no entry (new to the run) and an entry no plugin restores (a plugin
        since removed) raise :class:`hookfit.StateMismatch` with ``strict``, else one
        :class:`hookfit.HookfitWarning` names them and the rest is restored. An entry no plugin
        restores is judged on the main process only: the others leave out what runs on rank 0
        alone (observers, a tracker a script gives rank 0)."""
        saved_states.load_plugin_states(self, states, strict)

    @property
    def max_train_steps(self) -> int | None:
        """The most training steps this fit takes (batches: what ``state.step`` and
        ``val_every_n_steps`` count): the fewer of ``max_steps`` and ``max_epochs`` times the training
        data's length (:func:`~hookfit.data.bounded_length`), of those known; ``None`` when neither is
        (no ``max_steps``, data of no length) and in ``validate()``. Read from ``fit_start`` on (``configure`` may shard the data)."""
        per_epoch = bounded_length(self.train_data) if self.mode == "fit" else None
        bounds = [n for n in (self.max_steps, per_epoch and self.max_epochs * per_epoch) if n and self.mode == "fit"]
        return min(bounds) if bounds else None

    def execute(self) -> State:
        """Run to the end (``Loop.fit()``, ``Loop.validate()``; the loop is
        :mod:`hookfit.training`): ``fit_end`` fires exactly once, whatever happened."""
        return training.execute(self)

    def check_configured(self) -> None:
        """After ``configure``: a smoke run asked was made one by a plugin (:attr:`smoke_by`),
        else a ``RuntimeError`` names the plugin that would have, before any batch trains."""
        if self.smoke and self.smoke_by is None:
            asked = "Loop(smoke=True)" if self.config.smoke else f"{ENV_SMOKE}={os.environ.get(ENV_SMOKE)}"
            raise RuntimeError(
                f"{asked} asks for a smoke run, and no enabled plugin made one at configure: the built-in "
                f"plugin 'smoke' (hookfit.plugins.smoke) does; enable it, or run without {asked} to train "
                f"for real (disabled plugins: {self.disabled_plugins()})")

    def disabled_plugins(self) -> str:
        """The names of the disabled plugins, for messages (``none`` when there are none)."""
        return ", ".join(i.name for i in self.pm.infos.values() if not i.enabled) or "none"

    def unserved(self, event: str) -> str:
        """For the error that no enabled plugin implements ``event``: the built-in plugins that do,
        with what disabled each (hookfit's own import safely), then every disabled plugin's name."""
        infos = {i.name: i for i in self.pm.infos.values()}
        why = {name: f" (disabled by {i.disabled_by})" if i.disabled_by else f" (replaced by {i.value})"
               for name, i in infos.items()}
        own = [f"{ep.name!r}{why.get(ep.name, '')}" for ep in discovery.builtin_entry_points()
               if hasattr(getattr(ep.load(), event, None), "hookfit_impl")]
        does = f"the built-in {' and '.join(own)} {'does' if len(own) == 1 else 'do'}; " if own else ""
        return f"{does}disabled plugins: {self.disabled_plugins()}"

    def predict(self, data: Iterable[Any], step: Step) -> Iterator[Any]:
        """What :meth:`hookfit.Loop.predict` returns: the step's output per batch, in eval
        mode, each call without autograd (only the call), the modes restored when the
        generator ends or is closed."""
        with modes.eval_modes(self.model):
            for batch in data:
                with modes.grad_mode(self.val_grad_mode):
                    output = step(self, batch)
                yield output


def smoke_wanted(smoke: bool | None) -> bool:
    """``Loop(smoke=...)``, else whether ``HOOKFIT_SMOKE`` is set to a true value."""
    if smoke is not None:
        return smoke
    return os.environ.get(ENV_SMOKE, "").strip().lower() in ("1", "true", "yes", "on")
