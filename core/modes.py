"""Train and eval mode: the model's root modules, every module in eval mode for a validation
with its own flag back afterwards (a frozen BatchNorm stays frozen), the grad mode of a
validation, and the warning for a model left in eval mode as training starts."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from hookfit.errors import HookfitWarning, user_level

__all__ = ["eval_modes", "grad_mode", "modules", "warn_eval_mode"]


def modules(model: Any) -> list[torch.nn.Module]:
    """The root modules of ``Loop(model=...)``: a module, or those in a mapping or a list."""
    if model is None:
        return []
    if isinstance(model, torch.nn.Module):
        return [model]
    if isinstance(model, Mapping):
        return [m for v in model.values() for m in modules(v)]
    if isinstance(model, (list, tuple)):
        return [m for v in model for m in modules(v)]
    raise TypeError(
        f"model must be a torch.nn.Module, a mapping or a list of modules, "
        f"not {type(model).__name__}"
    )


def grad_mode(kind: str) -> contextlib.AbstractContextManager[Any]:
    """``torch.inference_mode()`` for ``"inference"``, else ``torch.no_grad()``."""
    return torch.inference_mode() if kind == "inference" else torch.no_grad()


@contextlib.contextmanager
def eval_modes(model: Any) -> Iterator[None]:
    """Every module of ``model`` in eval mode; each module's own training flag back
    afterwards, whatever happened."""
    roots = modules(model)
    flags = [(m, m.training) for root in roots for m in root.modules()]
    try:
        for root in roots:
            root.eval()
        yield
    finally:
        for module, flag in flags:
            module.training = flag


def warn_eval_mode(model: Any) -> None:
    """A model left in eval mode would train with dropout off and frozen batch norm: one
    :class:`HookfitWarning` names the modules. A module with no parameter that requires grad
    (a frozen teacher, ``.eval().requires_grad_(False)``, given beside the student in
    ``Loop(model={...})``) is in eval mode on purpose and is not named."""
    if isinstance(model, Mapping):
        roots = [(f"model[{key!r}]", m) for key, value in model.items() for m in modules(value)]
    elif isinstance(model, (list, tuple)):
        roots = [(f"model[{index}]", m) for index, value in enumerate(model) for m in modules(value)]
    else:
        roots = [("the model", m) for m in modules(model)]
    evaluating = [f"{where} ({type(m).__name__})" for where, m in roots
                  if not m.training and any(p.requires_grad for p in m.parameters())]
    if evaluating:
        warnings.warn(
            f"{', '.join(evaluating)} {'is' if len(evaluating) == 1 else 'are'} in eval mode "
            f"as training starts: dropout and batch norm will behave as in evaluation. Call "
            f".train() before fit() (validation sets eval mode itself and restores every "
            f"module's own mode); for a module kept in eval mode on purpose, filter this "
            f"HookfitWarning",
            HookfitWarning,
            stacklevel=user_level(),
        )
