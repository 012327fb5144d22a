"""Where the dashboard's training curves stopped being finite, as far as their points can say.

A training curve has a point per publication of the metrics plugin (every ``Metrics(interval=...)``
seconds, every batch with ``interval=0``), so a run of non-finite values that first shows at a
point began somewhere after the point before it: :class:`Onsets` keeps that point's step for
every such run, and :meth:`Onsets.note` says, in words, where the runs the summary lists are
not exact."""

from __future__ import annotations

import math
from collections.abc import Sequence

from hookfit.payloads import ResumeInfo
from hookfit.plugins.support.plot import Series

__all__ = ["Onsets"]

KEPT = 1024
"""Runs remembered per metric; the oldest are forgotten beyond (the curve itself keeps fewer)."""


class Onsets:
    """Per training metric: the first step of each run of non-finite points -> the step of the
    point before it (or of the run's start, where the curve had none)."""

    def __init__(self) -> None:
        self.before: dict[str, dict[float, float]] = {}

    def add(self, series: Series, name: str, x: float, y: float, resumed: ResumeInfo | None = None) -> None:
        """Add the point ``(x, y)`` of ``name`` to ``series``, noting where a non-finite run it
        starts could have begun (the run's first step: 1, or the one after ``resumed``'s)."""
        start = resumed.step if resumed is not None else 0
        previous = series.last_x
        runs = series.nonfinite.runs
        if not math.isfinite(y) and not (runs and previous is not None and runs[-1][1] == previous):
            kept = self.before.setdefault(name, {})
            kept[x] = previous if previous is not None else start
            if len(kept) > KEPT:
                del kept[next(iter(kept))]
        series.add(x, y)

    def note(self, name: str, runs: Sequence[tuple[float, float]]) -> str:
        """``""`` when each of ``runs`` (``name``'s, as the summary lists them) starts at the step
        after the point before it (every step published); else what is known of the first one's
        start and how far the later ones may start before they show."""
        before = self.before.get(name, {})
        gaps = [(a, before[a]) for a, _ in runs if a in before and before[a] < a - 1]
        if not gaps:
            return ""
        first = runs[0][0]
        words = []
        if gaps[0][0] == first:
            which = "the first range" if len(runs) > 1 else "the range"
            words.append(f"{which} began after step {gaps[0][1]:g}, by step {first:g}")
        later = [a - b - 1 for a, b in gaps if a != first]
        if later:
            words.append(f"{'a later' if words else 'a'} range may begin up to {max(later):g} steps before it shows")
        return f"(published every few steps: {'; '.join(words)})"
