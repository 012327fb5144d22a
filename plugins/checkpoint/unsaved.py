"""checkpoint's watch on the modules a step function changes that no checkpoint holds: an EMA teacher
(BYOL, DINO, MoCo) or a module in train mode whose batch-norm statistics move, kept as a variable the
step reads from its closure or its globals (:mod:`~hookfit.plugins.support.referenced`) rather than
given to ``Loop(model=...)``. A checkpoint holds the run's model, optimizers and plugins; such a
module's changes are in none, so a resumed run starts it again as it was built and is not the run it
continues. At ``fit_start`` each such module's parameters and buffers that neither the run's model nor
a plugin that saves its state holds are fingerprinted (their values' bits, hashed and summed: an in-place
update and one through ``.data`` alike, which torch's version counters do not see); at the run's first save they are fingerprinted
again, and a module whose tensors changed is warned of (:class:`CheckpointWarning`), once, naming the
step function, the variable and where it is read. A module that did not change (a frozen perceptual
network, a frozen teacher in eval mode, an embedding read from a global) is never warned of. No
per-batch cost: two fingerprints a run, main process only, of the tensors on the CPU or a CUDA device."""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from hookfit.errors import user_level
from hookfit.plugins.checkpoint.storage import CheckpointWarning
from hookfit.plugins.support.models import unwrap_model
from hookfit.plugins.support.referenced import Referenced, held_modules, referenced_modules
from hookfit.stopping import qualname

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

__all__ = ["Unsaved"]

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer type each element size's bits are read as."""
_WHERE = {"closure": "from its closure", "global": "as a global", "self": "from its instance",
          "argument": "as an argument of its functools.partial"}


class _Watched:
    """One module a step reads: its tensors the run's model does not hold, by name, and their fingerprints."""

    def __init__(self, step: str, function: Any, referenced: Referenced, tensors: dict[str, torch.Tensor]) -> None:
        self.step, self.function, self.referenced, self.tensors = step, function, referenced, tensors
        self.before = _fingerprints(tensors)

    def changed(self) -> list[str]:
        """The names of the tensors whose values changed since the fingerprint at ``fit_start``."""
        after = _fingerprints(self.tensors)
        return [name for name in self.tensors if not torch.equal(self.before[name], after[name])]


class Unsaved:
    """The modules a run's step functions change outside the checkpoints, warned of at the first save."""

    def __init__(self) -> None:
        self._watched: list[_Watched] = []

    def start(self, loop: Run) -> None:
        """Fingerprint the modules the step functions read that the run's model does not hold (``fit_start``)."""
        self._watched = []
        if loop.mode != "fit" or not loop.is_main or loop.model is None:
            return
        plugins = tuple(plugin for _, plugin in loop.pm.list_name_plugin())
        held = _held([loop.model, *(module for plugin in plugins if callable(getattr(plugin, "save_state", None))
                                    for module in held_modules(plugin))])  # (a plugin's state is saved)
        for step, function in (("train_step", loop.config.train_step), ("val_step", loop.config.val_step)):
            if function is None:
                continue
            for referenced in referenced_modules(function, skip=plugins):
                taken = {id(watched.referenced.module) for watched in self._watched}
                if id(referenced.module) in held or id(referenced.module) in taken:
                    continue
                tensors = {name: tensor for name, tensor in _named_tensors(referenced.module)
                           if id(tensor) not in held and _hashable(tensor)}
                held.update(id(tensor) for tensor in tensors.values())  # (a module read under two names: once)
                if tensors:
                    self._watched.append(_Watched(step, function, referenced, tensors))

    def check(self) -> None:
        """At a save: warn of each watched module the run changed; the first save only."""
        watched, self._watched = self._watched, []
        for one in watched:
            if changed := one.changed():
                _warn(one, changed)


def _warn(watched: _Watched, changed: list[str]) -> None:
    referenced = watched.referenced
    name = referenced.name
    key = next((word for word in reversed(re.findall(r"[A-Za-z_]\w*", name)) if word != "self"), "module").lower()
    by = "" if referenced.reader == qualname(watched.function) else f" (in its helper {referenced.reader!r})"
    shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
    warnings.warn(
        f"checkpoint: {watched.step} {qualname(watched.function)!r} reads the module {name!r} "
        f"{_WHERE[referenced.where]}{by}, which is not in the run's model, and the run changed its parameters or "
        f"buffers ({shown}: an in-place update such as an EMA teacher's, or batch-norm statistics in train mode): "
        f"those changes are in no checkpoint, so a run resumed from one starts {name!r} again as it was built "
        f"and does not continue this run exactly; give it to the run with the model, Loop(model={{..., {key!r}: "
        f"{name}}}), and read it in the step as loop.model[{key!r}]", CheckpointWarning, stacklevel=user_level())


def _held(models: list[Any]) -> set[int]:
    """The ids of the modules and tensors of ``models`` (the run's model, a dict of models, modules)."""
    ids: set[int] = set()
    for model in models:
        for module in (model.values() if isinstance(model, Mapping) else [model]):
            if isinstance(module, torch.nn.Module):
                for inner in {id(module): module, id(plain := unwrap_model(module)): plain}.values():
                    ids.update(id(m) for m in inner.modules())
                    ids.update(id(tensor) for _, tensor in _named_tensors(inner))
    return ids


def _named_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(), *module.named_buffers()]


def _hashable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a plain tensor whose values can be fingerprinted here: on the CPU or a CUDA device
    (:func:`torch.hash_tensor`'s), not a sharded or quantized one."""
    return (type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.numel() > 0
            and tensor.device.type in ("cpu", "cuda") and not tensor.is_quantized)


def _fingerprints(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor's fingerprint (on its device: read at the comparison only): :func:`torch.hash_tensor` (the
    exclusive or of its values' bits, which an even count of equal values cancels) beside the sum of the values'
    bits read as integers (which a change of values all alike moves)."""
    with torch.no_grad():
        return {name: torch.stack([torch.hash_tensor(t).view(torch.int64), _bits_sum(t)])
                for name, t in ((name, torch.view_as_real(t) if t.is_complex() else t) for name, t in tensors.items())}


_CHUNK = 1 << 22
"""The most elements summed at once: a sum to int64 widens its input, 8 bytes an element, so a slice at a time
bounds that to 32 MiB whatever the tensor's size."""


def _bits_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor``'s values' bits read as integers, as an int64 (wrapping), summed a slice at a time
    (a non-contiguous tensor is first copied contiguous, at its own element size)."""
    flat = tensor.view(_BITS[tensor.element_size()]).reshape(-1)
    total = torch.zeros((), dtype=torch.int64, device=tensor.device)
    for start in range(0, flat.numel(), _CHUNK):
        total += flat[start:start + _CHUNK].sum(dtype=torch.int64)
    return total
