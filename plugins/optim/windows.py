"""optim's accumulation window (``Optim(accumulate=N)``): README.md, "The accumulation window"."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from hookfit.data import length

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run


class Window:
    """Windows of ``size`` training batches (``Optim(accumulate=size)``)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.measure(None)  # _stage_len: the stage's batches (None: unknown); _last_window, _last_size: its partial one

    def measure(self, data: Any) -> None:
        """At a training stage's start: its length, and its last window when that is partial."""
        self._stage_len, self._last_window, self._last_size = length(data), sys.maxsize, self.size
        if self._stage_len is not None and self._stage_len % self.size:
            self._last_size = self._stage_len % self.size
            self._last_window = self._stage_len - self._last_size

    def closes(self, loop: Run) -> bool:
        """Whether the running training batch is its window's last (the epoch's last batch closes a partial one)."""
        return self.size == 1 or (done := loop.state.batch_idx + 1) % self.size == 0 or done == self._stage_len

    def divisor(self, loop: Run) -> int:
        """What this batch's loss is divided by (``size`` past the data's length: a wrong ``__len__``)."""
        in_last = self._last_window <= loop.state.batch_idx < self._last_window + self._last_size  # (a partial one)
        return self._last_size if in_last and loop.training else self.size

    def should_sync(self, loop: Run) -> bool:
        """The built-in's answer to ``should_sync_gradients`` (its contract is stated there)."""
        state = loop.state
        return (self.closes(loop) or self._stage_len is None or state.batch_idx >= self._stage_len - 1
                or (loop.max_steps is not None and state.step + 1 >= loop.max_steps))
