"""How a run ends, whatever happened: :func:`fail` when it raised (``exception``), then
:func:`finish`: ``fit_end`` exactly once, every implementation run even if one raises, then
``results``, and ``run.jsonl``'s end line with the final status."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from hookfit import blame, persistent, results
from hookfit.state import State

if TYPE_CHECKING:  # pragma: no cover
    from hookfit.run import Run

__all__ = ["fail", "finish"]


def fail(run: Run, error: BaseException) -> None:
    state = run.state
    if isinstance(error, KeyboardInterrupt):
        state.status, state.stop_reason = "interrupted", "KeyboardInterrupt"
        return
    state.status, state.error = "failed", error
    state.stop_reason = f"{type(error).__name__}: {error}"
    error.add_note(blame.where(run, error))
    for _, secondary in run.hooks.call_all("exception", run, error):
        blame.warn_secondary(secondary, "exception")


def finish(run: Run, failed: bool) -> None:
    """Fire ``fit_end`` once: every implementation runs even if one raises; then ask
    ``results`` (:mod:`hookfit.results`) and write the run's end line in ``run.jsonl`` with the
    final status; the persistent worker processes of its loaders end with it
    (:func:`hookfit.persistent.release`). An error of either fails a run that had not failed."""
    state = run.state
    state.stage = None
    state.ended_at = time.perf_counter()  # the run is over: what fit_end does is not its time
    errors = [(error, "fit_end") for _, error in run.hooks.call_all("fit_end", run)]
    _failed_by(state, errors, failed)  # results sees the status fit_end's errors made
    errors += [(error, "results") for error in results.ask(run)]
    _failed_by(state, errors, failed)
    run.hooks.close()
    run.folder.record_end()
    persistent.release(run.train_data, run.val_data)
    for exc, hook in errors if failed else errors[1:]:
        blame.warn_secondary(exc, hook)
    if errors and not failed:
        raise errors[0][0]


def _failed_by(state: State, errors: list[tuple[BaseException, str]], failed: bool) -> None:
    if errors and not failed and state.status != "failed":
        error = errors[0][0]
        state.status, state.error, state.stopped_by = "failed", error, None
        state.stop_reason = f"{type(error).__name__}: {error}"
