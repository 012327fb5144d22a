"""A cadence, as Ignite's ``Events.X(every=n)``: "every n-th step (epoch, batch...)"."""

from __future__ import annotations

from typing import Any

from hookfit.plugins.support.options import positive_int

__all__ = ["Every"]

class Every:
    """A cadence: due at every ``n``-th event (step, epoch, batch...), or never (``n=None``).

    ``n`` is checked here (a positive integer, ``None`` too where ``none``), the error naming
    ``plugin`` and ``option`` like every option's (:func:`positive_int`)::

        self._saves = Every(every_n_steps, plugin="checkpoint", option="every_n_steps")
        ...
        if self._saves.due(loop.state.step): ...

    Counts start at 1 (the first event is count 1), so ``due(0)`` is never true."""

    __slots__ = ("n",)

    def __init__(self, n: int | None, *, plugin: str = "every", option: str = "n", none: bool = True,
                 meaning: str | None = None) -> None:
        self.n: int | None = positive_int(plugin, option, n, none=none, meaning=meaning)
        """Events between two due ones, or ``None``: never due."""

    @property
    def never(self) -> bool:
        """Whether it is never due (``n`` is ``None``)."""
        return self.n is None

    def due(self, count: int) -> bool:
        """Whether the ``count``-th event (from 1) is due: ``count`` is a multiple of ``n``."""
        n = self.n
        return n is not None and count > 0 and count % n == 0

    def between(self, start: int, stop: int) -> int:
        """How many of the events ``start + 1`` to ``stop`` (both counts, from 1) are due: the
        number of multiples of ``n`` in ``(start, stop]``; 0 when ``stop <= start``."""
        n = self.n
        if n is None or stop <= start:
            return 0
        return stop // n - max(start, 0) // n

    def __repr__(self) -> str:
        return f"Every({self.n})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Every) and other.n == self.n

    def __hash__(self) -> int:
        return hash((Every, self.n))


