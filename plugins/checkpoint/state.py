"""checkpoint state: what a checkpoint holds beyond the plugins' states (the model's state
dict, the random number generators) and how it is copied and restored."""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hookfit.plugins.checkpoint.storage import CheckpointError


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


def _unwrap(module: Any) -> Any:
    """The user's module inside a (Distributed)DataParallel wrapper."""
    parallel = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    return module.module if isinstance(module, parallel) else module


def _model_state(model: Any) -> Any:
    if model is None:
        return None
    if isinstance(model, torch.nn.Module):
        return _unwrap(model).state_dict()
    if isinstance(model, Mapping):
        return {k: _model_state(v) for k, v in model.items()}
    return [_model_state(v) for v in model]


def _load_model(model: Any, state: Any, path: Path) -> None:
    if model is None or state is None:
        if (model is None) != (state is None):
            raise CheckpointError(f"checkpoint: {path} {'has' if state is not None else 'lacks'} a model, this run {'lacks' if model is None else 'has'} one")
        return
    if isinstance(model, torch.nn.Module):
        try:
            _unwrap(model).load_state_dict(state)
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


def _rng_state() -> dict[str, Any]:
    version, keys, gauss = random.getstate()
    out: dict[str, Any] = {"python": [version, list(keys), gauss], "torch": torch.get_rng_state()}
    try:
        import numpy
    except ImportError:
        numpy = None  # type: ignore[assignment]
    if numpy is not None:
        name, keys_np, pos, has_gauss, cached = numpy.random.get_state()
        out["numpy"] = [name, torch.from_numpy(keys_np.astype("int64")), pos, has_gauss, cached]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _set_rng_state(state: Mapping[str, Any]) -> None:
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy

        name, keys_np, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((name, keys_np.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
