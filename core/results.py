"""What a run reports when it is over: every plugin's ``results`` answer, merged into
``loop.state.results`` (a read-only mapping, what ``fit()`` and ``validate()`` return). The core
merges mappings and reads none of them: the metrics, the best checkpoint and whatever else a
plugin reports are the plugins' own keys."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from hookfit.run import Run

__all__ = ["ask"]


def ask(run: Run) -> list[BaseException]:
    """Ask every ``results`` implementation (every one, even if another raised), set
    ``run.state.results`` to the merged answers, and return the errors: an implementation's
    own, an answer that is not a mapping with string keys, a key answered by two plugins (each
    naming the plugins). What the bad answers held is left out; the rest is kept."""
    answers, raised = run.hooks.gather("results", run)
    errors = [error for _, error in raised]
    merged: dict[str, Any] = {}
    owner: dict[str, str] = {}
    describe = run.pm.describe
    for plugin, answer in answers:
        if not isinstance(answer, Mapping):
            errors.append(TypeError(f"results: {describe(plugin)} answered a {type(answer).__name__}; "
                                    f"'results' returns a mapping of names to values, or None"))
            continue
        bad = [key for key in answer if not isinstance(key, str)]
        if bad:
            errors.append(TypeError(f"results: {describe(plugin)} answered the key {bad[0]!r} "
                                    f"({type(bad[0]).__name__}); keys of results are strings"))
            continue
        for key, value in answer.items():
            if key in owner:
                errors.append(ValueError(
                    f"results: {describe(owner[key])} and {describe(plugin)} both answer the key {key!r}; "
                    f"a key of loop.state.results has one owner: rename one, or disable one of the plugins"))
                continue
            owner[key] = plugin
            merged[key] = value
    run.state.results = MappingProxyType(merged)
    return errors
