"""The callables an event's implementations are called through, built by :mod:`hookfit.dispatch`:
:func:`adapter` (an implementation given the spec's arguments it takes), :func:`direct` (a list of
them called in order, results collected as pluggy collects them) and :func:`by_name` (a call that
takes the spec's arguments by name too, as pluggy's ``pm.hook.<event>(**kwargs)`` does)."""

from __future__ import annotations

from typing import Any, Sequence

import pluggy

from hookfit.handlers import Call

__all__ = ["adapter", "by_name", "direct"]


def adapter(function: Call, spec_args: Sequence[str], impl: pluggy.HookImpl) -> Call:
    """``function`` called positionally with the spec's arguments, passing only those the
    implementation asked for (keyword parameters with defaults by keyword, as pluggy does)."""
    names = tuple(impl.argnames)
    keywords = [(k, spec_args.index(k)) for k in impl.kwargnames if k in spec_args]
    if names == tuple(spec_args[:len(names)]) and not keywords:
        if len(names) == len(spec_args):
            return function
        count = len(names)

        def first_arguments(*args: Any) -> Any:
            return function(*args[:count])

        return first_arguments
    positions = [spec_args.index(name) for name in names]

    def picked(*args: Any) -> Any:
        return function(*[args[i] for i in positions], **{k: args[i] for k, i in keywords})

    return picked


def direct(functions: list[Call], results: bool, firstresult: bool) -> Call:
    """The functions called in order, results collected as pluggy collects them."""
    if len(functions) == 1 and (not results or firstresult):
        return functions[0]  # nothing to collect: its own return value is the answer

    if not results:

        def notify(*args: Any) -> None:
            for function in functions:
                function(*args)

        return notify

    if firstresult:

        def first(*args: Any) -> Any:
            for function in functions:
                result = function(*args)
                if result is not None:
                    return result
            return None

        return first

    def collect(*args: Any) -> list[Any]:
        out = []
        for function in functions:
            result = function(*args)
            if result is not None:
                out.append(result)
        return out

    return collect


def by_name(call: Call, event: str, spec_args: Sequence[str]) -> Call:
    """``call`` (which takes the spec's arguments in order) taking them in order, by name, or both, as
    ``loop.hooks.<event>``: a plugin that fires an event with pluggy's keywords gets the same call
    whatever implements it. An argument the spec lacks, one given twice or one missing is a
    ``TypeError`` naming the event and its arguments. (One Python call more than ``call``, about 0.05 us:
    the loop's own per-batch events are read from handler lists; the events fired this way come at most
    once a batch, as ``should_sync_gradients`` under DDP.)"""
    count = len(spec_args)

    def named(*args: Any, **kwargs: Any) -> Any:
        if kwargs or len(args) != count:
            args = _in_order(event, spec_args, args, kwargs)
        return call(*args)

    return named


def _in_order(event: str, spec_args: Sequence[str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    signature = f"loop.hooks.{event}({', '.join(spec_args)})"
    if len(args) > len(spec_args):
        raise TypeError(f"{signature} takes {len(spec_args)} argument(s), {len(args)} were given")
    given = dict(zip(spec_args, args))
    for key in kwargs:
        if key not in spec_args:
            raise TypeError(f"{signature} has no argument {key!r}")
        if key in given:
            raise TypeError(f"{signature} was given {key!r} twice, in order and by name")
    given.update(kwargs)
    if missing := [key for key in spec_args if key not in given]:
        raise TypeError(f"{signature} was not given {', '.join(map(repr, missing))}")
    return tuple(given[key] for key in spec_args)
