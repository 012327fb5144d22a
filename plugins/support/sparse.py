"""Sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``, stepped by ``SparseAdam`` or
``SGD``): gradients checked for non-finite values by their coalesced values, as a plain script checks them
(:func:`nonfinite_flag`), and the parameters that get sparse gradients, which torch's ``clip_grad_norm_`` and
``clip_grad_value_`` refuse (:func:`refuse_clip`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from hookfit.errors import UsageError
from hookfit.modes import modules

__all__ = ["SparseClipError", "nonfinite_flag", "refuse_clip", "sparse_parameters"]


def nonfinite_flag(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """True (a 0-dim bool tensor on ``device``) where any of ``grads`` has a value that is not finite: a sparse
    gradient by ``torch.isfinite(grad.coalesce().values())``, duplicates summed first, as a plain script's check."""
    return torch.stack([torch.isfinite(g.coalesce().values() if g.is_sparse else g).all().to(device)
                        for g in grads]).all().logical_not_()


def sparse_parameters(model: Any) -> list[torch.Tensor]:
    """The weights of the embeddings in ``model`` (a module, or a dict or list of them) built with ``sparse=True``."""
    return [m.weight for root in modules(model) for m in root.modules()
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse]


class SparseClipError(UsageError, ValueError):
    """A clip asked of an optimizer whose parameters get sparse gradients, which torch's clips do not take."""


def refuse_clip(plugin: str, option: str, optimizer: str, stepped: torch.optim.Optimizer,
                params: Iterable[torch.Tensor], sparse: Iterable[torch.Tensor], names: Mapping[int, str],
                others: Sequence[str], value: Any) -> None:
    """Raise :class:`SparseClipError` when one of ``params`` (those the ``option`` clips, of optimizer ``optimizer``)
    is in ``sparse`` (sparse gradients: :func:`sparse_parameters`, or a step's), naming it and what to do
    (``others``: the run's optimizers, clipped by name; ``value``: the clip asked)."""
    ids = {id(p) for p in sparse}
    if (hit := next((p for p in params if id(p) in ids), None)) is None:
        return
    kind = f"{type(stepped).__module__}.{type(stepped).__qualname__}"
    rest = [n for n in others if n != optimizer]
    fix = (f"clip only the others by name: {plugin.capitalize()}({option}={ {n: value for n in rest} !r})" if rest
           else "clip none (give no " + option + ")")
    raise SparseClipError(
        f"{plugin}: {option} cannot clip optimizer {optimizer!r} ({kind}): its parameter "
        f"{names.get(id(hit), f'of shape {tuple(hit.shape)}')!r} gets sparse gradients (an embedding built with "
        f"sparse=True), which torch's clip_grad_norm_ and clip_grad_value_ refuse; {fix}, or build the embedding "
        f"with sparse=False to clip it")
