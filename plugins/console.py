r"""console: plain-text progress for pipes, CI logs, batch schedulers and notebooks.

Every line is complete, starts with ``hookfit`` and is made of ``key=value`` fields, so logs
can be grepped; no carriage returns, backspaces or escape codes, ever.

Quoting, one rule for keys and values alike (metric names are keys, and values of
``metric=``): a key or a value is written as it is unless it is empty or holds white space, a
quote (``"`` or ``'``), ``=``, a backslash or a character that does not print (a line break, a
tab, an escape code); then it is written in double quotes, with ``\\``, ``\"``, ``\n``, ``\r``,
``\t`` and ``\xNN``/``\uNNNN`` for those characters, so a line stays one line and splits into
its fields: ``hookfit train epoch=1/3 done ... loss=0.25 "top 1 acc"=0.5 "f=1"=0.7``. A field
reads back with the regular expression ``("(?:\\.|[^"\\])*"|[^\s=]+)=("(?:\\.|[^"\\])*"|\S*)``,
and Python's ``ast.literal_eval`` turns a quoted part into the text it was. The free-text
fields (``reason``, ``by``, ``last_reason``, ``error``, ``message``) are always quoted.

Epoch summaries
    Every stage of every epoch gets its summary line, however quickly the epochs come (a log
    that skips epochs cannot be compared with another run's): ``hookfit train epoch=<e>/<max>
    done batches=<n> time=<s>s samples_per_s=<x> <metric>=<epoch mean>...``. A stage that ended early (a
    stop or ``max_steps`` inside the epoch: ``batches < total``, or for data without a length its summary
    coming after the run's end) says so, lest it be read as a whole epoch: ``partial batches=37/100``; a
    validation every N steps (``val_every_n_steps``) says after which: ``step=<n>``.
    ``interval`` and ``every_n_batches`` bound the progress lines, never the summaries.

Progress lines
    ``hookfit train epoch=<e>/<max> batch=<n>/<total> samples_per_s=<x> eta=<h:mm:ss>
    <metric>=<running mean>...``, from the metrics plugin's ``metrics_update`` snapshots, at
    most every ``interval`` seconds (10; ``None``: never by time), however fast the steps are.
    ``every_n_batches=N`` adds a line at every N-th training batch of an epoch (batches N,
    2N... from the epoch's start, a resumed epoch's included), whatever the time, with the
    values of the epoch's latest snapshot; when that is of an earlier batch (the metrics plugin
    publishes at most every ``Metrics(interval=...)`` seconds) the line says which:
    ``metrics_at_batch=<n>``. Any progress line restarts the ``interval`` clock, so with both
    a line by time comes only when N batches take longer than ``interval`` seconds, and no
    batch is reported twice. ``Console(every_n_batches=200, interval=None)`` prints by batches
    only. Validation progress is by time only.

The rest
    The first line names the run's plugins as the user knows them (discovered or given,
    enabled and registered; not the helpers a plugin registers for itself). Then comes the
    size of the model (:func:`hookfit.plugins.support.summary.summarize`; nothing without
    ``Loop(model=...)``): ``hookfit model params=<n> trainable=<n> size_mb=<MB>`` (parameters
    and buffers, in MB of 2**20 bytes; ``uninitialised=<n>`` for the tensors of lazy modules
    not initialised yet), and ``hookfit model module=<name> type=<class> params=<n>
    trainable=<n> size_mb=<MB>`` for each top-level module (``tied_to=<module>`` where it shares a
    tied weight, counted in that earlier one; at most ``MODULE_LINES``, then ``hookfit model
    more_modules=<n>``). A resumed run says where it continues from
    (``hookfit resumed from=<checkpoint> epoch=<from 1> batch=<n> step=<n>``). At the end: the
    status, the reason, the duration and, for every metric, its last epoch value and its best
    or its extremes over the whole run (a resumed run's include the epochs of the run it
    continues, the summaries' ``history``; ``Loop.validate(resume=...)`` reports its own
    validation alone, as its ``results["best"]``); last, where each stage's time went
    (``loop.state.time_split``): ``hookfit time stage=train batches=<n> time=<s>s data=<%>
    step=<%> plugins=<%>`` and, when waiting for data is more than
    :data:`hookfit.payloads.DATA_BOTTLENECK` (20 %) of a stage's time, a plain warning:
    ``hookfit bottleneck stage=train part=data share=45% message="data loading is 45% of
    training time: the data loader is the bottleneck (try DataLoader num_workers)"``, the advice from
    the stage's data (:func:`hookfit.plugins.support.faster_data`). A run that a stop interrupted
    or an exception failed ends with where to continue from: the newest checkpoint the checkpoint
    role announced (``checkpoint_saved``; the stop's own, where it saved one; never a failure's
    ``failed-*`` file), else the one the run resumed from, ``hookfit checkpoint reason=interrupt
    path=<file> resume="run again with Loop(..., resume=<this path>)"`` (the file relative to the
    current folder where it lies inside it, else absolute, a one-file checkpoint's and a sharded one's alike)
    (:mod:`hookfit.plugins.support.resumable`); nothing without a checkpoint.

Several processes (``torchrun``: rank 0 prints)
    Every figure counts the whole job, as one process running it would: samples and metrics as the snapshots carry
    them (summed over the processes), batches those of every process (the start line says ``processes=<n>``; each
    runs as many training batches, so ``batch=20/64`` is 10 of 32 on each of 2; ``every_n_batches`` counts so).
    Validation progress (the metrics role reduces a validation at its end only) and the ``time`` and ``bottleneck``
    lines (measured per process) are rank 0's and say ``rank=0``; a validation summary counts ``samples=<n>``, as
    the processes' parts differ by a batch.

When a dashboard claims the terminal (the ``claim_output`` event), the console stays silent
unless given a stream of its own. Progress comes from whichever plugin publishes
``metrics_update``/``epoch_metrics`` (:class:`hookfit.payloads.MetricsSnapshot`); without one,
only the start, the end (and with ``every_n_batches`` the position: ``batch=<n>/<total>``).

Which value is best is configuration, never guessed from a name (``mae`` and ``perplexity`` are best low,
``accuracy`` high). By default it is what the snapshots carry (:attr:`hookfit.payloads.MetricsSnapshot.best`,
configured in the metrics plugin); ``Console(best={"loss": "min", "accuracy": "max", "valid/f1": "max"})``, keyed by
metric name or ``"<stage>/<metric>"`` (which wins over the bare name), wins for the names it lists. A metric with a
direction gets ``last=... best=... best_epoch=...``; one without gets ``last=... min=... min_epoch=... max=...
max_epoch=...``. Epochs count from 1; NaN and infinities are never best (:class:`hookfit.plugins.support.Monitor`),
nor lowest or highest: a metric with no finite value gets ``last=nan`` alone, as ``results["best"]`` has no entry
for it. A stage a stop that interrupted the run cut short gives the last value, never the best (as ``results["best"]``),
and the line says so: ``last=2.239 last_partial=true best=2.331 best_epoch=1`` (that last value is the mean over the batches
the stage ran, not a whole epoch's), as ``hookfit runs`` and ``hookfit compare`` say ``(partial)``; a stage the stop
came right after the last batch of is whole.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any, Mapping, TextIO

from hookfit import hookimpl
from hookfit.config import records_options
from hookfit.data import length
from hookfit.payloads import MetricsSnapshot, ModelSummary, ModuleRow, ResumeInfo, TimeSplit
from hookfit.plugins.support import MODES, Every, Monitor, faster_data, number, option_error
from hookfit.plugins.support.plain import duration as _duration
from hookfit.plugins.support.plain import field as _field
from hookfit.plugins.support.plain import number as _number
from hookfit.plugins.support.plain import quote
from hookfit.plugins.support import skips
from hookfit.plugins.support.resumable import RESUME, LastCheckpoint
from hookfit.plugins.support.summary import summarize
from hookfit.plugins.support.best import cut_short

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

MODULE_LINES = 30
"""The most ``hookfit model module=...`` lines printed at the start; more are counted."""

_clock = time.monotonic  # the console's clock for ``interval`` (a test may stand a fake in)

_STAGE_TIME = {"train": "training time", "valid": "validation time"}


def _directions(best: Any) -> dict[str, str]:
    """``Console(best=...)`` checked: a mapping of metric names (or ``"stage/metric"``) to
    ``"min"`` or ``"max"``."""
    if best is None:
        return {}
    if not isinstance(best, Mapping):
        raise TypeError(f"console: best must map metric names to 'min' or 'max', e.g. "
                        f"best={{'loss': 'min', 'accuracy': 'max'}}; got {type(best).__name__} {best!r}")
    out = {}
    for key, direction in best.items():
        if not isinstance(key, str) or not key or key.endswith("/") or key.startswith("/"):
            raise ValueError(f"console: best has the key {key!r}; keys are metric names ('loss') or "
                             f"'<stage>/<metric>' ('valid/loss')")
        if direction not in MODES:
            raise ValueError(f"console: best[{key!r}] is {direction!r}; the direction of a metric is "
                             f"'min' (lower is better) or 'max' (higher is better)")
        out[key] = direction
    return out


class _Extremes:
    """The last, lowest and highest epoch values of one metric of one stage (the first of equal
    values stays; NaN and infinities are never lowest or highest, as never best)."""

    __slots__ = ("last", "low", "high", "cut")

    def __init__(self) -> None:
        self.low, self.high = Monitor(mode="min"), Monitor(mode="max")
        self.cut = False  # the last value is of a stage a stop cut short

    def add(self, value: float, epoch: int, whole: bool = True) -> None:
        self.last, self.cut = value, not whole
        if whole:  # a stage a stop that interrupted the run cut short: the last value, never the lowest or highest
            self.low.update(value, at=epoch)
            self.high.update(value, at=epoch)

    def best(self, direction: str) -> tuple[float, int] | None:
        """The lowest (``"min"``) or highest (``"max"``) value and its epoch; ``None`` with no finite value."""
        return (self.low if direction == "min" else self.high).record


@records_options
class Console:
    """Grep-able progress and every epoch's summary on a text stream (each line: the module's docstring).

    ``stream``: where to write (standard output by default). ``interval``: seconds between
    progress lines, at least (``None``: no line by time). ``every_n_batches``: a progress line
    at every N-th training batch of an epoch as well (``None``: none). ``best``: which way is
    best for metrics, by name or ``"<stage>/<metric>"``, over the snapshots' own
    :attr:`~hookfit.payloads.MetricsSnapshot.best`.
    """

    name = "console"
    observer = True  # a renderer: its failures switch it off, never the run

    def __init__(self, stream: TextIO | None = None, interval: float | None = 10.0, *,
                 every_n_batches: int | None = None, best: Mapping[str, str] | None = None) -> None:
        if stream is not None and not callable(getattr(stream, "write", None)):
            raise option_error(self.name, "stream", stream, "be a text stream (with write()), or None for standard "
                               "output", shown=type(stream).__name__)
        self.stream = stream
        self.interval = number(self.name, "interval", interval, least=0, none=True,
                               meaning="seconds between progress lines")
        self._every = Every(every_n_batches, plugin=self.name, option="every_n_batches",
                            meaning="training batches between progress lines")
        self.every_n_batches = self._every.n
        self._every_n = self._every.n or 1
        self.best = _directions(best)
        """Metric name or ``"stage/metric"`` -> ``"min"`` or ``"max"`` (which value is best),
        given to the console: wins over the snapshots' :attr:`~hookfit.payloads.MetricsSnapshot.best`."""
        self._published: dict[tuple[str, str], str] = {}  # (stage, metric) -> the snapshots' direction
        self._last_progress = 0.0
        self._last_line: tuple[str, int, int] | None = None  # (stage, epoch, batch) of the last progress line
        self._latest: MetricsSnapshot | None = None  # the last metrics_update snapshot
        self._total: int | None = None  # training batches per epoch, when the data has a length
        self._by_steps = False  # max_steps ends the run before its last epoch (fit_start)
        self._results: dict[tuple[str, str], _Extremes] = {}
        self._stages: set[str] = set()  # stages with an epoch summary in this run
        self._skipped: dict[str, int] = {}  # optimizer steps skipped (step_skipped), by optimizer; the last why
        self._attempted: dict[str, int] = {}  # by optimizer, its steps attempted before the run (skips.attempted)
        self._skip_reason = ""
        self._resumable = LastCheckpoint()  # the newest checkpoint announced that resume="latest" takes
        self._silent, self._world, self._rank = False, 1, 0  # (fit_start) the run's processes, this one's rank

    def direction(self, stage: str, metric: str) -> str | None:
        """``"min"``, ``"max"`` or ``None`` (not configured) for ``metric`` of ``stage``: the
        console's own ``best`` first, then what the stage's snapshots carry."""
        return self.best.get(f"{stage}/{metric}") or self.best.get(metric) or self._published.get((stage, metric))

    def _print(self, *fields: str) -> None:
        if not self._silent:
            print("hookfit " + " ".join(f for f in fields if f), file=self.stream or sys.stdout, flush=True)

    @hookimpl
    def fit_start(self, loop: Run) -> None:
        # a full-screen renderer owns the terminal; writing to a stream given explicitly is fine
        claim = loop.hooks.claim_output
        self._silent = self.stream is None and claim is not None and claim(loop) is not None
        self._last_progress = _clock()
        self._last_line = self._latest = None
        for kept in (self._results, self._stages, self._published):
            kept.clear()
        self._skipped, self._skip_reason, self._attempted = {}, "", skips.attempted(loop.optimizers)
        self._resumable.clear()
        self._world, self._rank = max(loop.state.world_size, 1), loop.state.rank
        data = loop.train_data
        self._total = length(data)
        total = self._total * self._world if self._total is not None and loop.mode == "fit" else None
        plugins = ",".join(loop.pm.participants())  # as the user knows them: no helpers
        # max_steps ends the run before the last epoch does (or epochs of unknown length), or
        # Loop.validate() labels its one validation with the checkpoint's epoch: the epochs are
        # counted without a total, as the dashboard counts them
        steps = loop.max_steps
        self._by_steps = loop.mode != "fit" or (
            steps is not None and (self._total is None or steps < loop.max_epochs * self._total))
        self._print("start", "" if self._by_steps else f"epochs={loop.max_epochs}",
                    f"max_steps={steps}" if steps is not None else "",
                    f"batches_per_epoch={total}" if total is not None else "",
                    f"processes={self._world}" if self._world > 1 else "", f"plugins={plugins}")
        if loop.model is not None and loop.is_main and not self._silent:
            self._print_model(summarize(loop.model))
        if not self._every.never:
            loop.hooks.resolve()  # batch_events' answer is known now that the console knows if it is silent

    def _epoch(self, epoch: int, of: int) -> str:
        """``epoch=E/N``, or ``epoch=E`` when ``max_steps`` ends the run first or in
        ``Loop.validate()`` (see fit_start)."""
        return f"epoch={epoch}" if self._by_steps else f"epoch={epoch}/{of}"

    def _print_model(self, summary: ModelSummary) -> None:
        def size(part: ModelSummary | ModuleRow) -> tuple[str, ...]:
            return (f"params={part.parameters}", f"trainable={part.trainable}", f"size_mb={part.size_mb:.2f}",
                    f"uninitialised={part.uninitialised}" if part.uninitialised else "")

        self._print("model", *size(summary))
        for row in summary.modules[:MODULE_LINES]:
            self._print("model", _field("module", row.name), f"type={row.type}", *size(row),
                        _field("tied_to", ",".join(row.tied)) if row.tied else "")
        if len(summary.modules) > MODULE_LINES:
            self._print("model", f"more_modules={len(summary.modules) - MODULE_LINES}")

    @hookimpl
    def resumed(self, loop: Run, info: ResumeInfo) -> None:
        self._attempted = skips.attempted(loop.optimizers)  # the steps of the runs it continues are not this one's
        self._print("resumed", _field("from", str(info.source)), f"epoch={info.epoch + 1}",
                    f"batch={info.batch * self._world}", f"step={info.step}")
        self._resumable.announced(str(info.source), "resumed")  # (until the run saves one of its own)

    @hookimpl
    def metrics_update(self, stage: str, metrics: MetricsSnapshot) -> None:
        self._latest = metrics
        if self.interval is not None and (now := _clock()) - self._last_progress >= self.interval:
            self._progress(stage, metrics, metrics.batches, now)

    def _progress(self, stage: str, metrics: MetricsSnapshot, batch: int, now: float) -> None:
        """A progress line at ``batch`` of ``stage``, with the values of ``metrics`` (a snapshot
        of this stage and epoch, taken at ``batch`` or before it: then the line says where)."""
        self._last_progress = now
        self._last_line = (stage, metrics.epoch, batch)
        total = metrics.total
        left = None if total is None or not metrics.batches else max(total - batch, 0) * metrics.step_time
        per = self._world if stage == "train" else 1  # the job's batches (the module's docstring)
        self._print(stage, self._epoch(metrics.epoch + 1, metrics.max_epochs), self._own(stage),
                    f"batch={batch * per}" + (f"/{total * per}" if total is not None else ""),
                    f"samples_per_s={metrics.samples_per_s:.1f}", f"eta={_duration(left)}" if left is not None else "",
                    f"metrics_at_batch={metrics.batches * per}" if metrics.batches != batch else "",
                    *(_field(k, _number(v.running)) for k, v in metrics.values.items()))

    def batch_events(self, loop: Run) -> tuple[str, ...]:
        """``batch_end`` only when lines are due by batch (``every_n_batches``) and the console
        prints: otherwise batches cost the console nothing."""
        return () if self._every.never or self._silent else ("batch_end",)

    @hookimpl(trylast=True)  # after the metrics plugin's batch_end, which may publish this batch
    def batch_end(self, loop: Run, output: Mapping[str, Any] | None, batch: Any, batch_idx: int) -> None:
        # (every argument of the event: the loop calls it without an adapter); due when the job's count
        # of batches reaches or passes a multiple of every_n_batches
        if loop.training and (batch_idx + 1) * self._world % self._every_n < self._world:
            self._batch_due(loop, batch_idx + 1)

    def _batch_due(self, loop: Run, batch: int) -> None:
        """The line for ``every_n_batches``: training batch ``batch`` of the epoch is done."""
        epoch = loop.state.epoch
        if self._last_line == ("train", epoch, batch):  # this batch was just reported, by time
            return
        latest = self._latest
        if latest is not None and latest.stage == "train" and latest.epoch == epoch and latest.batches <= batch:
            self._progress("train", latest, batch, _clock())
            return
        # no snapshot of this epoch yet (or no metrics plugin): the position only
        self._last_progress, self._last_line = _clock(), ("train", epoch, batch)
        total = f"/{self._total * self._world}" if self._total is not None else ""
        self._print("train", self._epoch(epoch + 1, loop.max_epochs), f"batch={batch * self._world}{total}")

    @hookimpl
    def epoch_metrics(self, loop: Run, stage: str, metrics: MetricsSnapshot) -> None:
        epoch = metrics.epoch + 1
        for key, direction in metrics.best.items():
            self._published[(stage, key)] = direction
        if stage not in self._stages:  # the stage's first epoch in this run: a resumed run's earlier ones first
            self._stages.add(stage)
            earlier = metrics.history[:-1] if loop.mode == "fit" else ()  # Loop.validate(): its validation alone
            for entry in earlier:  # (the last entry is this epoch's)
                for key, value in entry.items():
                    if key not in ("epoch", "step") and isinstance(value, (int, float)) and not isinstance(value, bool):
                        self._extremes(stage, key, float(value), int(entry["epoch"]) + 1)
        for key, value in metrics.values.items():
            self._extremes(stage, key, value.epoch, epoch, not cut_short(loop, metrics))
        self._last_progress = _clock()
        total = metrics.total
        partial = metrics.batches < total if total is not None else loop.state.stop_reason is not None
        per = self._world if stage == "train" else 1
        count = (f"samples={metrics.samples}" if self._own(stage)  # the processes' parts differ
                 else f"batches={metrics.batches * per}" + (f"/{total * per}" if partial and total else ""))
        at = (f"step={metrics.step}",) if stage != "train" and loop.val_every_n_steps else ()
        self._print(stage, self._epoch(epoch, metrics.max_epochs), "partial" if partial else "done", count, *at,
                    f"time={metrics.elapsed:.2f}s", f"samples_per_s={metrics.samples_per_s:.1f}",
                    *(_field(k, _number(v.epoch)) for k, v in metrics.values.items()))

    def _extremes(self, stage: str, key: str, value: float, epoch: int, whole: bool = True) -> None:
        if (result := self._results.get((stage, key))) is None:
            self._results[(stage, key)] = result = _Extremes()
        result.add(value, epoch, whole)

    @hookimpl
    def step_skipped(self, optimizer: str, reason: str) -> None:
        self._skipped[optimizer], self._skip_reason = self._skipped.get(optimizer, 0) + 1, reason

    @hookimpl(optionalhook=True)
    def checkpoint_saved(self, path: str, reason: str) -> None:
        self._resumable.announced(path, reason)  # (announced in order: the last is the newest)

    @hookimpl(trylast=True)  # after the checkpoint role's fit_end, which saves and announces a stop's checkpoint
    def fit_end(self, loop: Run) -> None:
        state = loop.state
        self._print("end", f"status={state.status}", _field("reason", state.stop_reason or "", always=True),
                    _field("by", state.stopped_by, always=True) if state.stopped_by else "",
                    f"duration={state.elapsed:.2f}s", f"epochs={state.epoch + 1}", f"steps={state.step}")
        if self._skipped:  # optimizer steps skipped (step_skipped): the worst optimizer's share of its steps
            name, share = skips.worst_share(self._skipped, self._attempted, skips.attempted(loop.optimizers), state.step)
            self._print("skipped", f"steps={sum(self._skipped.values())}", f"share={share:.0%}",
                        _field("optimizer", name) if len(self._attempted) > 1 else "",
                        _field("last_reason", self._skip_reason, always=True),
                        'message="most steps were skipped: the run barely trained"' if share > 0.5 else "")
        for silenced in state.silenced:
            self._print("silenced", f"plugin={silenced.plugin}", f"hook={silenced.hook}",
                        _field("error", f"{type(silenced.error).__name__}: {silenced.error}", always=True))
        for (stage, key), result in self._results.items():
            direction = self.direction(stage, key)  # none configured: both extremes, no guess
            named = {"best": direction} if direction is not None else {"min": "min", "max": "max"}
            extremes = [f"{name}={_number(record[0])} {name}_epoch={record[1]}" for name, way in named.items()
                        if (record := result.best(way)) is not None]  # none: no finite value, as in results["best"]
            self._print("result", _field("stage", stage), _field("metric", key), f"last={_number(result.last)}",
                        "last_partial=true" if result.cut else "", *extremes)
        self._print_time(state.time_split, {"train": loop.train_data, "valid": loop.val_data})
        if (resumable := self._resumable.to_resume(state.status)) is not None:
            path, reason = resumable
            self._print("checkpoint", _field("reason", reason), _field("path", path), _field("resume", RESUME, always=True))

    def _own(self, stage: str = "") -> str:
        """``rank=R`` where a line's figures are this process's own (see the module's docstring)."""
        return f"rank={self._rank}" if self._world > 1 and stage != "train" else ""

    def _print_time(self, splits: Mapping[str, TimeSplit], data: Mapping[str, object]) -> None:
        """Where each stage's time went, and a plain warning when the data loader holds it up."""
        for stage, split in splits.items():
            self._print("time", _field("stage", stage), self._own(), f"batches={split.batches}",
                        f"time={split.total:.2f}s", *(f"{part}={share:.0%}" for part, share in split.shares.items()))
        for stage, split in splits.items():
            if split.data_bound:
                share = split.shares["data"]
                what = _STAGE_TIME.get(stage, f"{stage} time")
                self._print("bottleneck", _field("stage", stage), self._own(), "part=data", f"share={share:.0%}",
                            _field("message", f"data loading is {share:.0%} of {what}: the data loader is the "
                                              f"bottleneck ({faster_data(data.get(stage))})", always=True))

