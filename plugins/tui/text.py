"""Words the dashboard, its summary and ``hookfit show`` share: values as tables show them
(``nan`` and ``inf`` as they are), text fitted to a width (whole parts, else ``…``), key help,
and :func:`summary`, the plain-text record printed after a run and by ``hookfit show --text``.
Nothing here needs urwid."""

from __future__ import annotations

import math
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




def summary(dashboard: DashboardModel | None, state: Any, output: Path | str | None = None,
            warned: Sequence[str] = ()) -> list[str]:
    """The plain-text record printed after the dashboard closes (and by ``hookfit show
    --text``): status (with the run's own duration, ``state.elapsed``: a persistent
    dashboard's hold is not part of it), how many steps were skipped and why, where the run
    resumed from, where its output is kept, the size of the model, where the time went, the
    table (``nan``/``inf`` as they are) and the loss curves up to the run's last step (``×``
    where the values were not finite); ``warned``: the warnings the run issued while the
    dashboard was up, a line each. ``state.evaluation`` true (``hookfit show`` of a folder of
    evaluations alone): an evaluation's record, which counts no steps and says what it evaluated."""
    from hookfit.plugins.support.plot import NONFINITE, spans_decades, text_plot

    evaluation = getattr(state, "evaluation", False) or getattr(dashboard, "evaluation", False)
    asked = f"; stop asked by {state.stopped_by}" if state.stopped_by else ""
    lines = [f"hookfit: {'evaluation' if evaluation else 'training'} {state.status} ({state.stop_reason}) after "
             f"{state.elapsed:.1f}s{'' if evaluation else f', {state.step} steps'}{asked}"]
    if dashboard is not None and dashboard.skipped:
        lines.append(f"  {dashboard.skipped_text()}"
                     + ("; most of the run did not train" if dashboard.mostly_skipped else ""))
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
    if dashboard is None or not dashboard.names:
        return lines
    width = max(len(n) for n in dashboard.names)
    lines.append(f"  {'metric':<{width}}  {'train':>10}  {'valid':>10}")
    for name in dashboard.names:
        row = dashboard.table.get(name, {})
        train = row.get("train_final", row.get("train_epoch"))
        valid = row.get("valid_final", row.get("valid_epoch"))
        lines.append(f"  {name:<{width}}  {fmt(train):>10}  {fmt(valid):>10}")
    for name in dashboard.names:
        if "loss" not in name:
            continue
        series = {s: dashboard.series[(s, name)] for s in ("train", "valid") if (s, name) in dashboard.series}
        groups = {s: g.points() for s, g in series.items()}
        ranges = [xs for g in series.values() if (xs := g.x_range()) is not None]
        x_range = (min(r[0] for r in ranges), max([*(r[1] for r in ranges), state.step])) if ranges else None
        bad = [(a, b) for g in series.values() for a, b in g.nonfinite.runs]
        log = spans_decades(groups.values())
        plot = text_plot(groups, width=60, height=8, log=log, x_range=x_range, nonfinite=bad)
        if plot:
            lines.append(f"  {name} over steps ({' and '.join(groups)}{', log scale' if log else ''}):")
            lines.extend("  " + line for line in plot)
        if bad:
            kinds = "/".join(sorted({k for g in series.values() for k in g.kinds}))
            lines.append(f"  {NONFINITE} where {name} was {kinds}: steps "
                         + ", ".join(f"{a:g}–{b:g}" if b > a else f"{a:g}" for a, b in bad[:8])
                         + (", …" if len(bad) > 8 else ""))
    return lines
