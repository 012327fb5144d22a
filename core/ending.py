"""How a run ends, whatever happened: :func:`fail` when it raised (``exception``), then
:func:`finish`: ``fit_end`` exactly once, every implementation run even if one raises (an
observer switched off during the run included), then
``results``, and ``run.jsonl``'s end line with the final status. The state then keeps what
ended the run without the run (:func:`detached`)."""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import TYPE_CHECKING

from hookfit import blame, persistent, results
from hookfit.errors import ErrorCopy
from hookfit.state import State

if TYPE_CHECKING:  # pragma: no cover
    from hookfit.run import Run

__all__ = ["detached", "fail", "finish"]


def fail(run: Run, error: BaseException) -> None:
    state = run.state
    if isinstance(error, KeyboardInterrupt):
        state.status, state.stop_reason = "interrupted", "KeyboardInterrupt"
        return
    state.status, state.error = "failed", error
    state.stop_reason = f"{type(error).__name__}: {error}"
    error.add_note(blame.where(run, error))
    known = len(getattr(error, "__notes__", ()))
    for _, secondary in run.hooks.call_all("exception", run, error):
        blame.warn_secondary(secondary, "exception")
    if added := getattr(error, "__notes__", [])[known:]:  # what the plugins know of it (a rank that failed first)
        state.stop_reason += f" ({'; '.join(added)})"


def finish(run: Run, failed: bool) -> None:
    """Fire ``fit_end`` once: every implementation runs even if one raises, and then that of
    each observer switched off during the run (not in ``fit_end``), whose error is a warning; then ask
    ``results`` (:mod:`hookfit.results`) and write the run's end line in ``run.jsonl`` with the
    final status; the persistent worker processes of its loaders end with it
    (:func:`hookfit.persistent.release`). An error of either fails a run that had not failed.
    Last, the state's errors (``error``, ``silenced``) become :func:`detached` copies: a state
    kept after the run holds none of its frames; what ``fit()`` raises is the exception itself."""
    state = run.state
    errors: list[tuple[BaseException, str]] = []
    try:
        _take_kept(run, failed, errors)
    finally:  # a second Ctrl-C in an exception hook told of the kept error still ends the run
        _end(run, failed, errors)
    if errors and not failed:
        raise errors[0][0]


def _take_kept(run: Run, failed: bool, errors: list[tuple[BaseException, str]]) -> None:
    """A participant's stop_requested error kept from another thread that no boundary raised: the run's
    failure (named, the exception event told) where it had not failed, else one more warning, named."""
    if (kept := run.stopping.kept()) is None:
        return
    if failed:
        kept.add_note(blame.where(run, kept))
        blame.warn_secondary(kept, "stop_requested", "on the thread that asked for a stop, before the run failed")
    else:
        errors.append((kept, "stop_requested"))
        fail(run, kept)


def _end(run: Run, failed: bool, errors: list[tuple[BaseException, str]]) -> None:
    """``fit_end`` (observers switched off included), ``results``, then, whatever these raised, a warning for
    each of their errors but the one that fails the run (:func:`hookfit.blame.warn_secondary`), the end line
    in ``run.jsonl``, the folder unlocked, the loaders' workers released and the state's errors detached."""
    state = run.state
    try:
        state.stage = None
        state.ended_at = time.perf_counter()  # the run is over: what fit_end does is not its time
        off = run.hooks.switched_off()
        # the implementations after a failing one (the trylast renderers and loggers) see the status it made
        fit_end = run.hooks.call_all("fit_end", run, on_error=lambda error: _failed_by(state, [(error, "")], failed))
        errors += [(error, "fit_end") for _, error in fit_end]
        run.hooks.call_switched_off("fit_end", off, run)  # so that they release what they hold
        _failed_by(state, errors, failed)  # results sees the status fit_end's errors made
        errors += [(error, "results") for error in results.ask(run)]
        _failed_by(state, errors, failed)
    finally:  # a second Ctrl-C in fit_end or results still ends the run: its end recorded, its folder unlocked
        try:
            try:  # the errors that did not end the run, as warnings before the end line (run.jsonl records them)
                for exc, hook in errors if failed else errors[1:]:
                    blame.warn_secondary(exc, hook)
            finally:
                run.hooks.close()
                run.folder.record_end()
                persistent.release(run.train_data, run.val_data)
        finally:
            if state.error is not None:
                state.error = detached(state.error)
            state.silenced[:] = [dataclasses.replace(s, error=detached(s.error)) for s in state.silenced]


def _failed_by(state: State, errors: list[tuple[BaseException, str]], failed: bool) -> None:
    if errors and not failed and state.status != "failed":
        error = errors[0][0]
        state.status, state.error, state.stopped_by = "failed", error, None
        state.stop_reason = f"{type(error).__name__}: {error}"


def detached(error: BaseException) -> BaseException:
    """A copy of ``error`` that says what it said, without its traceback: its class, ``args``,
    attributes and ``__notes__``, and its ``__cause__`` and ``__context__`` (and an exception
    group's exceptions) copied the same way. A traceback holds every frame the exception went
    through and each frame's locals (the run, its model and optimizers, a loss with its autograd
    graph); a copy holds none. Made the way pickling makes one (``copy.copy``); an exception
    whose class cannot be built again from its ``args`` is made without its ``__init__``, and
    one whose class cannot be made at all becomes a :class:`hookfit.errors.ErrorCopy` naming it."""
    return _detached(error, {})


def _detached(error: BaseException, copies: dict[int, BaseException]) -> BaseException:
    if (done := copies.get(id(error))) is not None:  # a chain that loops back
        return done
    inner = [_detached(e, copies) for e in error.exceptions] if isinstance(error, BaseExceptionGroup) else None
    twin = copies[id(error)] = _copy(error, inner)
    twin.__traceback__ = None
    twin.__cause__ = None if error.__cause__ is None else _detached(error.__cause__, copies)
    twin.__context__ = None if error.__context__ is None else _detached(error.__context__, copies)
    twin.__suppress_context__ = error.__suppress_context__
    return twin


def _copy(error: BaseException, inner: list[BaseException] | None) -> BaseException:
    kind = type(error)
    attributes = dict(getattr(error, "__dict__", {}))
    if "__notes__" in attributes:
        attributes["__notes__"] = list(attributes["__notes__"])
    args = error.args if inner is None else (error.args[0], inner)  # a group's own exceptions copied
    try:
        if isinstance(error, BaseExceptionGroup) and inner is not None:
            twin: BaseException = error.derive(inner)
        else:
            twin = copy.copy(error)
        if type(twin) is not kind:
            raise TypeError(f"{kind.__name__} copied as {type(twin).__name__}")
    except Exception:  # its __init__ takes other arguments than its args (or derive is not its own)
        try:
            twin = kind.__new__(kind, *args)
            twin.args = args
        except Exception:
            twin = ErrorCopy(f"{kind.__module__}.{kind.__qualname__}: {error}")
            attributes = {name: attributes[name] for name in ("__notes__",) if name in attributes}
    for name, value in attributes.items():
        try:
            setattr(twin, name, value)
        except (AttributeError, TypeError):  # a read-only property: the copy made it already
            pass
    return twin
