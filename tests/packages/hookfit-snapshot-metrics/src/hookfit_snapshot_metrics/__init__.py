"""hookfit-snapshot-metrics: hookfit's metrics role, publishing snapshots and writing nothing.

A test fixture written from hookfit's ``README.md`` and ``core/hooks.md`` (the metrics role)
alone. Run it with the built-in ``metrics`` disabled (``HOOKFIT_DISABLE_PLUGINS=metrics``).

Every scalar a step returns is averaged, weighted by its batch's size, per stage and epoch. The
plugin publishes :class:`~hookfit.payloads.MetricsSnapshot` objects: ``metrics_update`` every
``every_n_batches`` batches and ``epoch_metrics`` once per stage of every epoch (from a
``trylast`` ``stage_end``, or from ``fit_end`` for a stage a stop cut short). Values read from a
CPU tensor become floats at once; values on an accelerator stay there until a publication, which
reads them all with one transfer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Union

import torch

from hookfit import hookimpl
from hookfit.payloads import MetricsSnapshot, Value

__all__ = ["SnapshotMetrics"]

Number = Union[float, torch.Tensor]
DIRECTIONS = ("min", "max")
FIELDS = 6  # numbers per metric in a packed publication: sum, count, window sum and count, last sum and count


def _scalar(value: Any) -> Number | None:
    """``value`` as a number a step may report (a float, or a one-element tensor on an
    accelerator), or ``None`` for anything else."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return None
        value = value.detach()
        return float(value.item()) if value.device.type == "cpu" else value.reshape(()).float()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _batch_size(output: Mapping[str, Any], batch: Any) -> int:
    """The output's ``batch_size``, else the first dimension of the batch's first tensor, else 1."""
    given = output.get("batch_size")
    if isinstance(given, torch.Tensor) and given.numel() == 1:
        return int(given.item())
    if isinstance(given, int) and not isinstance(given, bool):
        return given
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else (batch,)
    tensor = next((item for item in items if isinstance(item, torch.Tensor)), None)
    return int(tensor.shape[0]) if tensor is not None and tensor.dim() else 1


def _length(data: Any) -> int | None:
    """``len(data)``, summed over a mapping of validation sets; ``None`` where unknown."""
    try:
        if isinstance(data, Mapping):
            return sum(len(part) for part in data.values())
        return len(data)
    except TypeError:
        return None


class _Stage:
    """The sums of one stage of one epoch."""

    def __init__(self, stage: str, epoch: int, total: int | None) -> None:
        self.stage, self.epoch, self.total = stage, epoch, total
        self.batches = 0  # in this stage of this epoch, a resumed run's earlier ones included
        self.run_batches = 0  # of this run only: a stage with none publishes nothing at a stop
        self.samples = 0
        self.sums: dict[str, Number] = {}
        self.counts: dict[str, float] = {}
        self.window_sums: dict[str, Number] = {}
        self.window_counts: dict[str, float] = {}
        self.last: dict[str, tuple[Number, float]] = {}
        self.started = time.monotonic()

    def add(self, output: Mapping[str, Any], batch: Any) -> None:
        size = _batch_size(output, batch)
        self.samples += size
        for key, raw in output.items():
            if key == "batch_size" or (value := _scalar(raw)) is None:
                continue
            weighted = value * size
            self.sums[key] = self.sums.get(key, 0.0) + weighted
            self.counts[key] = self.counts.get(key, 0.0) + size
            self.window_sums[key] = self.window_sums.get(key, 0.0) + weighted
            self.window_counts[key] = self.window_counts.get(key, 0.0) + size
            self.last[key] = (weighted, float(size))

    def entries(self) -> tuple[list[str], list[Number]]:
        keys = sorted(self.sums)
        numbers: list[Number] = []
        for key in keys:
            numbers += [self.sums[key], self.counts[key], self.window_sums.get(key, 0.0),
                        self.window_counts.get(key, 0.0), *self.last[key]]
        numbers.append(float(self.samples))
        return keys, numbers

    def dump(self) -> dict[str, Any]:
        def copy(number: Number) -> Number:
            return number.detach().clone() if isinstance(number, torch.Tensor) else number

        return {"stage": self.stage, "epoch": self.epoch, "total": self.total, "batches": self.batches,
                "samples": self.samples, "sums": {k: copy(v) for k, v in self.sums.items()},
                "counts": dict(self.counts), "window_sums": {k: copy(v) for k, v in self.window_sums.items()},
                "window_counts": dict(self.window_counts),
                "last": {k: [copy(v), n] for k, (v, n) in self.last.items()}}

    @classmethod
    def load(cls, saved: Mapping[str, Any]) -> _Stage:
        stage = cls(str(saved["stage"]), int(saved["epoch"]), saved["total"])
        stage.batches, stage.samples = int(saved["batches"]), int(saved["samples"])
        stage.sums, stage.counts = dict(saved["sums"]), dict(saved["counts"])
        stage.window_sums, stage.window_counts = dict(saved["window_sums"]), dict(saved["window_counts"])
        stage.last = {k: (v, float(n)) for k, (v, n) in saved["last"].items()}
        return stage


def _check_every(every: Any) -> int:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"snapshot_metrics: every_n_batches must be a positive integer, got {every!r}")
    return every


def _check_best(best: Any) -> dict[str, str]:
    if best is None:
        return {}
    if not isinstance(best, Mapping) or not all(isinstance(k, str) and k for k in best):
        raise ValueError(f"snapshot_metrics: best must map metric names ('valid/acc', or 'acc' for both "
                         f"stages) to 'min' or 'max', got {best!r}")
    wrong = {k: v for k, v in best.items() if v not in DIRECTIONS}
    if wrong:
        raise ValueError(f"snapshot_metrics: best must map metric names to 'min' or 'max', got {wrong!r}")
    return dict(best)


class SnapshotMetrics:
    """Batch-size-weighted means of what steps return, published as snapshots.

    ``every_n_batches``: batches between two ``metrics_update`` publications of a stage.
    ``best``: which value of a metric is best, ``{"valid/score": "max"}`` for one stage's metric
    or ``{"mae": "min"}`` for both stages'; ``loss`` is ``"min"`` unless given.
    """

    name = "snapshot_metrics"

    def __init__(self, every_n_batches: int = 20, best: Mapping[str, str] | None = None) -> None:
        self.every_n_batches = _check_every(every_n_batches)
        self.best = _check_best(best)
        self._open: dict[str, _Stage] = {}
        self._history: dict[str, list[dict[str, Any]]] = {}
        self._restored: _Stage | None = None

    # -- the run ---------------------------------------------------------------------------------
    @hookimpl
    def fit_start(self) -> None:
        self._open, self._history, self._restored = {}, {}, None

    @hookimpl
    def stage_start(self, loop: Any, stage: str) -> None:
        """Open the stage's sums; in the epoch a resumed run continues, the saved ones."""
        restored, self._restored = self._restored, None
        if restored is not None and restored.stage == stage and restored.epoch == loop.state.epoch:
            restored.started = time.monotonic()
            self._open[stage] = restored
            return
        data = loop.train_data if stage == "train" else loop.val_data
        self._open[stage] = _Stage(stage, loop.state.epoch, _length(data))

    @hookimpl
    def batch_end(self, loop: Any, output: Mapping[str, Any] | None, batch: Any, batch_idx: int) -> None:
        current = self._open.get(loop.state.stage)
        if current is None:
            return
        current.batches += 1
        current.run_batches += 1
        if output is not None:
            current.add(output, batch)
        if current.batches % self.every_n_batches == 0:
            # with several processes every one publishes at the same batch (training: the same
            # number of batches everywhere); in a validation, which processes may run different
            # numbers of batches of, nothing is reduced before its end
            hooks = loop.hooks
            if hooks.metrics_update is None and hooks.all_reduce is None:
                return
            snapshot = self._snapshot(loop, current, final=False, reduce=loop.training)
            current.window_sums, current.window_counts = {}, {}
            if hooks.metrics_update is not None:
                hooks.metrics_update(loop, current.stage, snapshot)

    @hookimpl(trylast=True)
    def stage_end(self, loop: Any, stage: str) -> None:
        """Publish the stage's final snapshot, after every other plugin finished the stage."""
        current = self._open.pop(stage, None)
        if current is not None:
            self._finish(loop, current)

    @hookimpl
    def fit_end(self, loop: Any) -> None:
        """A stage that a graceful stop or ``max_steps`` cut short is published here, innermost
        first (after a checkpoint plugin's ``tryfirst`` ``fit_end`` saved the run without it)."""
        state = loop.state
        graceful = state.status == "completed" or (state.status == "interrupted"
                                                   and state.stop_reason != "KeyboardInterrupt")
        open_stages, self._open = list(self._open.values()), {}
        if graceful:
            for current in reversed(open_stages):
                if current.run_batches:
                    self._finish(loop, current)

    def _finish(self, loop: Any, current: _Stage) -> None:
        means = self._means(loop, current, reduce=True)
        entry: dict[str, Any] = {"epoch": current.epoch, "step": loop.state.step}
        entry.update({key: value.epoch for key, value in means[0].items()})
        self._history.setdefault(current.stage, []).append(entry)
        snapshot = self._snapshot(loop, current, final=True, reduce=True, means=means)
        if (publish := loop.hooks.epoch_metrics) is not None:
            publish(loop, current.stage, snapshot)

    # -- snapshots -------------------------------------------------------------------------------
    def _means(self, loop: Any, current: _Stage, reduce: bool) -> tuple[dict[str, Value], int]:
        keys, entries = current.entries()
        all_reduce = loop.hooks.all_reduce if reduce else None
        if all_reduce is not None or any(isinstance(e, torch.Tensor) for e in entries):
            device = next((e.device for e in entries if isinstance(e, torch.Tensor)), torch.device("cpu"))
            dtype = torch.float64 if device.type == "cpu" else torch.float32
            packed = torch.stack([torch.as_tensor(e, dtype=dtype, device=device) for e in entries])
            if all_reduce is not None:
                summed = all_reduce(loop, packed)
                packed = packed if summed is None else summed
            numbers = [float(n) for n in packed.tolist()]  # one read of the device per publication
        else:
            numbers = [float(e) for e in entries]
        values: dict[str, Value] = {}
        for index, key in enumerate(keys):
            total, count, window, window_count, last, last_count = numbers[index * FIELDS:(index + 1) * FIELDS]
            epoch = total / count if count else math.nan
            values[key] = Value(last=last / last_count if last_count else math.nan,
                                running=window / window_count if window_count else epoch, epoch=epoch)
        return values, int(numbers[-1])

    def _direction(self, stage: str, key: str) -> str | None:
        return self.best.get(f"{stage}/{key}") or self.best.get(key) or ("min" if key == "loss" else None)

    def _snapshot(self, loop: Any, current: _Stage, final: bool, reduce: bool,
                  means: tuple[dict[str, Value], int] | None = None) -> MetricsSnapshot:
        values, samples = means if means is not None else self._means(loop, current, reduce)
        best = {key: direction for key in values if (direction := self._direction(current.stage, key))}
        history = tuple(MappingProxyType(dict(e)) for e in self._history.get(current.stage, ())) if final else ()
        return MetricsSnapshot(
            stage=current.stage, epoch=current.epoch, max_epochs=loop.max_epochs, step=loop.state.step,
            batches=current.batches, total=current.total, samples=samples,
            elapsed=time.monotonic() - current.started, values=MappingProxyType(values),
            lr=MappingProxyType(self._learning_rates(loop)), final=final, history=history,
            best=MappingProxyType(best))

    @staticmethod
    def _learning_rates(loop: Any) -> dict[str, float]:
        optimizers = loop.optimizers
        named = optimizers if isinstance(optimizers, Mapping) else {} if optimizers is None else {"default": optimizers}
        return {str(name): float(opt.param_groups[0]["lr"]) for name, opt in named.items()
                if getattr(opt, "param_groups", None)}

    # -- the run's end and checkpoints -------------------------------------------------------------
    @hookimpl
    def results(self) -> dict[str, Any] | None:
        """``{"metrics": {"<stage>/<name>": last epoch value}, "best": {"<stage>/<name>": (best
        value, epoch counted from 1)}}``, ``best`` for the metrics with a direction."""
        if not self._history:
            return None
        last: dict[str, float] = {}
        best: dict[str, tuple[float, int]] = {}
        for stage, entries in sorted(self._history.items()):
            for key in sorted({k for entry in entries for k in entry} - {"epoch", "step"}):
                name = f"{stage}/{key}"
                seen = [(entry[key], entry["epoch"]) for entry in entries if key in entry]
                last[name] = seen[-1][0]
                direction = self._direction(stage, key)
                finite = [(value, epoch) for value, epoch in seen if math.isfinite(value)]
                if direction is not None and finite:
                    pick = min if direction == "min" else max
                    value, epoch = pick(finite, key=lambda pair: pair[0])  # the first of equal values
                    best[name] = (value, epoch + 1)
        return {"metrics": last, "best": best}

    @hookimpl
    def save_state(self) -> dict[str, Any]:
        """The per-epoch history and the open training stage's sums (a validation in progress
        is left out: a run resumed from here runs it again from its start)."""
        train = self._open.get("train")
        return {"history": {stage: [dict(e) for e in entries] for stage, entries in self._history.items()},
                "train": None if train is None else train.dump()}

    @hookimpl
    def load_state(self, state: Any) -> None:
        if not isinstance(state, Mapping) or not {"history", "train"} <= set(state):
            keys = sorted(state) if isinstance(state, Mapping) else "-"
            raise ValueError(f"snapshot_metrics: the saved state is not snapshot_metrics' (got "
                             f"{type(state).__name__} with keys {keys})")
        self._history = {str(stage): [dict(e) for e in entries] for stage, entries in state["history"].items()}
        self._restored = None if state["train"] is None else _Stage.load(state["train"])
