"""console: plain-text progress for pipes, CI logs, batch schedulers and notebooks.

Every line is complete, starts with ``hookfit`` and is made of ``key=value`` fields, so logs
can be grepped; no carriage returns, backspaces or escape codes, ever. It never floods:
progress lines come at most every ``interval`` seconds, epoch summaries at most every
``summary_interval`` seconds (the last epoch's always), so the number of lines per minute is
bounded however fast the steps are. The first line names the run's plugins as the user knows
them (discovered or given, enabled and registered; not the helpers a plugin registers for
itself). Then comes the size of the model (:func:`hookfit.plugins.summary.summarize`; nothing for a
run without ``Loop(model=...)``): ``hookfit model params=<n> trainable=<n> size_mb=<MB>``
(parameters and buffers, in MB of 2**20 bytes; with ``uninitialised=<n>`` for the tensors of
lazy modules not initialised yet), and ``hookfit model module=<name> type=<class> params=<n>
trainable=<n> size_mb=<MB>`` for each top-level module (at most ``MODULE_LINES``, then
``hookfit model more_modules=<n>``). A resumed run says where it continues from (``hookfit
resumed from=<checkpoint> epoch=<from 1> batch=<n> step=<n>``), and at the end it prints the
status, the reason, the duration and, for every metric, its last epoch value and its best or
its extremes. Last comes where each stage's time went (``loop.state.time_split``, measured by
the loop): ``hookfit time stage=train batches=<n> time=<s>s data=<%> step=<%> plugins=<%>``, and
when waiting for data is more than :data:`hookfit.payloads.DATA_BOTTLENECK` (20 %) of a stage's
time (:attr:`hookfit.payloads.TimeSplit.data_bound`), a plain warning:
``hookfit bottleneck stage=train part=data share=45% message="data loading is 45% of training
time: the data loader is the bottleneck (try DataLoader num_workers, pin_memory)"``.

When a dashboard claims the terminal (the ``claim_output`` event), the console stays silent
unless it was given a stream of its own. Progress comes from whichever plugin publishes
``metrics_update``/``epoch_metrics`` (:class:`hookfit.payloads.MetricsSnapshot`); without one,
the console prints the start and the end of the run only.

Which value is best is configuration, never guessed from a name (``mae`` and ``perplexity``
are best low, ``accuracy`` high, and a name cannot say so reliably):
``Console(best={"loss": "min", "accuracy": "max", "valid/f1": "max"})``, keyed by metric name
or by ``"<stage>/<metric>"`` (which wins over the bare name). A metric with a direction gets
``last=... best=... best_epoch=...``; one without gets ``last=... min=... min_epoch=...
max=... max_epoch=...``. Epochs count from 1; NaN and infinities are never best
(:class:`hookfit.plugins.common.Monitor`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sized
from typing import TYPE_CHECKING, Any, Mapping, TextIO

from hookfit import hookimpl
from hookfit.payloads import MetricsSnapshot, ModelSummary, ModuleRow, ResumeInfo, TimeSplit
from hookfit.plugins.common import MODES, Monitor, number, option_error
from hookfit.plugins.summary import summarize

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

MODULE_LINES = 30
"""The most ``hookfit model module=...`` lines printed at the start; more are counted."""

_STAGE_TIME = {"train": "training time", "valid": "validation time"}


def _number(value: float) -> str:
    if value != value:  # NaN
        return "nan"
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}" if abs(value) < 1 else f"{value:.5g}"
    return f"{value:.3e}"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _field(key: str, value: str) -> str:
    """``key=value``, the value quoted when it has spaces or quotes (a path, say)."""
    if value and not any(c.isspace() or c in "\"'" for c in value):
        return f"{key}={value}"
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'{key}="{escaped}"'


DIRECTIONS = MODES


def _directions(best: Any) -> dict[str, str]:
    """``Console(best=...)`` checked: a mapping of metric names (or ``"stage/metric"``) to
    ``"min"`` or ``"max"``."""
    if best is None:
        return {}
    if not isinstance(best, Mapping):
        raise TypeError(
            f"console: best must map metric names to 'min' or 'max', e.g. "
            f"best={{'loss': 'min', 'accuracy': 'max'}}; got {type(best).__name__} {best!r}"
        )
    out = {}
    for key, direction in best.items():
        if not isinstance(key, str) or not key or key.endswith("/") or key.startswith("/"):
            raise ValueError(
                f"console: best has the key {key!r}; keys are metric names ('loss') or "
                f"'<stage>/<metric>' ('valid/loss')"
            )
        if direction not in DIRECTIONS:
            raise ValueError(
                f"console: best[{key!r}] is {direction!r}; the direction of a metric is "
                f"'min' (lower is better) or 'max' (higher is better)"
            )
        out[key] = direction
    return out


class _Extremes:
    """The last, lowest and highest epoch values of one metric of one stage (the first of equal
    values stays; NaN and infinities are never lowest or highest, unless there is nothing else)."""

    __slots__ = ("last", "first", "low", "high")

    def __init__(self, value: float, epoch: int) -> None:
        self.first = (value, epoch)
        self.low, self.high = Monitor(mode="min"), Monitor(mode="max")
        self.add(value, epoch)

    def add(self, value: float, epoch: int) -> None:
        self.last = value
        self.low.update(value, at=epoch)
        self.high.update(value, at=epoch)

    def best(self, direction: str) -> tuple[float, int]:
        """The lowest (``"min"``) or highest (``"max"``) value and its epoch; with no finite value,
        the first one."""
        record = (self.low if direction == "min" else self.high).record
        return record if record is not None else self.first


class Console:
    """Throttled, grep-able progress and summaries on a text stream."""

    name = "console"
    observer = True  # a renderer: its failures switch it off, never the run

    def __init__(self, stream: TextIO | None = None, interval: float = 10.0, summary_interval: float = 2.0,
                 best: Mapping[str, str] | None = None) -> None:
        if stream is not None and not callable(getattr(stream, "write", None)):
            raise option_error(self.name, "stream", stream, "be a text stream (with write()), or None for standard "
                               "output", shown=type(stream).__name__)
        self.stream = stream
        self.interval = number(self.name, "interval", interval, least=0, meaning="seconds between progress lines")
        self.summary_interval = number(self.name, "summary_interval", summary_interval, least=0,
                                       meaning="seconds between epoch summaries")
        self.best = _directions(best)
        """Metric name or ``"stage/metric"`` -> ``"min"`` or ``"max"`` (which value is best)."""
        self._last_progress = 0.0
        self._last_summary = 0.0
        self._results: dict[tuple[str, str], _Extremes] = {}
        self._silent = False

    def direction(self, stage: str, metric: str) -> str | None:
        """``"min"``, ``"max"`` or ``None`` (not configured) for ``metric`` of ``stage``."""
        return self.best.get(f"{stage}/{metric}") or self.best.get(metric)

    def _print(self, *fields: str) -> None:
        if self._silent:
            return
        stream = self.stream or sys.stdout
        print("hookfit " + " ".join(f for f in fields if f), file=stream, flush=True)

    @hookimpl
    def fit_start(self, loop: Run) -> None:
        # a full-screen renderer owns the terminal; writing to a stream given explicitly is fine
        claim = loop.hooks.claim_output
        self._silent = self.stream is None and claim is not None and claim(loop) is not None
        self._last_progress = self._last_summary = time.monotonic()
        self._results.clear()
        data = loop.train_data
        per_epoch = f"batches_per_epoch={len(data)}" if isinstance(data, Sized) else ""
        plugins = ",".join(loop.pm.participants())  # as the user knows them: no helpers
        self._print("start", f"epochs={loop.max_epochs}", per_epoch, f"plugins={plugins}")
        if loop.model is not None and loop.is_main and not self._silent:
            self._print_model(summarize(loop.model))

    def _print_model(self, summary: ModelSummary) -> None:
        def size(part: ModelSummary | ModuleRow) -> tuple[str, ...]:
            return (f"params={part.parameters}", f"trainable={part.trainable}", f"size_mb={part.size_mb:.2f}",
                    f"uninitialised={part.uninitialised}" if part.uninitialised else "")

        self._print("model", *size(summary))
        for row in summary.modules[:MODULE_LINES]:
            self._print("model", _field("module", row.name), f"type={row.type}", *size(row))
        if len(summary.modules) > MODULE_LINES:
            self._print("model", f"more_modules={len(summary.modules) - MODULE_LINES}")

    @hookimpl
    def resumed(self, info: ResumeInfo) -> None:
        self._print("resumed", _field("from", str(info.source)), f"epoch={info.epoch + 1}",
                    f"batch={info.batch}", f"step={info.step}")

    @hookimpl
    def metrics_update(self, stage: str, metrics: MetricsSnapshot) -> None:
        now = time.monotonic()
        if now - self._last_progress < self.interval:
            return
        self._last_progress = now
        total = f"/{metrics.total}" if metrics.total is not None else ""
        eta = metrics.eta
        self._print(
            stage,
            f"epoch={metrics.epoch + 1}/{metrics.max_epochs}",
            f"batch={metrics.batches}{total}",
            f"samples_per_s={metrics.samples_per_s:.1f}",
            f"eta={_duration(eta)}" if eta is not None else "",
            *(f"{k}={_number(v.running)}" for k, v in metrics.values.items()),
        )

    @hookimpl
    def epoch_metrics(self, loop: Run, stage: str, metrics: MetricsSnapshot) -> None:
        epoch = metrics.epoch + 1
        for key, value in metrics.values.items():
            result = self._results.get((stage, key))
            if result is None:
                self._results[(stage, key)] = _Extremes(value.epoch, epoch)
            else:
                result.add(value.epoch, epoch)
        now = time.monotonic()
        last_epoch = metrics.epoch + 1 == loop.max_epochs
        if now - self._last_summary < self.summary_interval and not last_epoch:
            return
        self._last_summary = self._last_progress = now
        self._print(
            stage,
            f"epoch={metrics.epoch + 1}/{metrics.max_epochs}",
            "done",
            f"batches={metrics.batches}",
            f"time={metrics.elapsed:.2f}s",
            f"samples_per_s={metrics.samples_per_s:.1f}",
            *(f"{k}={_number(v.epoch)}" for k, v in metrics.values.items()),
        )

    @hookimpl(trylast=True)
    def fit_end(self, loop: Run) -> None:
        state = loop.state
        reason = (state.stop_reason or "").replace('"', "'")
        self._print(
            "end",
            f"status={state.status}",
            f'reason="{reason}"',
            f'by="{state.stopped_by}"' if state.stopped_by else "",
            f"duration={state.elapsed:.2f}s",
            f"epochs={state.epoch + 1}",
            f"steps={state.step}",
        )
        for silenced in state.silenced:
            self._print("silenced", f"plugin={silenced.plugin}", f"hook={silenced.hook}",
                        f'error="{type(silenced.error).__name__}: {silenced.error}"'.replace("\n", " "))
        for (stage, key), result in self._results.items():
            direction = self.direction(stage, key)
            extremes: tuple[str, ...]
            if direction is None:  # no direction configured: both extremes, no guess
                (low, low_epoch), (high, high_epoch) = result.best("min"), result.best("max")
                extremes = (f"min={_number(low)}", f"min_epoch={low_epoch}",
                            f"max={_number(high)}", f"max_epoch={high_epoch}")
            else:
                best, best_epoch = result.best(direction)
                extremes = (f"best={_number(best)}", f"best_epoch={best_epoch}")
            self._print("result", f"stage={stage}", f"metric={key}", f"last={_number(result.last)}", *extremes)
        self._print_time(state.time_split)

    def _print_time(self, splits: Mapping[str, TimeSplit]) -> None:
        """Where each stage's time went, and a plain warning when the data loader holds it up."""
        for stage, split in splits.items():
            shares = split.shares
            self._print("time", _field("stage", stage), f"batches={split.batches}", f"time={split.total:.2f}s",
                        *(f"{part}={share:.0%}" for part, share in shares.items()))
        for stage, split in splits.items():
            if split.data_bound:
                share = split.shares["data"]
                what = _STAGE_TIME.get(stage, f"{stage} time")
                self._print("bottleneck", _field("stage", stage), "part=data", f"share={share:.0%}",
                            _field("message", f"data loading is {share:.0%} of {what}: the data loader is the "
                                              f"bottleneck (try DataLoader num_workers, pin_memory)"))
