"""What the metrics plugin reports when a run is over (the core's ``results`` event): each
metric's last epoch value and, for the metrics with a direction, its best value and epoch."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from hookfit.plugins.metrics.aggregate import HISTORY_FIELDS
from hookfit.plugins.metrics.directions import Directions

__all__ = ["Report"]


class Report:
    """Every published epoch of a run, summed up as it goes: ``last`` (``"<stage>/<name>"`` ->
    the value of the latest epoch that had the metric) and ``best`` (``"<stage>/<name>"`` ->
    ``(value, epoch counted from 1)``, for the metrics ``directions`` gives a direction: the
    lowest for ``"min"``, the highest for ``"max"``; of equal values the first; NaN and
    infinities are never best)."""

    def __init__(self, directions: Directions) -> None:
        self.directions = directions
        self.last: dict[str, float] = {}
        self.best: dict[str, tuple[float, int]] = {}

    def take(self, stage: str, epoch: int, values: Mapping[str, Any], best: bool = True) -> None:
        """The epoch means of ``stage`` in ``epoch`` (counted from 0), by metric name; with
        ``best=False`` (a stage a stop cut short: the mean of some of its batches) the last values only."""
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            key, value = f"{stage}/{name}", float(value)
            self.last[key] = value
            mode = self.directions.direction(stage, name)
            if not best or mode is None or not math.isfinite(value):
                continue
            held = self.best.get(key)
            if held is None or (value < held[0] if mode == "min" else value > held[0]):
                self.best[key] = (value, epoch + 1)

    def answer(self) -> dict[str, Any]:
        """``{"metrics": {...}, "best": {...}}``: copies, which the plugin never changes."""
        return {"metrics": dict(self.last), "best": dict(self.best)}

    def state(self) -> dict[str, Any]:
        """Plain data for a checkpoint."""
        return {"last": dict(self.last), "best": {key: list(held) for key, held in self.best.items()}}

    def load(self, state: Mapping[str, Any] | None, history: Mapping[str, Iterable[Mapping[str, Any]]]) -> None:
        """Restore :meth:`state`; a checkpoint from before it existed has the ``history``
        (``{stage: [{"epoch": ..., "step": ..., <metric>: <epoch mean>}, ...]}``) instead."""
        self.last, self.best = {}, {}
        if state is not None:
            self.last = {str(k): float(v) for k, v in state["last"].items()}
            self.best = {str(k): (float(v), int(e)) for k, (v, e) in state["best"].items()}
            return
        for stage, entries in history.items():
            for entry in entries:
                self.take(stage, int(entry["epoch"]), {k: v for k, v in entry.items() if k not in HISTORY_FIELDS})
