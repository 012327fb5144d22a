"""metrics: aggregates every scalar a step returns and publishes read-only snapshots.

* Each value of a step output that is a Python number, or a tensor with one element, is
  aggregated under its key, weighted by the batch size: last value, running mean over the last
  ``window`` batches, and epoch mean; train and valid apart. Other values (strings, vectors,
  images) are ignored, without error. The batch size is the output's ``batch_size`` key if
  present (not itself aggregated), else the first dimension of the batch's first tensor, else 1.
* ``torchmetrics.Metric`` objects in an output are the step's to update; this plugin computes
  them at the end of the stage (published in ``epoch_metrics``) and resets them.
* Tensors on an accelerator stay there until the publishing interval: one host read per
  publication, never one per step. On the CPU, where reading is no synchronisation, each value
  is read at once (the cheapest path). ``defer=True`` forces the deferred path anywhere.
* Publishes ``metrics_update`` at most every ``interval`` seconds and ``epoch_metrics`` at the
  end of every stage; keeps a per-epoch history (``history_epochs`` long) for plots.
* Writes ``metrics.jsonl`` in ``loop.run_dir``: a line per completed stage, one per
  ``log_every_n_steps`` training steps if set, and one at the end. ``log=False`` writes nothing.
* Several processes (a plugin implements ``all_reduce`` and ``loop.state.world_size > 1``):
  sums and counts are added up over the processes before each publication, so every snapshot
  carries global, sample-weighted numbers (``last`` is the mean of the processes' last
  values). Publications then happen every ``sync_every`` batches, at the same batch on every
  process, instead of by time. Only the main process writes the log.
* Checkpoints: ``save_state`` carries the history and the aggregate of a training stage in
  progress, so a resumed run publishes the same epoch means as an uninterrupted one.
"""

from __future__ import annotations

import collections
import json
import math
import time
from types import MappingProxyType
from typing import Any, Mapping

import torch

from hookfit import hookimpl
from hookfit.payloads import MetricsSnapshot, Value
from hookfit.run import Run


def _is_metric(value: Any) -> bool:
    return hasattr(value, "compute") and hasattr(value, "reset") and hasattr(value, "update")


_Tensor = torch.Tensor
_clock = time.perf_counter
FOLD_EVERY = 1024
"""Values are folded into the aggregates at every publication and at least this often (in
batches), so a long interval between publications cannot hold many values."""


def batch_size(batch: Any) -> int:
    """The first dimension of the batch's first tensor; 1 when there is none."""
    kind = type(batch)
    if (kind is tuple or kind is list) and batch and type(first := batch[0]) is _Tensor:
        shape = first.shape  # the common (inputs, targets) case, without the generic walk
        return shape[0] if shape else 1
    if isinstance(batch, (list, tuple)):
        batch = next((item for item in batch if isinstance(item, _Tensor)), None)
    elif isinstance(batch, Mapping):
        batch = next((item for item in batch.values() if isinstance(item, _Tensor)), None)
    if isinstance(batch, _Tensor):
        shape = batch.shape
        return shape[0] if shape else 1
    return 1


class _Series:
    """One metric in one stage: weighted sum and count (epoch mean), last value, and the
    last ``window`` (weighted value, size) pairs for the running mean."""

    __slots__ = ("weighted", "count", "last", "window")

    def __init__(self, window: int) -> None:
        self.weighted = 0.0
        self.count = 0
        self.last = math.nan
        self.window: collections.deque = collections.deque(maxlen=window)

    def fold(self, entries: list[tuple[float, int]]) -> None:
        """Take in ``(value, batch size)`` pairs, oldest first."""
        weighted, count = self.weighted, self.count
        for value, n in entries:  # in order, so the sums round as a batch-by-batch sum would
            weighted += value * n
            count += n
        self.weighted, self.count = weighted, count
        self.last = entries[-1][0]
        self.window.extend((value * n, n) for value, n in entries[-self.window.maxlen:])


class _Stage:
    """Aggregates of one stage of one epoch.

    Per batch, a value is only appended to ``host`` (read on the CPU) or ``device`` (a tensor
    left where it is) with its batch size; :meth:`read` folds them into the series when a
    snapshot is taken, and at least every :data:`FOLD_EVERY` batches so memory stays flat."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.series: dict[str, _Series] = {}
        self.host: collections.defaultdict[str, list[tuple[float, int]]] = collections.defaultdict(list)
        self.device: collections.defaultdict[str, list[tuple[torch.Tensor, int]]] = collections.defaultdict(list)
        self.metric_objects: dict[str, Any] = {}
        self.batches = 0
        self.samples = 0
        self.global_samples: int | None = None  # all processes' samples, after a reduction
        self.started = time.perf_counter()

    def read(self) -> None:
        """Fold every value taken since the last read; device values come over in one
        transfer."""
        host, device = self.host, self.device
        if device:
            tensors = [t for entries in device.values() for t, _ in entries]
            values = iter(torch.stack([t.reshape(()).to(torch.float64) for t in tensors]).tolist())
            for key, entries in device.items():
                host[key].extend((next(values), n) for _, n in entries)
            self.device = collections.defaultdict(list)
        if not host:
            return
        for key, entries in host.items():
            series = self.series.get(key)
            if series is None:
                series = self.series[key] = _Series(self.window)
            series.fold(entries)
        self.host = collections.defaultdict(list)

    def values(self, reduce: Any = None) -> dict[str, Value]:
        """Each metric's Value; with ``reduce`` (an all-reduce sum over processes), global."""
        items = [(key, s) for key, s in self.series.items() if s.count]
        if reduce is not None:  # the same order on every process
            items.sort(key=lambda item: item[0])
        rows = [(s.last, s.weighted, s.count, sum(w for w, _ in s.window), sum(n for _, n in s.window))
                for _, s in items]
        if reduce is not None:
            rows = self._reduced(reduce, [key for key, _ in items], rows)
        out = {}
        for (key, _), (last, weighted, count, w_sum, w_count) in zip(items, rows):
            running = w_sum / w_count if w_count else math.nan
            out[key] = Value(last, running, weighted / count if count else math.nan)
        return out

    def _reduced(self, reduce: Any, keys: list[str], rows: list[tuple]) -> list[tuple]:
        """Sum rows, samples and a checksum of the key names over every process."""
        checksum = float(sum(ord(c) * (i + 1) for i, c in enumerate("|".join(keys))) % 1_000_003)
        local = torch.tensor([1.0, checksum, float(self.samples)] + [v for row in rows for v in row],
                             dtype=torch.float64)
        total = reduce(local)
        if total is None:
            return rows
        world, sums = total[0].item(), total.tolist()
        if sums[1] != checksum * world:
            raise RuntimeError(
                f"metrics: the processes of this run report different metric names (this one: "
                f"{keys}); every process must return the same keys from the step function"
            )
        self.global_samples = int(sums[2])
        flat = sums[3:]
        return [(flat[i] / world, *flat[i + 1:i + 5]) for i in range(0, len(flat), 5)]

    def state(self) -> dict[str, Any]:
        """Plain data for a checkpoint (readable with ``torch.load(weights_only=True)``)."""
        self.read()
        return {
            "batches": self.batches, "samples": self.samples,
            "elapsed": time.perf_counter() - self.started,
            "series": {k: {"weighted": s.weighted, "count": s.count, "last": s.last,
                           "window": [list(w) for w in s.window]}
                       for k, s in self.series.items()},
        }

    @classmethod
    def from_state(cls, window: int, state: Mapping[str, Any]) -> _Stage:
        stage = cls(window)
        stage.batches, stage.samples = state["batches"], state["samples"]
        stage.started -= state["elapsed"]
        for key, saved in state["series"].items():
            series = stage.series[key] = _Series(window)
            series.weighted, series.count, series.last = saved["weighted"], saved["count"], saved["last"]
            series.window.extend((weighted, n) for weighted, n in saved["window"][-window:])
        return stage


class Metrics:
    """Batch-size-weighted aggregation of step outputs, published as snapshots."""

    name = "metrics"

    def __init__(
        self,
        interval: float = 0.5,
        window: int = 50,
        history_epochs: int = 1000,
        log: bool = True,
        log_every_n_steps: int | None = None,
        defer: bool | None = None,
        sync_every: int = 50,
    ) -> None:
        self.interval = interval
        self.window = window
        self.log = log
        self.log_every_n_steps = log_every_n_steps
        self.defer = defer
        self.sync_every = sync_every
        self._every = 0  # with several processes: publish every this many batches
        self._by_time = True  # publications by time only, no per-step log line (the fast path)
        self._resumed: _Stage | None = None
        self._stage_name: str | None = None
        self.history: dict[str, collections.deque] = {}
        self._history_epochs = history_epochs
        self._stage: _Stage | None = None
        self._next_publish = 0.0
        self._log_file: Any = None
        self.loop: Any = None

    # -- events ---------------------------------------------------------------------------
    @hookimpl
    def fit_start(self, loop: Any) -> None:
        self.loop = loop
        self.history = {
            s: collections.deque(maxlen=self._history_epochs) for s in ("train", "valid")
        }

    @hookimpl
    def stage_start(self, loop: Any, stage: str) -> None:
        resumed, self._resumed = self._resumed, None
        self._stage = resumed if resumed is not None and stage == "train" else _Stage(self.window)
        self._stage_name = stage
        self._next_publish = time.perf_counter() + self.interval
        self._every = self.sync_every if self._reduce(loop) is not None else 0
        self._by_time = not self._every and not self.log_every_n_steps

    @hookimpl
    def batch_end(self, loop: Any, output: Mapping[str, Any] | None, batch: Any, batch_idx: int) -> None:
        # (every argument of the event, though batch_idx is unused: then the loop calls this
        # method itself, not through an adapter that drops arguments)
        agg = self._stage
        agg.batches += 1  # type: ignore[union-attr]
        if output is not None:
            n = output.get("batch_size")
            n = int(n) if n is not None else batch_size(batch)
            agg.samples += n  # type: ignore[union-attr]
            host, defer = agg.host, self.defer  # type: ignore[union-attr]
            for key, value in output.items():
                kind = type(value)
                if kind is _Tensor or isinstance(value, _Tensor):
                    if value.numel() != 1:
                        continue  # not a scalar: ignored, by design
                    if value.is_cpu and not defer:
                        host[key].append((value.item(), n))
                    else:
                        agg.device[key].append((value.detach(), n))  # type: ignore[union-attr]
                elif kind is float or kind is int:
                    if key != "batch_size":
                        host[key].append((value, n))
                elif _is_metric(value):
                    agg.metric_objects[key] = value  # type: ignore[union-attr]
        else:
            agg.samples += batch_size(batch)  # type: ignore[union-attr]
        if not self._by_time:  # a log line every N steps, or several processes
            if self.log_every_n_steps and loop.training and loop.state.step % self.log_every_n_steps == 0:
                self._write({"event": "step", **self.snapshot().row()})
            if self._every:  # several processes: the same batches everywhere, for the reduction
                if agg.batches % self._every == 0:  # type: ignore[union-attr]
                    self._publish(loop)
                elif not agg.batches % FOLD_EVERY:  # type: ignore[union-attr]
                    agg.read()  # type: ignore[union-attr]
                return
        now = _clock()
        if now >= self._next_publish:
            self._next_publish = now + self.interval
            self._publish(loop)
        elif not agg.batches % FOLD_EVERY:  # type: ignore[union-attr]
            agg.read()  # type: ignore[union-attr]

    def _publish(self, loop: Run) -> None:
        if (call := loop.hooks.metrics_update) is not None:
            call(loop, loop.state.stage, self.snapshot())

    @hookimpl(trylast=True)  # after every stage_end that finishes the stage's work (optim's)
    def stage_end(self, loop: Run, stage: str) -> None:
        agg = self._stage
        assert agg is not None
        agg.read()
        extra = {}
        for key, metric in agg.metric_objects.items():
            value = metric.compute()
            metric.reset()
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                extra[key] = float(value)
        values = agg.values(self._reduce(loop))
        entry = {"epoch": loop.state.epoch, "step": loop.state.step,
                 **{k: v.epoch for k, v in values.items()}, **extra}
        self.history.setdefault(stage, collections.deque(maxlen=self._history_epochs)).append(
            MappingProxyType(entry)
        )
        for key, value in extra.items():
            values[key] = Value(value, value, value)
        snapshot = self.snapshot(values=values, final=True)
        self._write({"event": "epoch", **snapshot.row()})
        if (call := loop.hooks.epoch_metrics) is not None:
            call(loop, stage, snapshot)
        self._stage = None

    @hookimpl
    def fit_end(self, loop: Any) -> None:
        state = loop.state
        if self.log:
            self._write({"event": "end", "status": state.status, "reason": state.stop_reason,
                         "by": state.stopped_by, "step": state.step, "time": round(state.elapsed, 3)})
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        self._stage = None
        self.loop = None

    @hookimpl
    def save_state(self) -> dict[str, Any]:
        """History, and the aggregate of the training stage in progress (if any)."""
        running = self._stage is not None and self._stage_name == "train"
        return {
            "history": {s: [dict(e) for e in h] for s, h in self.history.items()},
            "train_stage": self._stage.state() if running else None,  # type: ignore[union-attr]
        }

    @hookimpl
    def load_state(self, state: Mapping[str, Any]) -> None:
        for stage, entries in state["history"].items():
            self.history[stage] = collections.deque(
                (MappingProxyType(dict(e)) for e in entries), maxlen=self._history_epochs)
        if state.get("train_stage") is not None:
            self._resumed = _Stage.from_state(self.window, state["train_stage"])

    def _reduce(self, loop: Any) -> Any:
        """The all-reduce to use for a publication, or None with one process."""
        call = loop.hooks.all_reduce
        if call is None or loop.state.world_size <= 1:
            return None
        return lambda tensor: call(loop, tensor)

    # -- snapshots and log ------------------------------------------------------------------
    def snapshot(self, values: dict[str, Value] | None = None, final: bool = False) -> MetricsSnapshot:
        """The current aggregate of the running stage, as published."""
        loop, agg = self.loop, self._stage
        assert agg is not None
        if values is None:
            agg.read()
            values = agg.values(self._reduce(loop))
        data = loop.val_data if loop.state.stage == "valid" else loop.train_data
        stage = loop.state.stage or "train"
        return MetricsSnapshot(
            stage=stage,
            epoch=loop.state.epoch,
            max_epochs=loop.max_epochs,
            step=loop.state.step,
            batches=agg.batches,
            total=len(data) if hasattr(data, "__len__") else None,
            samples=agg.samples if agg.global_samples is None else agg.global_samples,
            elapsed=time.perf_counter() - agg.started,
            values=MappingProxyType(values),
            lr=MappingProxyType(_learning_rates(loop.optimizers)),
            final=final,
            history=tuple(self.history.get(stage, ())) if final else (),
        )

    def _write(self, record: dict[str, Any]) -> None:
        if not self.log or self.loop is None or not self.loop.is_main:
            return  # (no loop: the run failed before this plugin's fit_start)
        if self._log_file is None:
            self._log_file = open(self.loop.run_dir / "metrics.jsonl", "a", encoding="utf-8")
        self._log_file.write(json.dumps(record, default=float) + "\n")
        self._log_file.flush()


def _learning_rates(optimizers: Any) -> dict[str, float]:
    if optimizers is None:
        return {}
    if not isinstance(optimizers, Mapping):
        optimizers = {"default": optimizers}
    out = {}
    for name, opt in optimizers.items():
        groups = getattr(opt, "param_groups", None)
        if groups:
            out[name] = float(groups[0]["lr"])
    return out
