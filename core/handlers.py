"""What a run's calls iterate: each event's implementations as a tuple of callables, bound anew
(never changed in place) when the plugins change, read by the loop (:class:`PerBatch`) and by
plugins that fire events on the hot path (:class:`Handlers`), and a plugin's answer to which of the
per-batch events it takes part in (:func:`asked`). :mod:`hookfit.dispatch` fills them."""

from __future__ import annotations

import difflib
from typing import Any, Callable, Collection, Iterator

from hookfit.errors import PluginError

Call = Callable[..., Any]

__all__ = ["PER_BATCH", "Call", "Handlers", "PerBatch", "asked"]


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


def asked(plugin: Any, run: Any, who: str) -> Collection[str]:
    """``plugin``'s ``batch_events(run)`` answer, checked: names of per-batch events; ``who``
    (the plugin described) is named in the error of an answer that is not, or raised."""
    try:
        answer = plugin.batch_events(run)
    except Exception as error:
        error.add_note(f"hookfit: raised by {who} in its batch_events(loop)")
        raise
    if isinstance(answer, (str, bytes)) or not isinstance(answer, Collection):
        raise PluginError(f"{who}: batch_events() answered a {type(answer).__name__}, not a collection of event "
                          f"names (those of {', '.join(PER_BATCH)} it takes part in)")
    for event in answer:
        if event not in PER_BATCH:
            close = difflib.get_close_matches(str(event), PER_BATCH, n=1)
            raise PluginError(
                f"{who}: batch_events() answered {event!r}, not a per-batch event: it names those of "
                f"{', '.join(PER_BATCH)} the plugin takes part in (should_stop and the other events are "
                f"not left out this way).{f' Did you mean {close[0]!r}?' if close else ''}")
    return answer
