"""A run's hyperparameters, as the loggers (``tensorboard``, ``mlflow``, ``wandb``) record them: one
flat mapping of scalars (:func:`run_hparams`); :func:`hyperparameters` checks a logger's ``hparams``;
:func:`settings` and :func:`replaced_settings` find the optimizer settings a resume puts back over those given,
:func:`load_schedule` a scheduler's;
:func:`warn_unsaved_schedule` and :class:`ScheduleCounts` find schedulers stepped outside an optimizer plugin;
:func:`resumed_schedule` steps a schedule whose optimizer stepped before a resume."""

from __future__ import annotations

import contextlib
import inspect
import math
import numbers
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.optim.lr_scheduler import ReduceLROnPlateau

from hookfit.errors import user_level
from hookfit.plugins.support.options import finite, is_int, option_error

_TORCH = os.path.dirname(torch.__file__)  # (a check inside torch's step pre-hook names the step function's line)

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

__all__ = ["Hparam", "ScheduleCounts", "given_group", "hparam", "hyperparameters", "load_schedule", "replaced_settings",
           "resumed_schedule", "run_hparams", "settings", "warn_replaced"]

Hparam = bool | int | float | str  # a hyperparameter's value: one scalar, as every tracker shows it
_MECHANICS = frozenset({"params", "param_names", "foreach", "fused", "capturable", "differentiable"})  # how, not what


def hparam(value: object) -> Hparam | None:
    """``value`` as a hyperparameter, or ``None`` if it is no scalar (tuples of scalars and paths as strings)."""
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, tuple) and all(isinstance(v, (bool, int, float, str)) for v in value):
        return str(value)
    return os.fsdecode(value) if isinstance(value, os.PathLike) else None


def hyperparameters(plugin: str, option: str, value: Any) -> dict[str, Hparam]:
    """A logger's ``hparams`` option: ``None`` or names to finite numbers, strings or booleans (a new dict)."""
    if value is not None and not isinstance(value, Mapping):
        raise option_error(plugin, option, value, "map names to numbers, strings or booleans",
                           shown=f"{type(value).__name__} {value!r}")
    out: dict[str, Hparam] = {}
    for key, item in (value or {}).items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"{plugin}: {option} has the key {key!r}; names are non-empty strings")
        if not isinstance(item, (bool, str)) and finite(item) is None:
            raise ValueError(f"{plugin}: {option}[{key!r}] is {item!r}; a hyperparameter is a finite number, "
                             f"a string or a boolean")
        out[key] = item if isinstance(item, (bool, str)) else int(item) if is_int(item) else float(item)
    return out


def run_hparams(loop: Run, extra: Mapping[str, Hparam] | None = None) -> dict[str, Hparam]:
    """The run's hyperparameters, as every logger records them: ``loop.name`` and the scalar ``loop.<setting>``s
    (``max_epochs``, ``seed``...), each optimizer's class (``optimizer.<name>``) and its parameter groups' scalar
    settings as given (:func:`given_group`: the ``lr`` given, not one a warmup scheduler has scaled already): the
    first group's as ``optimizer.<name>.<setting>`` (``optimizer.default.lr``), another group's where it differs
    from the first's as ``optimizer.<name>.group<i>.<setting>`` (``optimizer.default.group1.weight_decay``);
    every plugin's scalar options (``plugin.<name>.<option>``), then ``extra``, which wins a clash."""
    from hookfit import config  # the core's, imported where it is used
    settings = ("max_epochs", "max_steps", "seed", "deterministic", "val_every_n_epochs", "val_every_n_steps")
    loop_values = {f"loop.{key}": hparam(getattr(loop, key, None)) for key in settings}
    out: dict[str, Hparam] = {"loop.name": loop.name, **{k: v for k, v in loop_values.items() if v is not None}}
    optimizers = getattr(loop.config, "optimizers", None)
    named = optimizers.items() if isinstance(optimizers, Mapping) else [("default", optimizers)] if optimizers else []
    for name, optimizer in named:
        out[f"optimizer.{name}"] = type(optimizer).__name__
        groups = [given_group(group) for group in getattr(optimizer, "param_groups", None) or [{}]]
        for index, group in enumerate(groups):
            for key, setting in sorted(group.items()):
                if index and key in groups[0] and not _differ(groups[0][key], setting):
                    continue  # a later group's setting is named where it differs from the first group's
                if (value := hparam(setting)) is not None:
                    out[f"optimizer.{name}{f'.group{index}' if index else ''}.{key}"] = value
    for name in loop.pm.participants():
        plugin, info = loop.pm.get_plugin(name), loop.pm.infos.get(name)
        options = config.accepted(type(plugin)) if plugin is not None and not isinstance(plugin, type) else None
        for option in sorted(options or ()):
            given = info.options if info is not None else {}
            if (value := hparam(getattr(plugin, option) if hasattr(plugin, option) else given.get(option))) is not None:
                out[f"plugin.{name}.{option}"] = value
    return {**out, **(extra or {})}


Replaced = tuple[int, str, Any, Any]  # (parameter group, setting, the saved value, the value given)
Setting = Any  # a setting as :func:`settings` keeps it: a number, a string, a bool, None, or a tuple of them


def settings(groups: Sequence[Mapping[str, Any]]) -> list[dict[str, Setting]]:
    """The settings of an optimizer's parameter groups (``param_groups`` as the run was given them, before
    any step, schedule or resume moves them): each group's values but how the optimizer runs (``params``,
    ``fused``, ``foreach``...), as plain values a checkpoint holds (a tensor ``lr`` as its number, ``betas``
    as a tuple); a value of any other kind (a custom optimizer's object) is left out."""
    return [{key: value for key, value in ((k, _plain(v)) for k, v in group.items() if k not in _MECHANICS)
             if _plain_value(value)} for group in groups]


def given_group(group: Mapping[str, Any]) -> dict[str, Setting]:
    """A parameter group's settings as the user gave them (:func:`settings`): its ``lr`` is the ``initial_lr``
    a torch scheduler keeps where one was built on it (a warmup has already scaled ``lr`` by then)."""
    (kept,) = settings([group])
    if "initial_lr" in kept:
        kept["lr"] = kept.pop("initial_lr")
    return kept


def replaced_settings(saved: Sequence[Mapping[str, Setting]], given: Sequence[Mapping[str, Setting]]
                      ) -> list[Replaced]:
    """The settings of ``given`` (:func:`settings` of the optimizer as this run was given it) that differ from
    ``saved`` (the same, of the run that wrote the checkpoint): what the user changed between the two runs,
    which a resume does not apply (torch's ``Optimizer.load_state_dict`` puts back the saved groups). What
    training moved since (a schedule, the training code's own rate) is not compared: both sides are as built.
    A setting only one side has is left out (another torch version's defaults)."""
    out: list[Replaced] = []
    for index, (old, new) in enumerate(zip(saved, given)):
        out += [(index, key, old[key], value) for key, value in new.items() if key in old and _differ(old[key], value)]
    return out


def warn_replaced(plugin: str, name: str, optimizer: Any, built: Sequence[Mapping[str, Setting]],
                  saved: Sequence[Mapping[str, Setting]] | None, category: type[Warning]) -> None:
    """One warning (``category``, at the user's line) when ``optimizer`` (``loop.optimizers[name]``, settings
    ``built`` as given to this run) resumes from a checkpoint whose run was given other settings (``saved``;
    ``None``: the checkpoint does not say): each with both values, and how to train with the new ones."""
    changes = replaced_settings(saved, built) if saved is not None else []
    # a scheduler keeps the rate given as initial_lr and moved lr as it was built: the rate given is the one to name
    scheduled = {index for index, key, *_ in changes if key == "initial_lr"}
    changes = [(index, "lr" if key == "initial_lr" else key, old, new) for index, key, old, new in changes
               if not (key == "lr" and index in scheduled)]
    if not changes:
        return
    groups = sorted({index for index, *_ in changes})
    listed = "; ".join(f"parameter group {group}: " + ", ".join(
        f"the checkpoint's {key}={_shown(old)} replaces {key}={_shown(new)} given"
        for index, key, old, new in changes if index == group) for group in groups)
    index, key, _, new = changes[0]
    then = (f"set them once the run has resumed, in a plugin's resumed(loop, info) hook: "
            f"loop.optimizers[{name!r}].param_groups[{index}][{key!r}] = {_shown(new)} (and so for each group named above)")
    if scheduled:  # the restored scheduler sets the rate at its next step, from its own saved state
        then = ("with a scheduler, whose saved state sets the rate at its next step, change the schedule as well, "
                "in a plugin's resumed(loop, info) hook (a closed-form one's base_lrs, a chained one's group lr)")
    warnings.warn(
        f"{plugin}: optimizer {name!r} ({type(optimizer).__name__}) resumed with the settings of the checkpoint, "
        f"not those it was built with: {listed}. A resumed run continues the saved one as it was (torch's "
        f"Optimizer.load_state_dict puts back the saved parameter groups, a scheduler its saved state). To train "
        f"with the new values, start a new run (another Loop(run_dir=...) or Loop(name=...), or no resume), or "
        f"{then}", category, stacklevel=user_level())


def load_schedule(plugin: str, name: str, scheduler: Any, saved: Mapping[str, Any], category: type[Warning]) -> None:
    """Load ``saved`` into ``scheduler`` (one of optimizer ``name``'s), first warning once (``category``, at the
    user's line) of the settings it was built with that the saved state replaces: the arguments of its class's
    constructor its state keeps under their own names (``T_max``, ``total_steps``, ``gamma``), as plain values;
    its progress (``last_epoch``) and what it derives are not compared."""
    names = set(inspect.signature(type(scheduler).__init__).parameters) - {"self", "optimizer", "last_epoch", "verbose"}
    built = {key: value for key, value in scheduler.state_dict().items() if key in names and _plain_value(_plain(value))}
    changes = [(key, saved[key], value) for key, value in built.items() if key in saved and _differ(saved[key], value)]
    if changes:
        warnings.warn(
            f"{plugin}: scheduler {type(scheduler).__name__} of optimizer {name!r} resumed with the settings of the "
            f"checkpoint, not those it was built with: " + ", ".join(
                f"the checkpoint's {key}={_shown(old)} replaces {key}={_shown(new)} given" for key, old, new in changes)
            + ". A resumed run continues the saved one as it was (torch's load_state_dict puts back the scheduler's "
            "saved state): to train on a new schedule, start a new run (another Loop(run_dir=...) or Loop(name=...), "
            "or no resume)", category, stacklevel=user_level())
    scheduler.load_state_dict(saved)


def warn_changed_options(plugin: str, saved: Mapping[str, Any] | None, given: Mapping[str, Any],
                         category: type[Warning]) -> None:
    """One warning (``category``, at the user's line) when a run resumes with options of ``plugin`` that change
    how it trains (``given``) other than those of the run that saved the checkpoint (``saved``; ``None``: it
    does not say): the resumed run trains with the new ones, so it no longer continues the saved run exactly."""
    changed = [f"{key}={_shown(saved[key])} then, {key}={_shown(value)} now" for key, value in given.items()
               if saved is not None and key in saved and _differ(saved[key], value)]
    if changed:
        warnings.warn(f"{plugin}: this run resumes with other options than the run that saved the checkpoint "
                      f"({'; '.join(changed)}): it trains on with the new ones, so it is not the saved run continued "
                      f"as it was; give {plugin.capitalize()}() the options of that run to resume it exactly, or "
                      f"start a new run (another Loop(run_dir=...) or Loop(name=...)) to train with these",
                      category, stacklevel=user_level())


def warn_unsaved_schedule(plugin: str, loop: Run, name: str, optimizer: Any, schedulers: Sequence[Any],
                          category: type[Warning]) -> None:
    """One warning (``category``, at the user's line) when a training run's ``optimizer`` has a
    learning-rate scheduler built on it (torch's schedulers put ``initial_lr`` in the parameter
    groups) and ``plugin`` was given none of it (``schedulers``): a scheduler the step steps
    itself is in no checkpoint, so a resumed run would start its schedule again."""
    if loop.mode == "fit" and not schedulers and any("initial_lr" in group for group in optimizer.param_groups):
        warnings.warn(f"{plugin}: optimizer {name!r} has a learning-rate scheduler built on it that was not given to "
                      f"{plugin.capitalize()}(schedulers=...): its state is in no checkpoint, so a resumed run starts "
                      f"its schedule again; give it as {plugin.capitalize()}(schedulers=scheduler) (with "
                      f"scheduler_interval=\"epoch\" for one stepped once an epoch) and do not step it yourself",
                      category, stacklevel=user_level())


class ScheduleCounts:
    """A plugin's schedulers stepped elsewhere as well in a training stage (the step function's
    ``scheduler.step()`` left in): their schedule runs ahead of the optimizer's steps, silently.
    Each scheduler's count (``last_epoch``) at the stage's start is compared at its end with the
    steps the plugin made of its optimizer (taken or skipped) where it steps the scheduler after
    each, none where it steps it per epoch; a ``ReduceLROnPlateau`` (stepped on metrics, which a
    validation inside training publishes) is not compared, a ``ChainedScheduler`` through its first
    scheduler. Checked at the stage's end, or at the run's where that came inside the stage
    (``max_steps``, a stop); not in a failed run. One warning (``category``) a run."""

    def __init__(self, plugin: str, category: type[Warning]) -> None:
        self.plugin, self.category = plugin, category
        self._before: dict[int, tuple[int, int]] = {}
        self._said = False

    def start(self, optimizers: Mapping[str, Any] | None, per_step: Callable[[list[Any]], list[Any]]) -> None:
        """A training stage begins. ``optimizers``: the plugin's by name (each with ``schedulers``, ``steps``
        and ``skipped``); ``per_step``: which of a list of schedulers the plugin steps after each optimizer step."""
        self._before = {id(s): (count, own) for _, s, count, own in self._counts(optimizers, per_step)}

    def check(self, loop: Run, optimizers: Mapping[str, Any] | None, per_step: Callable[[list[Any]], list[Any]],
              early: bool = False) -> None:
        """The training stage ended (or the run, inside one): warn where a scheduler moved more than the plugin
        stepped it. Once a stage: the next is compared from its start. ``early``: inside the stage, before an
        optimizer step the plugin makes (its watch's step pre-hook), so the step function's ``scheduler.step()``
        is told at the batch that shows it, not after the stage; the stage's start is kept."""
        before = self._before
        if not early:
            self._before = {}
        if self._said or not before or loop.state.status == "failed":
            return
        for name, scheduler, count, own in self._counts(optimizers, per_step):
            if (then := before.get(id(scheduler))) is None or count - then[0] <= own - then[1]:
                continue
            self._said = True
            where = f"in the first {loop.state.batch_idx + 1} batches of the training stage" if early else (
                "in the training stage")
            warnings.warn(f"{self.plugin}: the {type(scheduler).__name__} of optimizer {name!r} stepped "
                          f"{count - then[0]} times {where} of epoch {loop.state.epoch + 1}, and "
                          f"{self.plugin} stepped it {own - then[1]} times: something else steps it too "
                          f"(scheduler.step() in the step function?), so its schedule runs ahead of the optimizer's "
                          f"steps. {self.plugin} steps the schedulers given to {self.plugin.capitalize()}"
                          f"(schedulers=...): remove the other step() call, or leave the scheduler out of "
                          f"{self.plugin.capitalize()}", self.category, stacklevel=user_level(_TORCH))
            return

    @staticmethod
    def _counts(optimizers: Mapping[str, Any] | None, per_step: Callable[[list[Any]], list[Any]]
                ) -> list[tuple[str, Any, int, int]]:
        """(optimizer name, scheduler, its count, the plugin's steps of the optimizer that step it)."""
        return [(name, s, count, managed.steps + managed.skipped if per_step([s]) else 0)
                for name, managed in (optimizers or {}).items() for s in managed.schedulers
                if not isinstance(s, ReduceLROnPlateau) and (count := _count(s)) is not None]


@contextlib.contextmanager
def resumed_schedule(stepped: bool) -> Iterator[None]:
    """Around a scheduler's ``step()``: torch's "lr_scheduler.step() before optimizer.step()" counts
    this process's optimizer steps, so a resumed run would hear it before its first; where the run
    already stepped the optimizer (``stepped``, before the resume too) it is not said."""
    if not stepped:  # (catch_warnings would clear every warning registry: a once-shown warning shown again)
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        yield


def _count(scheduler: Any) -> int | None:
    """A scheduler's steps (``last_epoch``); a ``ChainedScheduler``'s, which has none, its first scheduler's."""
    count = getattr(scheduler, "last_epoch", None)
    if isinstance(count, int) and not isinstance(count, bool):
        return count
    inner = getattr(scheduler, "_schedulers", None)
    return _count(inner[0]) if isinstance(inner, (list, tuple)) and inner else None


def _plain_value(value: Any) -> bool:
    """Whether :func:`settings` keeps ``value``: what ``torch.load(weights_only=True)`` reads back."""
    if isinstance(value, tuple):
        return all(_plain_value(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _plain(value: Any) -> Any:
    """``value`` as compared: a tensor (``lr`` may be one) as its number(s), a list as a tuple (``betas``)."""
    value = value.tolist() if callable(getattr(value, "tolist", None)) else value
    return tuple(_plain(v) for v in value) if isinstance(value, (list, tuple)) else value


def _differ(saved: Any, given: Any) -> bool:
    """Whether two values of a setting differ: numbers by more than a float32 tensor's rounding (``lr`` may be
    one), tuples item by item; values that cannot be compared are taken as the same."""
    saved, given = _plain(saved), _plain(given)
    if isinstance(saved, tuple) and isinstance(given, tuple):
        return len(saved) != len(given) or any(_differ(a, b) for a, b in zip(saved, given))
    if all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in (saved, given)):
        return not math.isclose(saved, given, rel_tol=1e-6)
    try:
        return bool(saved != given)
    except Exception:  # (an object whose comparison fails or is not a truth value)
        return False


def _shown(value: Any) -> str:
    """A setting as the warning shows it: ``0.001``, ``(0.9, 0.999)``."""
    return repr(_plain(value))
