"""What a run gives a checkpoint and takes back: its own state (``loop.state_dict()``: the
position, the random state, the data's own states; see :mod:`hookfit.position`) and every
plugin's (``loop.plugin_states()``, through the ``save_state``/``load_state`` events)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

from hookfit.manager import HookfitWarning, StateMismatch
from hookfit.position import Position, check_position, check_rng, set_rng_state

if TYPE_CHECKING:  # pragma: no cover
    from hookfit.run import Run

__all__ = ["load_plugin_states", "load_run_state", "plugin_states", "run_state", "stateful"]


class Restorable(Protocol):
    """Data that takes a saved state back (``load_state_dict``)."""

    def load_state_dict(self, state: Any, /) -> Any: ...


class Stateful(Restorable, Protocol):
    """Data that keeps a state of its own: torchdata's ``StatefulDataLoader``,
    :class:`hookfit.data.Batches`."""

    def state_dict(self) -> Any: ...


def stateful(data: object) -> TypeGuard[Stateful]:
    """Whether ``data`` keeps a state of its own (``state_dict`` and ``load_state_dict``)."""
    return hasattr(data, "state_dict") and hasattr(data, "load_state_dict")


def restorable(data: object) -> TypeGuard[Restorable]:
    """Whether ``data`` takes a saved state back (``load_state_dict``)."""
    return hasattr(data, "load_state_dict")


def run_state(run: Run) -> dict[str, Any]:
    """See :meth:`hookfit.run.Run.state_dict`."""
    cursor = run.cursor
    data: dict[str, Any] = {}
    if stateful(run.train_data):
        data["train"] = run.train_data.state_dict()
    if stateful(run.val_data):
        inside = cursor.valid_rng is not None and cursor.valid_data is not None
        data["valid"] = cursor.valid_data if inside else run.val_data.state_dict()
    saved = {"loop": cursor.position().as_dict(), "rng": cursor.rng(), "data": data}
    if cursor.training and cursor.iter_rng is not None:
        saved["data_rng"] = cursor.iter_rng
    return saved


def load_run_state(run: Run, saved: Mapping[str, Any]) -> Position:
    """See :meth:`hookfit.run.Run.load_state_dict`; returns where the run starts."""
    for key in ("loop", "rng"):
        if key not in saved:
            raise ValueError(f"load_state_dict: the run's state lacks {key!r} (it has {', '.join(map(repr, saved))})")
    check_position(saved["loop"], run.train_data)
    check_rng(saved["rng"])
    if saved.get("data_rng") is not None:
        check_rng(saved["data_rng"])
    position = Position.from_dict(saved["loop"])
    data = saved.get("data") or {}
    cursor = run.cursor
    cursor.restored = set()
    for key, target in (("train", run.train_data), ("valid", run.val_data)):
        if key in data and restorable(target):
            target.load_state_dict(data[key])
            cursor.restored.add(key)
    set_rng_state(saved["rng"])
    state = run.state
    state.epoch, state.step, state.val_due = position.epoch, position.step, position.val_due
    cursor.epoch_begins(position.epoch, position.batch, position.stage)
    cursor.iter_rng = saved.get("data_rng")
    return position


def plugin_states(run: Run) -> dict[str, Any]:
    """See :meth:`hookfit.run.Run.plugin_states`."""
    hooks = run.hooks
    states: dict[str, Any] = dict.fromkeys(hooks.plugins("save_state"))
    states.update(hooks.call_each("save_state", run))
    return states


def load_plugin_states(run: Run, states: Mapping[str, Any], strict: bool) -> None:
    """See :meth:`hookfit.run.Run.load_plugin_states`."""
    hooks = run.hooks
    loaders = hooks.plugins("load_state")
    savers = hooks.plugins("save_state")
    # a plugin new to the run misses a state only if it has one to keep (an inert plugin,
    # whose save_state answers None now, has nothing to restore)
    missing = sorted(name for name in savers if name not in states
                     and hooks.call_plugin("save_state", name, run) is not None)
    extra = sorted(name for name in states if name not in loaders and states[name] is not None)
    if missing or extra:
        problems = []
        if missing:
            problems.append(f"no saved state for {', '.join(map(run.pm.describe, missing))} "
                            f"(new to the run: it starts fresh)")
        if extra:
            problems.append(f"saved state of plugin(s) {', '.join(map(repr, extra))} that "
                            "no enabled plugin of this run restores (left unused)")
        message = "plugin states do not match this run: " + "; ".join(problems)
        if strict:
            raise StateMismatch(message, missing, extra)
        warnings.warn(message + "; restoring the rest", HookfitWarning, stacklevel=3)
    for name in loaders:
        if states.get(name) is not None:
            hooks.call_plugin("load_state", name, run, states[name])
