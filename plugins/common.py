"""What plugins share, written once for the built-in plugins and for third-party plugin authors
alike (the core uses none of it): option checking, a cadence (:class:`Every`), a metric
watched for its best value (:class:`Monitor`), the user's module inside its wrappers
(:func:`unwrap_model`).

Option checking
    Every option is checked when the plugin is built (from code or from ``hookfit.toml``), and a
    bad one is a ``ValueError`` of one form, naming the plugin, the option, what it must be and
    the value given::

        metrics: window must be a positive integer (batches of the running mean), got -1

    :func:`check` takes any rule; :func:`positive_int`, :func:`integer`, :func:`number`,
    :func:`positive_number`, :func:`choice`, :func:`flag`, :func:`text` and :func:`path` are
    the usual ones. Each returns the value (an ``int``, a ``float``...), so a plugin writes
    ``self.window = positive_int(self.name, "window", window)``. A ``bool`` is never taken for
    a number.

Cadence
    ``Every(n)`` is "every n-th step (epoch, batch...)", as Ignite's ``Events.X(every=n)``:
    checked when built (a positive integer, or ``None`` for never), then ``due(count)`` for the
    count-th event, counted from 1. ``Every(3).due(6)`` is true; ``Every(None).due(6)`` is not.

Best values
    ``Monitor("valid/loss", mode="min", min_delta=0.0)`` is a metric of a stage and the
    direction in which it gets better: it checks the three when built, says whether a value
    improves on the best so far (``improves``; NaN and infinities never do) and keeps the best
    and where it was seen (``update(value, at)``). The checkpoint plugin keeps its best
    checkpoint by one, early stopping counts the epochs without improvement by one, the console
    and the dashboard pick best values with them.

Models (:mod:`hookfit.plugins.models`)
    ``unwrap_model(loop.model)`` is the module the user wrote, inside
    ``DistributedDataParallel``/``DataParallel`` (``.module``) and ``torch.compile``
    (``._orig_mod``), however nested. Its ``state_dict()`` has the plain module's keys, so a
    checkpoint written from a compiled or a data-parallel model loads into a plain one and back;
    :func:`unwrap_state_dict` reads a state dict written from the compiled module itself
    (``_orig_mod.``-prefixed keys) the same way.

Gradients, watched for a while
    ``GradientWatch(params, arrived)`` (:mod:`hookfit.plugins.gradients`) calls ``arrived``
    for each gradient of ``params`` until ``remove()``, which leaves no cost behind.

Hyperparameters
    ``run_hparams(loop, extra)`` is what the loggers (``tensorboard``, ``mlflow``, ``wandb``) record as a
    run's hyperparameters, one flat mapping of scalars; :func:`hyperparameters` checks their ``hparams``.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast, overload

from hookfit.plugins.gradients import GradientWatch
from hookfit.plugins.models import unwrap_model, unwrap_state_dict

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

__all__ = [
    "MODES", "STAGES", "Every", "GradientWatch", "Hparam", "Monitor", "check", "choice", "flag", "hparam", "hyperparameters",
    "integer", "number", "option_error", "path", "positive_int", "positive_number", "run_hparams", "text",
    "unwrap_model", "unwrap_state_dict",
]

T = TypeVar("T")


# -- option checking -------------------------------------------------------------------------

def option_error(plugin: str, option: str, value: Any, must: str, error: type[Exception] = ValueError, *,
                 shown: str | None = None) -> Exception:
    """The error for a bad option, in the one form every plugin uses:
    ``"<plugin>: <option> must <must>, got <value!r>"`` (``must`` reads on from "must": ``"be a
    positive integer"``). ``shown`` replaces ``repr(value)`` where that says less (a type's
    name for an object whose repr is long)."""
    return error(f"{plugin}: {option} must {must}, got {repr(value) if shown is None else shown}")


def check(plugin: str, option: str, value: T, rule: Callable[[Any], bool], must: str,
          error: type[Exception] = ValueError) -> T:
    """``value`` if ``rule(value)`` holds, else :func:`option_error` raised. A rule that raises
    (comparing a string with a number, say) does not hold."""
    try:
        ok = bool(rule(value))
    except Exception:  # noqa: BLE001 - a value the rule cannot even look at is not allowed
        ok = False
    if not ok:
        raise option_error(plugin, option, value, must, error)
    return value


def _must(what: str, meaning: str | None, none: bool) -> str:
    """``be <what> (<meaning>) or None``."""
    return "be " + what + (f" ({meaning})" if meaning else "") + (" or None" if none else "")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _finite(value: Any) -> float | None:
    """``value`` as a finite float, or ``None`` when it is no real number (a bool is none) or
    not finite."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except (OverflowError, ValueError):
        return None
    return number if math.isfinite(number) else None


@overload
def positive_int(plugin: str, option: str, value: Any, *, none: Literal[False] = ...,
                 meaning: str | None = ...) -> int: ...
@overload
def positive_int(plugin: str, option: str, value: Any, *, none: bool, meaning: str | None = ...) -> int | None: ...
def positive_int(plugin: str, option: str, value: Any, *, none: bool = False, meaning: str | None = None) -> int | None:
    """A positive integer (``None`` too where ``none``): ``... must be a positive integer
    (<meaning>) or None, got 0``."""
    if none and value is None:
        return None
    check(plugin, option, value, lambda v: _is_int(v) and v >= 1, _must("a positive integer", meaning, none))
    return int(value)


@overload
def integer(plugin: str, option: str, value: Any, *, least: int | None = ..., none: Literal[False] = ...,
            meaning: str | None = ...) -> int: ...
@overload
def integer(plugin: str, option: str, value: Any, *, least: int | None = ..., none: bool,
            meaning: str | None = ...) -> int | None: ...
def integer(plugin: str, option: str, value: Any, *, least: int | None = None, none: bool = False,
            meaning: str | None = None) -> int | None:
    """An integer, ``>= least`` when given: ``... must be an integer >= 0 (<meaning>), got -1``."""
    if none and value is None:
        return None
    what = "an integer" if least is None else f"an integer >= {least}"
    check(plugin, option, value, lambda v: _is_int(v) and (least is None or v >= least), _must(what, meaning, none))
    return int(value)


@overload
def number(plugin: str, option: str, value: Any, *, least: float | None = ..., none: Literal[False] = ...,
           meaning: str | None = ...) -> float: ...
@overload
def number(plugin: str, option: str, value: Any, *, least: float | None = ..., none: bool,
           meaning: str | None = ...) -> float | None: ...
def number(plugin: str, option: str, value: Any, *, least: float | None = None, none: bool = False,
           meaning: str | None = None) -> float | None:
    """A finite real number (never NaN or an infinity), ``>= least`` when given, as a float:
    ``... must be a finite number >= 0 (<meaning>), got nan``."""
    if none and value is None:
        return None
    what = "a finite number" if least is None else f"a finite number >= {least:g}"
    number_ = _finite(value)
    check(plugin, option, value, lambda v: number_ is not None and (least is None or number_ >= least),
          _must(what, meaning, none))
    return number_


@overload
def positive_number(plugin: str, option: str, value: Any, *, none: Literal[False] = ...,
                    meaning: str | None = ...) -> float: ...
@overload
def positive_number(plugin: str, option: str, value: Any, *, none: bool,
                    meaning: str | None = ...) -> float | None: ...
def positive_number(plugin: str, option: str, value: Any, *, none: bool = False,
                    meaning: str | None = None) -> float | None:
    """A finite number above 0, as a float: ``... must be a positive finite number (seconds) or
    None, got inf``."""
    if none and value is None:
        return None
    number_ = _finite(value)
    check(plugin, option, value, lambda v: number_ is not None and number_ > 0,
          _must("a positive finite number", meaning, none))
    return number_


def _listing(choices: Iterable[Any], none: bool) -> str:
    """``'a' or 'b'``, ``'a', 'b' or None``, ``one of 'a', 'b', 'c'``."""
    shown = [repr(c) for c in choices] + (["None"] if none else [])
    if len(shown) == 1:
        return shown[0]
    if len(shown) == 2 or none:
        return ", ".join(shown[:-1]) + " or " + shown[-1]
    return "one of " + ", ".join(shown)


def choice(plugin: str, option: str, value: Any, choices: Iterable[T], *, none: bool = False) -> Any:
    """One of ``choices`` (``None`` too where ``none``): ``... must be 'min' or 'max', got
    'best'``, ``... must be one of '32', 'bf16-mixed', '16-mixed', got '16'``."""
    choices = tuple(choices)
    if none and value is None:
        return None
    # True is not 1, and 1 is not True
    check(plugin, option, value, lambda v: any(v == c and isinstance(v, bool) == isinstance(c, bool) for c in choices),
          "be " + _listing(choices, none))
    return value


@overload
def flag(plugin: str, option: str, value: Any, *, none: Literal[False] = ...) -> bool: ...
@overload
def flag(plugin: str, option: str, value: Any, *, none: bool) -> bool | None: ...
def flag(plugin: str, option: str, value: Any, *, none: bool = False) -> bool | None:
    """``True`` or ``False`` (``None`` too where ``none``), never a truthy stand-in such as
    ``1`` or ``"yes"``: ``... must be True, False or None, got 'yes'``."""
    check(plugin, option, value, lambda v: isinstance(v, bool) or (none and v is None),
          "be True, False or None" if none else "be True or False")
    return cast("bool | None", value)  # checked above


@overload
def text(plugin: str, option: str, value: Any, *, none: Literal[False] = ..., what: str = ...,
         meaning: str | None = ...) -> str: ...
@overload
def text(plugin: str, option: str, value: Any, *, none: bool, what: str = ...,
         meaning: str | None = ...) -> str | None: ...
def text(plugin: str, option: str, value: Any, *, none: bool = False, what: str = "a non-empty string",
         meaning: str | None = None) -> str | None:
    """A string with something besides spaces in it: ``... must be a non-empty string (<meaning>)
    or None, got 5``."""
    if none and value is None:
        return None
    check(plugin, option, value, lambda v: isinstance(v, str) and bool(v.strip()), _must(what, meaning, none))
    return cast(str, value)  # checked above


def path(plugin: str, option: str, value: Any, *, none: bool = False, what: str = "a path") -> Any:
    """A path, a ``str`` that is not blank or an ``os.PathLike`` (returned as given): ``... must be
    a folder (a str or os.PathLike) or None, got 5``."""
    if none and value is None:
        return None
    check(plugin, option, value,
          lambda v: isinstance(v, os.PathLike) or (isinstance(v, str) and bool(v.strip())),
          _must(f"{what} (a str or os.PathLike)", None, none))
    return value


# -- cadence ---------------------------------------------------------------------------------

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


# -- best values -----------------------------------------------------------------------------

MODES = ("min", "max")
"""The directions of a metric: ``"min"`` (lower is better) and ``"max"`` (higher is better)."""

STAGES = ("train", "valid")
"""The stages whose metrics a monitor names: ``"<stage>/<metric>"``."""

_METRIC_MUST = "be '<stage>/<metric>' with stage train or valid (like 'valid/loss'), or None"


def _stage_metric(metric: Any) -> bool:
    """Whether ``metric`` is ``"<stage>/<name>"`` with a known stage and a name (or ``None``)."""
    if metric is None:
        return True
    if not isinstance(metric, str) or "/" not in metric:
        return False
    stage, name = metric.split("/", 1)
    return stage in STAGES and bool(name.strip())


class Monitor:
    """A metric watched for its best value.

    * ``metric``: ``"<stage>/<metric>"`` (``"valid/loss"``: the epoch mean of ``loss`` in the
      validation stage, as a metrics plugin publishes it), or ``None`` for a monitor that only
      compares values (a plugin switched off, a console ranking any metric).
    * ``mode``: ``"min"`` (lower is better) or ``"max"``.
    * ``min_delta``: how much better a value must be to improve, a finite number ``>= 0``.

    All three are checked here, with the error every option gives (naming ``plugin``;
    ``must`` keeps a plugin's own wording of what ``metric`` must be). A value improves when it
    is below ``best - min_delta`` (``"min"``) or above ``best + min_delta`` (``"max"``); the first
    value improves on nothing; NaN and infinities never improve, so never become the best (a
    diverged epoch is no best checkpoint). Of equal values the first stays the best.

    Thread-safe for one writer: the best and where it was seen change together, so a reader on
    another thread never sees one without the other."""

    __slots__ = ("metric", "stage", "key", "mode", "min_delta", "_record")

    def __init__(self, metric: str | None = None, mode: str = "min", min_delta: float = 0.0, *,
                 plugin: str = "monitor", option: str = "monitor", must: str | None = None) -> None:
        check(plugin, option, metric, _stage_metric, must or _METRIC_MUST)
        self.metric: str | None = metric
        """``"<stage>/<metric>"``, or ``None``."""
        stage, key = metric.split("/", 1) if metric is not None else (None, None)
        self.stage: str | None = stage
        """The stage of ``metric`` (``"valid"``), or ``None``."""
        self.key: str | None = key
        """The metric's name within its stage (``"loss"``), or ``None``."""
        self.mode: str = choice(plugin, "mode", mode, MODES)
        self.min_delta: float = number(plugin, "min_delta", min_delta, least=0)
        self._record: tuple[float, Any] | None = None

    @property
    def best(self) -> float | None:
        """The best value so far, or ``None`` before any finite one."""
        record = self._record
        return None if record is None else record[0]

    @property
    def best_at(self) -> Any:
        """Where the best value was seen (what ``update`` was given as ``at``), or ``None``."""
        record = self._record
        return None if record is None else record[1]

    @property
    def record(self) -> tuple[float, Any] | None:
        """``(best, best_at)`` together, or ``None`` before any finite value."""
        return self._record

    def improves(self, value: float) -> bool:
        """Whether ``value`` improves on the best so far (by more than ``min_delta``)."""
        value = float(value)
        if not math.isfinite(value):
            return False
        record = self._record
        if record is None:
            return True
        if self.mode == "min":
            return value < record[0] - self.min_delta
        return value > record[0] + self.min_delta

    def update(self, value: float, at: Any = None) -> bool:
        """Take ``value`` (seen ``at`` an epoch, a step, a file...) as the best if it improves
        on it; returns whether it did."""
        if not self.improves(value):
            return False
        self._record = (float(value), at)
        return True

    def reset(self, best: float | None = None, at: Any = None) -> None:
        """Forget the best, or set it (a best restored from a checkpoint; one that is not a
        finite number is forgotten)."""
        self._record = None
        if best is not None and math.isfinite(float(best)):
            self._record = (float(best), at)

    def __repr__(self) -> str:
        return f"Monitor({self.metric!r}, mode={self.mode!r}, min_delta={self.min_delta:g}, best={self.best!r})"


# -- hyperparameters -------------------------------------------------------------------------

Hparam = bool | int | float | str  # a hyperparameter's value: one scalar, as every tracker shows it
_MECHANICS = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})  # how, not what


def hparam(value: object) -> Hparam | None:
    """``value`` as a hyperparameter, or ``None`` if it is no scalar (tuples of scalars and paths as strings)."""
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, tuple) and all(isinstance(v, (bool, int, float, str)) for v in value):
        return str(value)
    return os.fsdecode(value) if isinstance(value, os.PathLike) else None


def hyperparameters(plugin: str, option: str, value: Any) -> dict[str, Hparam]:
    """A logger's ``hparams`` option: ``None`` or names to finite numbers, strings or booleans (a new dict)."""
    if value is not None and not isinstance(value, Mapping):
        raise option_error(plugin, option, value, "map names to numbers, strings or booleans",
                           shown=f"{type(value).__name__} {value!r}")
    out: dict[str, Hparam] = {}
    for key, item in (value or {}).items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"{plugin}: {option} has the key {key!r}; names are non-empty strings")
        if not isinstance(item, (bool, str)) and _finite(item) is None:
            raise ValueError(f"{plugin}: {option}[{key!r}] is {item!r}; a hyperparameter is a finite number, "
                             f"a string or a boolean")
        out[key] = item if isinstance(item, (bool, str)) else int(item) if _is_int(item) else float(item)
    return out


def run_hparams(loop: Run, extra: Mapping[str, Hparam] | None = None) -> dict[str, Hparam]:
    """The run's hyperparameters, as every logger records them: ``loop.name`` and the scalar ``loop.<setting>``s
    (``max_epochs``, ``seed``...), each optimizer's class and the scalar settings of its first parameter group
    (``optimizer.<name>``, ``optimizer.<name>.lr``...), every plugin's scalar options (``plugin.<name>.<option>``),
    then ``extra``, which wins a clash."""
    from hookfit import config  # the core's, imported where it is used
    settings = ("max_epochs", "max_steps", "seed", "deterministic", "val_every_n_epochs", "val_every_n_steps")
    loop_values = {f"loop.{key}": hparam(getattr(loop, key, None)) for key in settings}
    out: dict[str, Hparam] = {"loop.name": loop.name, **{k: v for k, v in loop_values.items() if v is not None}}
    optimizers = getattr(loop.config, "optimizers", None)
    named = optimizers.items() if isinstance(optimizers, Mapping) else [("default", optimizers)] if optimizers else []
    for name, optimizer in named:
        out[f"optimizer.{name}"] = type(optimizer).__name__
        for key, setting in sorted((getattr(optimizer, "param_groups", None) or [{}])[0].items()):
            if key not in _MECHANICS and (value := hparam(setting)) is not None:
                out[f"optimizer.{name}.{key}"] = value
    for name in loop.pm.participants():
        plugin, info = loop.pm.get_plugin(name), loop.pm.infos.get(name)
        options = config.accepted(type(plugin)) if plugin is not None and not isinstance(plugin, type) else None
        for option in sorted(options or ()):
            given = info.options if info is not None else {}
            if (value := hparam(getattr(plugin, option) if hasattr(plugin, option) else given.get(option))) is not None:
                out[f"plugin.{name}.{option}"] = value
    return {**out, **(extra or {})}
