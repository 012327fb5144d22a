"""torch's learning-rate schedulers read without stepping them, for a plugin that steps them: whether a schedule
is done within a number of steps (:func:`passing`), a chain's (``ChainedScheduler``, ``SequentialLR``) included.
How the built-in optim uses it: ``plugins/optim/README.md``, "Schedulers"."""

from __future__ import annotations

import contextlib
from typing import Any

from torch.optim import lr_scheduler

__all__ = ["passing"]


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
