"""The dashboard's skipped optimizer steps: where they were (``!`` on the curves), how many, and why,
from the ``step_skipped`` event (live) or the count a run's log gives (``hookfit show``).
:class:`SkippedSteps` is a part of :class:`hookfit.plugins.tui.model.DashboardModel`, which
receives the ``skipped`` and ``skipped_total`` messages through it."""

from __future__ import annotations

import collections

from hookfit.plugins.support.plot import Ranges


class SkippedSteps:
    """The skipped steps of a run, counted against its step (``self.step``, the model's)."""

    step: int

    def __init__(self) -> None:
        self.skips = Ranges()
        """Where optimizer steps were skipped (the ``step_skipped`` event): ``!`` on the curves."""
        self.skip_reasons: collections.Counter[str] = collections.Counter()
        self._skipped: dict[str, int] = {}  # optimizer -> its skipped steps
        self.skipped_total: int | None = None  # as a run's log says, where the events are not seen

    def _on_skipped(self, step: int, optimizer: str = "default", reason: str = "") -> None:
        """An optimizer step was skipped (the ``step_skipped`` event: a non-finite loss...)."""
        last = self.skips.runs[-1][1] if self.skips else None
        self.skips.add(step, join=last is not None and step - last <= 1)
        self._skipped[optimizer] = self._skipped.get(optimizer, 0) + 1
        self.skip_reasons[reason.split(" at ", 1)[0] or "no reason given"] += 1

    def _on_skipped_total(self, count: int) -> None:
        """The run's count of skipped steps, as its log says (``hookfit show``)."""
        self.skipped_total = count

    @property
    def skipped(self) -> int:
        """Optimizer steps skipped in the run (the most of any one optimizer)."""
        seen = max(self._skipped.values(), default=0)
        return max(seen, self.skipped_total or 0)

    @property
    def mostly_skipped(self) -> bool:
        """Whether more than half of the run's steps were skipped."""
        return self.step > 0 and self.skipped * 2 > self.step

    def skipped_text(self) -> str:
        """``124 of 224 steps skipped (non-finite loss)``, or ``""`` when none was."""
        n = self.skipped
        if not n:
            return ""
        reasons = self.skip_reasons.most_common()
        why = reasons[0][0] if len(reasons) == 1 else ", ".join(f"{r}: {c}" for r, c in reasons)
        return f"{n} of {self.step} steps skipped" + (f" ({why})" if why else "")
