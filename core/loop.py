"""The loop's configuration and entry point: ``hookfit.Loop(train_step, train_data, ...).fit()``.

A :class:`Loop` holds what the user configured and never changes it; each ``fit()`` makes a
:class:`hookfit.run.Run`, which owns everything that exists only while training runs and is
what step functions and hooks receive as ``loop``.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

from hookfit import discovery, errors, manager
from hookfit.data import FACTORY, check_passes, length
from hookfit.payloads import StopRequest
from hookfit.reproducibility import as_int, check_seed
from hookfit.run import Run, modules
from hookfit.state import State
from hookfit.steps import check_step
from hookfit.stopping import brief, qualname
from hookfit.valsets import ValSets

Step = Callable[[Run, Any], Any]

__all__ = ["Loop", "end_with", "modules"]

_ENDINGS: weakref.WeakKeyDictionary[Run, BaseException] = weakref.WeakKeyDictionary()


def end_with(run: Run, error: BaseException) -> None:
    """Make the ``fit()`` (or ``validate()``) of ``run`` raise ``error`` once the run is over:
    after ``fit_end``, ``results`` and ``run.jsonl``'s end line, with the run's own outcome
    (status, checkpoints, results) as it is. For a plugin that ends the process the way an
    event of the run asks (the interrupter, after a stop asked by a signal: ``KeyboardInterrupt``
    for SIGINT, ``SystemExit(143)`` for SIGTERM). The first error asked wins; a run that raises
    its own error (it failed, or was aborted) raises that one instead."""
    if not isinstance(error, BaseException):
        raise TypeError(f"end_with: error must be an exception, got {type(error).__name__}")
    _ENDINGS.setdefault(run, error)


def _execute(run: Run) -> State:
    """Run ``run`` to the end, each of hookfit's warnings shown once in it
    (:func:`hookfit.errors.forget_warnings`) and recorded in its folder
    (:mod:`hookfit.runwarnings`); then raise the error a plugin asked it to end with
    (:func:`end_with`), if any, unless the run raised its own."""
    errors.forget_warnings(run.train_step, run.val_step)
    run.folder.warned.install()
    try:
        state = run.execute()
    finally:
        run.folder.warned.remove()
        error = _ENDINGS.pop(run, None)
    if error is not None:
        raise error
    return state


def _shown(value: Any) -> str:
    """``value`` as an error names it: its type and its :func:`~hookfit.stopping.brief` repr."""
    return f"{type(value).__name__} {brief(value)}"


def _iterable(value: Any) -> bool:
    try:
        iter(value)
    except TypeError:
        return False
    return True


def _check_optimizers(optimizers: Any) -> None:
    """Refuse the shapes of ``Loop(optimizers=...)`` that are a slip, not an optimizer: a list of
    them, the parameters themselves, an optimizer's class (any other object is for the
    optimizer plugin to accept or refuse)."""
    if isinstance(optimizers, (list, tuple)):
        raise TypeError(f"optimizers: give one optimizer, or several as a dict of names "
                        f"({{'gen': g_opt, 'disc': d_opt}}), not a {type(optimizers).__name__}")
    if isinstance(optimizers, Iterator):
        raise TypeError(f"optimizers: got a {type(optimizers).__name__} (model.parameters()?), not an optimizer: "
                        f"build one on them, optimizers=torch.optim.SGD(model.parameters(), lr=...)")
    if isinstance(optimizers, type):
        raise TypeError(f"optimizers: got the class {optimizers.__name__}, not an optimizer: build one, "
                        f"optimizers={optimizers.__name__}(model.parameters(), ...)")


def _check_sets(what: str, sets: Mapping[Any, Any]) -> None:
    """Refuse a mapping of validation sets ``{name: data}`` (``what``: the argument) that is empty, has a name
    that is not a non-empty string without ``/``, or data that is no iterable of batches."""
    if not sets:
        raise ValueError(f"{what} is an empty mapping: give at least one validation set, {{name: data}}")
    for key, data in sets.items():
        if not isinstance(key, str) or not key or "/" in key:
            raise ValueError(f"{what}: the name of a validation set must be a non-empty string without '/', "
                             f"got {key!r}")
        if data is None or isinstance(data, (str, bytes)) or not isinstance(data, Iterable):
            raise TypeError(f"{what}[{key!r}] must be an iterable of batches (a list, a DataLoader, ...), got "
                            f"{type(data).__name__}")


def _positive_int(value: Any, what: str) -> int | None:
    """``value`` as a plain ``int`` (NumPy's integers and other ``__index__`` types too), or ``None``."""
    if value is None:
        return None
    number = as_int(value)
    if number is None or number < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return number


class Loop:
    """A training run's configuration: ``Loop(train_step, train_data, ...).fit()``.

    ``train_step(loop, batch)`` and ``val_step(loop, batch)`` are plain functions (a ``Loop`` for evaluations
    alone, ``Loop(val_step=..., val_data=..., model=...).validate()``, needs no train step nor training data, and
    training data without a train step is refused);
    their ``loop`` is the :class:`hookfit.Run` of the current ``fit()``. They return ``None``
    (nothing to report for this batch), a mapping with any keys, or a tensor (taken as
    ``{"loss": tensor}``). Optimizers, metrics and output are plugins: discovered through the
    ``hookfit`` entry-point group, given in ``plugins`` (an instance replaces a discovered
    plugin of the same name; a ``None`` element is left out, so ``[tb if log else None]``
    works; a string, a number, a model or an optimizer there is refused), switched off by name in ``disable``. Stopping is the run's own:
    ``loop.request_stop(reason)``. A run never changes the ``Loop``: what plugins replace (a
    wrapped model, sharded data, managed optimizers) is the run's.

    ``val_data`` may be a mapping ``{name: data}`` of several validation sets: they run one
    after the other in one validation stage, ``loop.state.val_set`` naming the current one,
    and what the step reports is named per set (``noisy/loss``: ``valid/noisy/loss`` for a
    monitor). Validation runs every ``val_every_n_epochs`` epochs after the training stage
    (every epoch by default), or, with ``val_every_n_steps=N`` instead, inside the training stage
    after every N-th training step (counted over the whole run, as ``max_steps`` is; also after
    the last step when ``max_steps`` falls on a multiple of N). Either way every module of
    ``model`` is in eval mode under ``torch.inference_mode()`` (``val_grad_mode="no_grad"`` for
    ``torch.no_grad()``), and afterwards each submodule gets back its own previous training flag; an
    optimizer step inside it with autograd off is refused (:class:`hookfit.modes.StepInValidation`).

    A run has an identity, ``name`` (default: the name of ``run_dir`` if given, else the
    script's name: ``train`` for ``python train.py``), and a folder for the files it writes
    (metrics log, checkpoints, captured output): ``run_dir`` if given, else a new
    ``runs/<name>/<date>-<time>``, created only when a plugin first asks for it.

    How long: ``max_epochs`` epochs, and at most ``max_steps`` training steps (batches) over the
    whole run when it is given; ``max_steps`` alone runs until that many steps, however many
    epochs that takes; neither: one epoch.

    ``resume="latest"`` or a checkpoint path continues an earlier run through the plugin that
    implements the ``resume`` event (the checkpoint plugin): ``"latest"`` is the newest
    checkpoint of a run *of this name* (never another script's), and the resumed run goes on
    in that run's folder. Without the argument, the ``HOOKFIT_RESUME`` environment variable
    is used when set. Training data that has ``set_epoch(epoch)``
    is told each epoch before it is iterated (for reproducible shuffles; validation data never
    is, so each validation reads the same batches); data that has
    ``iter_from(start)`` starts a resumed epoch there instead of skipping batches one by one.

    ``seed`` seeds Python, NumPy and torch (every device), and with them the order of data that
    draws from torch's generator, as the run starts (a resumed run takes the random states of its
    checkpoint instead; a ``DataLoader``'s own ``generator=`` is the script's to seed, and a seeded
    run warns of one that goes on from where an earlier run in the process left it);
    ``deterministic=True`` runs with PyTorch's deterministic algorithms and puts the settings
    back afterwards (see :mod:`hookfit.reproducibility`). Both are recorded, with the run's
    name, command line, plugins and versions, in ``run.jsonl`` in the run folder; when the run
    ends, a second line there records its status, duration and where each stage's time went.

    Where the time goes: every run measures, per stage, the seconds spent waiting for the data,
    in the step function (an optimizer plugin's work inside it included) and in plugins, with
    clock reads only (never a device synchronisation: on an accelerator the step's share is the
    time to enqueue its work plus the synchronisations its own code makes). It is
    ``fit().time_split`` (stage name -> :class:`hookfit.payloads.TimeSplit`), the console's
    ``hookfit time`` lines at the end (with a plain warning when the data loader is the
    bottleneck), and the ``"time_split"`` of the end line in ``run.jsonl``.

    ``smoke=True`` (or ``HOOKFIT_SMOKE=1`` when ``smoke`` is not given) makes a smoke run: two
    batches of each stage, one epoch, every plugin, nothing kept, and a report of what ran,
    made by the ``smoke`` plugin (:mod:`hookfit.plugins.smoke`); with it disabled such a run
    fails after ``configure``, before any batch, naming it.
    """

    if not TYPE_CHECKING:  # (an attribute that is not there stays a type error) loop.log(...): Run's words
        __getattr__ = errors.no_attribute

    @errors.keywords_named
    def __init__(
        self,
        train_step: Step | None = None,
        train_data: Iterable[Any] | None = None,
        *,
        val_step: Step | None = None,
        val_data: Iterable[Any] | None = None,
        model: Any = None,
        optimizers: Any = None,
        max_epochs: int | None = None,
        max_steps: int | None = None,
        val_every_n_epochs: int | None = None,
        val_every_n_steps: int | None = None,
        val_grad_mode: Literal["inference", "no_grad"] = "inference",
        run_dir: str | os.PathLike[str] | None = None,
        name: str | None = None,
        resume: str | os.PathLike[str] | None = None,
        plugins: Sequence[Any] = (),
        disable: Sequence[str] = (),
        seed: int | None = None,
        deterministic: bool = False,
        smoke: bool | None = None,
    ) -> None:
        for what, fn in (("train_step", train_step), ("val_step", val_step)):
            if fn is not None:
                check_step(what, fn)
        _check_optimizers(optimizers)
        if train_step is None and train_data is None:  # a Loop for evaluations alone: Loop(val_step=..., val_data=...)
            train_data = []
        for what, data in (("train_data", train_data), ("val_data", val_data)):
            if data is None or isinstance(data, (str, bytes)) or not isinstance(data, Iterable):
                if what == "val_data" and data is None:
                    continue
                raise TypeError(
                    f"{what} must be an iterable of batches (a list, a DataLoader, ...), "
                    f"got {type(data).__name__}" + (f" {qualname(data)!r}; {FACTORY}" if callable(data) else "")
                    + ("; a Loop that only validates reads no training data: give [] (or neither train_step nor "
                       "train_data)" if data is None else "")
                )
        if isinstance(val_data, Mapping):
            _check_sets("val_data", val_data)
        if val_step is not None and val_data is None:
            raise ValueError(f"val_step {qualname(val_step)!r} was given without val_data")
        if val_data is not None and val_step is None:
            raise ValueError("val_data was given without a val_step to run on it")
        if train_step is None and length(train_data) != 0:  # (a Loop for evaluations alone reads none)
            raise ValueError("train_data was given without a train_step to run on it: Loop(train_step, train_data, ...); "
                             "a Loop only for validate() takes neither (or train_data=[])")
        max_epochs = _positive_int(max_epochs, "max_epochs")
        max_steps = _positive_int(max_steps, "max_steps")
        val_every_n_epochs = _positive_int(val_every_n_epochs, "val_every_n_epochs")
        val_every_n_steps = _positive_int(val_every_n_steps, "val_every_n_steps")
        if val_every_n_epochs is not None and val_every_n_steps is not None:
            raise ValueError(
                f"give val_every_n_epochs={val_every_n_epochs!r} or val_every_n_steps={val_every_n_steps!r}, "
                f"not both: validation runs at epoch ends or every N training steps")
        if val_every_n_steps is not None and val_step is None:
            raise ValueError(f"val_every_n_steps={val_every_n_steps!r} was given without a val_step and val_data")
        check_passes(train_data, val_data, max_epochs, max_steps, val_every_n_epochs, val_every_n_steps)
        if val_grad_mode not in ("inference", "no_grad"):
            raise ValueError(f"val_grad_mode must be 'inference' or 'no_grad', got {val_grad_mode!r}")
        if name is not None and (not isinstance(name, str) or not name.strip() or any(
                c in name for c in "/\\:") or name in (".", "..")):
            raise ValueError(f"name must be a non-empty string usable as a folder name, got {name!r}")
        if isinstance(disable, str) or not _iterable(disable):
            raise TypeError(f"disable must be a list of plugin names, got {_shown(disable)}")
        if isinstance(plugins, (str, bytes)) or not _iterable(plugins):
            raise TypeError(f"plugins must be a list of plugin objects, got {_shown(plugins)}")
        discovery.check_given(plugins := tuple(plugins))
        if run_dir is not None and not isinstance(run_dir, (str, os.PathLike)):
            raise TypeError(f"run_dir must be a path (a str or os.PathLike) or None, got {_shown(run_dir)}")
        if resume is not None and not isinstance(resume, (str, os.PathLike)):
            raise TypeError(f"resume must be 'latest', a checkpoint's path (a str or os.PathLike) or None, "
                            f"got {_shown(resume)}")
        seed = check_seed(seed)
        if not isinstance(deterministic, bool):
            raise ValueError(f"deterministic must be True or False, got {deterministic!r}")
        if smoke is not None and not isinstance(smoke, bool):
            raise ValueError(f"smoke must be True, False or None (HOOKFIT_SMOKE decides), got {smoke!r}")
        modules(model)  # type check now, not mid-run

        self.train_step = train_step
        self.train_data: Iterable[Any] = train_data if train_data is not None else []  # (None was refused above)
        self.val_step = val_step
        self.val_data = val_data
        self.model = model
        self.optimizers = optimizers
        self.epochs_given = max_epochs is not None
        """Whether ``max_epochs`` was given; without it and with ``max_steps`` the run goes on
        until ``max_steps``, however many epochs that takes."""
        self.max_epochs: int = max_epochs if max_epochs is not None else 1 if max_steps is None else max_steps
        """``max_epochs`` as given; without it one epoch, or with ``max_steps`` alone a bound
        that never ends the run first (every epoch makes at least one step): each run then
        tells its plugins the epochs ``max_steps`` takes when the training data has a length
        (``loop.max_epochs`` from ``configure`` on)."""
        self.max_steps = max_steps
        self.val_every_n_epochs: int | None = (
            val_every_n_epochs if val_every_n_epochs is not None else 1 if val_every_n_steps is None else None)
        """Validation every this many epochs, at the epoch's end; ``None`` with
        ``val_every_n_steps``."""
        self.val_every_n_steps = val_every_n_steps
        self.val_grad_mode = val_grad_mode
        self.run_dir = Path(run_dir) if run_dir is not None else None
        """``run_dir`` as given (else each run gets a new ``runs/<name>/<date>-<time>``)."""
        self.name = name
        """``name`` as given: the run's identity (else the name of ``run_dir``, else the
        script's name; see :attr:`hookfit.run.Run.name`)."""
        self.resume = resume
        self.seed = seed
        self.deterministic = deterministic
        self.smoke = smoke
        self._given = tuple(plugin for plugin in plugins if plugin is not None)
        self._disable = tuple(disable)
        self.run: Run | None = None
        """The run of the last ``fit()`` (its plugin manager, events, state), or ``None``."""

    @property
    def state(self) -> State:
        """The state of the last run (``fit()`` returns it too); idle before any."""
        return self.run.state if self.run is not None else State()

    def fit(self) -> State:
        """Run training (and validation) to the end; return the final :class:`State`.

        Plugins are discovered, registered and checked first: a broken plugin raises
        :class:`hookfit.PluginError` before any event fires. After ``fit_start`` fired,
        ``fit_end`` fires exactly once whatever happens, and an exception from the data, a
        step or a plugin propagates unchanged after ``exception`` and ``fit_end``. A ``Loop``
        runs once; a ``fit()`` that failed before it started may be called again. The
        returned state's ``results`` is what the plugins report once the run is over (the
        ``results`` event): with the built-in plugins the final and best metrics and the best
        and last checkpoints' paths. A plugin may make it raise instead once the run is over
        (:func:`end_with`): the interrupter does after a stop asked by SIGINT
        (``KeyboardInterrupt``) or SIGTERM (``SystemExit(143)``), unless ``Interrupter(exit=False)``
        or in a notebook; ``loop.state`` is then the run's state as it would have returned it."""
        if self.run is not None and self.run.state.status != "idle":
            raise RuntimeError("this Loop has already run; create a new Loop to train again")
        if self.train_step is None:
            raise TypeError("fit() needs a train_step: this Loop was given None (a Loop for validate() only)")
        self.run = Run(self, manager.build(self._given, self._disable))
        return _execute(self.run)

    @errors.keywords_named
    def validate(self, resume: str | os.PathLike[str] | None = None) -> State:
        """Run the validation stage alone, with every plugin (metrics, console, dashboard),
        as ``fit()`` runs it: every module in eval mode, without autograd, modes restored
        after. ``resume`` (a checkpoint path, ``"latest"`` or, with the built-in checkpoint plugin,
        ``"best"``: the best checkpoint of the newest run by ``Checkpoint(monitor=...)``, as ``hookfit
        export --best`` takes it; else ``Loop(resume=...)`` or ``HOOKFIT_RESUME``) loads the weights
        and plugin states of a checkpoint first. No
        training batch runs, no ``epoch_start``/``epoch_end`` fires, no checkpoint is written;
        the run ends ``completed`` with the reason ``"validation done"``. Returns the
        :class:`State` (``results``: what the plugins report, the metrics among them);
        ``loop.run`` is this run. The run is labelled with the epoch whose weights it
        validates: ``state.epoch`` is 0 for the checkpoint of the first epoch's end
        (``epoch0001-...``), and the console, the metric log and ``run.jsonl`` say epoch 1, as
        the file's name does. No optimizers are needed, and the training data is not read (a
        ``Loop`` built only to validate may be given ``[]``), whatever the checkpoint's position in
        its epoch. A ``Loop`` runs once: ``fit()`` or ``validate()``."""
        if self.val_step is None:
            raise ValueError("validate() needs a val_step and val_data: give Loop(val_step=..., val_data=...)")
        if self.run is not None and self.run.state.status != "idle":
            raise RuntimeError("this Loop has already run; create a new Loop to validate")
        self.run = Run(self, manager.build(self._given, self._disable), mode="validate", resume=resume)
        return _execute(self.run)

    @errors.keywords_named
    def predict(self, data: Iterable[Any] | Mapping[str, Iterable[Any]], step: Step | None = None) -> Iterator[Any]:
        """Yield ``step(loop, batch)`` for each batch of ``data``, one at a time, keeping none: the model in eval
        mode under ``torch.inference_mode()``, every module's mode restored when the iteration ends or is abandoned.
        ``step`` defaults to the ``val_step``. No plugin takes part: load a checkpoint's weights first, with
        :meth:`validate` ``(resume=...)`` on a ``Loop`` sharing the model (the training weights: an EMA average
        scored the checkpoint where EMA validated, and ``EMA.module`` holds it then, README "Evaluation and
        prediction"). The ``loop`` a step receives has ``model`` and the configuration. ``data`` may be a mapping
        ``{name: data}``, as ``val_data``: the sets are predicted one after the other, ``loop.state.val_set``
        naming the current one (a step keyed by the set's name works as in a validation; its outputs are yielded
        as it returns them, not renamed per set); with other data ``loop.state.val_set`` is ``None``."""
        step = step if step is not None else self.val_step
        if step is None:
            raise TypeError("predict() needs a step function step(loop, batch): give one, or Loop(val_step=...)")
        check_step("predict()'s step", step)
        if data is None or isinstance(data, (str, bytes)) or not isinstance(data, Iterable):
            raise TypeError(f"predict() data must be an iterable of batches, got {type(data).__name__}")
        run = Run(self, manager.PluginManager(), mode="validate")
        if isinstance(data, Mapping):  # named sets, as val_data's: state.val_set names each
            _check_sets("predict() data", data)
            data = ValSets(data, run.state)
        return run.predict(data, step)

    def request_stop(self, reason: str = "stop requested", by: str | None = None, *,
                     complete: bool = False, ends_process: bool = False) -> StopRequest:
        """Ask the running ``fit()`` for a graceful stop, from any thread: see
        :meth:`hookfit.run.Run.request_stop`, whose options these are."""
        if self.run is None or self.run.state.status != "running":
            raise RuntimeError("request_stop() needs a running loop: call it during fit()")
        return self.run.request_stop(reason, by, complete=complete, ends_process=ends_process)
