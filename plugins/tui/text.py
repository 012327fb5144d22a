"""Words the dashboard, its summary and ``hookfit show`` share: values as tables show them
(``nan`` and ``inf`` as they are), text fitted to a width (whole parts, else ``…``), key help,
and :func:`summary`, the plain-text record printed after a run and by ``hookfit show --text``.
Nothing here needs urwid."""

from __future__ import annotations

import math
import os
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.plugins.tui.model import DashboardModel

KeyHelp = Sequence[tuple[str, str]]
"""Key help as ``(long, short)`` words, the first one kept whatever the width."""

KEYS: KeyHelp = (("q stop", "q stop"), ("tab/←→ metric", "tab metric"), ("n/p table", "n/p table"),
                 ("w window", "w"), ("l log", "l"), ("? help", "? help"))
"""The live dashboard's key help; ``q leave`` instead of ``q stop`` once the run ended."""

def fmt(value: float | None) -> str:
    """A value as tables show it: ``-`` for none yet, ``nan``, ``inf`` and ``-inf`` as they are."""
    if value is None:
        return "-"
    if not math.isfinite(value):
        return "nan" if value != value else "inf" if value > 0 else "-inf"
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    return f"{value:.3e}"


def nonfinite(value: float | None) -> bool:
    """Whether ``value`` is NaN or infinite (``None``, no value yet, is not)."""
    return value is not None and not math.isfinite(value)


def ellipsize(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, its last one ``…`` when it was cut."""
    if width <= 0:
        return ""
    return text if len(text) <= width else text[: width - 1] + "…"


def fit_parts(parts: Sequence[tuple[str, int]], width: int, sep: str = " │ ") -> str:
    """``parts`` (text, rank) joined by ``sep`` in their order, leaving out the highest rank
    (the least important) until they fit in ``width``; ellipsized if one part still does not."""
    kept = list(parts)
    while len(kept) > 1 and len(sep.join(t for t, _ in kept)) > width:
        del kept[max(range(len(kept)), key=lambda i: kept[i][1])]
    return ellipsize(sep.join(t for t, _ in kept), width)


def key_line(keys: KeyHelp, width: int) -> str:
    """One line of key help that fits ``width``: long words, then short ones from the right,
    then fewer keys (the first and the last stay), ellipsized at worst."""
    words = [long for long, _ in keys]
    candidates = [list(words)]
    for i in range(len(keys) - 1, -1, -1):
        words[i] = keys[i][1]
        candidates.append(list(words))
    while len(words) > 2:
        del words[-2]
        candidates.append(list(words))
    for candidate in candidates:
        line = " " + " · ".join(candidate)
        if len(line) <= width:
            return line
    return ellipsize(" " + " · ".join(candidates[-1]), width)


def clock(seconds: float | None) -> str:
    if seconds is None:
        return "--:--:--"
    s = int(seconds)
    return f"{s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}"




def terminal_width() -> int | None:
    """The columns of the terminal standard output writes to, or ``None`` where it writes to
    no terminal (a file or a pipe has no width to fit) or one that says no size."""
    try:
        fd = sys.stdout.fileno()
        if not os.isatty(fd):
            return None
        return os.get_terminal_size(fd).columns or None
    except (AttributeError, ValueError, OSError):  # no descriptor (replaced, closed): no terminal
        return None


def summary(dashboard: DashboardModel | None, state: Any, output: Path | str | None = None,
            warned: Sequence[str] = (), width: int | None = None) -> list[str]:
    """The plain-text record printed after the dashboard closes (and by ``hookfit show
    --text``): status (with the run's own duration, ``state.elapsed``: a persistent
    dashboard's hold is not part of it), how many steps were skipped and why, for an interrupted
    or failed run the checkpoint to resume from (as the console words it: :mod:`hookfit.plugins.support.resumable`;
    live only, a replayed log names no path), where the run resumed from, where its output is kept, the size of the model, where the time went, the
    table (``nan``/``inf`` as they are; the value of a stage a stop cut short, the mean over the
    batches it ran, says ``(partial)``, as ``hookfit runs`` and ``hookfit compare`` do) and the
    loss curves up to the run's last step (several in a plot: each ending in its stage's name, a
    line saying so under it; ``×`` where the values were not finite, and the steps
    where they were: those of the published values, with what is known of where a range began
    when metrics were not published every step); ``warned``: the warnings the run issued while
    the dashboard was up, a line each.
    ``state.evaluation`` true (``hookfit show`` of a folder of evaluations alone): an
    evaluation's record, which counts no steps and says what it evaluated. ``width``: no line is
    longer, from 40 columns on (text wraps at spaces, a word longer than a line, a path, kept
    whole on its own; long metric names are ellipsized in the table; the plots narrow); ``None``:
    the lines as long as they come, the plots 60 columns wide."""
    from hookfit.plugins.support.plot import NONFINITE, spans_decades, text_plot

    evaluation = getattr(state, "evaluation", False) or getattr(dashboard, "evaluation", False)
    asked = f"; stop asked by {state.stopped_by}" if state.stopped_by else ""
    took = [] if state.elapsed is None else [f"{state.elapsed:.1f}s"]  # (None: no end recorded its time)
    took += [] if evaluation else [f"{state.step} steps"]
    lines = [f"hookfit: {'evaluation' if evaluation else 'training'} {state.status} ({state.stop_reason})"
             f"{' after ' + ', '.join(took) if took else ''}{asked}"]
    if dashboard is not None and dashboard.skipped:
        lines.append(f"  {dashboard.skipped_text()}"
                     + ("; most of the run did not train" if dashboard.mostly_skipped else ""))
    if dashboard is not None and (resume := dashboard.resumable.sentence(state.status)) is not None:
        lines.append(f"  {resume}")
    if getattr(state, "resumed_from", None) is not None:
        lines.append(f"  {'evaluated' if evaluation else 'resumed from'} {state.resumed_from}")
    if output is not None:
        lines.append(f"  output printed during the run: {output}")
    lines.extend(f"  {line}" for line in warned)
    model = getattr(dashboard, "model", None)
    if model is not None:
        lines.append(f"  model: {model}")
    for split in (getattr(state, "time_split", None) or {}).values():
        lines.append(f"  time in {split.stage}: {split.total:.1f}s over {split.batches} batches, {split}"
                     + (f"; data loading is {split.shares['data']:.0%} of it: the data loader is the bottleneck"
                        if split.data_bound else ""))
    lines = wrapped(lines, width)
    if dashboard is None or not dashboard.names:
        return lines
    name_w = max(len(n) for n in dashboard.names)
    if width is not None:
        name_w = max(6, min(name_w, width - 26))  # "  name  " and two values of 10
    cut = {stage for stage, _ in dashboard.cut}  # (a stage a stop cut short: its epoch is the run's last)
    cells = []
    for name in dashboard.names:
        row = dashboard.table.get(name, {})
        cells.append([fmt(value) + (" (partial)" if stage in cut and value is not None else "") for stage in
                      ("train", "valid") for value in [row.get(f"{stage}_final", row.get(f"{stage}_epoch"))]])
    value_w = max([10, *(len(cell) for row_cells in cells for cell in row_cells)])
    lines.append(f"  {'metric':<{name_w}}  {'train':>{value_w}}  {'valid':>{value_w}}")
    for name, (train, valid) in zip(dashboard.names, cells):
        lines.append(f"  {ellipsize(name, name_w):<{name_w}}  {train:>{value_w}}  {valid:>{value_w}}")
    if any(cell.endswith(" (partial)") for row_cells in cells for cell in row_cells):
        lines += wrapped(["  (partial: the mean over the batches of an epoch a stop cut short, not a whole "
                          "epoch's)"], width)
    plot_w = 60 if width is None else max(10, min(60, width - 14))  # "  ", the y labels and the axis: 14
    for name in dashboard.names:
        if "loss" not in name:
            continue
        series = {s: dashboard.series[(s, name)] for s in ("train", "valid") if (s, name) in dashboard.series}
        groups = {s: g.points() for s, g in series.items()}
        ranges = [xs for g in series.values() if (xs := g.x_range()) is not None]
        x_range = (min(r[0] for r in ranges), max([*(r[1] for r in ranges), state.step])) if ranges else None
        bad = [(a, b) for g in series.values() for a, b in g.nonfinite.runs]
        log = spans_decades(groups.values())
        several = len(groups) > 1  # which curve is which: each ends in its stage's name, as the legend says
        plot = text_plot(groups, width=plot_w, height=8, log=log, x_range=x_range, nonfinite=bad, marks=several)
        if plot:
            lines += wrapped([f"  {name} over steps ({' and '.join(groups)}{', log scale' if log else ''}):"], width)
            lines.extend("  " + line for line in plot)
            if several:
                lines += wrapped([f"  (each curve ends in its name: {', '.join(groups)})"], width)
        if bad:
            kinds = "/".join(sorted({k for g in series.values() for k in g.kinds}))
            listed = bad[:8]
            trained = series.get("train")  # (the validation's points are its epochs': exact)
            note = dashboard.onsets.note(name, [(a, b) for a, b in trained.nonfinite.runs if (a, b) in listed]) \
                if trained is not None else ""
            lines += wrapped([f"  {NONFINITE} where {name} was {kinds}: steps "
                              + ", ".join(f"{a:g}–{b:g}" if b > a else f"{a:g}" for a, b in listed)
                              + (", …" if len(bad) > 8 else "")] + ([f"    {note}"] if note else []), width)
    return lines


def wrapped(lines: Sequence[str], width: int | None) -> list[str]:
    """``lines`` each cut at spaces into lines of at most ``width`` characters, the rest indented
    under the line's text; a word longer than that (a path) whole, on a line of its own, for
    the terminal to wrap (and a copy to keep whole). ``None``: the lines as they are."""
    if width is None:
        return list(lines)
    out: list[str] = []
    for line in lines:
        indent = " " * (len(line) - len(line.lstrip(" ")) + 2)
        out += textwrap.wrap(line, max(width, len(indent) + 8), subsequent_indent=indent, break_on_hyphens=False,
                             break_long_words=False) or [""]
    return out
