"""optim's accumulation windows: which training batch closes one (the optimizers step after
it), what each loss is divided by, and the answer to ``should_sync_gradients``. The windows are
aligned to batch indices, so that a run resumed mid-epoch has the windows of an uninterrupted
one (see :class:`~hookfit.plugins.optim.Optim`, ``accumulate``). :class:`Windows` is that part
of the plugin's class."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from hookfit import hookimpl
from hookfit.data import length

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run


class Windows:
    """The accumulation windows of :class:`~hookfit.plugins.optim.Optim` (a part of its class)."""

    # the plugin's, read here
    loop: Run | None
    accumulate: int

    def __init__(self, accumulate: int) -> None:
        self._stage_len: int | None = None  # batches in the training stage, when known
        # the epoch's last window when it is partial: its first batch (never, the length
        # unknown or a multiple of accumulate) and how many batches it holds (see _divisor)
        self._last_window, self._last_size = sys.maxsize, accumulate

    def _measure(self, data: Any) -> None:
        """At a training stage's start: its length, and its last window when that is partial."""
        self._stage_len = length(data)
        self._last_window, self._last_size = sys.maxsize, self.accumulate
        if self._stage_len is not None and self._stage_len % self.accumulate:
            self._last_size = self._stage_len % self.accumulate
            self._last_window = self._stage_len - self._last_size

    def _window_closes(self) -> bool:
        if self.accumulate == 1:
            return True
        assert self.loop is not None  # asked by a step or an event, during the run
        return (self.loop.state.batch_idx + 1) % self.accumulate == 0

    def _divisor(self, loop: Run) -> int:
        """What the loss of this batch is divided by (``accumulate > 1``): the number of
        batches of its window, ``accumulate`` but in the epoch's last window when the data's
        length makes it partial. A pure function of the batch index and the data's length,
        so a run resumed inside the window weights it as an uninterrupted one; a batch past
        the length the data gave (a wrong ``__len__``) is divided by ``accumulate``."""
        batch_idx = loop.state.batch_idx
        # (_last_window is sys.maxsize while the stage's length is unknown)
        if (batch_idx < self._last_window or not loop.training or self._stage_len is None
                or batch_idx >= self._stage_len):
            return self.accumulate
        return self._last_size

    @hookimpl
    def should_sync_gradients(self, loop: Run) -> bool:
        """Whether the optimizers step after this training batch (the window's last batch, or
        the stage's last, where the partial window is stepped), or the run may end after it
        with the window open (``max_steps``: a checkpoint then keeps the averaged gradients).
        When the stage's length is unknown its last batch cannot be told: every batch syncs."""
        if self._window_closes() or self._stage_len is None:
            return True
        state = loop.state
        if state.batch_idx >= self._stage_len - 1:
            return True
        return loop.max_steps is not None and state.step + 1 >= loop.max_steps

