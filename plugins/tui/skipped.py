"""The dashboard's skipped optimizer steps: where they were (``!`` on the curves), how many, and why,
from the ``step_skipped`` event (live) or the count a run's log gives (``hookfit show``).
:class:`SkippedSteps` is a part of :class:`hookfit.plugins.tui.model.DashboardModel`, which
receives the ``skipped``, ``attempted`` and ``skipped_total`` messages through it.

How many is the console's share (:mod:`hookfit.plugins.support.skips`): the optimizer with the
largest share of its own steps skipped, over the steps it attempted in the run (the ``attempted``
message: each optimizer's counts), so that two optimizers, or a window of ``accumulate=N``
batches, count as the optimizers stepped, not as the batches ran."""

from __future__ import annotations

import collections
from collections.abc import Mapping

from hookfit.plugins.support import skips
from hookfit.plugins.support.plot import Ranges


class SkippedSteps:
    """The skipped steps of a run, counted against the steps its optimizers attempted, else against its
    step (``self.step``, the model's)."""

    step: int

    def __init__(self) -> None:
        self.skips = Ranges()
        """Where optimizer steps were skipped (the ``step_skipped`` event): ``!`` on the curves."""
        self.skip_reasons: collections.Counter[str] = collections.Counter()
        self._skipped: dict[str, int] = {}  # optimizer -> its skipped steps
        self._before: dict[str, int] = {}  # optimizer -> its steps attempted before the run (skips.attempted)
        self._attempted: dict[str, int] = {}  # optimizer -> its steps attempted so far, as last read
        self.skipped_total: int | None = None  # as a run's log says, where the events are not seen

    def _on_skipped(self, step: int, optimizer: str = "default", reason: str = "") -> None:
        """An optimizer step was skipped (the ``step_skipped`` event: a non-finite loss...)."""
        last = self.skips.runs[-1][1] if self.skips else None
        self.skips.add(step, join=last is not None and step - last <= 1)
        self._skipped[optimizer] = self._skipped.get(optimizer, 0) + 1
        self.skip_reasons[reason.split(" at ", 1)[0] or "no reason given"] += 1

    def _on_attempted(self, counts: Mapping[str, int], start: bool = False) -> None:
        """Each optimizer's steps attempted so far, real and skipped (:func:`hookfit.plugins.support.skips.attempted`);
        ``start``: the run starts, or resumes, from these (those of the runs it continues are not its own)."""
        self._attempted = dict(counts)
        if start:
            self._before = dict(counts)

    def _on_skipped_total(self, count: int) -> None:
        """The run's count of skipped steps, as its log says (``hookfit show``)."""
        self.skipped_total = count

    def worst(self) -> tuple[str, int, int]:
        """``(optimizer, skipped, attempted)``: the optimizer with the largest share of its steps
        skipped (:func:`hookfit.plugins.support.skips.worst`; one that does not count its steps,
        or without the ``attempted`` message, of the run's steps), as the console's ``hookfit
        skipped`` line says it. Without events, the count of the run's log over its steps."""
        if self._skipped:
            return skips.worst(self._skipped, self._before, self._attempted, self.step)
        return "", self.skipped_total or 0, self.step

    @property
    def skipped(self) -> int:
        """Optimizer steps skipped in the run: those of :meth:`worst`'s optimizer."""
        return self.worst()[1]

    @property
    def mostly_skipped(self) -> bool:
        """Whether more than half of the steps :meth:`worst`'s optimizer attempted were skipped."""
        _, count, of = self.worst()
        return of > 0 and count * 2 > of

    def skipped_text(self) -> str:
        """``124 of 224 steps skipped (non-finite loss)``, or ``""`` when none was; with several
        optimizers, whose steps they are: ``3 of 10 steps of optimizer 'G' skipped (...)``."""
        name, n, of = self.worst()
        if not n:
            return ""
        reasons = self.skip_reasons.most_common()
        why = reasons[0][0] if len(reasons) == 1 else ", ".join(f"{r}: {c}" for r, c in reasons)
        whose = f" of optimizer {name!r}" if len(self._attempted) > 1 else ""
        return f"{n} of {of} steps{whose} skipped" + (f" ({why})" if why else "")
