"""Step functions, ``step(loop, batch)``: what :class:`hookfit.Loop` accepts as its ``train_step`` and
``val_step`` and ``predict()`` as its ``step``, checked when they are given, not at the first batch."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from hookfit.stopping import brief, qualname

__all__ = ["check_step"]


def check_step(what: str, step: Any) -> None:
    """Refuse, naming it, a step function that cannot be called as ``step(loop, batch)``: not
    callable; a model, the data or an optimizer (Lightning's ``trainer.fit(model, data)``), saying where
    it goes; or a signature that does not take two positional arguments (``def step(batch)``)."""
    if (instead := _not_a_step(what, step)) or not callable(step):
        raise TypeError(f"{what} must be a function step(loop, batch), got "
                        f"{instead or f'{type(step).__name__} {brief(step)}'}")
    try:  # the function's signature, and a decorator's own (functools.wraps points at the inner one)
        signatures = [inspect.signature(step), inspect.signature(step, follow_wrapped=False)]
    except (TypeError, ValueError):  # a builtin or an extension's callable: nothing to check
        return
    if not any(_binds(signature) for signature in signatures):
        raise TypeError(f"{what} {qualname(step)!r} is called as step(loop, batch), and its signature "
                        f"{signatures[0]} does not take those two arguments")
    names = list(signatures[0].parameters)[:2]
    if names == ["batch", "batch_idx"]:  # a Lightning step would get the run as its batch
        raise TypeError(f"{what} {qualname(step)!r} is called as step(loop, batch), and its signature "
                        f"{signatures[0]} takes (batch, batch_idx), as a LightningModule's does: write "
                        f"(loop, batch) and read the batch's index as loop.state.batch_idx")
    if names == ["batch", "loop"]:  # swapped: the batch would be the run (failing deep inside, or not at all)
        raise TypeError(f"{what} {qualname(step)!r} is called as step(loop, batch), and its signature "
                        f"{signatures[0]} names them the other way round: write (loop, batch)")


def _not_a_step(what: str, value: Any) -> str | None:
    """A model, the data or an optimizer given as the step function ``what``, and where it goes."""
    if isinstance(value, torch.nn.Module) and _forward_takes_loop_and_batch(value):
        return None  # a module written as the step: forward(self, loop, batch), under any names
    call = {"val_step": "Loop(..., val_step=val_step, val_data=val_data{})",
            "predict()'s step": "Loop(...{}).predict(data, step)"}.get(what, "Loop(train_step, train_data{})")
    for kind, name, given in ((torch.nn.Module, "the model", ", model=model"), ((DataLoader, Dataset), "the data", ""),
                              (torch.optim.Optimizer, "an optimizer", ", model=model, optimizers=optimizer")):
        if isinstance(value, kind):
            return f"{name} {type(value).__name__}, which goes in {call.format(given)}"
    return None


def _binds(signature: inspect.Signature) -> bool:
    try:
        signature.bind(None, None)
    except TypeError:
        return False
    return True


def _forward_takes_loop_and_batch(module: torch.nn.Module) -> bool:
    """Whether ``module``'s own ``forward`` takes two positional arguments, as a step does: its signature
    as written (a decorator's ``functools.wraps`` points at it), not a generic wrapper's ``(*args, **kwargs)``,
    which any model's would bind; a module without a ``forward`` of its own is not a step."""
    if type(module).forward is torch.nn.Module.forward:
        return False
    try:
        return _binds(inspect.signature(module.forward))
    except (TypeError, ValueError):  # a builtin or an extension's forward: nothing to check
        return True
