"""Values other plugins publish with the metrics: the answers to ``metrics_values``, asked at each
publication and added to the snapshot's values as gauges (``Value(v, v, v)``)."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any, Mapping

import torch

from hookfit.errors import RefusedAnswer
from hookfit.payloads import Value
from hookfit.plugins.metrics.aggregate import real, reserved

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

__all__ = ["add"]

EVENT = "metrics_values"


def add(loop: Run, stage: str, values: dict[str, Value], taken: Collection[str] = ()) -> None:
    """Ask every plugin's ``metrics_values`` for ``stage`` and add each answer to ``values`` (the
    stage's metrics so far, changed in place); ``taken``: names the stage publishes that are not
    in ``values`` yet (its metric objects', computed at its end). An answer refused
    (:func:`_taken`) fails the run naming its plugin, unless the plugin is an observer: then it
    is switched off with one warning and its answer left out, as an observer that raises is by
    the call itself. A replacement of the metrics role that publishes gauges calls this."""
    owners: dict[str, str] = {}  # a name published by a plugin here -> that plugin
    for plugin, answer in loop.hooks.call_each(EVENT, loop, stage):
        try:
            gauges = _taken(loop, plugin, stage, answer, values, owners, taken)
        except RefusedAnswer as error:
            loop.pm.refuse(plugin, EVENT, error)
            continue
        values.update(gauges)
        owners.update(dict.fromkeys(gauges, plugin))


def _taken(loop: Run, plugin: str, stage: str, answer: Any, values: Mapping[str, Value],
           owners: Mapping[str, str], objects: Collection[str]) -> dict[str, Value]:
    """``answer``, ``plugin``'s, as gauges; a :class:`RefusedAnswer` naming it, the event and the key
    when it is not a mapping of new names to real numbers."""
    who = f"{loop.pm.describe(plugin)} answered {EVENT} for stage {stage!r}"
    if not isinstance(answer, Mapping):
        raise RefusedAnswer(plugin, EVENT, f"{who} with {type(answer).__name__} {answer!r:.80}: answer a mapping of "
                                           f"metric names to numbers ({{'grad_norm': 0.5}}), or None for none")
    taken: dict[str, Value] = {}
    for key, value in answer.items():
        if not isinstance(key, str) or not key:
            raise RefusedAnswer(plugin, EVENT, f"{who} with the key {key!r:.80}: a metric's name is a non-empty string")
        if (why := reserved(key)) is not None:
            raise RefusedAnswer(plugin, EVENT, f"{who} with {key!r}: {why}")
        number = real(value)
        if number is None:
            shape = f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else ""
            raise RefusedAnswer(plugin, EVENT, f"{who} with {type(value).__name__}{shape} {value!r:.80} under {key!r}: "
                                               f"a value is a real number or a tensor of one real element")
        if key in values or key in objects:
            other = (f"the answer of {loop.pm.describe(owners[key])}" if key in owners
                     else "a value its step returns, or a metric object it computes")
            raise RefusedAnswer(plugin, EVENT, f"{who} with {key!r}, a name the stage publishes already ({other}): "
                                               f"rename one of them")
        taken[key] = Value(number, number, number)
    return taken

