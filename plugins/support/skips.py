"""Optimizer steps skipped for non-finite values, as a share of those attempted (the console's ``hookfit skipped``
line, the dashboard's ``N of M steps skipped`` and ``mostly skipped``): by optimizer, where the optimizer role's
items count their steps (the built-in's ``steps`` and ``skipped``), so that two optimizers each skipping a batch
are not two skips of one batch, and a window of ``accumulate=N`` batches is one step, not N."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["attempted", "worst", "worst_share"]


def attempted(optimizers: Any) -> dict[str, int]:
    """Each optimizer's steps attempted so far (real and skipped), by name, for items of ``loop.optimizers`` that
    count them (integer ``steps`` and ``skipped``); others are left out."""
    items = optimizers.items() if isinstance(optimizers, Mapping) else ()
    return {name: each.steps + each.skipped for name, each in items
            if isinstance(getattr(each, "steps", None), int) and isinstance(getattr(each, "skipped", None), int)}


def worst(skipped: Mapping[str, int], before: Mapping[str, int], after: Mapping[str, int],
          batches: int) -> tuple[str, int, int]:
    """The optimizer with the largest share of its steps skipped: its name, its ``skipped`` steps and the steps it
    attempted between the counts ``before`` and ``after`` (:func:`attempted`), or ``batches`` for one that does not
    count its steps (never fewer than its skips, nor than 1). ``skipped`` names one optimizer at least."""
    counts = {name: (count, max(after[name] - before.get(name, 0) if name in after else batches, count, 1))
              for name, count in skipped.items()}
    name, (count, of) = max(counts.items(), key=lambda item: item[1][0] / item[1][1])
    return name, count, of


def worst_share(skipped: Mapping[str, int], before: Mapping[str, int], after: Mapping[str, int],
                batches: int) -> tuple[str, float]:
    """The optimizer with the largest share of its steps skipped and that share (:func:`worst`)."""
    name, count, of = worst(skipped, before, after, batches)
    return name, count / of
