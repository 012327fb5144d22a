"""``Optim(clip_scope="model")``: one gradient norm over the run's optimizers, not one each (README.md, "Clipping")."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Sequence

import torch

from hookfit.plugins.support import kernels

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.plugins.optim.managed import ManagedOptimizer
    from hookfit.run import Run

Left = tuple["weakref.ref[torch.Tensor] | None", int]  # a parameter's gradient as a clip left it, and its version


class ModelNorm:
    """Clips, before a step on gradients no clip took yet, those of every optimizer not stepped in the batch, by
    their one norm: torch's ``unscale_`` of each, then ``clip_grad_norm_`` over all their parameters."""

    def __init__(self, max_norm: float, optimizers: Sequence[ManagedOptimizer]) -> None:
        self.max_norm, self.optimizers = max_norm, list(optimizers)
        self._left: dict[int, Left] = {}  # by parameter (id), what the latest clip left
        self._bad: torch.Tensor | None = None  # the latest clip's flag: True where its norm was not finite
        self._batch = -1  # the batch (loop.state.step) of the latest clip
        self._before: dict[str, int] = {}  # by optimizer, its steps and skips when that batch's first clip came

    def clip(self, managed: ManagedOptimizer, loop: Run, scaler: torch.amp.GradScaler | None,
             check: bool) -> torch.Tensor | None:
        """Clip before ``managed`` steps (``check``: flag a norm that is not finite, as a ``scaler`` needs too): the
        flag of the clip that took its gradients, this one or an earlier one in the batch, or ``None``."""
        if all(self._took(p) for p in managed.params):
            return self._bad
        if loop.state.step != self._batch:
            self._batch, self._before = loop.state.step, {m.name: m.steps + m.skipped for m in self.optimizers}
        scope = [m for m in self.optimizers if m is managed or m.steps + m.skipped == self._before.get(m.name)]
        if scaler is not None:
            for each in scope:
                kernels.unscale(scaler, each.optimizer)
        params = [p for m in scope for p in m.params]
        norm = torch.nn.utils.clip_grad_norm_(params, self.max_norm)
        self._bad = torch.isfinite(norm).logical_not_() if check or scaler is not None else None
        self._left = {id(p): (None, 0) if p.grad is None else (weakref.ref(p.grad), p.grad._version) for p in params}
        return self._bad

    def _took(self, param: torch.Tensor) -> bool:
        """Whether the latest clip took the gradient ``param`` has now (the same tensor, not changed in place since)."""
        grad, (then, version) = param.grad, self._left.get(id(param), (None, -1))
        return then is None and grad is None and version == 0 or (
            then is not None and then() is grad and grad is not None and grad._version == version)
