"""console: plain-text progress for pipes, CI logs, batch schedulers and notebooks.

Every line is complete, starts with ``hookfit`` and is made of ``key=value`` fields, so logs
can be grepped; no carriage returns, backspaces or escape codes, ever. It never floods:
progress lines come at most every ``interval`` seconds, epoch summaries at most every
``summary_interval`` seconds (the last epoch's always), so the number of lines per minute is
bounded however fast the steps are. At the end it prints the status, the reason, the
duration and, for every metric, its last and best epoch value.

When a dashboard claims the terminal (the ``claim_output`` event), the console stays silent
unless it was given a stream of its own. Progress comes from whichever plugin publishes
``metrics_update``/``epoch_metrics`` (:class:`hookfit.payloads.MetricsSnapshot`); without one,
the console prints the start and the end of the run only. "Best" is the lowest value for
names containing ``loss`` or ``err``, the highest for others.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from hookfit import hookimpl
from hookfit.payloads import MetricsSnapshot
from hookfit.run import Run


def _number(value: float) -> str:
    if value != value:  # NaN
        return "nan"
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}" if abs(value) < 1 else f"{value:.5g}"
    return f"{value:.3e}"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _lower_is_better(name: str) -> bool:
    return "loss" in name or "err" in name


class Console:
    """Throttled, grep-able progress and summaries on a text stream."""

    name = "console"
    observer = True  # a renderer: its failures switch it off, never the run

    def __init__(self, stream: TextIO | None = None, interval: float = 10.0, summary_interval: float = 2.0) -> None:
        self.stream = stream
        self.interval = interval
        self.summary_interval = summary_interval
        self._last_progress = 0.0
        self._last_summary = 0.0
        self._best: dict[tuple[str, str], tuple[float, int]] = {}
        self._last: dict[tuple[str, str], float] = {}
        self._silent = False

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
        self._best.clear()
        self._last.clear()
        data = loop.train_data
        per_epoch = f"batches_per_epoch={len(data)}" if hasattr(data, "__len__") else ""
        plugins = ",".join(name for name, _ in loop.pm.list_name_plugin())
        self._print("start", f"epochs={loop.max_epochs}", per_epoch, f"plugins={plugins}")

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
        for key, value in metrics.values.items():
            self._last[(stage, key)] = value.epoch
            best = self._best.get((stage, key))
            better = min if _lower_is_better(key) else max
            if best is None or better(value.epoch, best[0]) != best[0]:
                self._best[(stage, key)] = (value.epoch, metrics.epoch + 1)
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
        for (stage, key), last in self._last.items():
            best, epoch = self._best[(stage, key)]
            self._print("result", f"stage={stage}", f"metric={key}", f"last={_number(last)}",
                        f"best={_number(best)}", f"best_epoch={epoch}")
