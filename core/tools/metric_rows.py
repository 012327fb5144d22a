"""What the metric rows of a run's ``metrics.jsonl`` say (rows of
:meth:`hookfit.payloads.MetricsSnapshot.row`, read by :mod:`hookfit.tools.runs`): the metrics
named, their series, which value of a metric is best, and which metric a run is judged by.

Without ``--metric``, a run's best value is that of the first metric the user configured a
direction for, in the order given, a validation one first (:func:`default_metric`:
``Metrics(best={"valid/auroc": "max", "valid/acc": "max"})``: ``valid/auroc``, whatever the order
of the step's keys), else of its loss; ``hookfit runs`` lists runs newest first, ``hookfit
compare`` ranked by that best value.
Which value of a metric is best is what the run's log says (its last ``"best"`` line), else
what the reader is told (``hookfit runs --mode``, ``hookfit compare --mode``), else, for a metric
named ``loss`` only, ``"min"`` (the loss is what the step minimises: the metrics role's default).
It is never guessed from other words in a name (``mae`` and ``perplexity`` are best low,
``accuracy`` high): a metric without a direction has no best value.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeGuard

from hookfit.tools import jsonlines

__all__ = ["ROW_FIELDS", "best", "cut_short", "default_metric", "direction", "directions", "final", "finite",
           "metric_names", "series", "series_names"]

ROW_FIELDS = frozenset({"event", "stage", "epoch", "step", "batches", "samples", "time", "samples_per_s", "stopped",
                        "evaluation"})
"""The keys of a metrics row that are not metrics (learning rates are ``lr_<optimizer>``)."""

POSITION_FIELDS = frozenset({"event", "stage", "epoch", "step", "stopped", "evaluation"})
"""The keys of a metrics row that place it: no series (:func:`series_names`)."""


def finite(value: Any) -> TypeGuard[int | float]:
    """Whether ``value`` is a finite number (not a ``bool``): a step, an epoch, a value that can be best."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def metric_names(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """``stage/metric`` names in ``rows`` (metrics rows), in order of appearance."""
    names: dict[str, None] = {}
    for row in rows:
        for key, value in row.items():
            if key not in ROW_FIELDS and not key.startswith("lr_") and isinstance(value, (int, float)):
                names[f"{row.get('stage', 'train')}/{key}"] = None
    return list(names)


def series_names(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every ``stage/key`` that :func:`series` finds numbers for in ``rows``: the metrics
    (:func:`metric_names`) first, then the rest in order of appearance (learning rates
    ``lr_<optimizer>``, ``samples_per_s``, ``time``, ``batches``, ``samples``)."""
    names: dict[str, None] = dict.fromkeys(metric_names(rows))
    for row in rows:
        for key, value in row.items():
            if key not in POSITION_FIELDS and jsonlines.numeric(value):
                names[f"{row.get('stage', 'train')}/{key}"] = None
    return list(names)


def default_metric(rows: Sequence[Mapping[str, Any]], known: Mapping[str, str] | None = None) -> str | None:
    """The metric a run is judged by (its best value): the first one in ``known`` (the run's
    directions, :func:`directions`) that ``rows`` have and that is not a loss, a validation one
    first; else ``valid/loss`` when the run validated a loss, else ``train/loss``, else its first
    metric. ``known`` is in the order of the log's ``"best"`` line: the order the user gave the
    directions in (``Metrics(best={"valid/auroc": "max", "valid/acc": "max"})``: ``valid/auroc``)."""
    names = metric_names(rows)
    chosen = [name for name in (known or {}) if name in names and name.rsplit("/", 1)[-1] != "loss"]
    ranked = [name for stage in ("valid/", "train/") for name in chosen if name.startswith(stage)]
    return next(iter(ranked + [name for name in ("valid/loss", "train/loss") if name in names] + names), None)


def directions(lines: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """``stage/metric`` -> ``"min"`` or ``"max"``: the last ``"best"`` line of a ``metrics.jsonl``
    (the directions the user configured in the metrics plugin), ``{}`` without one."""
    found: dict[str, str] = {}
    for line in lines:
        given = line.get("metrics") if line.get("event") == "best" else None
        if isinstance(given, Mapping):
            found = {str(k): v for k, v in given.items() if v in ("min", "max")}
    return found


def direction(metric: str, known: Mapping[str, str] | None = None) -> str | None:
    """Which value of ``metric`` (``stage/name`` or a bare name) is best: ``known``'s entry for
    it (by ``stage/name``, then by bare name), else ``"min"`` for a metric named ``loss``,
    else ``None``: unknown, never guessed from the name."""
    known = known or {}
    name = metric.rsplit("/", 1)[-1]
    found = known.get(metric) or known.get(name)
    if found in ("min", "max"):
        return found
    return "min" if name == "loss" else None


def series(rows: Iterable[Mapping[str, Any]], metric: str) -> list[tuple[int, int, float]]:
    """``(step, epoch, value)`` of ``stage/metric`` in ``rows``, NaN and infinite values
    included (a run that diverged)."""
    stage, key = metric.split("/", 1) if "/" in metric else ("train", metric)
    out = []
    for row in rows:
        value = row.get(key)
        if row.get("stage") == stage and jsonlines.numeric(value) and finite(row.get("step", 0)) and finite(row.get("epoch", 0)):
            out.append((int(row.get("step", 0)), int(row.get("epoch", 0)), float(value)))
    return out


def best(rows: Sequence[Mapping[str, Any]], metric: str, mode: str | None = None) -> tuple[float, int] | None:
    """The best value of ``metric`` over the epochs and its epoch (from 1), a stage a stop cut
    short (``"stopped"``, :mod:`hookfit.plugins.metrics_log`) left out: the lowest for
    ``mode="min"``, the highest for ``"max"``; ``mode=None``: the direction the rows' ``"best"``
    line gives (:func:`direction`). ``None`` with no finite value or no direction."""
    mode = mode or direction(metric, directions(rows))
    points = [p for p in series([row for row in rows if not row.get("stopped")], metric)  # not a stage a stop
              if math.isfinite(p[2])]  # cut short; a NaN or an infinity is never best
    if not points or mode is None:
        return None
    pick = max if mode == "max" else min
    _, epoch, value = pick(points, key=lambda p: p[2])
    return value, epoch


def final(rows: Sequence[Mapping[str, Any]], metric: str) -> tuple[tuple[float, int] | None, int | None]:
    """The last value of ``metric`` in ``rows`` and its epoch (NaN or infinite where the run
    diverged), ``None`` without one; and the epoch from which its values are not finite to the
    last (the run diverged there), ``None`` when the last is finite."""
    points = series(rows, metric)
    if not points:
        return None, None
    since = len(points)
    while since and not math.isfinite(points[since - 1][2]):
        since -= 1
    return (points[-1][2], points[-1][1]), (points[since][1] if since < len(points) else None)


def cut_short(rows: Sequence[Mapping[str, Any]], metric: str) -> bool:
    """Whether the last value of ``metric`` in ``rows`` (:func:`final`'s) is of a stage a stop cut
    short (``"stopped"``): the mean over the batches that stage ran, not a whole epoch's, so neither
    comparable with :func:`best` (over whole epochs) nor with another run's whole epochs."""
    stage, key = metric.split("/", 1) if "/" in metric else ("train", metric)
    last = next((row for row in reversed(rows) if row.get("stage") == stage and jsonlines.numeric(row.get(key))
                 and finite(row.get("step", 0)) and finite(row.get("epoch", 0))), None)
    return bool(last is not None and last.get("stopped"))
