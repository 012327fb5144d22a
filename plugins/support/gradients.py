"""Gradients watched for a while, without a cost left behind once the watch ends
(:class:`GradientWatch`; also importable from :mod:`hookfit.plugins.support`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["GradientWatch"]


class GradientWatch:
    """Calls ``arrived(...)`` whenever a gradient for one of ``params`` (leaf tensors that
    require one) is computed, until :meth:`remove`. A plain tensor or ``Parameter`` gets a
    tensor hook (``register_hook``: ``arrived`` is given the gradient, and its return value, to
    be ``None``, is ignored). A tensor subclass (a DTensor that FSDP2 shards, whose gradient FSDP2
    sets after its reduce-scatter and then runs the post-accumulate-grad hooks of) gets a
    post-accumulate-grad hook (``arrived`` is given the tensor).

    :meth:`remove` leaves nothing behind on a plain tensor: torch keeps a tensor's hook
    dictionary attached to its autograd metadata once made, and a ``RemovableHandle`` only
    empties it, so every later backward pass would still take the GIL and walk an empty
    dictionary for each parameter (measured at about 1 µs a parameter, a pass, on a CPU). A
    dictionary this watch made is dropped when nothing else was put in it, which drops torch's
    hook with it. (Torch has no such way for post-accumulate-grad hooks; autograd never
    accumulates into a sharded DTensor, so those cost nothing once removed.)"""

    def __init__(self, params: Iterable[torch.Tensor], arrived: Callable[[torch.Tensor], None]) -> None:
        self._handles: list[Any] = []
        self._made: list[torch.Tensor] = []  # plain tensors whose hook dictionary this watch made
        for param in params:
            if type(param) is torch.Tensor or type(param) is torch.nn.Parameter:
                if param._backward_hooks is None:
                    self._made.append(param)
                self._handles.append(param.register_hook(arrived))  # type: ignore[no-untyped-call]  # unannotated in torch
            else:
                self._handles.append(param.register_post_accumulate_grad_hook(arrived))  # type: ignore[no-untyped-call]  # unannotated in torch

    def __len__(self) -> int:
        """How many tensors are watched (none after :meth:`remove`)."""
        return len(self._handles)

    def remove(self) -> None:
        """Remove every hook, and the hook dictionaries this watch made that nothing else uses."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        made, self._made = self._made, []
        for param in made:
            if not param._backward_hooks:  # no one else's hook came since
                param._backward_hooks = None  # torch clears the tensor's hooks with it
