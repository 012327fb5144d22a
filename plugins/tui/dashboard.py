"""The dashboard's screen, drawn with urwid from what :class:`~hookfit.plugins.tui.model.DashboardModel`
knows. Everything here runs on the UI thread only.

Layout, top to bottom: the status line, a banner (the end of the run, or a stop on its way), the
model's size, the metrics table, the plot's title, the plot with its axis, the stage's and the
run's progress, where the time went, what the run printed, the key help. The status line, the
plot title, the progress rows and the key help are always there; the other lines appear when the
terminal has rows for them (the model and time lines from about 20 rows, the log pane only for
lines that were printed), and the rows left go to the table (as many as it has metrics, up to
two fifths) and the plot. Every text is whole or ellipsized (``…``) at any width from 40
columns, and the layout holds from 40x12; below that only the status lines are drawn.

The table lists every metric, validation-only ones included: the training batch's value
(``train last``), the running mean, the mean of the training epoch so far (``epoch``) and of the
validation so far (``valid``), each epoch's from its first publication on (see ``COLUMNS``). When
the metrics do not fit, its last row says which of how many are shown, and ``n``/``p`` page
through them. Columns are left out when narrow (``train last`` first, then ``epoch``). Non-finite values show as ``nan``
or ``inf`` in the warning colour. The plot draws the selected metric's train and valid curves
(the legend names only those it has); its x axis reaches the metric's last step (and, once the
run ended, the run's last step); columns where the values were NaN or infinite get ``×`` on the
top row; under the axis, letters mark resumes (``R``), checkpoints (``C``), learning-rate changes
(``L``), skipped steps (``!``, every one of them) and the best epoch (``*``), and the step range
is written where no mark is (on a line of its own when marks fill the axis).
"""

from __future__ import annotations

import time  # noqa: F401 - the clock the model reads (time.monotonic); tests replace it here
from typing import Any

import urwid

from hookfit.plugins.tui.model import DashboardModel
from hookfit.plugins.tui.text import ellipsize, fmt, nonfinite
from hookfit.plugins.support.plot import NONFINITE, bounds, braille, column, draw, logged, spread, y_label

_fmt = fmt  # (the name tests and older code import)

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
    ("warn", "light red,bold", ""),
]

HELP = """\
 q          ask for a graceful stop (after the current batch)
 tab  → / ← next / previous metric in the plot
 n  p       next / previous page of the metrics table
 w          plot the full history or the recent window
 l          log-scale y axis on or off (on by itself when a curve
            spans more than two orders of magnitude)
 ?  h       show or hide this help
 Esc        leave the final screen (persistent mode)"""

COLUMNS = (("train last", ("train_last",), 3), ("running", ("train_running",), 0),
           ("epoch", ("train_epoch",), 2), ("valid", ("valid_epoch",), 1))
"""Table columns: heading, the row's keys (the first present is shown), rank (kept longest: 0).
``epoch`` and ``valid`` are the mean over the batches of the training or validation epoch so
far (:attr:`hookfit.payloads.Value.epoch`): the running epoch's while it runs (``-`` until its
first publication), the last one's, whole, once it ended."""
CELL = 11  # characters of a value column
LABEL = 10  # characters of the plot's y labels
MARKS_LONG = " · R resumed  C checkpoint  L lr changed  ! skipped  * best"
MARKS_SHORT = " · R C L ! * marks"
MIN_COLS, MIN_ROWS = 30, 9  # below: the status lines only


class StageBar(urwid.ProgressBar):
    """The stage's progress bar: its share of the stage's batches, or, for data without a length
    (a stream), an empty bar that says so instead of a percentage."""

    counted = True
    """Whether the stage's batches have a total (else the bar shows :attr:`UNCOUNTED`)."""
    UNCOUNTED = "no length: batches counted"

    def get_text(self) -> str:
        return super().get_text() if self.counted else self.UNCOUNTED


class Dashboard(DashboardModel):
    """Metrics table, plot, progress, log pane, status and key help, drawn with urwid."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.w_status = urwid.Text("", wrap="clip")
        self.w_model = urwid.Text("", wrap="ellipsis")
        self.w_time = urwid.Text("", wrap="ellipsis")
        self.w_table = urwid.Text("", wrap="clip")
        self.w_plot_title = urwid.Text("", wrap="clip")
        self.w_plot = urwid.Text("", wrap="clip")
        self.w_stage = StageBar("bar_empty", "bar")
        self.w_stage_label = urwid.Text("", wrap="ellipsis")
        self.w_run = urwid.ProgressBar("bar_empty", "bar")
        self.w_run_label = urwid.Text("", wrap="ellipsis")
        self.w_log = urwid.Text("", wrap="ellipsis")
        self.w_keys = urwid.Text("", wrap="clip")
        self.w_banner = urwid.Text("", wrap="ellipsis")
        self.w_hint = urwid.Text("", wrap="clip")

    # -- markup -----------------------------------------------------------------------------
    def _time_markup(self) -> list[Any]:
        """`` time  train data 12% · step 80% · plugins 8% │ valid ...``, and a warning when
        waiting for data takes over the stage (:attr:`TimeSplit.data_bound`)."""
        markup: list[Any] = [("head", " time ")]
        slow = next(((stage, split.shares["data"]) for stage, split in self.time_split.items() if split.data_bound),
                    None)
        if slow is not None:  # first, so that a narrow terminal still shows it
            markup.append(("banner", f" the data loader is the bottleneck: {slow[1]:.0%} of {slow[0]} time "))
        for stage, split in self.time_split.items():
            shares = split.shares
            markup.append(f" {stage} " + " · ".join(f"{part} {shares[part]:.0%}" for part in split.PARTS) + " ")
        return markup

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

    def _table_markup(self, width: int, rows: int) -> list[Any]:
        """The table in ``rows`` rows (heading included): the columns that fit ``width``, and,
        when the metrics do not fit, a page of them and a row saying which."""
        if not self.names:
            return [("dim", ellipsize("waiting for the first metrics…", width))]
        count = max((k for k in range(len(COLUMNS), 0, -1) if 13 + CELL * k <= width), default=1)
        shown = [c for c in COLUMNS if c[2] < count]
        name_w = max(6, min(max(len(n) for n in self.names), width - CELL * len(shown) - 1))
        head = f"{'metric':<{name_w}} " + "".join(f"{c[0]:>{CELL}}" for c in shown)
        out: list[Any] = [("head", head[:width] + "\n")]
        names = self.names
        if len(names) > rows - 1:
            per_page = max(1, rows - 2)
            self.table_pages = -(-len(names) // per_page)
            page = self.table_page = min(self.table_page, self.table_pages - 1)
            names = names[page * per_page:(page + 1) * per_page]
            first = page * per_page + 1
            footer = f"{first}–{first + len(names) - 1} of {len(self.names)} metrics · n/p more"
            if rows < 3:  # no row for it: the heading says it
                out = [("head", f"{ellipsize(f'{first}/{len(self.names)} n/p', name_w):<{name_w}} "
                                + "".join(f"{c[0]:>{CELL}}" for c in shown)[:max(width - name_w - 1, 0)] + "\n")]
                footer = ""
        else:
            self.table_pages, self.table_page, footer = 1, 0, ""
        for name in names:
            row = self.table.get(name, {})
            attr = "both" if name == self.plotted else ""
            line: list[Any] = [(attr, f"{ellipsize(name, name_w):<{name_w}} ")]
            for _, keys, _ in shown:
                value = next((row[k] for k in keys if row.get(k) is not None), None)
                line.append(("warn" if nonfinite(value) else attr, f"{fmt(value):>{CELL}}"))
            out += [*_clip(line, width), "\n"]
        if footer:
            out.append(("dim", ellipsize(footer, width)))
        return out

    def _ruler(self, name: str, width: int, x0: float, x1: float) -> str:
        """One row under the plot with a letter at the step of each mark (see ``marks``), ``!``
        over every skipped step (over checkpoints and learning-rate changes at the same column)
        and ``*`` at the best epoch (once the run ended)."""
        if width <= 0:
            return ""
        cells = [" "] * width
        marks = [*self.marks]
        best = self.best_step(name)
        if best is not None and self.finished:
            marks.append((best, "*"))
        for x, letter in marks:
            if x0 <= x <= x1 and letter in "CL":
                cells[column(x, x0, x1, width)] = letter
        for col in spread(self.skips.within(x0, x1), x0, x1, width):
            cells[col] = "!"
        for x, letter in marks:
            if x0 <= x <= x1 and letter not in "CL":
                cells[column(x, x0, x1, width)] = letter
        return "".join(cells)

    def _plot_markup(self, width: int, height: int) -> list[Any]:
        """The plot of the selected metric in ``width`` x ``height`` cells, its axis rows
        included."""
        name = self.plotted
        if name is None or width < 20 or height < 2:
            return [("dim", "")]
        groups = [self.series.get((s, name)) for s in ("train", "valid")]
        points = [g.points(self.recent) if g else [] for g in groups]
        log = self._log_now(points)
        if log:
            points = [logged(p) for p in points]
        ranges = [xs for g in groups if g is not None and (xs := g.x_range(self.recent)) is not None]
        bad = [run for g in groups if g is not None for run in g.nonfinite.runs]
        box = bounds(points)
        if box is None and not bad:
            return [("dim", "no points yet")]
        x0, x1, y0, y1 = box if box is not None else (ranges[0][0], ranges[0][1], 0.0, 1.0)
        x0, x1 = min([x0, *(r[0] for r in ranges)]), max([x1, *(r[1] for r in ranges)])
        if self.finished and not self.recent:
            x1 = max(x1, self.step)  # the run's last step, where its curves ended before it
        x1 = x1 if x1 > x0 else x0 + 1
        plot_w = width - LABEL - 1
        ruler = self._ruler(name, plot_w, x0, x1)
        axis = _axis(ruler, f"step {x0:g} … {x1:g}")
        cells_h = max(1, height - len(axis))
        cells = draw(points, plot_w, cells_h, (x0, x1, y0, y1))
        crosses = spread([(a, b) for a, b in bad if b >= x0], x0, x1, plot_w)
        markup: list[Any] = []
        for r, row in enumerate(cells):
            label = ""
            if box is not None:
                label = y_label(y1, log) if r == 0 else y_label(y0, log) if r == len(cells) - 1 else ""
            markup.append(("dim", f"{label:>{LABEL}}"[:LABEL] + "│"))
            for c, mask in enumerate(row):
                if r == 0 and c in crosses:
                    markup.append(("warn", NONFINITE))
                    continue
                attr = "both" if (mask & 0xFF and mask >> 8) else "train" if mask & 0xFF else "valid"
                markup.append((attr, braille(mask)))
            markup.append("\n")
        for i, runs in enumerate(axis):
            markup.append(("dim", " " * LABEL + ("└" if i == 0 else " ")))
            for text, kind in runs:
                markup.append(({"mark": "head", "skip": "warn"}.get(kind, "dim"), text))
            if i < len(axis) - 1:
                markup.append("\n")
        return markup

    def _title_markup(self, width: int) -> list[Any]:
        """The plot's title and legend, shortened to fit ``width``: the series it has, the
        window, the scale, ``× nan`` where values were not finite, the marks' letters."""
        name = self.plotted or "-"
        groups = {s: self.series.get((s, name)) for s in ("train", "valid")}
        legend: list[Any] = [(s, f"━ {s} ") for s, g in groups.items() if g is not None and len(g)]
        kinds = sorted({k for g in groups.values() if g is not None for k in g.kinds})
        bad = [("warn", f" · {NONFINITE} {'/'.join(kinds)}")] if kinds else []
        window = "recent" if self.recent else "full history"
        scale = " · log scale" if self._log_now() else ""
        marks = bool(self.marks or self.skips or self.finished)
        tries = [(f" {name} ", f"· {window}{scale}", MARKS_LONG if marks else ""),
                 (f" {name} ", f"· {window}{scale}", MARKS_SHORT if marks else ""),
                 (f" {name} ", f"· {window}{scale}", ""),
                 (f" {name} ", scale[1:], "")]
        for head, words, letters in tries:
            markup = [("head", head), *legend, ("dim", words), *bad, ("dim", letters)]
            if sum(len(t) for _, t in markup) <= width:
                return markup
        return _clip([("head", f" {ellipsize(name, max(width - 12, 4))} "), *legend, *bad], width)

    # -- drawing ----------------------------------------------------------------------------
    def render(self, size: tuple[int, int]) -> urwid.Canvas:
        cols, rows = size
        self._refresh(cols, rows)
        return self.widget(cols, rows).render(size, focus=True)

    def _refresh(self, cols: int, rows: int) -> None:
        self.w_status.set_text(("status", self.status_line(cols)))
        self.w_model.set_text(self._model_markup())
        self.w_time.set_text(self._time_markup() if self.time_split else "")
        p = self.progress
        self.w_stage.counted = p.total is not None
        self.w_stage.set_completion(100 * min(p.batches, p.total) / p.total if p.total else 0)
        self.w_stage_label.set_text(self.stage_label())
        self.w_run.set_completion(100 * self.run_fraction())
        self.w_run_label.set_text(self.run_label())
        self.w_plot_title.set_text(self._title_markup(cols))
        self.w_keys.set_text(("dim", self.key_help(cols)))
        banner = self.banner()
        if banner is not None:
            attr, text, hint = banner
            if self._banner_rows(cols, rows) == 1 and hint.strip() and len(text) + len(hint) > cols:
                hint = " — q leaves "  # one row for it all: the key help says the rest
            self.w_banner.set_text((attr, text))
            self.w_hint.set_text((attr, ellipsize(hint, cols)))

    def _banner_rows(self, cols: int, rows: int) -> int:
        """Rows of the banner: 0 without one; 2 when what happened and what to do are too long
        for one row together and the terminal has 16 rows or more (else one, shortened)."""
        banner = self.banner()
        if banner is None:
            return 0
        _, text, hint = banner
        return 2 if rows >= 16 and hint.strip() and len(text) + len(hint) > cols else 1

    def layout(self, cols: int, rows: int) -> dict[str, int]:
        """Rows of each part at ``cols`` x ``rows`` (see the module's documentation)."""
        fixed = 5 + self._banner_rows(cols, rows)  # status, title, two progress rows, keys; the banner
        free = rows - fixed
        extras = [part for part, present in (("model", self.model is not None), ("time", bool(self.time_split)))
                  if present]
        while extras and free - len(extras) < 12:
            extras.pop()
        free -= len(extras)
        table_want = len(self.names) + 1 if self.names else 1
        table = min(table_want, max(2, free * 2 // 5), max(1, free - 3))
        log = min(len(self.log), 6, max(0, (free - table - 8) // 2))
        return {"fixed": fixed, **{part: 1 for part in extras}, "table": table, "log": log,
                "plot": max(1, free - table - log)}

    def widget(self, cols: int, rows: int) -> urwid.Widget:
        banner = self._banner_rows(cols, rows)
        if cols < MIN_COLS or rows < MIN_ROWS:  # too small for a layout: the status lines only
            lines = [self.status_line(cols), self.stage_label(), self.run_label(), self.key_help(cols)]
            return urwid.Filler(urwid.Text("\n".join(ellipsize(line, cols) for line in lines), wrap="clip"),
                                valign="top")
        size = self.layout(cols, rows)
        self.w_table.set_text(self._table_markup(cols, size["table"]))
        self.w_plot.set_text(self._plot_markup(cols, size["plot"]))
        self.w_log.set_text(("dim", "\n".join(self.log[-size["log"]:]) if size["log"] else ""))
        label_w = min(max(len(self.stage_label()), len(self.run_label())) + 1, cols - 10)
        items: list[Any] = [("pack", self.w_status)]
        if banner == 2:
            self.w_hint.align = "right"
            attr = (self.banner() or ("banner",))[0]
            items += [("pack", urwid.AttrMap(self.w_banner, attr)), ("pack", urwid.AttrMap(self.w_hint, attr))]
        elif banner:
            self.w_hint.align = "left"
            hint_w = len(self.w_hint.text)
            items.append(("pack", urwid.Columns([self.w_banner, (hint_w, self.w_hint)]) if hint_w else self.w_banner))
        if "model" in size:
            items.append(("pack", self.w_model))
        items += [
            (size["table"], urwid.Filler(self.w_table, valign="top")),
            ("pack", self.w_plot_title),
            (size["plot"], urwid.Filler(self.w_plot, valign="top")),
            ("pack", urwid.Columns([(label_w, self.w_stage_label), self.w_stage])),
            ("pack", urwid.Columns([(label_w, self.w_run_label), self.w_run])),
            *([("pack", self.w_time)] if "time" in size else []),
            *([(size["log"], urwid.Filler(self.w_log, valign="bottom"))] if size["log"] else []),
            ("pack", self.w_keys),
        ]
        body: urwid.Widget = urwid.Pile(items)
        if self.show_help:
            box = urwid.LineBox(urwid.Text(("help", HELP)), title="keys")
            body = urwid.Overlay(urwid.AttrMap(box, "help"), body, "center", min(cols, 70), "middle", min(rows, 10))
        return body


def _clip(markup: list[Any], width: int) -> list[Any]:
    """``(attribute, text)`` markup cut to ``width`` characters."""
    out: list[Any] = []
    left = width
    for attr, text in markup:
        if left <= 0:
            break
        out.append((attr, text[:left]))
        left -= len(text[:left])
    return out


def _axis(ruler: str, span: str) -> list[list[tuple[str, str]]]:
    """The rows under the plot as runs of ``(text, kind)``: the ruler's marks (``"mark"``,
    ``"skip"`` for ``!``) and ``span`` (``"span"``) where no mark is: at the left, else at
    the right, else in the first gap wide enough, else on a row of its own."""
    width = len(ruler)
    need = len(span) + 1

    def free(start: int) -> bool:
        return all(c == " " for c in ruler[max(0, start - 1):start + need])

    at = next((s for s in [0, width - len(span), *range(1, width - len(span))] if s >= 0 and free(s)), None)
    cells = [(c, "skip" if c == "!" else "mark") if c != " " else (" ", "blank") for c in ruler]
    extra: list[list[tuple[str, str]]] = []
    if at is not None and len(span) <= width:
        for i, c in enumerate(span):
            cells[at + i] = (c, "span")
    elif width > 0:
        extra = [[(ellipsize(span, width), "span")]]
    runs: list[tuple[str, str]] = []
    for c, kind in cells:
        if runs and runs[-1][1] == kind:
            runs[-1] = (runs[-1][0] + c, kind)
        else:
            runs.append((c, kind))
    return [runs, *extra]
