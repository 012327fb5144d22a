"""Option checking, one form for every plugin: every option is checked when the plugin is built
(from code or from ``hookfit.toml``), and a bad one is a ``ValueError`` naming the plugin, the
option, what it must be and the value given::

    metrics: window must be a positive integer (batches of the running mean), got -1

:func:`check` takes any rule; :func:`positive_int`, :func:`integer`, :func:`number`,
:func:`positive_number`, :func:`choice`, :func:`flag`, :func:`text` and :func:`path` are the usual
ones. Each returns the value (an ``int``, a ``float``...), so a plugin writes
``self.window = positive_int(self.name, "window", window)``. A ``bool`` is never taken for a
number."""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, TypeVar, cast, overload

__all__ = ["check", "choice", "flag", "integer", "is_int", "finite", "known_names", "number", "option_error", "path",
           "positive_by_name", "positive_int", "positive_number", "text"]

T = TypeVar("T")

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


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def finite(value: Any) -> float | None:
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
    check(plugin, option, value, lambda v: is_int(v) and v >= 1, _must("a positive integer", meaning, none))
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
    check(plugin, option, value, lambda v: is_int(v) and (least is None or v >= least), _must(what, meaning, none))
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
    number_ = finite(value)
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
    number_ = finite(value)
    check(plugin, option, value, lambda v: number_ is not None and number_ > 0,
          _must("a positive finite number", meaning, none))
    return number_


def positive_by_name(plugin: str, option: str, value: Any) -> float | dict[str, float] | None:
    """A positive finite number for every named part (every optimizer), a non-empty mapping of some of their names
    to one each (the others left out), or ``None``: ``... must be a positive finite number, a dict of names to
    positive finite numbers or None, got {}``. A name is checked by :func:`known_names` once the names are known."""
    if isinstance(value, Mapping):
        check(plugin, option, value, lambda v: v and all(isinstance(k, str) for k in v),
              "be a positive finite number, a dict of names to positive finite numbers or None")
        return {name: positive_number(plugin, f"{option}[{name!r}]", each) for name, each in value.items()}
    return positive_number(plugin, option, value, none=True)


def known_names(plugin: str, option: str, value: Any, names: Iterable[str], what: str) -> None:
    """Refuse, naming them and the known ones, the names of a mapping ``value`` (:func:`positive_by_name`'s) that
    are not among ``names`` (the run's ``what``: ``"optimizers"``)."""
    names = list(names)
    if isinstance(value, Mapping) and (unknown := [n for n in value if n not in names]):
        raise ValueError(f"{plugin}: {option} names {', '.join(map(repr, unknown))}, which this run does not have: "
                         f"its {what} are {', '.join(map(repr, names)) or 'none'}")


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


