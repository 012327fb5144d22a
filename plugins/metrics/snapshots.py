"""The metrics plugin's snapshots: a :class:`~hookfit.payloads.MetricsSnapshot` built from a
stage's aggregate and values, and the learning rates each one carries."""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

from hookfit.data import stage_length
from hookfit.payloads import MetricsSnapshot, Value
from hookfit.plugins.metrics.aggregate import Stage
from hookfit.plugins.metrics.directions import Directions

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

__all__ = ["build", "learning_rates"]


def build(loop: Run, stage: str, agg: Stage, values: dict[str, Value], directions: Directions, *, final: bool,
          history: tuple[Mapping[str, Any], ...]) -> MetricsSnapshot:
    """The snapshot of ``stage`` whose aggregate is ``agg`` and whose metrics are ``values``
    (owned by the snapshot from then on: never changed after)."""
    data = loop.val_data if stage == "valid" else loop.train_data
    return MetricsSnapshot(
        stage=stage,
        epoch=loop.state.epoch,
        max_epochs=loop.max_epochs,
        step=loop.state.step,
        batches=agg.batches,
        total=stage_length(data),
        samples=agg.samples if agg.global_samples is None else agg.global_samples,
        elapsed=agg.elapsed(),
        values=MappingProxyType(values),
        lr=MappingProxyType(learning_rates(loop.optimizers)),
        final=final,
        history=history,
        best=directions.of(stage, values),
    )


def learning_rates(optimizers: object) -> dict[str, float]:
    """Each parameter group's learning rate as ``<name>/<group>``: the group's ``"name"`` entry where it has one
    of its own (the first group's too), else its index; an unnamed first group's as ``<name>``. Each the rate
    of the optimizer's latest step where the optimizer role records it (``used_lrs``), else the group's now."""
    named = optimizers if isinstance(optimizers, Mapping) else {} if optimizers is None else {"default": optimizers}
    out: dict[str, float] = {}
    for name, opt in named.items():
        used = getattr(opt, "used_lrs", None) or ()
        for index, group in enumerate(getattr(opt, "param_groups", None) or ()):
            label = group.get("name")
            label = label if isinstance(label, str) and label else index or None  # (None: an unnamed first group)
            key = name if label is None else f"{name}/{label}"
            while key in out:  # a group's name taken by another's (or its index)
                key += f"#{index}"
            out[key] = float(used[index] if index < len(used) else group["lr"])  # (a group added since: its own)
    return out
