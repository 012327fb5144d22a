"""hookfit-mean-metrics: a metrics plugin that replaces hookfit's built-in ``metrics``.

A test fixture written only against ``core/hooks.md``. Run it with ``metrics`` disabled
(``HOOKFIT_DISABLE_PLUGINS=metrics``) or select it (``HOOKFIT_PLUGINS=mean_metrics,...``).

What it averages: every scalar a step returns (a tensor with one element, an int or a float;
anything else is ignored), train and valid apart, each value weighted by the batch size (the
first dimension of the batch's first tensor, 1 when it has none), as ``Value`` documents.
It publishes ``metrics_update`` every ``every`` batches (``$MEAN_METRICS_EVERY``, default 10)
and ``epoch_metrics`` from a ``trylast`` ``stage_end``. With several processes (a plugin
implementing ``all_reduce``), epoch means and samples are global; every process must then
return the same keys. It writes no files, and a resumed run restarts the interrupted stage's
means (only the per-epoch history is saved in checkpoints).
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from hookfit import hookimpl
from hookfit.payloads import MetricsSnapshot, Value

__all__ = ["ENV_EVERY", "MeanMetrics"]
ENV_EVERY = "MEAN_METRICS_EVERY"


def batch_size(batch: Any) -> int:
    """The first dimension of the batch's first tensor (itself, or in a tuple, list or dict)."""
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else [batch]
    tensor = next((item for item in items if isinstance(item, torch.Tensor)), None)
    return int(tensor.shape[0]) if tensor is not None and tensor.dim() else 1


def scalar(value: Any) -> float | None:
    """``value`` as a float if it is a scalar a step may report, else ``None``."""
    if isinstance(value, torch.Tensor):
        return float(value.detach().item()) if value.numel() == 1 else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def learning_rates(optimizers: Any) -> dict[str, float]:
    """``param_groups[0]["lr"]`` of ``loop.optimizers`` (an optimizer, or a mapping of them)."""
    named = optimizers if isinstance(optimizers, Mapping) else {} if optimizers is None else {"default": optimizers}
    return {name: float(opt.param_groups[0]["lr"]) for name, opt in named.items() if getattr(opt, "param_groups", None)}


class MeanMetrics:
    """Batch-size-weighted means of the scalars steps return, published as
    :class:`~hookfit.payloads.MetricsSnapshot` (``window``: batches of the running mean)."""

    name = "mean_metrics"

    def __init__(self, every: int | None = None, window: int = 20) -> None:
        self.every = every or int(os.environ.get(ENV_EVERY) or 10)
        self.window = window
        self.history: dict[str, list[Mapping[str, Any]]] = {"train": [], "valid": []}
        self._begin()

    def _begin(self) -> None:
        self.sums: dict[str, list[float]] = {}  # key -> [sum of value * size, sum of sizes]
        self.last: dict[str, float] = {}
        self.recent: dict[str, collections.deque] = {}
        self.batches = self.samples = 0
        self.started = time.perf_counter()

    @hookimpl
    def fit_start(self) -> None:
        """A new run: no history yet."""
        self.history = {"train": [], "valid": []}

    @hookimpl
    def stage_start(self) -> None:
        """A stage begins: its means start from nothing."""
        self._begin()

    @hookimpl
    def step_output(self, loop: Any, output: Mapping[str, Any], batch: Any) -> None:
        """Fold the step's scalars into the stage's sums (nothing of the output is kept)."""
        n = batch_size(batch)
        for key, value in output.items():
            value = scalar(value)
            if value is not None:
                total = self.sums.setdefault(key, [0.0, 0.0])
                total[0] += value * n
                total[1] += n
                self.last[key] = value
                self.recent.setdefault(key, collections.deque(maxlen=self.window)).append((value * n, n))

    @hookimpl
    def batch_end(self, loop: Any, output: Any, batch: Any, batch_idx: int) -> None:
        """Count the batch; every ``every`` batches publish ``metrics_update``."""
        self.batches += 1
        self.samples += batch_size(batch)
        if self.batches % self.every == 0 and (call := loop.hooks.metrics_update) is not None:
            call(loop, loop.state.stage, self.snapshot(loop, loop.state.stage))

    @hookimpl(trylast=True)  # hooks.md: reports come after the stage's work is finished
    def stage_end(self, loop: Any, stage: str) -> None:
        """Publish the stage's final snapshot, with the history, as ``epoch_metrics``."""
        sums, samples = self._global(loop)
        means = {key: total / count for key, (total, count) in sums.items() if count}
        self.history[stage].append(MappingProxyType({"epoch": loop.state.epoch, "step": loop.state.step, **means}))
        snapshot = self.snapshot(loop, stage, final=True, reduced=(sums, samples))
        if (call := loop.hooks.epoch_metrics) is not None:
            call(loop, stage, snapshot)

    def _global(self, loop: Any) -> tuple[dict[str, tuple[float, float]], int]:
        """Epoch sums and samples over every process of the run (one ``all_reduce``)."""
        keys = sorted(self.sums)
        local = {key: tuple(self.sums[key]) for key in keys}
        reduce = loop.hooks.all_reduce
        if reduce is None or loop.state.world_size <= 1:
            return local, self.samples
        flat = torch.tensor([self.samples, *(x for key in keys for x in local[key])], dtype=torch.float64)
        total = reduce(loop, flat).tolist()
        return {key: (total[1 + 2 * i], total[2 + 2 * i]) for i, key in enumerate(keys)}, int(total[0])

    def snapshot(self, loop: Any, stage: str, final: bool = False, reduced: Any = None) -> MetricsSnapshot:
        """The stage as it is now (``final``: the stage's last, with the history)."""
        sums, samples = reduced if reduced is not None else self._global(loop)
        values = {key: Value(self.last[key], sum(w for w, _ in self.recent[key]) / sum(n for _, n in self.recent[key]),
                             total / count) for key, (total, count) in sums.items() if count}
        data = loop.train_data if stage == "train" else loop.val_data
        return MetricsSnapshot(
            stage=stage, epoch=loop.state.epoch, max_epochs=loop.max_epochs, step=loop.state.step,
            batches=self.batches, total=len(data) if hasattr(data, "__len__") else None, samples=samples,
            elapsed=time.perf_counter() - self.started, values=values, lr=learning_rates(loop.optimizers),
            final=final, history=tuple(self.history[stage]) if final else (),
        )

    @hookimpl
    def save_state(self) -> dict[str, Any]:
        """The per-epoch history of both stages (plain data)."""
        return {"history": {stage: [dict(entry) for entry in entries] for stage, entries in self.history.items()}}

    @hookimpl
    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore the history :meth:`save_state` returned."""
        saved = state["history"]
        self.history = {stage: [MappingProxyType(dict(e)) for e in saved.get(stage, ())] for stage in ("train", "valid")}
