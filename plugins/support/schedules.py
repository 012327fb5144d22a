"""torch's learning-rate schedulers read without stepping them, for a plugin that steps them: whether a schedule
is done within a number of steps (:func:`passing`), how many steps it lasts (:func:`horizons`), a chain's
(``ChainedScheduler``, ``SequentialLR``) included, and how many optimizer steps a run's batches make under
gradient accumulation (:func:`optimizer_steps`). How the built-in optim uses them: ``plugins/optim/README.md``,
"Schedulers"."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch.optim import lr_scheduler

__all__ = ["HORIZONS", "horizons", "optimizer_steps", "passing"]

HORIZONS = ("T_max", "total_steps", "total_iters")
"""The attributes that say how many steps a scheduler's schedule lasts: ``CosineAnnealingLR``'s, ``OneCycleLR``'s,
``LinearLR``'s, ``PolynomialLR``'s and ``ConstantLR``'s."""


def passing(scheduler: Any, steps: int) -> Any:
    """The scheduler whose schedule ``steps`` steps pass (``scheduler``, or the one a ``ChainedScheduler`` or
    ``SequentialLR`` holds, each of a ``SequentialLR``'s counted from its milestone), or ``None``. Judged: a
    ``MultiStepLR`` past its last milestone, a ``CosineAnnealingLR`` past its ``T_max``, a ``StepLR`` or
    ``ExponentialLR`` below a thousandth of its rate, a ``LambdaLR`` below a thousandth at step ``steps - 1`` (each
    lambda called once there, out of the schedule's order; one that raises is not judged); no other scheduler."""
    if isinstance(inner := getattr(scheduler, "_schedulers", None), list):  # torch's ChainedScheduler, SequentialLR
        bounds = [0, *getattr(scheduler, "_milestones", []), steps]
        spans = list(zip(bounds, bounds[1:])) if len(bounds) == len(inner) + 1 else [(0, steps)] * len(inner)
        return next((f for s, (a, b) in zip(inner, spans) if a < steps and (f := passing(s, min(steps, b) - a))), None)
    passed = isinstance(scheduler, (lr_scheduler.MultiStepLR, lr_scheduler.CosineAnnealingLR)) and max(  # (T_max)
        getattr(scheduler, "milestones", None) or [getattr(scheduler, "T_max", steps)]) < steps
    if isinstance(scheduler, (lr_scheduler.StepLR, lr_scheduler.ExponentialLR)) and 0 <= scheduler.gamma < 1:
        passed = scheduler.gamma ** (steps // getattr(scheduler, "step_size", 1)) < 1e-3
    with contextlib.suppress(Exception):  # a LambdaLR's lambdas are the user's: one that raises there says nothing
        passed = passed or isinstance(scheduler, lr_scheduler.LambdaLR) and any(  # where CosineAnnealingLR(T_max=
            float(f(steps - 1)) < 1e-3 for f in scheduler.lr_lambdas)  # steps) ends: its lr at the step steps - 1
    return scheduler if passed else None


def horizons(scheduler: Any, start: int = 0, holder: str = "") -> Iterator[tuple[str, str, int, int]]:
    """How many steps ``scheduler``'s schedule lasts (:data:`HORIZONS`), and each a ``ChainedScheduler`` or
    ``SequentialLR`` holds (a ``SequentialLR``'s from its milestone): ``(name, attribute, steps, start)``, the name
    as a message gives it (``"SequentialLR's CosineAnnealingLR"``), start the step its schedule starts at."""
    name = holder + type(scheduler).__name__
    yield from ((name, a, getattr(scheduler, a), start) for a in HORIZONS if type(getattr(scheduler, a, None)) is int)
    if isinstance(inner := getattr(scheduler, "_schedulers", None), list):
        starts = [0, *getattr(scheduler, "_milestones", [])]
        for index, held in enumerate(inner):
            yield from horizons(held, start + (starts[index] if len(starts) == len(inner) else 0), name + "'s ")


def optimizer_steps(batches: int, per_epoch: int | None, accumulate: int) -> int:
    """The optimizer steps ``batches`` training batches make in windows of ``accumulate`` batches: each epoch of
    ``per_epoch`` batches (``None`` or 0: unknown, whole windows only) closes its last, partial window with a step,
    and a window the run's last batch leaves open takes none (optim's README.md, "The accumulation window")."""
    if not per_epoch:
        return batches // accumulate
    return batches // per_epoch * -(-per_epoch // accumulate) + batches % per_epoch // accumulate
