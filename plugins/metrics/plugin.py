"""Publication: the ``Metrics`` plugin's events, its ``metrics_update`` and ``epoch_metrics``
snapshots (a partial last stage's too), the metrics' directions and its checkpoint state."""

from __future__ import annotations

import collections
import time
import warnings
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Collection, Mapping

import torch

from hookfit import HookfitWarning, hookimpl
from hookfit.config import records_options
from hookfit.errors import user_level
from hookfit.payloads import MetricsSnapshot, ResumeInfo, Value
from hookfit.plugins.support import Every, cut_short, flag, integer, number, positive_int
from hookfit.plugins.metrics import gauges, hookspecs, ranks, snapshots
from hookfit.plugins.metrics.aggregate import (E, FOLD_EVERY, Reduce, Stage, Tensor, as_real, check, is_complex,
                                               is_metric, metric_numbers, refuse_shared)
from hookfit.plugins.metrics.batches import batch_size, warn_ambiguous
from hookfit.plugins.metrics.outputs import nested
from hookfit.plugins.metrics.derived import Derived, Function
from hookfit.plugins.metrics.directions import Directions
from hookfit.plugins.metrics.results import Report
from hookfit.plugins.metrics.sums import Sums
from hookfit.tools.runs import trained_directions

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run, Step

_clock = time.perf_counter


@records_options
class Metrics:
    """Batch-size-weighted aggregation of step outputs, published as snapshots."""

    name = "metrics"
    hookspecs = hookspecs  # the events it declares, added to every run (core/hooks.md)

    def __init__(
        self,
        interval: float = 0.5,
        window: int = 50,
        history_epochs: int = 1000,
        defer: bool | None = None,
        sync_every: int = 50,
        best: Mapping[str, str] | None = None,
        derived: Mapping[str, Function] | None = None,
        sums: Collection[str] | None = None,
    ) -> None:
        name = self.name  # every option checked now, naming it (hookfit.plugins.support)
        self.interval = number(name, "interval", interval, least=0, meaning="seconds between publications")
        self.window = positive_int(name, "window", window, meaning="batches of the running mean")
        history_epochs = integer(name, "history_epochs", history_epochs, least=0, meaning="epochs of history kept")
        self.defer = flag(name, "defer", defer, none=True)
        self._sync = Every(sync_every, plugin=name, option="sync_every", none=False,
                           meaning="batches between publications with several processes")
        self.sync_every = sync_every
        self.directions = Directions(best, plugin=name)
        self.best: Mapping[str, str] = self.directions.given
        self.derived = Derived(derived, plugin=name)  # metrics computed from the aggregated ones
        self._sums = Sums(sums, plugin=name)  # keys aggregated as sums, not means
        self.sums: tuple[str, ...] = self._sums.names
        self.report = Report(self.directions)  # what the results event answers
        self._every: Every | None = None  # with several processes: publish every sync_every batches
        self._said_sync = False  # interval=0 with several processes was warned about
        self._said_numbers: set[str] = set()  # metric objects that compute no number, warned about
        self._dropped: set[object] = set()  # keys of values never aggregated looked at, steps warned of one (nested)
        self._said_sizes: set[tuple[object, str | None]] = set()  # (step, stage) warned of an ambiguous batch size
        self._local = False  # publications before the stage's end are not reduced
        self._by_time = True  # publications by time only (the fast path)
        self._resumed: Stage | None = None
        self._stage_name: str | None = None
        self.history: dict[str, collections.deque[Mapping[str, Any]]] = {}
        self._history_epochs = history_epochs
        self._stage: Stage | None = None
        self._outer: list[tuple[str | None, Stage]] = []  # stages a nested one interrupted
        self._next_publish = 0.0
        self._val_set: str | None = None  # the validation set whose batches run (batch_start)
        self.loop: Run | None = None

    # -- events ---------------------------------------------------------------------------
    @hookimpl
    def fit_start(self, loop: Run) -> None:
        self.loop = loop
        self.history = {s: collections.deque(maxlen=self._history_epochs) for s in ("train", "valid")}
        self._stage, self._stage_name, self._outer, self._said_sync, self._said_numbers = None, None, [], False, set()
        self._dropped, self._said_sizes = set(), set()
        self.directions.learn({})
        self.report = Report(self.directions)
        self.derived.reset()
        self._sums.reset()

    @hookimpl
    def resumed(self, loop: Run, info: ResumeInfo) -> None:
        """An evaluation (``Loop.validate(resume=...)``) of a training run's checkpoint judges the
        metrics that ``best`` gives no direction as that run did: by the directions its metrics log
        records (:func:`hookfit.tools.runs.trained_directions`)."""
        if loop.mode != "fit":
            self.directions.learn(trained_directions(info.source))

    @hookimpl
    def stage_start(self, loop: Run, stage: str) -> None:
        if self._stage is not None:  # a validation inside training: the training aggregate waits
            self._stage.pause()
            self._outer.append((self._stage_name, self._stage))
        resumed, self._resumed = self._resumed, None
        sums = self._sums.keys(loop.val_data if stage == "valid" else None)
        self._stage = resumed if resumed is not None and stage == "train" else Stage(self.window, sums)
        self._stage_name = stage
        self._next_publish = time.perf_counter() + self.interval
        self._val_set = None
        self._publishing(loop, stage, first=True)

    def _publishing(self, loop: Run, stage: str | None, first: bool = False) -> None:
        """How the running stage publishes. With several processes, training publishes every
        ``sync_every`` batches (the same ones everywhere, for the reduction); validation parts
        may differ by a batch, so what it publishes before its end is this process's own,
        reduced only at its ``stage_end``."""
        several = self._reduce(loop) is not None
        if several and stage == "train" and self.interval == 0 and self.sync_every > 1 and not self._said_sync:
            self._said_sync = True
            warnings.warn(f"metrics: interval=0 asks for a publication after every batch; with several processes "
                          f"they come every sync_every={self.sync_every} batches (a reduction over the processes "
                          f"each time): give Metrics(sync_every=1) for every batch", HookfitWarning,
                          stacklevel=user_level())
        every = self._sync if several and stage == "train" else None
        self._every = None if first else every  # first: batch_end hands the stage's next batch to _first_batch
        self._local = several and stage != "train"
        self._by_time = every is None and not first

    @hookimpl
    def batch_end(self, loop: Run, output: Mapping[str, Any] | None, batch: Any, batch_idx: int) -> None:
        # (every argument of the event, though batch_idx is unused: then the loop calls this
        # method itself, not through an adapter that drops arguments)
        # Per value a batch costs one read and one append: a key is looked at beyond its type
        # only when it has no list since the last fold (_take), a CPU tensor under a key
        # known to hold one number (agg.scalars) is read with item() alone, and one that stays
        # on its device is kept, detached, after two tests.
        agg = self._stage
        assert agg is not None  # inside a stage
        agg.batches += 1
        if output is not None:
            given = output.get("batch_size")
            if given is not None:
                n = int(given)
            elif (type(batch) is tuple or type(batch) is list) and batch and type(first := batch[0]) is Tensor:
                shape = first.shape  # the common (inputs, targets) case, without a call
                n = shape[0] if shape else 1
            else:
                n = batch_size(batch)
            agg.samples += n
            scalars, host, device = agg.scalars, agg.host, agg.device
            for key, value in output.items():
                kind = type(value)
                if kind is Tensor:
                    if (entries := scalars.get(key)) is not None:
                        try:
                            entries.append((value.item(), n))
                        except RuntimeError:  # no longer one number: ignored as any non-scalar is (or refused)
                            self._take(agg, key, value, n, loop)
                        continue
                    if ((kept := device.get(key)) is not None and (self.defer or not value.is_cpu)
                            and value.numel() == 1):  # (_take's device case, without its call)
                        kept.append((value.detach(), n))
                        continue
                elif kind is float or kind is int:
                    if key != "batch_size":
                        try:
                            host[key].append((value, n))
                        except KeyError:
                            self._first(host, key, value, loop).append((value, n))
                    continue
                self._take(agg, key, value, n, loop)
        else:
            agg.samples += batch_size(batch)
        if not self._by_time:  # several processes: the same batches everywhere, for the reduction
            every = self._every
            if every is None:  # a stage's first batch (_publishing): looked at once, and published
                self._first_batch(loop, agg, output, batch)
                return
            if every.due(agg.batches):
                self._publish(loop)
            elif not agg.batches % FOLD_EVERY:
                agg.read()
            return
        now = _clock()
        if now >= self._next_publish:
            self._next_publish = now + self.interval
            self._publish(loop)
        elif not agg.batches % FOLD_EVERY:
            agg.read()

    def _take(self, agg: Stage, key: str, value: Any, n: int, loop: Run) -> None:
        """A value past ``batch_end``'s fast paths: a tensor under a key with no list yet, one
        that stays on its device (an accelerator, ``defer=True``), a subclass of a tensor, a
        metric object, a NumPy scalar or a ``bool``; refused when it cannot be aggregated."""
        if key in agg.sums:
            self._sums.check(key, value, self._step(loop))
        if isinstance(value, Tensor):
            if value.numel() != 1:
                return  # not a scalar: ignored, by design
            if value.is_cpu and not self.defer:
                try:
                    entries = agg.host[key]
                except KeyError:
                    entries = self._first(agg.host, key, value, loop)
                if type(value) is Tensor:  # its next values take the fast path
                    agg.scalars[key] = entries
                entries.append((value.item(), n))
            else:
                try:
                    agg.device[key].append((value.detach(), n))
                except KeyError:
                    self._first(agg.device, key, value, loop).append((value.detach(), n))
        elif is_metric(value):
            if key not in agg.metric_objects:  # its first batch
                check(key, value, self._step(loop))
            if self._outer:  # a validation inside the training stage
                refuse_shared(key, value, [outer for _, outer in self._outer])
            agg.take_metric(key, value)
        elif (real := as_real(value)) is not None:  # NumPy scalars, bool: past the fast path
            if key != "batch_size":
                try:
                    agg.host[key].append((real, n))
                except KeyError:
                    self._first(agg.host, key, value, loop).append((real, n))
        elif is_complex(value):
            check(key, value, self._step(loop))  # a number that cannot be aggregated: refused
        elif key not in self._dropped:  # left out: looked at once a run, a step warned of once
            self._dropped.add(key)
            step = self._step(loop)
            if step not in self._dropped and (said := nested(key, value, step, loop.state.val_set)) is not None:
                self._dropped.add(step)
                warnings.warn(said, HookfitWarning, stacklevel=user_level())

    def batch_events(self, loop: Run) -> tuple[str, ...]:
        """``batch_start`` with several validation sets (``Loop(val_data={...})``), where a set's end closes its metric
        objects; else ``batch_end`` alone."""
        return ("batch_end", "batch_start") if isinstance(loop.val_data, Mapping) else ("batch_end",)

    @hookimpl
    def batch_start(self, loop: Run) -> None:
        """The first batch of a validation set: the metric objects of the set before it are computed now, before the
        step updates an object they share with this one (one torchmetrics object over every set)."""
        name = loop.state.val_set
        if not loop.training and name != self._val_set and self._stage is not None:
            if self._val_set is not None:
                self._stage.close_metrics(f"{self._val_set}/")
            self._val_set = name
            self._publishing(loop, "valid", first=True)  # each set's first batch is looked at (_first_batch)

    def _first_batch(self, loop: Run, agg: Stage, output: Mapping[str, Any] | None, batch: Any) -> None:
        """``batch_end``'s end for a stage's first batch (each validation set's): an ambiguous inferred batch size is
        warned of (:func:`.batches.warn_ambiguous`), the stage's publishing set, the batch published or folded."""
        if output is None or output.get("batch_size") is None:
            warn_ambiguous(batch, self._step(loop), self._stage_name, loop.state.val_set, self._said_sizes)
        self._publishing(loop, self._stage_name)
        now, every = _clock(), self._every
        if every.due(agg.batches) if every is not None else now >= self._next_publish:
            self._next_publish = now + self.interval
            self._publish(loop)
        elif not agg.batches % FOLD_EVERY:
            agg.read()

    @staticmethod
    def _step(loop: Run) -> Step | None:
        """The step function of the running stage (named when a value is refused)."""
        return loop.train_step if loop.training else loop.val_step

    def _first(self, where: dict[str, list[E]], key: str, value: object, loop: Run) -> list[E]:
        """The new list of ``key``'s values in ``where``, once its first value is checked."""
        agg = self._stage
        assert agg is not None  # inside a stage
        return agg.entries(where, key, value, self._step(loop))

    def _publish(self, loop: Run) -> None:
        call = loop.hooks.metrics_update
        if call is not None or self._every is not None:  # several processes: each joins the reduction, heard or not
            snapshot = self.snapshot()
            if call is not None:
                call(loop, loop.state.stage, snapshot)

    @hookimpl(trylast=True)  # after every stage_end that finishes the stage's work (optim's)
    def stage_end(self, loop: Run, stage: str) -> None:
        agg = self._stage
        assert agg is not None
        self._final(loop, stage, agg)
        self._stage_name, self._stage = self._outer.pop() if self._outer else (None, None)
        if self._stage is not None:  # back in the training stage a validation ran inside
            self._stage.resume()
            self._publishing(loop, self._stage_name)

    def _final(self, loop: Run, stage: str, agg: Stage, keep: bool = True) -> None:
        """Publish ``agg``, the aggregate of ``stage``, in ``epoch_metrics``: the stage's end,
        or (``keep=False``) a stage a stop cut short, whose epoch the history does not keep."""
        agg.read()
        computed = agg.close_metrics()
        extra = metric_numbers(computed, stage, self._said_numbers)
        if (short := agg.unmerged(stage, loop.state.epoch)) is not None:  # resumed mid-way
            warnings.warn(short, HookfitWarning, stacklevel=user_level())
        values = agg.values(self._reduce(loop))
        for key, value in extra.items():
            values[key] = Value(value, value, value)
        gauges.add(loop, stage, values)
        self._sums.stage_end(loop, stage, values)
        self.derived.add(stage, values, final=True)
        entry = MappingProxyType({"epoch": loop.state.epoch, "step": loop.state.step,  # HISTORY_FIELDS
                                  **{k: v.epoch for k, v in values.items()}})
        history = self.history.setdefault(stage, collections.deque(maxlen=self._history_epochs))
        if keep:
            history.append(entry)
        earlier: tuple[Mapping[str, Any], ...] = tuple(history) if keep else (*history, entry)
        if history.maxlen is not None:  # as long as the history kept
            earlier = earlier[len(earlier) - history.maxlen:]
        snapshot = self.snapshot(values=values, final=True, stage=stage, history=earlier, agg=agg)
        # a stage an interrupting stop cut short: the run's last value, never its best (max_steps completes a run)
        self.report.take(stage, loop.state.epoch, {k: v.epoch for k, v in values.items()},
                         best=not cut_short(loop, snapshot))
        if (call := loop.hooks.epoch_metrics) is not None:
            call(loop, stage, snapshot)

    @hookimpl  # after the checkpoint's tryfirst fit_end: what it saves never counts a partial stage
    def fit_end(self, loop: Run) -> None:
        """A run that stopped inside a stage (a stop request, ``max_steps``) publishes that
        stage's epoch as it got (``final``, ``batches < total``), the innermost first (a
        validation inside training, then the training stage). Not after a failure or an abort
        (a second Ctrl-C): the run ended at no boundary, and other processes may be gone. A
        stage with no batch of this run publishes nothing (a resumed one re-publishes no
        earlier run's epoch)."""
        state = loop.state
        try:
            if self.loop is not None and state.status != "failed" and state.stop_reason != "KeyboardInterrupt":
                open_stages = [*self._outer, (self._stage_name, self._stage)]
                for stage, agg in reversed(open_stages):
                    if stage is not None and agg is not None and agg.batches > agg.start_batches:
                        self._final(loop, stage, agg, keep=False)
        finally:
            self._stage, self._outer, self._stage_name = None, [], None
            self.loop = None

    @hookimpl(optionalhook=True)  # the core's, asked after fit_end
    def results(self) -> dict[str, Any]:
        """``{"metrics": {"<stage>/<name>": last epoch value}, "best": {"<stage>/<name>":
        (best value, epoch counted from 1)}}``, best only for the metrics with a direction."""
        return self.report.answer()

    @hookimpl
    def save_state(self, loop: Run) -> dict[str, Any]:
        """History, and the aggregate of the training stage in progress (if any): every
        process's, with several (:mod:`hookfit.plugins.metrics.ranks`)."""
        running = [agg for name, agg in (*self._outer, (self._stage_name, self._stage))
                   if name == "train" and agg is not None]
        stage = running[0].state() if running else None
        if stage is not None and (reduce := self._reduce(loop)) is not None:
            stage = ranks.gather(stage, loop.state.rank, loop.state.world_size, reduce)
        return {
            "history": {s: [dict(e) for e in h] for s, h in self.history.items()},
            "train_stage": stage,
            "results": self.report.state(),
            "sums": list(self.sums),  # how the training stage's series aggregate
        }

    @hookimpl
    def load_state(self, loop: Run, state: Mapping[str, Any]) -> None:
        for stage, entries in state["history"].items():
            self.history[stage] = collections.deque(
                (MappingProxyType(dict(e)) for e in entries), maxlen=self._history_epochs)
        if loop.mode == "fit":  # Loop.validate(resume=...) reports its validation alone
            self.report.load(state.get("results"), self.history)
        if state.get("train_stage") is not None:
            mine = ranks.own(state["train_stage"], loop.state.rank, loop.state.world_size)
            self._sums.resumed(mine["series"], state.get("sums", ()))
            self._resumed = Stage.from_state(self.window, mine, self._sums.keys())

    def _reduce(self, loop: Run) -> Reduce | None:
        """The all-reduce to use for a publication, or None with one process."""
        call = loop.hooks.all_reduce
        if call is None or loop.state.world_size <= 1:
            return None
        return lambda tensor: call(loop, tensor)

    # -- snapshots and log ------------------------------------------------------------------
    def snapshot(self, values: dict[str, Value] | None = None, final: bool = False, *, stage: str | None = None,
                 history: tuple[Mapping[str, Any], ...] | None = None, agg: Stage | None = None) -> MetricsSnapshot:
        """The current aggregate of the running stage (or ``agg``, that of ``stage``), as published."""
        loop, agg = self.loop, agg or self._stage
        assert loop is not None and agg is not None  # inside a stage of a run
        stage = stage or loop.state.stage or "train"
        if values is None:
            agg.read()
            values = agg.values(None if self._local else self._reduce(loop))
            gauges.add(loop, stage, values, taken=agg.metric_objects.keys() | agg.computed.keys())
            self.derived.add(stage, values, final=False)
        if history is None:
            history = tuple(self.history.get(stage, ())) if final else ()
        return snapshots.build(loop, stage, agg, values, self.directions, final=final, history=history)
