"""What a run gives a checkpoint and takes back: its own state (``loop.state_dict()``: the
position, the random state, the data's own states; see :mod:`hookfit.position`) and every
plugin's (``loop.plugin_states()``, through the ``save_state``/``load_state`` events). Each is
checked as it is taken to hold only what a checkpoint is read back with
(``torch.load(weights_only=True)``), so that no checkpoint is written that cannot be read."""

from __future__ import annotations

import io
import warnings
from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

import torch

from hookfit.discovery import inert
from hookfit.errors import HookfitWarning, RefusedState, StateMismatch, user_level
from hookfit.modes import modules
from hookfit.persistent import made, named, other_workers, persistent, workers
from hookfit.position import Position, check_position, check_rng, rng_state, set_rng_state

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
    saved: dict[str, Any] = {"loop": cursor.position().as_dict(), "rng": cursor.rng(run.train_data, run.val_data),
                             "data": data}
    if made_iterators := cursor.persistent_iterators(run.train_data, run.val_data):
        saved["persistent_iterators"] = made_iterators
    if counts := workers(run.train_data, run.val_data):
        saved["workers"] = counts
    if cursor.training:
        if cursor.iter_rng is not None:
            saved["data_rng"] = cursor.iter_rng
        for key in cursor.carry:
            if not isinstance(key, str):
                raise TypeError(f"loop.carry has the key {key!r} ({type(key).__name__}): its keys are names (strings)")
        saved["carry"] = {key: _carried(value, f"loop.carry[{key!r}]") for key, value in cursor.carry.items()}
    return saved


def load_run_state(run: Run, saved: Mapping[str, Any]) -> Position:
    """See :meth:`hookfit.run.Run.load_state_dict`; returns where the run starts."""
    for key in ("loop", "rng"):
        if key not in saved:
            raise ValueError(f"load_state_dict: the run's state lacks {key!r} (it has {', '.join(map(repr, saved))})")
    check_position(saved["loop"], run.train_data if run.mode == "fit" else None)  # (an evaluation trains nothing)
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
    carry = saved.get("carry")
    if carry is not None:
        if not isinstance(carry, Mapping) or not all(isinstance(key, str) for key in carry):
            raise ValueError(f"load_state_dict: 'carry' (loop.carry) is not a mapping of names to values: "
                             f"{carry!r:.80}")
        carry = dict(_on_device(carry, run.model))
        if carry and run.state.world_size > 1:
            warnings.warn(f"load_state_dict: loop.carry ({', '.join(map(repr, carry))}) was saved by the main "
                          f"process and goes to each of the {run.state.world_size} processes: a carry of each "
                          f"process's own (an RNN's hidden state over its part of the data) is not resumed "
                          f"exactly", HookfitWarning, stacklevel=user_level())
    made_before = saved.get("persistent_iterators") or []
    if not isinstance(made_before, (list, tuple)) or not all(isinstance(name, str) for name in made_before):
        raise ValueError(f"load_state_dict: 'persistent_iterators' is not a list of names: {made_before!r:.80}")
    if run.mode == "fit" and run.is_main and (changed := other_workers(run.train_data, run.val_data,
                                                                       saved.get("workers"))):
        warnings.warn(f"load_state_dict: {changed}", HookfitWarning, stacklevel=user_level())
    if run.mode == "fit":  # made as the run it continues had them, the random state kept
        for name, target in named(run.train_data, run.val_data).items():
            if name in made_before and persistent(target) and not made(target):
                keep = rng_state(target)
                iter(target)
                set_rng_state(keep, target)
    held = set_rng_state(saved["rng"], run.train_data, run.val_data)
    if saved.get("data_rng") is not None:  # a stage's iterator is made again from these
        held &= frozenset(saved["data_rng"].get("data") or ())
    state = run.state
    state.epoch, state.step, state.val_due = position.epoch, position.step, position.val_due
    cursor.epoch_begins(position.epoch, position.batch, position.stage)
    cursor.iter_rng = saved.get("data_rng")
    cursor.iter_made, cursor.made_before = "train" in made_before, frozenset(made_before)
    cursor.held = held
    cursor.resumed_carry = carry
    return position


_PLAIN = (bool, int, float, str, type(None))


def _carried(value: Any, where: str) -> Any:
    """``value`` of ``loop.carry`` as a state dict keeps it (tensors detached, containers
    copied), or a ``TypeError`` naming where it is when a checkpoint cannot hold it."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if type(value) in _PLAIN:  # (exact: a numpy.float64 is a float that a checkpoint cannot be read back with)
        return value
    if isinstance(value, (list, tuple)):
        items = [_carried(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, Mapping):
        return {k: _carried(v, f"{where}[{k!r}]") for k, v in value.items()}
    raise TypeError(f"{where} is a {_type_name(value)}: "
                    f"what the step carries is saved with the run, and a checkpoint keeps tensors, numbers, "
                    f"strings, None and lists, tuples and dicts of them")


def _on_device(value: Any, model: Any) -> Any:
    """A restored ``loop.carry`` value with its tensors on the device of the model's first
    parameter (a checkpoint is read onto the CPU); unchanged without a model or parameters."""
    device = next((p.device for m in modules(model) for p in m.parameters()), None)
    if device is None or device.type == "cpu":
        return value

    def move(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            return item.to(device)
        if isinstance(item, (list, tuple)):
            moved = [move(v) for v in item]
            return moved if isinstance(item, list) else tuple(moved)
        if isinstance(item, Mapping):
            return {k: move(v) for k, v in item.items()}
        return item

    return move(value)


def plugin_states(run: Run, check: bool = True) -> dict[str, Any]:
    """See :meth:`hookfit.run.Run.plugin_states`. Each answer is checked to be what a checkpoint
    can be read back with (:func:`_refused`): a participant whose state is not fails the run with a
    ``TypeError`` naming it, the place in its state and the type; an observer is switched off with
    one warning naming it, its entry ``None``. So no checkpoint that cannot be read is written."""
    hooks = run.hooks
    states: dict[str, Any] = dict.fromkeys(hooks.plugins("save_state"))
    states.update(hooks.call_each("save_state", run))
    trusted = _trusted()
    for name, state in states.items():
        if not check or state is None or (found := _refused(state, "state", trusted)) is None:
            continue
        if _reads_back(found[1]) and _reads_back(state):  # a type allowlisted another way: torch's word
            continue
        where, part = found
        kind = _type_name(part)
        hint = " (of a numpy value: .item(), .tolist() or torch.from_numpy())" if kind.startswith("numpy.") else ""
        error = RefusedState(name, (
            f"{run.pm.describe(name)} returned from save_state a state that no checkpoint could be read back with: "
            f"{where} is {'an' if kind[0] in 'aeiou' else 'a'} {kind}, which torch.load(weights_only=True), the way "
            f"hookfit reads checkpoints, refuses. Return plain data instead: Python numbers{hint}, strings, bytes, "
            f"None, tensors, torch dtypes and devices, and lists, tuples, sets and dicts of them"))
        run.pm.refuse(name, "save_state", error)
        states[name] = None
    return states


_ATOMS = frozenset({bool, int, float, complex, str, bytes, bytearray, type(None),
                    torch.device, torch.dtype, torch.layout, torch.qscheme})
"""The types of values ``torch.load(weights_only=True)`` reads back, besides tensors and :data:`_CONTAINERS`
(exact types: a ``numpy.float64`` is a ``float`` that it refuses)."""
_CONTAINERS = frozenset({dict, OrderedDict, Counter, list, tuple, set, torch.Size})


def _trusted() -> frozenset[Any]:
    """What the process allows a safe load beyond torch's own (``torch.serialization.add_safe_globals``; none
    in a torch without the allowlist)."""
    allowed: list[Any] = getattr(torch.serialization, "get_safe_globals", list)()
    return frozenset(g[0] if isinstance(g, tuple) else g for g in allowed)


def _refused(value: Any, where: str, trusted: frozenset[Any], path: set[int] | None = None) -> tuple[str, Any] | None:
    """The first part of ``value`` that ``torch.load(weights_only=True)`` would refuse to read back, as
    ``(where it is, the part)`` (``where`` names ``value``: ``"state['best']"``, ``"a key of state"``), or
    ``None``. Walks the containers without serialising anything: a tensor (of any size) is taken as it is,
    an instance of a type in ``trusted`` too. ``path``: the containers being walked (one inside itself)."""
    kind = type(value)
    if kind in _ATOMS or isinstance(value, torch.Tensor) or kind in trusted:
        return None
    if kind not in _CONTAINERS:
        return where, value
    path = set() if path is None else path
    if id(value) in path:
        return None
    path.add(id(value))
    try:
        if isinstance(value, dict):
            for key, item in value.items():
                if found := (_refused(key, f"a key of {where} ({key!r:.40})", trusted, path)
                             or _refused(item, f"{where}[{key!r:.40}]", trusted, path)):
                    return found
            return None
        for i, item in enumerate(value):
            if found := _refused(item, f"an item of {where}" if kind is set else f"{where}[{i}]", trusted, path):
                return found
        return None
    finally:
        path.discard(id(value))


def _reads_back(value: Any) -> bool:
    """Whether ``torch.load(weights_only=True)`` reads ``value`` back, saved in memory."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception:
        return False
    return True


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


_MEASURED = frozenset({"stage_start", "batch_start", "step_output"})
"""The events that shape what a validation measures: the model for the stage (weights swapped in), the model or batch
for the step, the outputs aggregated; ``batch_end``, ``after_batch``, ``stage_end`` see it done (a tracker logs there)."""


def _left_out(run: Run, name: str) -> bool:
    """Whether ``run`` is an evaluation (``loop.mode != "fit"``) that has plugin ``name``, enabled, and takes
    no part in it: left out as inert there or unregistered at its ``configure``."""
    info = run.pm.infos.get(name)
    return run.mode != "fit" and info is not None and info.enabled and run.pm.get_plugin(name) is None


def _sits_out(run: Run, name: str) -> bool:
    """Whether plugin ``name`` is :func:`_left_out` of the evaluation ``run`` so that the saved state it would
    restore is of no use to it: it left at its own ``configure``, chosen and seeing the run (early stopping given
    without a monitor), or, left out as inert merely discovered, it acts in none of the events of
    :data:`_MEASURED` (early stopping, a tracker logging each batch), so that no validation of the run it comes
    from measured its state. One left out as inert that acts in one of them (weights averaged and swapped in for
    the validation) is not, nor is a plugin the evaluation lacks altogether (disabled, not installed, not given):
    its state may be what was validated."""
    info = run.pm.infos.get(name)
    return info is not None and _left_out(run, name) and (info.chosen or _MEASURED.isdisjoint(info.hooks))


def _turned_on(run: Run, name: str) -> str:
    """How plugin ``name``, left out of ``run`` as inert, takes part: its own ``inert`` answer."""
    try:
        return inert(run.pm.infos[name].plugin, False, run) or "chosen for the run"
    except Exception:  # (an answer that fails was reported when the run left it out)
        return "chosen for the run"


def load_plugin_states(run: Run, states: Mapping[str, Any], strict: bool) -> None:
    """See :meth:`hookfit.run.Run.load_plugin_states`."""
    hooks = run.hooks
    loaders = hooks.plugins("load_state")
    savers = hooks.plugins("save_state")
    # a plugin new to the run misses a state only if it has one to keep (an inert plugin,
    # whose save_state answers None now, has nothing to restore)
    missing = sorted(name for name in savers if name not in states
                     and hooks.call_plugin("save_state", name, run) is not None)
    # a state no plugin here restores is rank 0's to judge: the checkpoint is its, and other ranks leave out what
    # runs on rank 0 alone (the observers switched off there, a tracker a script gives rank 0 only)
    extra = sorted(name for name in states if name not in loaders and states[name] is not None
                   and not _sits_out(run, name)) if run.is_main else []
    inert_here = [name for name in extra if _left_out(run, name)]  # (for an evaluation: what would restore it)
    if missing or extra:
        problems = []
        if missing:
            problems.append(f"no saved state for {', '.join(map(run.pm.describe, missing))} "
                            f"(new to the run: it starts fresh)")
        if absent := [name for name in extra if name not in inert_here]:
            problems.append(f"saved state of plugin(s) {', '.join(map(repr, absent))} that "
                            "no enabled plugin of this run restores (left unused)")
        problems.extend(f"saved state of {run.pm.describe(name)}, which is inert in this evaluation (left unused), "
                        f"although the validations of the run it comes from may have measured it (it acts on the "
                        f"model, batches or outputs of a stage, as a plugin validating with averaged weights does); it takes part when {_turned_on(run, name)}"
                        for name in inert_here)
        message = "plugin states do not match this run: " + "; ".join(problems)
        if strict:
            raise StateMismatch(message, missing, extra)
        warnings.warn(message + "; restoring the rest", HookfitWarning, stacklevel=user_level())
    for name in loaders:
        if states.get(name) is not None:
            hooks.call_plugin("load_state", name, run, states[name])
