"""Optimizer steps skipped for non-finite values, as a share of those attempted (the console's ``hookfit skipped``
line): by optimizer, where the optimizer role's items count their steps (the built-in's ``steps`` and ``skipped``),
so that two optimizers each skipping a batch are not two skips of one batch, and a window of ``accumulate=N``
batches is one step, not N."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["attempted", "worst_share"]


def attempted(optimizers: Any) -> dict[str, int]:
    """Each optimizer's steps attempted so far (real and skipped), by name, for items of ``loop.optimizers`` that
    count them (integer ``steps`` and ``skipped``); others are left out."""
    items = optimizers.items() if isinstance(optimizers, Mapping) else ()
    return {name: each.steps + each.skipped for name, each in items
            if isinstance(getattr(each, "steps", None), int) and isinstance(getattr(each, "skipped", None), int)}


def worst_share(skipped: Mapping[str, int], before: Mapping[str, int], after: Mapping[str, int],
                batches: int) -> tuple[str, float]:
    """The optimizer with the largest share of its steps skipped and that share: ``skipped`` of those it attempted
    between the counts ``before`` and ``after`` (:func:`attempted`), or of ``batches`` for one that does not count
    its steps."""
    shares = {name: count / max(after[name] - before.get(name, 0) if name in after else batches, count, 1)
              for name, count in skipped.items()}
    return max(shares.items(), key=lambda item: item[1])
