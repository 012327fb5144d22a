"""What a run's calls iterate: each event's implementations as a tuple of callables, bound anew
(never changed in place) when the plugins change, read by the loop (:class:`PerBatch`) and by
plugins that fire events on the hot path (:class:`Handlers`). :mod:`hookfit.dispatch` fills them."""

from __future__ import annotations

from typing import Any, Callable, Iterator

Call = Callable[..., Any]

__all__ = ["PER_BATCH", "Call", "Handlers", "PerBatch"]


class Handlers:
    """One event's implementations (:meth:`hookfit.dispatch.Dispatch.handlers`): ``calls``, a tuple
    of callables in pluggy's call order, bound to a new tuple when the plugins change, never changed
    in place, so a call in progress ends over the callables it began with (an observer switched off
    during it leaves the others their call) and the next call sees the change."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls: tuple[Call, ...] = ()

    def __iter__(self) -> Iterator[Call]:
        return iter(self.calls)

    def __len__(self) -> int:
        return len(self.calls)


class PerBatch:
    """The loop's per-batch events as it reads them for every batch: ``batch_start``,
    ``step_output``, ``batch_end`` and ``after_batch``, each its :class:`Handlers`' tuple of the
    moment (empty when nothing implements it), and ``asks``: whether anything answers
    ``should_stop`` or ``agree_stop``, so the loop must ask after each batch.

    A plain object with slots, its attributes bound anew at each resolution: CPython specialises
    loads of its attributes, which it cannot do on :class:`hookfit.dispatch.Dispatch` (a class with ``__getattr__``)."""

    __slots__ = ("batch_start", "step_output", "batch_end", "after_batch", "asks")

    def __init__(self) -> None:
        self.batch_start: tuple[Call, ...] = ()
        self.step_output: tuple[Call, ...] = ()
        self.batch_end: tuple[Call, ...] = ()
        self.after_batch: tuple[Call, ...] = ()
        self.asks = False


PER_BATCH = ("batch_start", "step_output", "batch_end", "after_batch")
"""The loop's per-batch events: results ignored, resolved into handler lists, and open to a
plugin's ``batch_events`` answer."""
