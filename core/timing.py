"""Where the time goes: each stage's seconds split into waiting for data, the step function
and plugins (:class:`hookfit.payloads.TimeSplit`), measured by the loop with clock reads only,
never a device sync, and kept in ``state.time_split``.

A clock read costs the loop about 0.4 µs a batch on a small model (its own 45 ns, and the
caches the step's torch work left cold), three of them more than the rest of the loop's
bookkeeping. So the loop times every batch of a stage's first :data:`EXACT` and, when batches
are fast (under :data:`CHEAP` seconds), a random sample of the later ones, about one in
:data:`GAP`: the stage's total is exact, its data and step parts are the timed batches' sums,
scaled to every batch (:class:`Sample`)."""

from __future__ import annotations

import random
from types import MappingProxyType
from typing import Any

from hookfit.payloads import TimeSplit

__all__ = ["CHEAP", "EXACT", "GAP", "INTERVAL", "Sample", "store_split"]

INTERVAL = 0.5
"""The most seconds ``state.time_split`` lags behind a running stage (it is stored at most
this often while a stage runs, and always at the stage's end)."""

EXACT = 16
"""Batches at the start of every stage that are all timed (a short stage's split is exact)."""

GAP = 8
"""The mean gap, in batches, between timed batches after the first :data:`EXACT`, while
batches are fast."""

CHEAP = 0.002
"""Batches slower than this (seconds, on average so far) are all timed: three clock reads are
then under a thousandth of a batch."""


class Sample:
    """Which batches of a stage the loop times, and the split they give.

    The loop asks :meth:`turn` at the end of the batch it was told (``turn`` is a batch index);
    the answer says whether the next batch is timed and at the end of which batch to ask again.
    Gaps between timed batches are drawn from a generator of the sample's own (uniform, mean
    :data:`GAP`), so that no periodic pattern of the data (a loader's workers taking turns) is
    sampled in phase; the user's random streams are not touched."""

    __slots__ = ("began", "start", "timed", "count", "base", "rng")

    def __init__(self, began: float, start: int) -> None:
        self.began, self.start = began, start
        self.timed = True  # the batch running now is timed
        self.count = 0  # timed batches done
        self.base: tuple[float, float] | None = None  # data and step seconds of the first EXACT
        self.rng: random.Random | None = None

    def turn(self, batch_idx: int, now: float, waited: float, stepping: float) -> tuple[bool, int]:
        """At the end of batch ``batch_idx`` (the clock read ``now``; ``waited`` and
        ``stepping`` summed over the timed batches so far): whether the next batch is timed,
        and the batch at whose end to ask again."""
        if self.timed:
            self.count += 1
            if self.count == EXACT:
                self.base = (waited, stepping)
        if self.count < EXACT or (now - self.began) >= CHEAP * (batch_idx - self.start + 1):
            self.timed = True  # every batch: the first ones, or slow ones
            return True, batch_idx + 1
        if not self.timed:  # the batch before a timed one ends now: t0 is this clock read
            self.timed = True
            return True, batch_idx + 1
        if self.rng is None:
            self.rng = random.Random(batch_idx)
        gap = self.rng.randint(1, 2 * GAP - 1)
        self.timed = gap == 1
        return self.timed, batch_idx + (1 if self.timed else gap - 1)

    def split(self, waited: float, stepping: float, batches: int) -> tuple[float, float]:
        """The data and step seconds of the stage's ``batches`` batches so far: the sums of
        the timed ones, the part after the first :data:`EXACT` scaled by batches over timed
        batches."""
        base, sampled = self.base, self.count - EXACT
        if base is None or sampled <= 0 or batches <= self.count:
            return waited, stepping
        scale = (batches - EXACT) / sampled
        return base[0] + (waited - base[0]) * scale, base[1] + (stepping - base[1]) * scale


def store_split(state: Any, stage: str, past: TimeSplit | None, elapsed: float, waited: float,
                stepping: float, batches: int, sample: Sample | None = None) -> None:
    """Store the time split of ``stage`` in ``state.time_split``: ``past`` (its earlier
    epochs) plus this one's, whose ``elapsed`` seconds were ``waited`` in ``next()``,
    ``stepping`` in the step and the rest in plugins; with ``sample``, ``waited`` and
    ``stepping`` are the timed batches' sums, scaled to every batch (:meth:`Sample.split`). A
    new read-only mapping each time (a renderer on another thread may keep the one it read)."""
    if batches <= 0 and past is None:
        return  # the stage drew no batch: nothing to say about it
    if sample is not None:
        waited, stepping = sample.split(waited, stepping, batches)
    split = TimeSplit(stage, waited, stepping, max(elapsed - waited - stepping, 0.0), max(batches, 0))
    if past is not None:
        split = past + split
    state.time_split = MappingProxyType({**state.time_split, stage: split})
