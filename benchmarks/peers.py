"""Lightning's and Ignite's stacks as variants of ``overhead.py`` (``--peers``), where the
``[bench]`` extra installed them: the builders of ``compare.py``, timed at their own epoch start
and end, on the same workload and in the same interleaved rounds as hookfit's variants.

* ``ignite``: Ignite's ``Engine`` alone; ``ignite-default``: with ``RunningAverage`` of the loss
  and its ``ProgressBar`` (to a null stream);
* ``lightning``: a quiet ``Trainer`` (no logger, checkpointing, progress bar or model summary);
  ``lightning-default``: its defaults, with ``self.log("loss", prog_bar=True)`` every step.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any, Callable

import compare
from overhead import Timing, Workload

PEERS: dict[str, tuple[str, Callable[..., Any]]] = {
    "ignite": ("ignite", lambda: compare.ignite(default=False)),
    "ignite-default": ("ignite", lambda: compare.ignite(default=True)),
    "lightning": ("pytorch_lightning", lambda: compare.lightning(default=False)),
    "lightning-default": ("pytorch_lightning", lambda: compare.lightning(default=True)),
}


class _Setup:
    """What ``compare.py``'s builders read: the batches, and a fresh copy of the model with its
    optimizer (the workload's own)."""

    def __init__(self, workload: Workload) -> None:
        self.data = workload.data
        self._make = workload.make

    def fresh(self) -> tuple[Any, Any]:
        parts = self._make()
        return parts.model, parts.optimizer


def _variant(make: Callable[[], Callable[[Any], Callable[[], float]]]) -> Callable[[Workload], Callable[[], Timing]]:
    def build(workload: Workload) -> Callable[[], Timing]:
        epoch = make()(_Setup(workload))

        def run() -> Timing:
            start = time.perf_counter()
            inside = epoch()
            return Timing(inside, time.perf_counter() - start)

        return run

    return build


def available() -> dict[str, Callable[[Workload], Callable[[], Timing]]]:
    """The peers whose package is installed, as ``overhead.VARIANTS`` entries."""
    return {name: _variant(make) for name, (module, make) in PEERS.items()
            if importlib.util.find_spec(module) is not None}
