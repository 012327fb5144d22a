"""Train and eval mode: the model's root modules, every module in eval mode for a validation
with its own flag back afterwards (a frozen BatchNorm stays frozen), the grad mode of a
validation, no optimizer step and no backward pass in one, and the warning for a model left in
eval mode as training starts."""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hookfit.errors import HookfitWarning, UsageError, user_level

__all__ = ["eval_modes", "grad_mode", "modules", "trains_nothing", "warn_eval_mode"]


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


class StepInValidation(UsageError, RuntimeError):
    """An optimizer stepped during a validation, which trains nothing."""


@contextlib.contextmanager
def trains_nothing() -> Iterator[None]:
    """A validation trains nothing: an optimizer step on this thread inside it with autograd off
    (``loop.optimizers.step()`` or an optimizer's own ``step()`` in a ``val_step`` copied from the
    training step; not one under ``torch.enable_grad()``, test-time adaptation) raises
    :class:`StepInValidation` before any parameter changes, and the error of a backward pass, which
    the validation's grad mode refuses, says why. (Both cost nothing a batch: a hook torch calls only
    on a step, and the ``except`` of a ``try`` around the stage.)"""
    thread = threading.get_ident()

    def refuse(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if threading.get_ident() == thread and not torch.is_grad_enabled():  # (enable_grad(): adapting on purpose)
            raise StepInValidation(
                f"an optimizer ({type(optimizer).__name__}) stepped during a validation, which trains nothing: the "
                f"step would change the parameters with the gradients training left. Step the optimizers in the "
                f"training step only (loop.backward, loop.optimizers.step() and zero_grad() belong there)")

    handle = register_optimizer_step_pre_hook(refuse)
    try:
        yield
    except RuntimeError as error:
        if "does not require grad" in str(error):  # torch's words for a backward pass through no graph
            error.add_note("hookfit: a validation runs without autograd (torch.inference_mode(), or no_grad with "
                           "Loop(val_grad_mode='no_grad')) and trains nothing: a val_step computes and returns its "
                           "outputs; the backward pass (loop.backward(loss), loss.backward()) belongs in the training "
                           "step")
        raise
    finally:
        handle.remove()


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
