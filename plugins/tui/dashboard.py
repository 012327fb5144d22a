"""The dashboard's model and widgets. Everything here runs on the UI thread only.

:class:`Dashboard` receives messages (snapshots published by the metrics plugin, stage changes,
the end of the run) through :meth:`Dashboard.receive`, answers keys through
:meth:`Dashboard.keypress` and draws itself with :meth:`Dashboard.render`. It holds no reference
to other plugins: a stop is asked for through the ``on_stop`` callback it is given. The size of
the model (a :class:`hookfit.payloads.ModelSummary`, the ``"model"`` message) is shown on a
line of its own under the status line: totals, then each top-level module's share of the
parameters, clipped to the width.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any, Callable

import urwid

from hookfit.payloads import MetricsSnapshot, ModelSummary, ResumeInfo, TimeSplit
from hookfit.plugins.common import Every, Monitor
from hookfit.plugins.tui.plot import Series, bounds, braille, draw, logged, spans_decades, y_label
from hookfit.tools.runs import direction

PALETTE = [
    ("title", "white,bold", "dark blue"),
    ("status", "black", "light gray"),
    ("train", "light cyan", ""),
    ("valid", "yellow", ""),
    ("both", "light green", ""),
    ("dim", "dark gray", ""),
    ("head", "bold", ""),
    ("bar", "black", "dark cyan"),
    ("bar_empty", "", "dark gray"),
    ("banner", "black,bold", "yellow"),
    ("failed", "white,bold", "dark red"),
    ("help", "black", "light gray"),
]

HELP = """\
 q          ask for a graceful stop (after the current batch)
 tab  → / ← next / previous metric in the plot
 w          plot the full history or the recent window
 l          log-scale y axis on or off (on by itself when a curve
            spans more than two orders of magnitude)
 ?  h       show or hide this help
 Esc        leave the final screen (persistent mode)"""

KEYS = " q stop · tab/←→ metric · w window · l log · ? help"


def _fmt(value: float | None) -> str:
    if value is None or value != value:
        return "-"
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    return f"{value:.3e}"


def _runs_of(ruler: str, span: str) -> list[tuple[int, str, bool]]:
    """The row under the plot: ``span`` (the steps shown) where no mark is, the marks' letters
    over it, as runs of ``(start, text, marked)``."""
    cells = [(c, True) if c != " " else ((span[i], False) if i < len(span) else (" ", False))
             for i, c in enumerate(ruler)]
    out: list[tuple[int, str, bool]] = []
    for i, (c, marked) in enumerate(cells):
        if out and out[-1][2] == marked:
            out[-1] = (out[-1][0], out[-1][1] + c, marked)
        else:
            out.append((i, c, marked))
    return out


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "--:--:--"
    s = int(seconds)
    return f"{s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}"


@dataclass
class Progress:
    """What the progress bars show, derived from snapshots."""

    stage: str = "train"
    batches: int = 0
    total: int | None = None
    rate: float = 0.0  # batches/s
    step_time: dict[str, float] = field(default_factory=dict)  # stage -> s per batch
    totals: dict[str, int | None] = field(default_factory=dict)  # stage -> batches per epoch


class Dashboard:
    """Metrics table, plot, progress, log pane, status and key help."""

    def __init__(self, max_epochs: int, val_every: int | None, on_stop: Callable[[], Any], on_leave: Callable[[], None]) -> None:
        self.max_epochs = max_epochs
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
        self.hold = False
        self.elapsed: float | None = None  # the run's duration once it ended: the clock stops
        self.resumed_from: ResumeInfo | None = None
        self.model: ModelSummary | None = None  # once the renderer sent it
        self.series: dict[tuple[str, str], Series] = {}
        self.table: dict[str, dict[str, float | None]] = {}
        self.directions: dict[tuple[str, str], str] = {}  # (stage, metric) -> "min"/"max", from the snapshots
        self.names: list[str] = []
        self.selected = 0
        self.recent = False
        self.log_scale: bool | None = None  # None: automatic (see plot.spans_decades)
        self.keys = KEYS
        self.show_help = False
        self.progress = Progress()
        self._open: list[str] = []  # the stages running, outermost first
        self._waiting: list[tuple[str, int, int | None, float]] = []  # progress of stages a nested one interrupted
        self.log: list[str] = []
        self.marks: list[tuple[float, str]] = []  # (step, "R" resumed / "C" checkpoint / "L" lr / "!" skipped)
        self._lr: dict[str, float] | None = None
        self.time_split: Mapping[str, TimeSplit] = {}  # stage -> its split (the "time" message)
        self._build()

    # -- messages from the training thread ------------------------------------------------
    def receive(self, kind: str, *args: Any) -> None:
        getattr(self, f"_on_{kind}")(*args)

    def _on_stage(self, stage: str, epoch: int, total: int | None) -> None:
        p = self.progress
        if self._open:  # a validation inside training: the training bar comes back after it
            self._waiting.append((p.stage, p.batches, p.total, p.rate))
        self._open.append(stage)
        self.progress.stage, self.progress.batches, self.progress.total = stage, 0, total
        self.progress.rate = 0.0
        self.progress.totals[stage] = total
        self.epoch = epoch

    def _on_update(self, m: MetricsSnapshot) -> None:
        if m.stage == "train" and m.lr:
            lr = dict(m.lr)
            if self._lr is not None and lr != self._lr:
                self.marks.append((m.step, "L"))  # the learning rate changed since the last snapshot
            self._lr = lr
        self.epoch, self.step = m.epoch, m.step
        for key, mode in m.best.items():
            self.directions[(m.stage, key)] = mode
        p = self.progress
        p.stage, p.batches, p.total, p.rate = m.stage, m.batches, m.total, m.batches_per_s
        if m.batches:
            p.step_time[m.stage] = m.step_time
        for key, value in m.values.items():
            self._note_name(key)
            row = self.table.setdefault(key, {})
            row[f"{m.stage}_last"], row[f"{m.stage}_running"], row[f"{m.stage}_epoch"] = value.last, value.running, value.epoch
            if m.stage == "train":
                self._series(m.stage, key).add(m.step, value.running)

    def _on_epoch(self, m: MetricsSnapshot) -> None:
        self._on_update(m)
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

    def _on_stopping(self, reason: str) -> None:
        self.stopping = reason

    def _on_log(self, lines: list[str]) -> None:
        self.log = (self.log + lines)[-200:]

    def _on_resumed(self, info: ResumeInfo) -> None:
        """The run continues from a checkpoint (:class:`hookfit.payloads.ResumeInfo`)."""
        self.resumed_from = info
        self.marks.append((info.step, "R"))
        self.epoch, self.step = info.epoch, info.step
        self._on_log([f"hookfit: resumed from {info}"])

    def _on_skipped(self, step: int) -> None:
        """An optimizer step was skipped (a non-finite loss; the ``step_skipped`` event)."""
        self.marks.append((step, "!"))

    def _on_time(self, splits: Mapping[str, TimeSplit]) -> None:
        """Where each stage's time went so far (``loop.state.time_split``: stage name ->
        :class:`hookfit.payloads.TimeSplit`)."""
        self.time_split = splits

    def _time_markup(self) -> list[Any]:
        """`` time  train data 12% · step 80% · plugins 8% │ valid ...``, and a warning when
        waiting for data takes over the stage (:attr:`TimeSplit.data_bound`)."""
        markup: list[Any] = [("head", " time ")]
        slow = next(((stage, split.shares["data"]) for stage, split in self.time_split.items() if split.data_bound), None)
        if slow is not None:  # first, so that a narrow terminal still shows it
            markup.append(("banner", f" the data loader is the bottleneck: {slow[1]:.0%} of {slow[0]} time "))
        for stage, split in self.time_split.items():
            shares = split.shares
            markup.append(f" {stage} " + " · ".join(f"{part} {shares[part]:.0%}" for part in split.PARTS) + " ")
        return markup

    def _on_checkpoint(self, step: int, reason: str) -> None:
        """A checkpoint was written at ``step`` (the ``checkpoint_saved`` event)."""
        self.marks.append((step, "C"))

    def _on_model(self, summary: ModelSummary) -> None:
        """The size of the run's model (:class:`hookfit.payloads.ModelSummary`)."""
        self.model = summary

    def _on_end(self, status: str, reason: str | None, hold: bool, by: str | None = None,
                elapsed: float | None = None) -> None:
        """The run ended: ``elapsed`` is its duration (``loop.state.elapsed``, which a
        persistent hold does not add to); without it, the clock stops now."""
        self.finished, self.status, self.reason, self.hold = True, status, reason, hold
        self.stopped_by = by
        self.elapsed = elapsed if elapsed is not None else time.monotonic() - self.started

    def _note_name(self, key: str) -> None:
        if key not in self.names:
            self.names.append(key)
            self.names.sort(key=lambda n: (0 if "loss" in n else 1, n))

    def _series(self, stage: str, key: str) -> Series:
        series = self.series.get((stage, key))
        if series is None:
            series = self.series[(stage, key)] = Series()
        return series

    # -- keys ----------------------------------------------------------------------------
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
        elif key == "w":
            self.recent = not self.recent
        elif key == "l":
            self.log_scale = not self._log_now()
        elif key in ("q", "esc") and self.finished:
            self.on_leave()
        elif key == "q" and self.stopping is None:
            self.stopping = "q pressed"
            self.on_stop()

    # -- drawing -------------------------------------------------------------------------
    def _build(self) -> None:
        self.w_status = urwid.Text("")
        self.w_model = urwid.Text("", wrap="clip")
        self.w_time = urwid.Text("", wrap="clip")
        self.w_table = urwid.Text("")
        self.w_plot_title = urwid.Text("")
        self.w_plot = urwid.Text("", wrap="clip")
        self.w_stage = urwid.ProgressBar("bar_empty", "bar")
        self.w_stage_label = urwid.Text("")
        self.w_run = urwid.ProgressBar("bar_empty", "bar")
        self.w_run_label = urwid.Text("")
        self.w_log = urwid.Text("", wrap="clip")
        self.w_keys = urwid.Text(("dim", KEYS))
        self.w_banner = urwid.Text("", align="center", wrap="ellipsis")

    @property
    def plotted(self) -> str | None:
        if not self.names:
            return None
        return self.names[self.selected % len(self.names)]

    def eta(self) -> float | None:
        """Seconds left in the run, counting the validation stages still to come."""
        p = self.progress
        train_total, valid_total = p.totals.get("train"), p.totals.get("valid")
        t_train, t_valid = p.step_time.get("train"), p.step_time.get("valid")
        if train_total is None or t_train is None:
            return None
        epochs_left = self.max_epochs - self.epoch - 1
        left = epochs_left * train_total * t_train
        if p.stage == "train" and p.total:
            left += (p.total - p.batches) * t_train
        if self.val_every and t_valid is not None and valid_total:
            vals_left = Every(self.val_every).between(self.epoch, self.max_epochs)
            if p.stage == "valid":
                left += (valid_total - p.batches) * t_valid
                vals_left -= 1
            left += max(vals_left, 0) * valid_total * t_valid
        return left

    def _table_text(self, width: int) -> list[Any]:
        cols = ["train last", "running", "epoch", "valid"]
        name_w = min(max([6] + [len(n) for n in self.names]), max(6, width - 4 * 11 - 2))
        head = f"{'metric':<{name_w}} " + "".join(f"{c:>11}" for c in cols)
        out: list[Any] = [("head", head[:width] + "\n")]
        for name in self.names:
            row = self.table.get(name, {})
            cells = [row.get("train_last"), row.get("train_running"), row.get("train_final", row.get("train_epoch")),
                     row.get("valid_final", row.get("valid_epoch"))]
            line = f"{name[:name_w]:<{name_w}} " + "".join(f"{_fmt(c):>11}" for c in cells)
            attr = "both" if name == self.plotted else ""
            out.append((attr, line[:width] + "\n"))
        if not self.names:
            out.append(("dim", "waiting for the first metrics…\n"))
        return out

    def _model_markup(self) -> list[Any]:
        """``model 1.23M params (1.2M trainable), 4.71 MB │ encoder Sequential 65% · ...``: the
        totals, then the share of the parameters of each top-level module that has any."""
        summary = self.model
        if summary is None:
            return [""]
        markup: list[Any] = [("head", " model "), f"{summary}"]
        shares = []
        for row in summary.modules:
            if not row.parameters:
                continue
            share = 100 * row.parameters / summary.parameters
            shares.append(f"{row.name} {row.type} {'<1' if share < 0.5 else f'{share:.0f}'}%")
        if shares:
            markup.append(("dim", " │ " + " · ".join(shares)))
        return markup

    def _plot_markup(self, width: int, height: int) -> list[Any]:
        name = self.plotted
        if name is None or width < 20 or height < 2:
            return [("dim", "")]
        groups = [self.series.get((s, name)) for s in ("train", "valid")]
        points = [g.points(self.recent) if g else [] for g in groups]
        log = self._log_now(points)
        if log:
            points = [logged(p) for p in points]
        box = bounds(points)
        if box is None:
            return [("dim", "no points yet")]
        label_w = 10
        cells = draw(points, width - label_w - 1, height - 1, box)
        x0, x1, y0, y1 = box
        markup: list[Any] = []
        for r, row in enumerate(cells):
            label = (f"{y_label(y1, log):>{label_w}}" if r == 0 else f"{y_label(y0, log):>{label_w}}"
                     if r == len(cells) - 1 else " " * label_w)
            markup.append(("dim", label + "│"))
            for mask in row:
                attr = "both" if (mask & 0xFF and mask >> 8) else "train" if mask & 0xFF else "valid"
                markup.append((attr, braille(mask)))
            markup.append("\n")
        span = f"step {x0:g} … {x1:g}"
        ruler = self._ruler(name, width - label_w - 1, x0, x1)
        markup.append(("dim", " " * label_w + "└"))
        for start, end, marked in _runs_of(ruler, span):
            markup.append(("head" if marked else "dim", end))
        return markup

    def best_step(self, name: str) -> float | None:
        """The step of the best epoch of ``name``: of its validation values, else of its
        training values, the lowest or the highest as the snapshots' ``best`` says (the
        directions the user configured; ``"min"`` for a metric named ``loss`` without one:
        :func:`hookfit.tools.runs.direction`). ``None`` for a metric with no direction: it
        is never guessed from the name."""
        for stage in ("valid", "train"):
            series = self.series.get((stage, name))
            if series is not None and len(series):
                mode = direction(name, {name: self.directions.get((stage, name), "")})
                if mode is None:
                    return None
                best = Monitor(mode=mode)
                for x, lo, hi in series.points():
                    best.update(hi if mode == "max" else lo, at=x)
                at: float | None = best.best_at  # None when no value is finite
                return at
        return None

    def _ruler(self, name: str, width: int, x0: float, x1: float) -> str:
        """One row under the plot with a letter at the step of each mark (see ``marks``) and
        ``*`` at the best epoch."""
        cells = [" "] * width
        marks = [*self.marks]
        best = self.best_step(name)
        if best is not None and self.finished:
            marks.append((best, "*"))
        for x, letter in marks:
            if x0 <= x <= x1 and width > 0:
                col = min(width - 1, max(0, int((x - x0) / (x1 - x0) * (width * 2 - 1) + 0.5) // 2))
                cells[col] = letter
        return "".join(cells)

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

    def render(self, size: tuple[int, int]) -> urwid.Canvas:
        cols, rows = size
        self._refresh(cols, rows)
        return self.widget(cols, rows).render(size, focus=True)

    def _refresh(self, cols: int, rows: int) -> None:
        elapsed = self.elapsed if self.finished and self.elapsed is not None else time.monotonic() - self.started
        stage = self.progress.stage
        state = self.status if self.finished else ("stopping" if self.stopping else "running")
        self.w_status.set_text(
            ("status", f" hookfit │ {stage} │ epoch {self.epoch + 1}/{self.max_epochs} │ step {self.step} │ "
                       f"{_clock(elapsed)} │ {state} ".ljust(cols)[:cols])
        )
        self.w_table.set_text(self._table_text(cols))
        self.w_model.set_text(self._model_markup())
        self.w_time.set_text(self._time_markup() if self.time_split else "")
        p = self.progress
        if p.total:
            self.w_stage.set_completion(100 * min(p.batches, p.total) / p.total)
        stage_eta = (p.total - p.batches) / p.rate if p.total and p.rate else None
        self.w_stage_label.set_text(
            f" {stage:<5} {p.batches}/{p.total or '?'} {p.rate:.1f} it/s ETA {_clock(stage_eta)}"
        )
        eta = self.eta()
        done_epochs = self.epoch + (p.batches / p.total if p.total else 0)
        self.w_run.set_completion(100 * min(done_epochs / self.max_epochs, 1.0))
        self.w_run_label.set_text(f" run   epoch {self.epoch + 1}/{self.max_epochs}  ETA {_clock(eta)}")
        window = "recent" if self.recent else "full history"
        scale = " · log scale" if self._log_now() else ""
        if self.marks or self.finished:
            scale += " · R resumed  C checkpoint  L lr changed  ! skipped  * best"
        self.w_plot_title.set_text([("head", f" {self.plotted or '-'} "), ("train", "━ train "), ("valid", "━ valid "),
                                    ("dim", f"· {window}{scale}")])
        self.w_keys.set_text(("dim", self.keys[:cols]))
        if self.finished:
            attr = "failed" if self.status == "failed" else "banner"
            leave = "  —  press q, Esc or Ctrl-C to leave" if self.hold else ""
            asked = f" (asked by {self.stopped_by})" if self.stopped_by else ""
            self.w_banner.set_text((attr, f" training {self.status}: {self.reason or ''}{asked}{leave} "))
        elif self.stopping:
            self.w_banner.set_text(("banner", f" stopping after this batch ({self.stopping}); Ctrl-C again aborts "))
        else:
            self.w_banner.set_text("")

    def widget(self, cols: int, rows: int) -> urwid.Widget:
        table_rows = min(len(self.names) + 1, max(2, rows // 4)) if self.names else 2
        log_rows = max(1, min(6, rows // 6))
        fixed = 1 + table_rows + 1 + 1 + 1 + log_rows + 1 + (1 if self.finished or self.stopping else 0)
        fixed += 1 if self.model is not None else 0
        fixed += 1 if self.time_split else 0
        plot_rows = max(3, rows - fixed)
        self.w_plot.set_text(self._plot_markup(cols, plot_rows))
        self.w_log.set_text(("dim", "\n".join(self.log[-log_rows:]) or " "))
        items: list[Any] = [("pack", self.w_status)]
        if self.finished or self.stopping:
            items.append(("pack", self.w_banner))
        if self.model is not None:
            items.append(("pack", self.w_model))
        items += [
            (table_rows, urwid.Filler(self.w_table, valign="top")),
            ("pack", self.w_plot_title),
            (plot_rows, urwid.Filler(self.w_plot, valign="top")),
            ("pack", urwid.Columns([(44, self.w_stage_label), self.w_stage])),
            ("pack", urwid.Columns([(44, self.w_run_label), self.w_run])),
            *([("pack", self.w_time)] if self.time_split else []),
            (log_rows, urwid.Filler(self.w_log, valign="bottom")),
            ("pack", self.w_keys),
        ]
        body: urwid.Widget = urwid.Pile(items)
        if self.show_help:
            box = urwid.LineBox(urwid.Text(("help", HELP)), title="keys")
            body = urwid.Overlay(urwid.AttrMap(box, "help"), body, "center", min(cols, 70), "middle", 9)
        return body
