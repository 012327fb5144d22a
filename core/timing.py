"""Where the time goes: each stage's seconds split into waiting for data, the step function
and plugins (:class:`hookfit.payloads.TimeSplit`), measured by the loop with clock reads only,
never a device sync, and kept in ``state.time_split``."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from hookfit.payloads import TimeSplit

__all__ = ["INTERVAL", "store_split"]

INTERVAL = 0.5
"""The most seconds ``state.time_split`` lags behind a running stage (it is stored at most
this often while a stage runs, and always at the stage's end)."""


def store_split(state: Any, stage: str, past: TimeSplit | None, elapsed: float, waited: float,
                stepping: float, batches: int) -> None:
    """Store the time split of ``stage`` in ``state.time_split``: ``past`` (its earlier
    epochs) plus this one's, whose ``elapsed`` seconds were ``waited`` in ``next()``,
    ``stepping`` in the step and the rest in plugins. A new read-only mapping each time (a
    renderer on another thread may keep the one it read)."""
    if batches <= 0 and past is None:
        return  # the stage drew no batch: nothing to say about it
    split = TimeSplit(stage, waited, stepping, max(elapsed - waited - stepping, 0.0), max(batches, 0))
    if past is not None:
        split = past + split
    state.time_split = MappingProxyType({**state.time_split, stage: split})
