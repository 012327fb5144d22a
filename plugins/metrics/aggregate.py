"""Aggregation: the per-stage, per-metric sums, counts, last values and running windows that the ``Metrics``
plugin publishes."""

from __future__ import annotations

import collections
import math
import numbers
import operator
import time
import warnings
from collections.abc import Callable
from typing import Any, Mapping, SupportsFloat, TypeVar, cast

import torch

from hookfit.errors import HookfitWarning, user_level
from hookfit.payloads import Value
from hookfit.stopping import qualname

E = TypeVar("E")
Reduce = Callable[[torch.Tensor], torch.Tensor | None]
"""A sum over every process of the run (the ``all_reduce`` event, bound to the run): ``None``
when nothing answered."""
Row = tuple[float, ...]
"""A metric's numbers as the processes add them up: last, weighted sum, count, and the
running window's weighted sum and count."""


def is_metric(value: Any) -> bool:
    """Whether ``value`` is a metric object (torchmetrics' ``Metric`` shape: update, compute, reset)."""
    return hasattr(value, "compute") and hasattr(value, "reset") and hasattr(value, "update")


Tensor = torch.Tensor  # (a module global: the per-batch type tests read it without an attribute lookup)
FOLD_EVERY = 1024
"""Values are folded into the aggregates at every publication and at least this often (in
batches), so a long interval between publications cannot hold many values."""


def as_real(value: object) -> float | None:
    """A real scalar a step returned that is neither a plain ``float``/``int`` nor a tensor (those
    take the per-batch fast path), as a float: ``bool``, NumPy's real scalars (``np.float64``,
    ``np.float32``, ``np.int64``, ``np.bool_``...) and 0-d arrays, ``fractions.Fraction``;
    ``None`` for anything else (text, a list, a complex number)."""
    if isinstance(value, numbers.Real):  # bool, NumPy's float and integer scalars, Fraction
        return float(value)
    if numpy_kind(value) in ("b", "i", "u", "f"):  # np.bool_ and 0-d arrays: no numbers ABC
        return float(cast(SupportsFloat, value))
    return None


def metric_numbers(computed: Mapping[str, Any], stage: str, said: set[str]) -> dict[str, float]:
    """The numbers of the metric objects' values (what ``compute()`` returned, by key): a value of
    one real number under its key, a mapping of names to such values (torchmetrics'
    ``ClasswiseWrapper``, a ``MetricCollection``) under ``<key>/<name>``. A key whose value is
    neither (a vector: ``F1Score(average=None)``) is left out, warned of once a run (``said``: the
    keys warned of), naming its key and shape."""
    out: dict[str, float] = {}
    for key, value in computed.items():
        found = {key: value} if not isinstance(value, Mapping) else {f"{key}/{name}": v for name, v in value.items()}
        numbers = {name: real(v) for name, v in found.items()}
        if None in numbers.values():
            if key not in said:
                said.add(key)
                shapes = ", ".join(f"{name} {_shape(v)}" for name, v in found.items() if numbers[name] is None)
                warnings.warn(
                    f"metrics: the metric object {key!r} of the {stage} stage computes more than one number ({shapes}): "
                    f"it is computed and reset at the stage's end and published nowhere; have it compute one number "
                    f"(F1Score(average='macro')), or a number per name (torchmetrics' ClasswiseWrapper, published as "
                    f"'{key}/<name>')", HookfitWarning, stacklevel=user_level())
            continue
        out.update(cast("dict[str, float]", numbers))
    return out


def real(value: Any) -> float | None:
    """``value`` as a float when it is one real number: what :func:`as_real` takes (a ``bool``
    too, as a step's output is), or a tensor of one real element (``bool`` and integer dtypes
    too), read on the host; else ``None``. What a metric object computes, a plugin's gauge and a
    derived metric's answer are read by it alike."""
    if isinstance(value, torch.Tensor):
        return float(value.item()) if value.numel() == 1 and not value.is_complex() else None
    return as_real(value)


def _shape(value: Any) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"


def numpy_kind(value: object) -> str | None:
    """The dtype kind of a NumPy scalar or 0-d array (``"f"``, ``"c"``...), else ``None``
    (without importing NumPy)."""
    if type(value).__module__ != "numpy" or getattr(value, "shape", None) != ():
        return None
    kind = getattr(getattr(value, "dtype", None), "kind", None)
    return kind if isinstance(kind, str) else None


def is_complex(value: object) -> bool:
    """Whether ``value`` is a complex number (Python's, NumPy's) or a complex tensor."""
    if isinstance(value, Tensor):
        return value.is_complex()
    return (isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real)) or numpy_kind(value) == "c"


HISTORY_FIELDS = ("epoch", "step")
"""The fields of a stage's history entry of its own (``MetricsSnapshot.history``: ``{"epoch": ..., "step": ...,
<metric>: <epoch mean>}``), which the results, the console and a checkpoint read back: no metric is named so. A
metric named as another field of a metric log's row (``time``, ``lr_<optimizer>``...) is written there as
``metric.<name>`` (:meth:`hookfit.payloads.MetricsSnapshot.row`, the csv plugin's columns)."""


def reserved(key: str) -> str | None:
    """Why ``key`` cannot name a metric (a step's output, a plugin's gauge), or ``None`` when it can."""
    if key in HISTORY_FIELDS:
        return (f"{key!r} is a field of every entry of the stage's history ({{'epoch': ..., 'step': ..., <metric>: "
                f"...}}), which a metric of that name would overwrite: rename the metric")
    return None


def check(key: object, value: object, step: object) -> None:
    """Refuse what the plugin cannot aggregate: a key that is not a string or is :func:`reserved`,
    a complex number. ``step`` is the step function that returned it, named in the error."""
    if type(key) is not str:
        raise TypeError(
            f"step function {qualname(step)!r} returned the key {key!r} ({type(key).__name__}) "
            f"with a value to aggregate; keys must be strings, the names of what it reports"
        )
    if (why := reserved(key)) is not None:
        raise ValueError(f"step function {qualname(step)!r} returned the key {key!r}: {why}")
    if is_complex(value):
        what = f"a complex tensor ({value.dtype})" if isinstance(value, Tensor) else f"a complex number ({value!r})"
        raise TypeError(
            f"step function {qualname(step)!r} returned {what} under the key {key!r}, which the "
            f"metrics plugin cannot aggregate (a metric is a real number); "
            f"return a real value, such as its .abs() or .real, or leave it out of the output"
        )


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One-number tensors of one metric as one float64 vector on the first one's device: one
    stacking and one conversion in the common case (0-d tensors of one dtype on one device),
    each tensor on its own otherwise (shapes ``(1,)``, mixed devices or dtypes, which stacking
    would promote to the narrower float)."""
    if len(set(map(_dtype, tensors))) == 1:
        try:
            stacked = torch.stack(tensors)
        except RuntimeError:  # shapes or devices differ
            pass
        else:
            if stacked.dim() == 1:
                return stacked.to(torch.float64)
    device = tensors[0].device
    return torch.stack([t.reshape(()).to(device=device, dtype=torch.float64) for t in tensors])


_dtype = operator.attrgetter("dtype")


class _Series:
    """One metric in one stage: weighted sum and count (epoch mean), last value, and the
    last ``window`` (weighted value, size) pairs for the running mean."""

    __slots__ = ("weighted", "count", "last", "window", "size", "summed")

    def __init__(self, window: int, summed: bool = False) -> None:
        self.weighted = 0.0  # (summed: the values' plain sum, Metrics(sums=...))
        self.count = 0
        self.last = math.nan
        self.size = window
        self.summed = summed
        self.window: collections.deque[tuple[float, int]] = collections.deque(maxlen=window)

    def fold(self, entries: list[tuple[float, int]]) -> None:
        """Take in ``(value, batch size)`` pairs, oldest first."""
        weighted, count = self.weighted, self.count
        if self.summed:
            for value, n in entries:  # in order, so the sum rounds as a batch-by-batch sum would
                weighted += value
                count += n
        else:
            for value, n in entries:
                weighted += value * n
                count += n
        self.weighted, self.count = weighted, count
        self.last = float(entries[-1][0])  # (a bool or integer tensor's item() is not a float)
        self.window.extend((value * n, n) for value, n in entries[-self.size:])


class Stage:
    """Aggregates of one stage of one epoch.

    Per batch, a value is only appended to ``host`` (read on the CPU) or ``device`` (a tensor
    left where it is) with its batch size; :meth:`read` folds them into the series when a
    snapshot is taken, and at least every :data:`FOLD_EVERY` batches so memory stays flat.
    ``scalars`` holds the lists of ``host`` whose key was given a CPU tensor of one number since
    the last fold: its next values are read with ``item()`` and nothing else."""

    def __init__(self, window: int, sums: frozenset[str] = frozenset()) -> None:
        self.window = window
        self.sums = sums  # the keys aggregated as sums (Metrics(sums=...))
        self.series: dict[str, _Series] = {}
        # plain dicts: a key missing from one (the first value under it since the last read)
        # is the only moment a value is looked at beyond its type (see :meth:`entries`)
        self.host: dict[str, list[tuple[float, int]]] = {}
        self.device: dict[str, list[tuple[torch.Tensor, int]]] = {}
        self.scalars: dict[str, list[tuple[float, int]]] = {}
        self.metric_objects: dict[str, Any] = {}
        self.computed: dict[str, Any] = {}  # the values of metric objects computed already (see close_metrics)
        self.saved_metrics: dict[str, Any] = {}  # metric objects' states an earlier run left (resumed: see merge)
        self.merged: set[str] = set()  # the keys whose saved state a metric object took
        self.batches = 0
        self.samples = 0
        self.global_samples: int | None = None  # all processes' samples, after a reduction
        self.start_batches = 0  # batches an earlier run did (a stage resumed from a checkpoint)
        self.started = time.perf_counter()  # moved on by the time validations inside it took (resume)
        self.paused: float | None = None  # when a validation inside it began

    def elapsed(self) -> float:
        """Seconds the stage ran: a validation inside it is not its time."""
        return (self.paused or time.perf_counter()) - self.started

    def pause(self) -> None:
        """A validation inside this (training) stage begins: its clock stops."""
        self.paused = time.perf_counter()

    def resume(self) -> None:
        """The validation inside it ended: its clock goes on."""
        if self.paused is not None:
            self.started += time.perf_counter() - self.paused
            self.paused = None

    def read(self) -> None:
        """Fold every value taken since the last read; device values come over in one
        transfer."""
        host, device = self.host, self.device
        if device:  # one host read for them all
            first = next(iter(device.values()))[0][0]
            vectors = [_stacked([t for t, _ in entries]).to(first.device) for entries in device.values()]
            values = iter(torch.cat(vectors).tolist())
            for key, kept in device.items():
                host.setdefault(key, []).extend((next(values), n) for _, n in kept)
            self.device = {}
        if not host:
            return
        for key, entries in host.items():
            series = self.series.get(key)
            if series is None:
                series = self.series[key] = _Series(self.window, key in self.sums)
            series.fold(entries)
        self.host, self.scalars = {}, {}

    def close_metrics(self, prefix: str = "") -> dict[str, Any]:
        """Compute and reset the metric objects under the keys that start with ``prefix`` (a
        validation set that is done: an object the next set shares starts afresh, so each set's
        value is its own); every value computed so far in the stage, by key."""
        for key in [key for key in self.metric_objects if key.startswith(prefix)]:
            metric = self.metric_objects.pop(key)
            self.computed[key] = metric.compute()
            metric.reset()
        return self.computed

    def unmerged(self, stage: str, epoch: int) -> str | None:
        """What to say, at the end of a stage (``stage``, of the epoch ``epoch`` counted from 0) resumed mid-way, of
        its metric objects that took no state of the earlier run's batches; ``None`` when there is none."""
        if not (short := [key for key in self.computed if self.start_batches and key not in self.merged]):
            return None
        return (f"metrics: the metric object(s) {', '.join(map(repr, short))} of the {stage} stage of epoch "
                f"{epoch + 1} count only its {self.batches - self.start_batches} batch(es) since the "
                f"resume: the checkpoint holds no state of it that it could merge (torchmetrics' merge_state; "
                f"a run of several processes keeps none), while the other metrics cover the whole epoch")

    def take_metric(self, key: str, metric: Any) -> None:
        """A metric object under ``key``; in a stage resumed mid-way, the state the earlier run's
        batches left in it (saved in the checkpoint) merged into it the first time, with
        torchmetrics' ``merge_state``, so its value covers the whole stage."""
        if self.saved_metrics and (saved := self.saved_metrics.pop(key, None)) is not None:
            device = getattr(metric, "device", None)
            moved = {name: [t.to(device) for t in value] if isinstance(value, list) else value.to(device)
                     for name, value in saved.items()}
            try:
                metric.merge_state(moved)
                self.merged.add(key)
            except (AttributeError, RuntimeError, TypeError, ValueError):  # no merge_state, or one it refuses
                pass  # said at the stage's end, with the other objects the resume left short
        self.metric_objects[key] = metric

    def entries(self, where: dict[str, list[E]], key: str, value: object, step: object) -> list[E]:
        """The new list for ``key`` in ``where`` (``host`` or ``device``), which has none: the
        first value under ``key`` in the stage, or since the last :meth:`read` (a few times a
        second at most). The key and the value are checked here, and only here: a value that
        cannot be aggregated is refused at the batch it first appears in, naming the step
        function that returned it, while the per-batch path stays one append per value."""
        check(key, value, step)
        entries: list[E] = []
        where[key] = entries
        return entries

    def values(self, reduce: Reduce | None = None) -> dict[str, Value]:
        """Each metric's Value; with ``reduce`` (an all-reduce sum over processes), global."""
        # (a series with nothing counted yet takes part in a sum over the processes: the other
        # processes' part of a stage resumed on another number of them, see ranks.py)
        items = [(key, s) for key, s in self.series.items() if s.count or reduce is not None]
        if reduce is not None:  # the same order on every process
            items.sort(key=lambda item: item[0])
        rows: list[Row] = [(s.last, s.weighted, s.count, sum(w for w, _ in s.window), sum(n for _, n in s.window))
                           for _, s in items]
        if reduce is not None:
            rows = self._reduced(reduce, [key for key, _ in items], rows)
        out: dict[str, Value] = {}
        for (key, series), (last, weighted, count, w_sum, w_count) in zip(items, rows):
            if series.summed:  # the sum so far is its running value too
                out[key] = Value(last, weighted, weighted)
                continue
            running = w_sum / w_count if w_count else math.nan
            out[key] = Value(last, running, weighted / count if count else math.nan)
        return out

    def _reduced(self, reduce: Reduce, keys: list[str], rows: list[Row]) -> list[Row]:
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
            "elapsed": self.elapsed(),
            "series": {k: {"weighted": s.weighted, "count": s.count, "last": s.last,
                           "window": [list(w) for w in s.window]}
                       for k, s in self.series.items()},
            # metric objects' states: those not merged yet (a save before the resumed step returned them), then each
            # object's own (torchmetrics' metric_state of tensors; another kind, as a MetricCollection's, keeps none)
            "metrics": {**self.saved_metrics, **{k: s for k, m in self.metric_objects.items()
                                                 if (s := _metric_state(m)) is not None}},
        }

    @classmethod
    def from_state(cls, window: int, state: Mapping[str, Any], sums: frozenset[str] = frozenset()) -> Stage:
        stage = cls(window, sums)
        stage.batches, stage.samples = state["batches"], state["samples"]
        stage.start_batches = stage.batches
        stage.started -= state["elapsed"]
        stage.saved_metrics = dict(state.get("metrics") or {})
        for key, saved in state["series"].items():
            series = stage.series[key] = _Series(window, key in sums)
            series.weighted, series.count, series.last = saved["weighted"], saved["count"], saved["last"]
            series.window.extend((weighted, n) for weighted, n in saved["window"][-window:])
        return stage


def refuse_shared(key: str, metric: object, outer: list[Stage]) -> None:
    """Refuse, in a validation inside the training stage (whose aggregates are ``outer``), a metric object the training
    stage is updating: the validation would count training's samples in it, and its end would reset it in the middle
    of the epoch."""
    for stage in outer:
        for shared, other in stage.metric_objects.items():
            if other is metric:
                raise ValueError(
                    f"metrics: the validation step returned under {key!r} the metric object that the training "
                    f"step returns under {shared!r}: a validation inside the training epoch (val_every_n_steps) "
                    f"would count the training's samples in it and reset it in the middle of the epoch; give "
                    f"each stage its own object (val_acc = train_acc.clone())")


def _metric_state(metric: Any) -> dict[str, Any] | None:
    """A metric object's state (torchmetrics' ``metric_state``: tensors, lists of tensors) as a checkpoint keeps it;
    ``None`` for an object without one of that kind."""
    state = getattr(metric, "metric_state", None)
    if not isinstance(state, Mapping) or not all(
            isinstance(v, torch.Tensor) or (isinstance(v, list) and all(isinstance(t, torch.Tensor) for t in v))
            for v in state.values()):
        return None
    return {name: [t.detach().clone() for t in value] if isinstance(value, list) else value.detach().clone()
            for name, value in state.items()}
