"""checkpoint state: what a checkpoint holds (:func:`payload`): the run's and the plugins'
states and the model's state dict, and how the model's is restored."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hookfit.plugins.checkpoint import ranks
from hookfit.plugins.checkpoint.storage import FORMAT, FORMAT_VERSION, CheckpointError
from hookfit.plugins.support import unwrap_model, unwrap_state_dict

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run


SWITCHED_OFF = "switched_off"
"""The entry of a checkpoint's ``meta`` naming the observers switched off (``loop.state.silenced``)
before it was written: their states are not in it. A checkpoint without it names none."""


def payload(loop: Run, *, reason: str, metric: float | None, monitor: str | None) -> dict[str, Any]:
    """Everything a checkpoint holds, as plain data and tensors (the ``digest`` is added when
    it is written): the run's own state (``loop.state_dict()``: ``loop``, ``rng`` and ``data``),
    every process's own random state in a run of several (:mod:`hookfit.plugins.checkpoint.ranks`:
    a collective), the model's, every plugin's (but an observer's switched off, which
    :data:`SWITCHED_OFF` names) and what the checkpoint notes about the file, the number of processes
    that wrote it (:data:`~hookfit.plugins.checkpoint.ranks.WRITERS`) and the identity and name of the run that
    wrote it (``loop.identity.key``, ``loop.name``: ``resume="latest"`` in a folder of several runs takes its own,
    :func:`~hookfit.plugins.checkpoint.resuming.latest`) among it.
    Its tensors are the run's own, not copies."""
    run = loop.state_dict()
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        **run,
        **({ranks.KEY: own} if (own := ranks.gather(loop, run)) is not None else {}),
        "model": model_state(loop.model),
        "plugins": {k: v for k, v in loop.plugin_states().items() if v is not None},
        "meta": {"reason": reason, "time": time.time(), "metric": metric, "monitor": monitor,
                 "identity": loop.identity.key, "name": loop.name,
                 "status": loop.state.status, SWITCHED_OFF: [s.plugin for s in loop.state.silenced],
                 ranks.WRITERS: loop.state.world_size},
    }


def model_state(model: Any) -> Any:
    """The state of ``Loop(model=...)``: of the module the user wrote (inside
    ``DistributedDataParallel``/``DataParallel`` and ``torch.compile``), so its keys are the
    plain module's and a checkpoint loads into a compiled or a plain model alike."""
    if model is None:
        return None
    if isinstance(model, torch.nn.Module):
        return unwrap_model(model).state_dict()
    if isinstance(model, Mapping):
        return {k: model_state(v) for k, v in model.items()}
    return [model_state(v) for v in model]


def load_model(model: Any, state: Any, path: Path) -> None:
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
            load_model(module, state[key], path)
    else:
        if not isinstance(state, (list, tuple)) or len(state) != len(model):
            raise CheckpointError(f"checkpoint: {path} holds {_held(state)}, this run {len(model)} models")
        for module, sub in zip(model, state, strict=True):
            load_model(module, sub, path)


def _held(state: Any) -> str:
    """What a checkpoint's model entry holds, in words: ``3 models``, ``the entries 'a', 'b'``, ``no model``."""
    if state is None:
        return "no model"
    if isinstance(state, (list, tuple)):
        return f"{len(state)} model{'' if len(state) == 1 else 's'}"
    if isinstance(state, Mapping):
        keys = sorted(map(str, state))
        return f"the entries {', '.join(map(repr, keys[:3]))}{' ...' if len(keys) > 3 else ''}"
    return f"a {type(state).__name__}"


def model_mismatch(model: Any, state: Any) -> str | None:
    """How the model state a checkpoint holds differs from ``model``'s by the keys of each module (``None``: the
    same keys), walked along ``model`` as :func:`load_model` loads it (a sharded state's entries are its keys too)."""
    if model is None or state is None:
        return None if model is None and state is None else f"the checkpoint holds {_held(state)}, this run " + (
            "no model" if model is None else "a model")
    if isinstance(model, torch.nn.Module):
        if not isinstance(state, Mapping):
            return f"the checkpoint holds {_held(state)}, this run one model"
        here, saved = set(unwrap_model(model).state_dict()), set(unwrap_state_dict(state))
        missing, unexpected = sorted(here - saved), sorted(saved - here)
        return "; ".join(f"{what} {', '.join(map(repr, keys[:3]))}{' ...' if len(keys) > 3 else ''}"
                         for what, keys in (("this run's model has", missing), ("the checkpoint has", unexpected))
                         if keys) or None
    if isinstance(model, Mapping):
        if not isinstance(state, Mapping) or set(model) != set(state):
            return f"the checkpoint holds {_held(state)}, this run the models {', '.join(map(repr, sorted(model)))}"
        return next((f"{key!r}: {why}" for key in model if (why := model_mismatch(model[key], state[key]))), None)
    if not isinstance(state, (list, tuple)) or len(state) != len(model):
        return f"the checkpoint holds {_held(state)}, this run {len(model)} models"
    return next((f"[{i}]: {why}" for i, (m, st) in enumerate(zip(model, state)) if (why := model_mismatch(m, st))), None)
