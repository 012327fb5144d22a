"""The batch size the metrics plugin weighs a batch by when the step's output gives none, and what it says of a
batch for which that size is ambiguous: tensors that disagree on their first dimension, as a sequence batch in
PyTorch's default RNN layout ``(T, B, F)`` beside its targets ``(B,)``, or flat ids beside per-row offsets."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from hookfit.errors import HookfitWarning, user_level
from hookfit.stopping import qualname

Tensor = torch.Tensor  # (a module global: the per-batch type tests read it without an attribute lookup)


class MetricsWarning(HookfitWarning):
    """A batch size the metrics plugin infers from a batch that holds other first dimensions than the one it takes."""


def batch_size(batch: Any) -> int:
    """The first dimension of the batch's first tensor; 1 when there is none."""
    kind = type(batch)
    if (kind is tuple or kind is list) and batch and type(first := batch[0]) is Tensor:
        shape = first.shape  # the common (inputs, targets) case, without the generic walk
        return shape[0] if shape else 1
    if isinstance(batch, (list, tuple)):
        batch = next((item for item in batch if isinstance(item, Tensor)), None)
    elif isinstance(batch, Mapping):
        batch = next((item for item in batch.values() if isinstance(item, Tensor)), None)
    if isinstance(batch, Tensor):
        shape = batch.shape
        return shape[0] if shape else 1
    return 1


def items(batch: Any) -> list[tuple[str, Any]]:
    """The batch's items one level in, each with where it is as an expression on ``batch``: ``[0]`` in a tuple or a
    list, ``['ids']`` in a mapping, ``.x`` in a named tuple or a dataclass; none for anything else (a tensor)."""
    if isinstance(batch, Mapping):
        return [(f"[{key!r}]", value) for key, value in batch.items()]
    if isinstance(batch, tuple) and isinstance(names := getattr(batch, "_fields", None), tuple):  # a named tuple
        return [(f".{name}", value) for name, value in zip(names, batch)]
    if isinstance(batch, (list, tuple)):
        return [(f"[{index}]", value) for index, value in enumerate(batch)]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return [(f".{field.name}", getattr(batch, field.name, None)) for field in dataclasses.fields(batch)]
    return []


def _size(value: Any) -> tuple[int, str] | None:
    """The first dimension ``value`` shows, and what to call it: a tensor's (not a 0-d one's, which has none), or the
    length of a list or tuple of text (what a DataLoader's collation makes of a sample's string, one a sample)."""
    if isinstance(value, Tensor):
        return (value.shape[0], "") if value.dim() else None
    if (isinstance(value, (list, tuple)) and not hasattr(value, "_fields") and value
            and all(isinstance(item, (str, bytes)) for item in value)):
        return len(value), f" (a {type(value).__name__} of {type(value[0]).__name__})"
    return None


SHOWN = 6
"""Places named for each other first dimension, and other first dimensions named, at most."""


def ambiguous(batch: Any, step: object, scope: str) -> str | None:
    """What to say of ``batch``, whose batch size :func:`batch_size` infers for the step function ``step`` (its
    output gives no ``batch_size``) in ``scope`` (``"the train stage"``, ``"the validation set 'noisy'"``), when
    the batch shows another first dimension than the one taken: a tensor's, or a list of text's, one level into the
    batch (a tuple, a list, a mapping, a named tuple: where the inference looks; a dataclass's fields, where it does
    not, taking 1); ``None`` when every one agrees with it (a last, smaller batch too) or the batch holds no items
    (a tensor, a number). A 0-d tensor has no first dimension: one taken gives 1, one elsewhere is not looked at.
    Reads no tensor's values."""
    found = items(batch)
    if isinstance(batch, Tensor) or not found:
        return None
    n = batch_size(batch)
    first = None if dataclasses.is_dataclass(batch) else next(
        (where for where, value in found if isinstance(value, Tensor)), None)
    others: dict[int, list[tuple[str, str]]] = {}  # by size: where, and what (a tensor: nothing said)
    for where, value in found:
        if where != first and (seen := _size(value)) is not None and seen[0] != n:
            others.setdefault(seen[0], []).append((where, seen[1]))
    if not others:
        return None
    if first is None:
        source = f"1, as the inference finds no tensor in the batch (a {type(batch).__name__}) where it looks"
    elif not dict(found)[first].dim():
        source = f"1, as the batch's first tensor, at {first}, is 0-dimensional"
    else:
        source = f"{n}, the first dimension of the batch's first tensor, at {first}"
    shown = [f"{size} at {', '.join(where + what for where, what in places[:SHOWN])}"
             f"{' and more' if len(places) > SHOWN else ''}" for size, places in list(others.items())[:SHOWN]]
    fix = next(iter(others.values()))[0][0]
    return (f"metrics: step function {qualname(step)!r} returns no 'batch_size', so {scope} weighs each of its "
            f"batches by the batch size inferred from the batch: {source}; but the batch shows other first "
            f"dimensions: {'; '.join(shown)}{'; and more' if len(others) > SHOWN else ''}. The means, samples and "
            f"samples_per_s count what the size taken counts; if the batch holds another number of samples, return "
            f"it: {{'loss': loss, 'batch_size': len(batch{fix})}} (README.md, 'A first script')")


def warn_ambiguous(batch: Any, step: object, stage: str | None, val_set: str | None,
                   said: set[tuple[object, str | None]]) -> None:
    """Warn of ``batch``, the first of ``stage`` (of the validation set ``val_set``, with several), when
    :func:`ambiguous` has something to say of it: one :class:`MetricsWarning` a step function and stage (``said``:
    those warned of), pointing at the script's line."""
    if (step, stage) in said:
        return
    scope = f"the validation set {val_set!r}" if val_set is not None else f"the {stage} stage"
    if (text := ambiguous(batch, step, scope)) is not None:
        said.add((step, stage))
        warnings.warn(text, MetricsWarning, stacklevel=user_level())
