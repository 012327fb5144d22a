"""Line plots drawn with Braille cells, from series that stay small however long the run.

A :class:`Series` keeps at most ``capacity`` buckets of (first x, min, max, last); when full,
neighbours merge and each bucket covers twice as many steps. Drawing a frame therefore costs
O(width), not O(steps), and a spike survives downsampling as the max of its bucket instead of
being dropped with the points around it.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

BRAILLE = 0x2800
# dot bit for (column 0..1, row 0..3) inside one cell
DOTS = ((0x01, 0x02, 0x04, 0x40), (0x08, 0x10, 0x20, 0x80))


@dataclass
class Series:
    """Downsampled ``(x, y)`` points: full history in min/max buckets, plus a recent window."""

    capacity: int = 512
    recent_size: int = 300
    span: int = 1
    buckets: list[list[float]] = field(default_factory=list)  # [x0, min, max, last]
    recent: collections.deque[tuple[float, float]] = field(default_factory=collections.deque)

    def __post_init__(self) -> None:
        self.recent = collections.deque(maxlen=self.recent_size)

    def add(self, x: float, y: float) -> None:
        if not math.isfinite(y):
            return
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

    def points(self, recent: bool = False) -> list[tuple[float, float, float]]:
        """``(x, low, high)`` for the full history or the recent window."""
        if recent:
            return [(x, y, y) for x, y in self.recent]
        return [(b[0], b[1], b[2]) for b in self.buckets]

    def __len__(self) -> int:
        return len(self.buckets)


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


def text_plot(series: Mapping[str, Sequence[tuple[float, float, float]]], width: int = 60, height: int = 10,
              log: bool = False, marks: bool = False, colours: Sequence[str] | None = None) -> list[str]:
    """A plain-text plot (Braille) with y labels and an x range, for summaries and ``hookfit
    compare``. ``log``: a log-scale y axis. ``marks``: each series' last point shows its name
    (its first character). ``colours``: ANSI colour codes, one per series (a cell shared by
    several series takes the first one's)."""
    groups = [logged(points) if log else list(points) for points in series.values()]
    box = bounds(groups)
    if box is None:
        return []
    x0, x1, y0, y1 = box
    cells = draw(groups, width, height, box)
    text = [[braille(mask) for mask in row] for row in cells]
    if colours:
        for r, row in enumerate(cells):
            for c, mask in enumerate(row):
                owner = next((i for i in range(len(groups)) if (mask >> 8 * i) & 0xFF), None)
                if owner is not None:
                    text[r][c] = f"\x1b[{colours[owner % len(colours)]}m{text[r][c]}\x1b[0m"
    if marks:
        for index, (name, points) in enumerate(zip(series, groups)):
            if not points:
                continue
            x, lo, hi = points[-1]
            col = min(width - 1, max(0, int((x - x0) / (x1 - x0) * (width * 2 - 1) + 0.5) // 2))
            line = min(height - 1, max(0, int(round((y1 - (lo + hi) / 2) / (y1 - y0) * (height * 4 - 1))) // 4))
            label = name[:1] or "*"
            text[line][col] = f"\x1b[1;{colours[index % len(colours)]}m{label}\x1b[0m" if colours else label
    top, bottom = y_label(y1, log), y_label(y0, log)
    labels = [f"{top:>10} ", *[" " * 11] * (height - 2), f"{bottom:>10} "] if height > 1 else [f"{top:>10} "]
    lines = [labels[r] + "│" + "".join(text[r]) for r in range(height)]
    lines.append(" " * 11 + "└" + "─" * width)
    left, right = f"{x0:g}", f"{x1:g}"
    lines.append(" " * 12 + left + right.rjust(width - len(left)))
    return lines
