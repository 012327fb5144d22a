"""The guard: an implementation called in a way that cannot end the call it is part of.

Where an implementation must not end a call (an observer plugin, which is switched off with one
warning when it raises; any implementation of ``fit_end`` and ``exception``, which all run whatever
happened), :mod:`hookfit.dispatch` calls ``guard(impl, on_error)`` in its place: the same function,
whose :class:`Exception` goes to ``on_error`` instead of out of the call. A wrapper (new style,
``wrapper=True``, or old style, ``hookwrapper=True``) that raises then behaves as if it were
absent, and an error raised inside it by the implementations it wraps still reaches its caller.
``KeyboardInterrupt`` and ``SystemExit`` are never caught.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import pluggy

Call = Callable[..., Any]
OnError = Callable[[BaseException], None]

__all__ = ["guard"]


def guard(impl: pluggy.HookImpl, on_error: OnError) -> Call:
    """``impl``'s function such that an :class:`Exception` it raises goes to ``on_error``
    instead of out of the call; a wrapper then behaves as if it were absent."""
    if impl.wrapper:
        return _wrapper(impl.function, on_error)
    if impl.hookwrapper:
        return _hookwrapper(impl.function, on_error)
    function = impl.function

    @functools.wraps(function)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except Exception as error:
            on_error(error)
            return None

    return guarded


def _wrapper(function: Call, on_error: OnError) -> Call:
    """A new-style wrapper (``wrapper=True``) whose own errors go to ``on_error``."""

    @functools.wraps(function)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            teardown = function(*args, **kwargs)
            next(teardown)
        except Exception as error:  # raised, or did not yield (StopIteration)
            on_error(error)
            return (yield)
        try:
            result = yield
        except BaseException as inner:  # an unguarded implementation inside raised
            try:
                teardown.throw(inner)
            except StopIteration as stop:
                return stop.value
            except BaseException as error:
                if error is not inner and isinstance(error, Exception):
                    on_error(error)
                    raise inner from None
                raise
            teardown.close()
            on_error(RuntimeError(f"wrapper {function.__qualname__} has a second yield"))
            raise
        try:
            teardown.send(result)
        except StopIteration as stop:
            return stop.value
        except Exception as error:
            on_error(error)
            return result
        teardown.close()
        on_error(RuntimeError(f"wrapper {function.__qualname__} has a second yield"))
        return result

    return guarded


def _hookwrapper(function: Call, on_error: OnError) -> Call:
    """An old-style wrapper (``hookwrapper=True``) whose own errors go to ``on_error``."""

    @functools.wraps(function)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            teardown = function(*args, **kwargs)
            next(teardown)
        except Exception as error:
            on_error(error)
            yield
            return
        outcome = yield
        try:
            teardown.send(outcome)
        except StopIteration:
            return
        except Exception as error:
            on_error(error)
            return
        teardown.close()
        on_error(RuntimeError(f"hookwrapper {function.__qualname__} has a second yield"))

    return guarded
