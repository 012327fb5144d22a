"""A run's hyperparameters, as the loggers (``tensorboard``, ``mlflow``, ``wandb``) record them: one
flat mapping of scalars (:func:`run_hparams`); :func:`hyperparameters` checks a logger's ``hparams``."""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hookfit.plugins.support.options import finite, is_int, option_error

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

__all__ = ["Hparam", "hparam", "hyperparameters", "run_hparams"]

Hparam = bool | int | float | str  # a hyperparameter's value: one scalar, as every tracker shows it
_MECHANICS = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})  # how, not what


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
    (``max_epochs``, ``seed``...), each optimizer's class and the scalar settings of its first parameter group
    (``optimizer.<name>``, ``optimizer.<name>.lr``...), every plugin's scalar options (``plugin.<name>.<option>``),
    then ``extra``, which wins a clash."""
    from hookfit import config  # the core's, imported where it is used
    settings = ("max_epochs", "max_steps", "seed", "deterministic", "val_every_n_epochs", "val_every_n_steps")
    loop_values = {f"loop.{key}": hparam(getattr(loop, key, None)) for key in settings}
    out: dict[str, Hparam] = {"loop.name": loop.name, **{k: v for k, v in loop_values.items() if v is not None}}
    optimizers = getattr(loop.config, "optimizers", None)
    named = optimizers.items() if isinstance(optimizers, Mapping) else [("default", optimizers)] if optimizers else []
    for name, optimizer in named:
        out[f"optimizer.{name}"] = type(optimizer).__name__
        for key, setting in sorted((getattr(optimizer, "param_groups", None) or [{}])[0].items()):
            if key not in _MECHANICS and (value := hparam(setting)) is not None:
                out[f"optimizer.{name}.{key}"] = value
    for name in loop.pm.participants():
        plugin, info = loop.pm.get_plugin(name), loop.pm.infos.get(name)
        options = config.accepted(type(plugin)) if plugin is not None and not isinstance(plugin, type) else None
        for option in sorted(options or ()):
            given = info.options if info is not None else {}
            if (value := hparam(getattr(plugin, option) if hasattr(plugin, option) else given.get(option))) is not None:
                out[f"plugin.{name}.{option}"] = value
    return {**out, **(extra or {})}
