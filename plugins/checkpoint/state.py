"""checkpoint state: what a checkpoint holds beyond the run's and the plugins' states (the
model's state dict) and how it is copied and restored."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hookfit.plugins.checkpoint.storage import CheckpointError
from hookfit.plugins.support import unwrap_model, unwrap_state_dict


def _snapshot(obj: Any) -> Any:
    """A copy in which every tensor is cloned: later training cannot change it."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_snapshot(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_snapshot(v) for v in obj)
    return obj


def _model_state(model: Any) -> Any:
    """The state of ``Loop(model=...)``: of the module the user wrote (inside
    ``DistributedDataParallel``/``DataParallel`` and ``torch.compile``), so its keys are the
    plain module's and a checkpoint loads into a compiled or a plain model alike."""
    if model is None:
        return None
    if isinstance(model, torch.nn.Module):
        return unwrap_model(model).state_dict()
    if isinstance(model, Mapping):
        return {k: _model_state(v) for k, v in model.items()}
    return [_model_state(v) for v in model]


def _load_model(model: Any, state: Any, path: Path) -> None:
    if model is None or state is None:
        if (model is None) != (state is None):
            raise CheckpointError(f"checkpoint: {path} {'has' if state is not None else 'lacks'} a model, this run {'lacks' if model is None else 'has'} one")
        return
    if isinstance(model, torch.nn.Module):
        try:  # (a checkpoint written from a compiled module before: its keys had "_orig_mod.")
            unwrap_model(model).load_state_dict(unwrap_state_dict(state) if isinstance(state, Mapping) else state)
        except RuntimeError as error:
            raise CheckpointError(f"checkpoint: the model in {path} does not fit this run's model: {error}") from error
    elif isinstance(model, Mapping):
        if set(model) != set(state):
            raise CheckpointError(f"checkpoint: {path} has models {sorted(state)}, this run {sorted(model)}")
        for key, module in model.items():
            _load_model(module, state[key], path)
    else:
        for module, sub in zip(model, state, strict=True):
            _load_model(module, sub, path)
