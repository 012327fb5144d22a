"""The module the user wrote, inside the wrappers a run may put around it: data-parallel
(``DistributedDataParallel``, ``DataParallel``) and ``torch.compile``, the state dict of a
compiled module with the plain module's keys, and the names of a model's parameters (a few of them, as a
message names them: :func:`few_parameters`). Also importable from :mod:`hookfit.plugins.support`."""

from __future__ import annotations

import collections
import sys
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch

__all__ = ["COMPILED_PREFIX", "few_parameters", "parameter_names", "unwrap_model", "unwrap_state_dict"]

COMPILED_PREFIX = "_orig_mod."
"""What ``torch.compile``'s wrapper puts before every key of the module's ``state_dict()``."""


def _compiled(module: Any) -> bool:
    """Whether ``module`` is ``torch.compile``'s wrapper (an ``OptimizedModule``: nothing was
    compiled in a process that never imported ``torch._dynamo``)."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    return dynamo is not None and isinstance(module, dynamo.OptimizedModule)


def unwrap_model(model: torch.nn.Module, *, compiled: bool = True) -> torch.nn.Module:
    """The user's module inside ``model``: through ``DistributedDataParallel`` and
    ``DataParallel`` (``.module``) and, unless ``compiled=False``, ``torch.compile``
    (``._orig_mod``), as deeply as they are nested (a compiled DDP, a DDP of a compiled module).
    A module that is no wrapper comes back as it is. Its parameters are the wrapper's, so what
    is loaded into it is loaded into the model the step calls.

    ``compiled=False`` stops at a compiled module: what a data-parallel wrapper was given (the
    distributed plugin gives the run its model back so)."""
    parallel = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    while True:
        if isinstance(model, parallel):
            model = cast(torch.nn.Module, model.module)
        elif compiled and _compiled(model):
            model = cast(torch.nn.Module, model._orig_mod)
        else:
            return model


def unwrap_state_dict(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state`` (a module's state dict) with ``torch.compile``'s ``_orig_mod.`` taken off its
    keys (and its ``_metadata``'s) where every key has it: the state of a compiled module, as
    :func:`unwrap_model`'s module takes it. Any other state comes back as it is."""
    prefix = COMPILED_PREFIX
    while state and all(isinstance(key, str) and key.startswith(prefix) for key in state):
        out: Any = collections.OrderedDict((key[len(prefix):], value) for key, value in state.items())
        metadata = getattr(state, "_metadata", None)
        if metadata is not None:  # per-module versions, keyed by module path ("" for the root)
            root = prefix[:-1]
            out._metadata = collections.OrderedDict(
                (key[len(prefix):] if key.startswith(prefix) else "", value)
                for key, value in metadata.items() if key == root or key.startswith(prefix))
        state = out
    return state


def parameter_names(model: Any, prefix: str = "", out: dict[int, str] | None = None) -> dict[int, str]:
    """``id(parameter)`` -> its first name in the run's model (``"g.0.weight"`` in a dict of models)."""
    out = {} if out is None else out
    if isinstance(model, torch.nn.Module):
        for name, parameter in unwrap_model(model).named_parameters():
            out.setdefault(id(parameter), prefix + name)
    elif isinstance(model, (Mapping, list, tuple)):
        for key, value in model.items() if isinstance(model, Mapping) else enumerate(model):
            parameter_names(value, f"{prefix}{key}.", out)
    return out


def few_parameters(params: Sequence[torch.Tensor], names: Mapping[int, str], shown: int = 4) -> str:
    """A few of ``params`` as a message names them: by ``names`` (:func:`parameter_names`), by shape where the
    model does not hold them, then how many more: ``net.0.weight, a tensor of shape (3,), and 2 more``."""
    parts = [names.get(id(p), f"a tensor of shape {tuple(p.shape)}") for p in params[:shown]]
    return ", ".join(parts + ([f"and {len(params) - shown} more"] if len(params) > shown else []))
