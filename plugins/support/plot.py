"""Line plots drawn with Braille cells, from series that stay small however long the run.

A :class:`Series` keeps at most ``capacity`` buckets of (first x, min, max, last); when full,
neighbours merge and each bucket covers twice as many steps. Drawing a frame therefore costs
O(width), not O(steps), and a spike survives downsampling as the max of its bucket instead of
being dropped with the points around it. Non-finite values (NaN, infinities) are not drawn as
points: a series keeps where they were (:class:`Ranges`), which a plot marks, and its x range
still reaches its last point, finite or not.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

BRAILLE = 0x2800
# dot bit for (column 0..1, row 0..3) inside one cell
DOTS = ((0x01, 0x02, 0x04, 0x40), (0x08, 0x10, 0x20, 0x80))
NONFINITE = "×"
"""The mark of a column where a plotted series had non-finite values."""


@dataclass
class Ranges:
    """Where something happened along x, as runs ``[first x, last x]``: :meth:`add` extends the
    last run when told the event goes on (``join``), else starts a new one. At most
    ``capacity`` runs are kept: beyond, neighbours merge, so a run may then also cover the
    gap between two (the resolution of a plot of a few hundred columns, at worst)."""

    capacity: int = 256
    runs: list[list[float]] = field(default_factory=list)
    count: int = 0
    """How many times :meth:`add` was called."""

    def add(self, x: float, join: bool = False) -> None:
        self.count += 1
        runs = self.runs
        if join and runs:
            last = runs[-1]
            last[0], last[1] = min(last[0], x), max(last[1], x)
            return
        runs.append([x, x])
        if len(runs) > self.capacity:
            merged = [[runs[i][0], runs[i + 1][1]] for i in range(0, len(runs) - 1, 2)]
            if len(runs) % 2:
                merged.append(runs[-1])
            self.runs = merged

    def within(self, x0: float, x1: float) -> list[tuple[float, float]]:
        """The runs that meet ``[x0, x1]``, clipped to it."""
        return [(max(a, x0), min(b, x1)) for a, b in self.runs if b >= x0 and a <= x1]

    def __len__(self) -> int:
        return len(self.runs)

    def __bool__(self) -> bool:
        return bool(self.runs)


RECENT_SHARE = 0.25
"""The recent window (the ``w`` key): the last quarter of the steps a curve covers."""


@dataclass
class Series:
    """Downsampled ``(x, y)`` points: full history in min/max buckets, plus a recent window;
    where ``y`` was not finite in :attr:`nonfinite` (its kinds, ``"nan"``/``"inf"``/``"-inf"``,
    in :attr:`kinds`)."""

    capacity: int = 512
    recent_size: int = 300
    span: int = 1
    buckets: list[list[float]] = field(default_factory=list)  # [x0, min, max, last]
    recent: collections.deque[tuple[float, float]] = field(default_factory=collections.deque)
    nonfinite: Ranges = field(default_factory=Ranges)
    kinds: set[str] = field(default_factory=set)
    first_x: float | None = None
    last_x: float | None = None
    _bad: bool = False  # the last value added was not finite

    def __post_init__(self) -> None:
        self.recent = collections.deque(maxlen=self.recent_size)

    def add(self, x: float, y: float) -> None:
        if self.first_x is None:
            self.first_x = x
        self.last_x = x if self.last_x is None else max(self.last_x, x)
        if not math.isfinite(y):
            self.nonfinite.add(x, join=self._bad)
            self.kinds.add("nan" if y != y else "inf" if y > 0 else "-inf")
            self._bad = True
            return
        self._bad = False
        self.recent.append((x, y))
        buckets = self.buckets
        if buckets and x < buckets[-1][0] + self.span:
            last = buckets[-1]
            last[1], last[2], last[3] = min(last[1], y), max(last[2], y), y
            return
        buckets.append([x, y, y, y])
        if len(buckets) > self.capacity:
            merged = []
            for i in range(0, len(buckets) - 1, 2):
                a, b = buckets[i], buckets[i + 1]
                merged.append([a[0], min(a[1], b[1]), max(a[2], b[2]), b[3]])
            if len(buckets) % 2:
                merged.append(buckets[-1])
            self.buckets = merged
            self.span *= 2

    def _cutoff(self) -> float:
        """The first step of the recent window: the last :data:`RECENT_SHARE` of the steps the
        series covers (and at most its last ``recent_size`` points), so that the window is
        never the whole history of a short run."""
        first, last = self.first_x or 0.0, self.last_x or 0.0
        start = last - (last - first) * RECENT_SHARE
        return max(start, self.recent[0][0]) if self.recent else start

    def points(self, recent: bool = False) -> list[tuple[float, float, float]]:
        """``(x, low, high)`` of the finite values, for the full history or the recent window."""
        if recent:
            cutoff = self._cutoff()
            return [(x, y, y) for x, y in self.recent if x >= cutoff]
        return [(b[0], b[1], b[2]) for b in self.buckets]

    def x_range(self, recent: bool = False) -> tuple[float, float] | None:
        """The steps the series covers, its non-finite values included (``recent``: those of
        the recent window)."""
        if self.first_x is None or self.last_x is None:
            return None
        return (self._cutoff() if recent else self.first_x), self.last_x

    def __len__(self) -> int:
        return len(self.buckets) + len(self.nonfinite)


def bounds(groups: Iterable[Sequence[tuple[float, float, float]]]) -> tuple[float, float, float, float] | None:
    """``(x0, x1, y0, y1)`` over every point of every group; ``None`` when there are none."""
    xs, lows, highs = [], [], []
    for points in groups:
        for x, lo, hi in points:
            xs.append(x)
            lows.append(lo)
            highs.append(hi)
    if not xs:
        return None
    y0, y1 = min(lows), max(highs)
    if y0 == y1:
        y0, y1 = y0 - 0.5, y1 + 0.5
    x0, x1 = min(xs), max(xs)
    return x0, (x1 if x1 > x0 else x0 + 1), y0, y1


def draw(
    series: Sequence[Sequence[tuple[float, float, float]]],
    width: int,
    height: int,
    box: tuple[float, float, float, float],
) -> list[list[int]]:
    """Cells of a ``width`` x ``height`` plot: for each cell a bit mask per series (as one int
    with 8 bits per series). Every column draws the vertical span from the lowest to the highest
    value that falls in it, joined to the previous column so lines stay continuous."""
    x0, x1, y0, y1 = box
    cols, rows = width * 2, height * 4
    cells = [[0] * width for _ in range(height)]

    def row_of(y: float) -> int:
        return min(rows - 1, max(0, int(round((y1 - y) / (y1 - y0) * (rows - 1)))))

    for index, points in enumerate(series):
        spans: dict[int, list[int]] = {}
        for x, lo, hi in points:
            col = min(cols - 1, max(0, int((x - x0) / (x1 - x0) * (cols - 1) + 0.5)))
            top, bottom = row_of(hi), row_of(lo)
            span = spans.setdefault(col, [top, bottom])
            span[0], span[1] = min(span[0], top), max(span[1], bottom)
        previous: tuple[int, list[int]] | None = None
        shift = 8 * index
        for col in sorted(spans):
            top, bottom = spans[col]
            if previous is not None:  # a straight line from the previous column, gaps included
                pcol, (ptop, pbottom) = previous
                start, end = (ptop + pbottom) / 2, (top + bottom) / 2
                for c in range(pcol + 1, col + 1):
                    t = (c - pcol) / (col - pcol)
                    mid = int(round(start + (end - start) * t))
                    lo_prev = int(round(start + (end - start) * (c - 1 - pcol) / (col - pcol)))
                    a, b = sorted((mid, lo_prev))
                    if c == col:
                        a, b = min(a, top), max(b, bottom)
                    for r in range(a, b + 1):
                        cells[r // 4][c // 2] |= DOTS[c % 2][r % 4] << shift
            else:
                for r in range(top, bottom + 1):
                    cells[r // 4][col // 2] |= DOTS[col % 2][r % 4] << shift
            previous = (col, spans[col])
    return cells


def braille(mask: int) -> str:
    """The Braille character for a dot mask (any series)."""
    merged = 0
    while mask:
        merged |= mask & 0xFF
        mask >>= 8
    return chr(BRAILLE + merged) if merged else " "


def logged(points: Sequence[tuple[float, float, float]]) -> list[tuple[float, float, float]]:
    """``points`` with ``log10`` of their values (the non-positive ones dropped): what a log
    scale draws."""
    return [(x, math.log10(lo), math.log10(hi)) for x, lo, hi in points if lo > 0 and hi > 0]


def spans_decades(groups: Iterable[Sequence[tuple[float, float, float]]], decades: float = 2.0) -> bool:
    """Whether the values of ``groups`` are all positive and span more than ``decades``
    orders of magnitude: a linear plot would flatten the end of such a curve to a line."""
    lows = [lo for points in groups for _, lo, _ in points]
    highs = [hi for points in groups for _, _, hi in points]
    if not lows or min(lows) <= 0:
        return False
    return max(highs) / min(lows) > 10 ** decades


def y_label(y: float, log: bool) -> str:
    """A y-axis value (``y`` is ``log10`` of it on a log scale)."""
    return f"{10 ** y:.4g}" if log else f"{y:.4g}"


def column(x: float, x0: float, x1: float, width: int) -> int:
    """The cell column (of ``width``) where step ``x`` falls on an axis from ``x0`` to ``x1``."""
    if width <= 0 or x1 <= x0:
        return 0
    return min(width - 1, max(0, int((x - x0) / (x1 - x0) * (width * 2 - 1) + 0.5) // 2))


def spread(ranges: Iterable[tuple[float, float]], x0: float, x1: float, width: int) -> set[int]:
    """The columns that runs ``(first x, last x)`` cover on an axis from ``x0`` to ``x1``."""
    cols: set[int] = set()
    for a, b in ranges:
        if b < x0 or a > x1:
            continue
        cols.update(range(column(max(a, x0), x0, x1, width), column(min(b, x1), x0, x1, width) + 1))
    return cols


def text_plot(series: Mapping[str, Sequence[tuple[float, float, float]]], width: int = 60, height: int = 10,
              log: bool = False, marks: bool = False, colours: Sequence[str] | None = None,
              x_range: tuple[float, float] | None = None,
              nonfinite: Iterable[tuple[float, float]] = (),
              undrawn: Mapping[str, float] | None = None) -> list[str]:
    """A plain-text plot (Braille) with y labels and an x range, for summaries and ``hookfit
    compare``. ``log``: a log-scale y axis. ``marks``: each series' last point shows its name,
    every one visible: where another name has its cell, in the nearest free cells (:func:`_placed`).
    ``colours``: ANSI colour codes, one per series (a cell shared by several series takes the
    first one's). ``x_range``: steps the axis spans at least (where the run went on with values
    that are not drawn); ``nonfinite``: runs of steps whose values were NaN or infinite, marked
    ``×`` on the top row; ``undrawn``: the step where each series with no finite value (no points)
    ended, where ``marks`` shows its name, on the top row."""
    groups = [logged(points) if log else list(points) for points in series.values()]
    nonfinite = list(nonfinite)
    box = bounds(groups)
    if box is None:
        if x_range is None or not nonfinite:
            return []
        box = (x_range[0], x_range[1], 0.0, 1.0)  # nothing finite to draw: the marks alone
    x0, x1, y0, y1 = box
    if x_range is not None:
        x0, x1 = min(x0, x_range[0]), max(x1, x_range[1])
        if x1 <= x0:
            x1 = x0 + 1
        box = (x0, x1, y0, y1)
    cells = draw(groups, width, height, box)
    text = [[braille(mask) for mask in row] for row in cells]
    if colours:
        for r, row in enumerate(cells):
            for c, mask in enumerate(row):
                owner = next((i for i in range(len(groups)) if (mask >> 8 * i) & 0xFF), None)
                if owner is not None:
                    text[r][c] = f"\x1b[{colours[owner % len(colours)]}m{text[r][c]}\x1b[0m"
    for col in spread(nonfinite, x0, x1, width):
        text[0][col] = NONFINITE
    if marks:
        ends: list[tuple[int, str, int, int]] = []  # (series' index, label, line, column)
        for index, (name, points) in enumerate(zip(series, groups)):
            if points:
                x, lo, hi = points[-1]
                line = min(height - 1, max(0, int(round((y1 - (lo + hi) / 2) / (y1 - y0) * (height * 4 - 1))) // 4))
                ends.append((index, name or "*", line, column(x, x0, x1, width)))
            elif name in (undrawn or {}):  # nothing finite drawn: labelled on the top row, with the × marks
                ends.append((index, name or "*", 0, column((undrawn or {})[name], x0, x1, width)))
        for index, label, line, col in _placed(ends, width, height):
            for offset, char in enumerate(label):
                text[line][col + offset] = f"\x1b[1;{colours[index % len(colours)]}m{char}\x1b[0m" if colours else char
    drawn = bounds(groups) is not None
    top, bottom = (y_label(y1, log), y_label(y0, log)) if drawn else ("", "")
    labels = [f"{top:>10} ", *[" " * 11] * (height - 2), f"{bottom:>10} "] if height > 1 else [f"{top:>10} "]
    lines = [labels[r] + "│" + "".join(text[r]) for r in range(height)]
    lines.append(" " * 11 + "└" + "─" * width)
    left, right = f"{x0:g}", f"{x1:g}"
    lines.append(" " * 12 + left + right.rjust(width - len(left)))
    return lines


def _placed(ends: Sequence[tuple[int, str, int, int]], width: int, height: int) -> list[tuple[int, str, int, int]]:
    """Where each label goes: ``(index, label, line, column)`` of its first character, at the end of
    its curve (the label ending there at the right edge), else in the nearest cells no label took
    before it with a free cell on each side (the lines nearest first, then to the left), else where
    it would go, over another."""
    taken: set[tuple[int, int]] = set()
    out = []
    for index, label, line, col in ends:
        label = label[:width]
        start = max(0, min(col, width - len(label)))
        lines = sorted(range(height), key=lambda r: (abs(r - line), r))
        spots = [(r, c) for shift in range(width) for r in lines for c in (start - shift,) if c >= 0]
        free = next(((r, c) for r, c in spots if all((r, c + k) not in taken for k in range(-1, len(label) + 1))),
                    (line, start))
        taken.update((free[0], free[1] + k) for k in range(len(label)))
        out.append((index, label, *free))
    return out
