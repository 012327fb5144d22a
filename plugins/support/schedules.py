"""torch's learning-rate schedulers read without stepping them, for a plugin that steps them: the schedulers its
option gives, by optimizer name (:func:`given`), whether a schedule is done within a number of steps
(:func:`passing`), how many steps it lasts (:func:`horizons`), a chain's (``ChainedScheduler``, ``SequentialLR``)
included, the step a ``LambdaLR``'s or ``MultiplicativeLR``'s lambda reaches its end at (:func:`lambda_end`,
:func:`multiplied`), and how many optimizer steps a run's batches make under gradient accumulation
(:func:`optimizer_steps`). How the built-in optim uses them: ``plugins/optim/README.md``, "Schedulers"."""

from __future__ import annotations

import contextlib
import math
import numbers
from typing import Any, Iterator, Mapping, NamedTuple

from torch.optim import Optimizer, lr_scheduler

from hookfit.plugins.support.options import option_error

__all__ = ["HORIZONS", "MULTIPLIED_STEPS", "Given", "given", "held", "horizons", "lambda_end", "multiplied", "optimizer_steps", "passing"]

HORIZONS = ("T_max", "total_steps", "total_iters")
"""The attributes that say how many steps a scheduler's schedule lasts: ``CosineAnnealingLR``'s, ``OneCycleLR``'s,
``LinearLR``'s, ``PolynomialLR``'s and ``ConstantLR``'s."""

MULTIPLIED_STEPS = 50_000
"""The longest schedule :func:`lambda_end` judges a ``MultiplicativeLR``'s lambda over: it calls the lambda at each
step up to twice that (about 50 ms for a plain lambda), where a ``LambdaLR``'s is called at 70 steps whatever the
length."""

SCHEDULERS_MUST = ("be a learning-rate scheduler built on one of the run's optimizers (torch.optim.lr_scheduler."
                   "StepLR(opt, ...)), a list of them, or a dict of optimizer name -> scheduler or list")


LIGHTNING_KEYS = frozenset({"scheduler", "interval", "frequency", "monitor", "strict", "name"})
"""The keys of Lightning's scheduler configuration dict, which a ``schedulers`` option is given by habit."""


class Given(NamedTuple):
    """One scheduler as a plugin's ``schedulers`` option gave it: under a dict's name, or none."""

    name: str | None
    scheduler: Any

    @property
    def where(self) -> str:
        """The option as errors name it: ``schedulers`` or ``schedulers['g']``."""
        return "schedulers" if self.name is None else f"schedulers[{self.name!r}]"


def given(plugin: str, schedulers: Any) -> list[Given]:
    """The schedulers of ``plugin``'s ``schedulers`` option (one, a list, or a dict of optimizer name -> scheduler or
    list), in order, with their dict names: each given once (a chain's too), those under a name on one optimizer;
    otherwise an error naming ``plugin`` and the option."""
    found: list[Given] = []
    if isinstance(schedulers, Mapping) and "scheduler" in schedulers and set(schedulers) <= LIGHTNING_KEYS:
        interval = schedulers.get("interval", "epoch")  # (Lightning's default)
        raise TypeError(f"{plugin}: schedulers: a dict's keys are optimizer names, and this one is Lightning's "
                        f"scheduler configuration ({', '.join(map(repr, schedulers))}): give "
                        f"{plugin.capitalize()}(schedulers=<the scheduler>, scheduler_interval={interval!r})"
                        + (", with monitor='<stage>/<metric>' for the metric it steps on" * ("monitor" in schedulers)))
    if isinstance(schedulers, Mapping):
        for key, value in schedulers.items():
            if not isinstance(key, str) or not key:
                raise TypeError(f"{plugin}: schedulers: a dict's keys are optimizer names (strings), got {key!r}")
            found.extend(Given(key, v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    elif schedulers is not None:
        found = [Given(None, v) for v in (schedulers if isinstance(schedulers, (list, tuple)) else [schedulers])]
    seen: dict[int, Any] = {}  # each scheduler so far (inside a chain too): the one given that holds it
    by_name: dict[str, Any] = {}  # the first under each dict name
    for item in found:
        one = item.scheduler
        if not (isinstance(getattr(one, "optimizer", None), Optimizer) and all(
                callable(getattr(one, attr, None)) for attr in ("step", "state_dict", "load_state_dict"))):
            raise option_error(plugin, item.where, one, SCHEDULERS_MUST, TypeError, shown=_shown(one))
        inner = getattr(one, "_schedulers", None)  # torch's ChainedScheduler, SequentialLR
        for scheduler in [one, *(inner if isinstance(inner, (list, tuple)) else ())]:
            if (holder := seen.get(id(scheduler))) is not None:
                inside = f" (inside the {type(holder).__name__} and on its own)" if holder is not scheduler else ""
                raise ValueError(f"{plugin}: schedulers: the same {type(scheduler).__name__} is given twice{inside}: "
                                 f"it would step twice; give it once")
            seen[id(scheduler)] = one
        first = by_name.setdefault(item.name, one) if item.name is not None else one
        if first.optimizer is not one.optimizer:
            raise ValueError(f"{plugin}: schedulers[{item.name!r}]: its {type(first).__name__} and "
                             f"{type(one).__name__} are built on different optimizers; the schedulers under a name "
                             f"drive that optimizer")
    return found


def _shown(value: Any) -> str:
    """A value as an error shows it: a class as itself, anything else by its type."""
    if isinstance(value, type):
        return f"the class {value.__name__} (build one: {value.__name__}(optimizer, ...))"
    return repr(value) if value is None or isinstance(value, (str, int, float)) else f"a {type(value).__name__}"


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


def held(scheduler: Any, start: int = 0, holder: str = "") -> Iterator[tuple[str, Any, int]]:
    """``scheduler`` and each a ``ChainedScheduler`` or ``SequentialLR`` holds, in order: ``(name, scheduler,
    start)``, the name as a message gives it (``"SequentialLR's CosineAnnealingLR"``), start the step its schedule
    starts at (a ``SequentialLR``'s milestone)."""
    name = holder + type(scheduler).__name__
    yield name, scheduler, start
    if isinstance(inner := getattr(scheduler, "_schedulers", None), list):
        starts = [0, *getattr(scheduler, "_milestones", [])]
        for index, one in enumerate(inner):
            yield from held(one, start + (starts[index] if len(starts) == len(inner) else 0), name + "'s ")


def horizons(scheduler: Any, start: int = 0, holder: str = "") -> Iterator[tuple[str, str, int, int]]:
    """How many steps ``scheduler``'s schedule lasts (:data:`HORIZONS`), and each a ``ChainedScheduler`` or
    ``SequentialLR`` holds (:func:`held`): ``(name, attribute, steps, start)``."""
    for name, one, begins in held(scheduler, start, holder):
        yield from ((name, a, getattr(one, a), begins) for a in HORIZONS if type(getattr(one, a, None)) is int)


def lambda_end(scheduler: Any, steps: int, taken: int) -> float | None:
    """The factor a ``LambdaLR``'s lambda ends its schedule on where it reaches it at step ``steps`` and not before,
    and the step ``taken`` is short of it; else ``None``. Reached there: the lambda's value at ``steps`` is below
    its value at ``steps - 1`` and at ``taken``, and none lower at 65 steps spread over ``0..steps`` nor at 4 steps
    after (``steps + 1`` to ``10 * steps``): a linear or cosine decay to 0 sized to ``steps`` (Hugging Face's
    ``get_linear_schedule_with_warmup``), not a constant, a warmup that then holds, a decay that goes on
    (``0.9 ** step``), or one that ended earlier. Each lambda is called with those steps, out of the schedule's
    order (a lambda is a function of the step, torch's documentation says); one that raises or gives no real
    number is not judged. A ``MultiplicativeLR``'s lambda is a factor on the step before: its schedule's factor at
    a step is the product of the lambda over the steps up to there (:func:`multiplied`), judged alike at those
    steps but for ``10 * steps`` (the lambda is called at each step from 1 to ``2 * steps``, in order), where
    ``steps`` is at most :data:`MULTIPLIED_STEPS`. Another scheduler is not judged."""
    multiplies = type(scheduler) is lr_scheduler.MultiplicativeLR
    if not (multiplies or type(scheduler) is lr_scheduler.LambdaLR) or not 0 <= taken < steps or (
            multiplies and steps > MULTIPLIED_STEPS):
        return None
    probe = sorted({*range(0, steps, max(1, steps // 64)), steps - 1, taken, steps + 1, steps * 3 // 2 + 1,
                    2 * steps, *(() if multiplies else (10 * steps,))})
    for f in scheduler.lr_lambdas:
        try:
            values = multiplied(f, [*probe, steps]) if multiplies else {s: f(s) for s in probe} | {steps: f(steps)}
        except Exception:  # the user's lambda: one that raises at a step is not judged (nothing is said)
            continue
        if not all(isinstance(v, numbers.Real) and math.isfinite(v) for v in values.values()):
            continue
        end = float(values[steps])
        if end < min(values[steps - 1], values[taken]) and end <= min(values.values()):
            return end
    return None


def multiplied(factor: Any, steps: list[int]) -> dict[int, Any]:
    """A ``MultiplicativeLR``'s factor of its initial rate at each of ``steps``: the product of its lambda ``factor``
    over the steps from 1 to there (torch multiplies the rate by ``factor(step)`` at each step past the first), the
    lambda called at each step in order, and no more past a step of ``steps`` where the product is no real number
    (the last value then)."""
    wanted, product = set(steps), 1.0
    out = {0: product} if 0 in wanted else {}
    for step in range(1, max(wanted, default=0) + 1):
        product = product * factor(step)
        if step in wanted:
            out[step] = product
            if not isinstance(product, numbers.Real):
                break
    return out


def optimizer_steps(batches: int, per_epoch: int | None, accumulate: int) -> int:
    """The optimizer steps ``batches`` training batches make in windows of ``accumulate`` batches: each epoch of
    ``per_epoch`` batches (``None`` or 0: unknown, whole windows only) closes its last, partial window with a step,
    and a window the run's last batch leaves open takes none (optim's README.md, "The accumulation window")."""
    if not per_epoch:
        return batches // accumulate
    return batches // per_epoch * -(-per_epoch // accumulate) + batches % per_epoch // accumulate
