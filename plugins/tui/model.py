"""What the dashboard knows of a run, without urwid: :class:`DashboardModel` and the text helpers
its screens and summaries share.

The model receives messages through :meth:`DashboardModel.receive` (snapshots published by the
metrics plugin, stage changes, skipped steps, checkpoints, the end of the run, and ``tick``: the
run's counters as the renderer's UI thread reads them from ``loop.state``), answers keys through
:meth:`DashboardModel.keypress` and says what the screen shows in words (status, progress,
banner, key help). :class:`hookfit.plugins.tui.dashboard.Dashboard` draws it with urwid;
``hookfit show --text`` and the summary printed after a run read it as it is, so they work
where urwid is not installed. It holds no reference to other plugins: a stop is asked for
through the ``on_stop`` callback it is given.

Progress is counted in what ends the run: steps when ``max_steps`` comes before the end of the
last epoch, epochs otherwise. While a run is live the bars follow the batches (the ``tick``
message, a few times a second, at no cost to the training thread); replayed from a file they
follow the published rows. Once the run ended there is no ETA, and a completed run is at 100 %.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping
from typing import Any, Callable

from hookfit.payloads import MetricsSnapshot, ModelSummary, ResumeInfo, TimeSplit
from hookfit.plugins.support import Monitor
from hookfit.plugins.support.resumable import LastCheckpoint
from hookfit.plugins.support.plot import Series, spans_decades
from hookfit.plugins.tui import onsets, timeline
from hookfit.plugins.tui.skipped import SkippedSteps
from hookfit.plugins.tui.timeline import Progress
from hookfit.plugins.tui.text import KEYS, KeyHelp, clock, fit_parts, key_line
from hookfit.tools.runs import direction

RATE_WINDOW = 3.0
"""Seconds of counter readings the live training rate is measured over."""


class DashboardModel(SkippedSteps):
    """Metrics, curves, marks, progress and status of a run, as messages make them; see the
    module's documentation."""

    def __init__(self, max_epochs: int, val_every: int | None, on_stop: Callable[[], Any],
                 on_leave: Callable[[], None], max_steps: int | None = None) -> None:
        self.max_epochs = max_epochs
        self.max_steps = max_steps
        self.val_every = val_every
        self.on_stop = on_stop
        self.on_leave = on_leave
        self.started = time.monotonic()
        self.epoch = 0
        self.step = 0
        self.status = "running"
        self.reason: str | None = None
        self.stopped_by: str | None = None
        self.stopping: str | None = None
        self.finished = False
        self.evaluation = False  # the run is an evaluation (Loop.validate()), not a training
        self.hold = False
        self.elapsed: float | None = None  # the run's duration once it ended: the clock stops
        self.resumed_from: ResumeInfo | None = None
        self.resumable = LastCheckpoint()  # the checkpoint a run that did not complete continues from
        self.model: ModelSummary | None = None  # once the renderer sent it
        self.series: dict[tuple[str, str], Series] = {}
        self.onsets = onsets.Onsets()  # where the training curves' non-finite runs could have begun
        self.table: dict[str, dict[str, float | None]] = {}
        self.directions: dict[tuple[str, str], str] = {}  # (stage, metric) -> "min"/"max", from the snapshots
        self.names: list[str] = []
        self.selected = 0
        self.table_page = 0
        self.table_pages = 1  # as many as the last frame had
        self.recent = False
        self.log_scale: bool | None = None  # None: automatic (see plot.spans_decades)
        self.keys: KeyHelp = KEYS
        self.show_help = False
        self.progress = Progress()
        self.live = False  # the renderer sends the run's counters (tick): the bars follow the batches
        self._samples: collections.deque[tuple[float, int]] = collections.deque()  # (time, step) of ticks
        self._open: list[str] = []  # the stages running, outermost first
        self._waiting: list[tuple[str, int, int | None, float]] = []  # progress of stages a nested one interrupted
        self.log: list[str] = []
        self.marks: list[tuple[float, str]] = []  # (step, "R" resumed / "C" checkpoint / "L" lr)
        self.cut: set[tuple[str, float]] = set()  # (stage, step) of epochs a stop cut short: never the best
        SkippedSteps.__init__(self)
        self._lr: dict[str, float] | None = None
        self.time_split: Mapping[str, TimeSplit] = {}  # stage -> its split (the "time" message)

    # -- messages ---------------------------------------------------------------------------
    def receive(self, kind: str, *args: Any) -> None:
        getattr(self, f"_on_{kind}")(*args)

    def _on_stage(self, stage: str, epoch: int, total: int | None, start: int = 0) -> None:
        """A stage starts (``start``: its first batch, later than 0 in a resumed epoch)."""
        p = self.progress
        if self._open:  # a validation inside training: the training bar comes back after it
            self._waiting.append((p.stage, p.batches, p.total, p.rate))
        self._open.append(stage)
        p.stage, p.epoch, p.batches, p.total = stage, epoch, start, total
        p.rate = p.rates.get(stage, 0.0)
        p.totals[stage] = total
        self.epoch = epoch
        for row in self.table.values():  # the stage's mean so far: none of this epoch yet
            row[f"{stage}_epoch"] = None

    def _on_update(self, m: MetricsSnapshot) -> None:
        if m.stage == "train" and m.lr:
            lr = dict(m.lr)
            if self._lr is not None and lr != self._lr:
                self.marks.append((m.step, "L"))  # the learning rate changed since the last snapshot
            self._lr = lr
        for key, mode in m.best.items():
            self.directions[(m.stage, key)] = mode
        p = self.progress
        if not self.live:  # replayed: the rows are the progress
            self.epoch, self.step = m.epoch, m.step
            p.stage, p.epoch, p.batches = m.stage, m.epoch, m.batches
            p.total = m.total if m.total is not None else p.totals.get(m.stage, p.total)
        else:  # the counters are ahead of any snapshot; the final one of a stage completes it
            self.step = max(self.step, m.step)
            if (p.stage, p.epoch) == (m.stage, m.epoch):
                p.batches = max(p.batches, m.batches)
                p.total = m.total if m.total is not None else p.total
        if m.batches:
            p.step_time[m.stage] = m.step_time
            p.rates[m.stage] = m.batches_per_s
            # (live, training's rate is the counters' once they have one: a snapshot's is the stage's mean)
            if p.stage == m.stage and not (self.live and m.stage == "train" and p.rate):
                p.rate = m.batches_per_s
        for key, value in m.values.items():
            self._note_name(key)
            row = self.table.setdefault(key, {})
            stage = m.stage
            row[f"{stage}_last"], row[f"{stage}_running"], row[f"{stage}_epoch"] = value.last, value.running, value.epoch
            if m.stage == "train":
                self.onsets.add(self._series(m.stage, key), key, m.step, value.running, self.resumed_from)

    def _on_epoch(self, m: MetricsSnapshot, whole: bool = True) -> None:
        """A stage's epoch means (``whole``: unless a stop that ended the run cut the stage short)."""
        self._on_update(m)
        if not whole:
            self.cut.add((m.stage, m.step))
        for key, value in m.values.items():
            if m.stage == "valid":
                self._series("valid", key).add(m.step, value.epoch)
            self.table.setdefault(key, {})[f"{m.stage}_final"] = value.epoch

    def _on_stage_end(self, stage: str) -> None:
        if self._open:
            self._open.pop()
        if self._waiting and len(self._waiting) >= len(self._open):
            p = self.progress
            p.stage, p.batches, p.total, p.rate = self._waiting.pop()

    def _on_tick(self, stage: str | None, epoch: int, batch_idx: int, step: int, now: float) -> None:
        """The run's counters (``loop.state``: stage, epoch, the batch in progress, the global
        step), read by the renderer's UI thread at ``now`` (``time.monotonic()``)."""
        if self.finished:
            return
        self.live = True
        self.step = max(self.step, step)
        samples = self._samples
        samples.append((now, step))
        while len(samples) > 2 and samples[1][0] <= now - RATE_WINDOW:
            samples.popleft()
        if stage is None:  # between stages
            return
        self.epoch = epoch
        p = self.progress
        if (p.stage, p.epoch) != (stage, epoch):
            p.stage, p.epoch, p.batches = stage, epoch, batch_idx
            p.total = p.totals.get(stage, p.total)
            p.rate = p.rates.get(stage, p.rate)
        else:
            p.batches = max(p.batches, batch_idx)
        first, first_step = samples[0]
        if stage == "train" and now - first >= 0.5 and step > first_step:
            p.rate = (step - first_step) / (now - first)

    def _on_stopping(self, reason: str) -> None:
        self.stopping = reason

    def _on_log(self, lines: list[str]) -> None:
        self.log = (self.log + lines)[-200:]

    def _on_resumed(self, info: ResumeInfo, path: str | None = None) -> None:
        """The run continues from a checkpoint (:class:`hookfit.payloads.ResumeInfo`; ``path`` live, not replayed),
        outside any stage: none of those its history opened is still running."""
        self.resumed_from = info
        self._open.clear()
        self._waiting.clear()
        self.marks.append((info.step, "R"))
        self.epoch, self.step = info.epoch, info.step
        self._on_log([f"hookfit: resumed from {info}"])
        if path is not None:
            self.resumable.announced(path, "resumed")

    def _on_time(self, splits: Mapping[str, TimeSplit]) -> None:
        """Where each stage's time went so far (``loop.state.time_split``)."""
        self.time_split = splits

    def _on_checkpoint(self, step: int, reason: str, path: str | None = None) -> None:
        """A checkpoint was written at ``step`` (the ``checkpoint_saved`` event; ``path`` live, not replayed)."""
        self.marks.append((step, "C"))
        if path is not None:
            self.resumable.announced(path, reason)

    def _on_model(self, summary: ModelSummary) -> None:
        """The size of the run's model (:class:`hookfit.payloads.ModelSummary`)."""
        self.model = summary

    def _on_end(self, status: str, reason: str | None, hold: bool, by: str | None = None,
                elapsed: float | None = None, step: int | None = None, epoch: int | None = None) -> None:
        """The run ended: ``elapsed`` is its duration (``loop.state.elapsed``, which a
        persistent hold does not add to; without it, the clock stops now), ``step`` and
        ``epoch`` where it ended."""
        self.finished, self.status, self.reason, self.hold = True, status, reason, hold
        self.stopped_by = by
        self.elapsed = elapsed if elapsed is not None else time.monotonic() - self.started
        if step is not None:
            self.step = step
        if epoch is not None:
            self.epoch = epoch
        if (resume := self.resumable.sentence(status)) is not None:  # (the log pane of the screen held after it)
            self._on_log([f"hookfit: {resume}"])

    def _note_name(self, key: str) -> None:
        if key not in self.names:
            self.names.append(key)
            self.names.sort(key=lambda n: (0 if "loss" in n else 1, n))

    def _series(self, stage: str, key: str) -> Series:
        series = self.series.get((stage, key))
        if series is None:
            series = self.series[(stage, key)] = Series()
        return series

    # -- keys -------------------------------------------------------------------------------
    def keypress(self, key: str) -> None:
        if self.show_help and key not in ("q", "ctrl c"):
            self.show_help = False
            return
        if key in ("?", "h"):
            self.show_help = True
        elif key in ("tab", "right") and self.names:
            self.selected = (self.selected + 1) % len(self.names)
        elif key in ("shift tab", "left") and self.names:
            self.selected = (self.selected - 1) % len(self.names)
        elif key in ("n", "page down"):
            self.table_page = (self.table_page + 1) % max(self.table_pages, 1)
        elif key in ("p", "page up"):
            self.table_page = (self.table_page - 1) % max(self.table_pages, 1)
        elif key == "w":
            self.recent = not self.recent
        elif key == "l":
            self.log_scale = not self._log_now()
        elif key in ("q", "esc") and self.finished:
            self.on_leave()
        elif key == "q" and self.stopping is None:
            self.stopping = "q pressed"
            self.on_stop()

    # -- what is shown ----------------------------------------------------------------------
    @property
    def plotted(self) -> str | None:
        if not self.names:
            return None
        return self.names[self.selected % len(self.names)]

    def steps_end(self) -> int | None:
        """The step the run ends at by ``max_steps``, when that comes before the end of its last
        epoch (as far as the epoch's length is known); else ``None``: epochs end it."""
        return timeline.steps_end(self.max_steps, self.max_epochs, self.progress.totals.get("train"))

    def eta(self) -> float | None:
        """Seconds left in the run, counting the validation stages still to come; ``None``
        once it ended or while the time of a batch is unknown."""
        if self.finished:
            return None
        return timeline.eta(self.progress, self.step, self.epoch, self.max_epochs, self.steps_end(), self.val_every)

    def run_fraction(self) -> float:
        """How much of the run is done, from 0 to 1, in what ends it (steps or epochs)."""
        if self.finished and self.status == "completed":
            return 1.0
        return timeline.run_fraction(self.progress, self.step, self.epoch, self.max_epochs, self.steps_end())

    def state_word(self) -> str:
        """``running``, ``stopping``, or how the run ended; with ``mostly skipped`` when an
        optimizer skipped more than half of the steps it attempted (:meth:`worst`)."""
        word = self.status if self.finished else ("stopping" if self.stopping else "running")
        return word + (" · mostly skipped" if self.mostly_skipped else "")

    def status_line(self, width: int) -> str:
        """`` hookfit │ train │ epoch 2/3 │ step 90 │ 00:00:12 │ running`` at ``width``
        (the least needed parts left out first); in steps when ``max_steps`` ends the run."""
        elapsed = self.elapsed if self.finished and self.elapsed is not None else time.monotonic() - self.started
        end = self.steps_end()
        epoch = f"epoch {self.epoch + 1}" if end is not None else f"epoch {self.epoch + 1}/{self.max_epochs}"
        step = f"step {self.step}/{end}" if end is not None else f"step {self.step}"
        parts = [("hookfit", 5), (self.progress.stage, 3), (epoch, 2), (step, 1), (clock(elapsed), 4),
                 (self.state_word(), 0)]
        return (" " + fit_parts(parts, max(width - 2, 1)) + " ").ljust(width)[:width]

    def stage_label(self) -> str:
        """`` train 57/120 12.3 it/s ETA 00:00:05``; for a stage whose data has no length (a
        stream) the batches done and the rate only: `` train 57 batches 12.3 it/s``."""
        p = self.progress
        if p.total is None:
            return f" {p.stage:<5} {p.batches} batches {p.rate:.1f} it/s"
        text = f" {p.stage:<5} {p.batches}/{p.total} {p.rate:.1f} it/s"
        if self.finished:
            return text
        eta = (p.total - p.batches) / p.rate if p.total and p.rate else None
        return f"{text} ETA {clock(max(eta, 0.0) if eta is not None else None)}"

    def endless(self) -> bool:
        """Whether the run's end cannot be foreseen: its training data has no length (a stream)
        and ``max_steps`` does not end it first. The progress rows then show no ETA."""
        p = self.progress
        return self.steps_end() is None and "train" in p.totals and p.totals["train"] is None

    def run_label(self) -> str:
        end = self.steps_end()
        where = f"step {self.step}/{end}" if end is not None else f"epoch {self.epoch + 1}/{self.max_epochs}"
        after = self.status if self.finished else "" if self.endless() else f"ETA {clock(self.eta())}"
        return f" run   {where}  {after}".rstrip()

    def banner(self) -> tuple[str, str, str] | None:
        """``(attribute, what happened, what to do)`` for the line under the status line, or
        ``None``: the end of the run (how many steps were skipped too), or a stop on its way."""
        if self.finished:
            attr = "failed" if self.status == "failed" else "banner"
            asked = f" (asked by {self.stopped_by})" if self.stopped_by else ""
            skipped = self.skipped_text()
            text = f" {'evaluation' if self.evaluation else 'training'} {self.status}: {self.reason or ''}{asked}" + (f" · {skipped}" if skipped else "")
            return attr, text, "  —  press q, Esc or Ctrl-C to leave " if self.hold else " "
        if self.stopping:
            return "banner", f" stopping after this batch ({self.stopping}); Ctrl-C again aborts ", ""
        return None

    def key_help(self, width: int) -> str:
        keys = list(self.keys)
        if self.finished and self.hold and keys and keys[0][0] == "q stop":
            keys[0] = ("q leave", "q leave")
        return key_line(keys, width)

    def best_step(self, name: str) -> float | None:
        """The step of the best epoch of ``name``: of its validation values, else of its
        training values, the lowest or the highest as the snapshots' ``best`` says (the
        directions the user configured; ``"min"`` for a metric named ``loss`` without one:
        :func:`hookfit.tools.runs.direction`). ``None`` for a metric with no direction: it
        is never guessed from the name. An epoch a stop cut short (:attr:`cut`) is never the best."""
        for stage in ("valid", "train"):
            series = self.series.get((stage, name))
            if series is not None and series.points():
                mode = direction(name, {name: self.directions.get((stage, name), "")})
                if mode is None:
                    return None
                best = Monitor(mode=mode)
                for x, lo, hi in series.points():
                    if (stage, x) not in self.cut:
                        best.update(hi if mode == "max" else lo, at=x)
                at: float | None = best.best_at  # None when no value is finite
                return at
        return None

    def _log_now(self, points: list[Any] | None = None) -> bool:
        """Whether the plot is on a log scale now: as chosen with ``l``, else when the plotted
        curves are positive and span more than two orders of magnitude."""
        if points is None:
            name = self.plotted
            groups = [self.series.get((s, name)) for s in ("train", "valid")] if name else []
            points = [g.points(self.recent) for g in groups if g]
        if self.log_scale is not None:
            return self.log_scale and not any(lo <= 0 for p in points for _, lo, _ in p)
        return spans_decades(points)
