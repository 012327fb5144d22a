"""checkpoint repeats: a position is saved once. Two save points of a run can fall at one
global step (``every_n_steps`` dividing the epoch's length: the step's save, then the epoch's;
a step's save at the step ``max_steps`` ends the run at, then the run's end), and both name one
file (:func:`~hookfit.plugins.checkpoint.storage.filename`). The later save is not written again
while the earlier one is written or in flight: the file holds that step's weights, and a run
resumed from it goes on exactly from there (the rest of the epoch, if any, runs first). It is
written again only when it carries a score of those weights that the earlier one lacked (a
validation between the two scored them): the best checkpoint holds its score. A save that is not
written again is not announced: the checkpoint is announced once, with the first save's reason.

With several processes only the main one knows that its write failed or that a busy writer
skipped it, and building a checkpoint is a collective operation that every process must join or
skip alike: a save at the step of the last one asked (every process asks the same saves) takes the
main process's answer, one broadcast; any other save is written without asking."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hookfit.plugins.checkpoint.ranks import from_main

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

__all__ = ["Written"]


class Written:
    """The step of the last checkpoint this process wrote or has in flight in a run, and whether
    it carries a score (see the module)."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.scored = False
        self.asked: int | None = None  # the step of the last save asked (again(), a held copy), on every process

    def wrote(self, step: int, metric: float | None) -> None:
        """A checkpoint at ``step`` carrying ``metric`` was handed to the writer (or written)."""
        self.step, self.scored = step, metric is not None

    def lost(self, step: int) -> None:
        """The checkpoint at ``step`` is not written (its write failed, or a busy writer skipped
        it): a later save at that step writes it."""
        if self.step == step:
            self.step, self.scored = None, False

    def again(self, loop: Run, step: int, metric: float | None) -> bool:
        """Whether a save at ``step`` carrying ``metric`` is to be written: ``False`` for a step whose
        checkpoint is written or in flight with a score, or with none and none now; with several
        processes, the main process's answer (see the module)."""
        repeat, self.asked = self.asked == step, step
        write = self.step != step or (metric is not None and not self.scored)
        return from_main(loop, write) if repeat and loop.state.world_size > 1 else write
