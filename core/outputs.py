"""What a step function returns, as the loop passes it on: ``None`` (the batch is skipped), a
mapping with string keys (passed on as it is) or a tensor (``{"loss": tensor}``); anything else is a
``TypeError`` naming the step function and what it returned. The loop turns a tensor into a
mapping itself (the common case, one type test); these are the rest."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from hookfit.errors import HookfitWarning, user_level
from hookfit.stopping import qualname

if TYPE_CHECKING:  # pragma: no cover
    from hookfit.run import Step

__all__ = ["as_mapping", "check_output"]


def check_output(output: Mapping[str, Any], step: Step) -> bool:
    """The first output of a stage: every key must be a string (outputs are read by name); a ``loss`` of
    several numbers (``reduction="none"``) is warned of, as nothing reads it as the loss."""
    for key in output:
        if not isinstance(key, str):
            raise TypeError(
                f"step function {qualname(step)!r} returned a mapping with the key {key!r} "
                f"({type(key).__name__}); keys must be strings, the names of what it reports")
    loss = output.get("loss")
    if isinstance(loss, torch.Tensor) and loss.numel() != 1:
        warnings.warn(f"step function {qualname(step)!r} returned a loss of {loss.numel()} numbers (shape "
                      f"{list(loss.shape)}), not one: no metric reports it and loop.backward takes one number; "
                      f"reduce it (loss.mean()), or return it under another key", HookfitWarning,
                      stacklevel=user_level())
    return True


def as_mapping(output: Any, step: Step) -> Mapping[str, Any]:
    if isinstance(output, Mapping):
        return output
    number = isinstance(output, (int, float)) and not isinstance(output, bool)
    raise TypeError(f"step function {qualname(step)!r} returned {type(output).__name__}; a step must "
                    f"return None, a mapping or a tensor" + (
                        " (return the loss tensor itself, not loss.item(): optim steps on it; a number to "
                        "report goes in a mapping, {'loss': value})" if number else ""))
