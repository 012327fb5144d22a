"""Directions: which value of a metric is best, as the user configured it (``Metrics(best=...)``),
carried by every snapshot in :attr:`hookfit.payloads.MetricsSnapshot.best`."""

from __future__ import annotations

from collections.abc import Iterable
from types import MappingProxyType
from typing import Mapping

from hookfit.plugins.support import MODES, STAGES, option_error

__all__ = ["Directions"]

_CACHED = 64
"""Sets of metric names whose directions are remembered (a run has a few: one a stage)."""


class Directions:
    """Metric name -> ``"min"`` or ``"max"``, from ``best`` as the user gave it.

    A key is a metric's name (``"acc"``: in every stage) or ``"<stage>/<name>"``
    (``"valid/acc"``; a key whose first part is ``train`` or ``valid`` is always read so); for a
    metric of a stage, its ``"<stage>/<name>"`` key wins over its bare name. With several
    validation sets a validation metric is named ``"<set>/<name>"`` (``"noisy/acc"``): its own
    keys (``"valid/noisy/acc"``, ``"noisy/acc"``) come first, then those of the name within the
    set (``"valid/acc"``, ``"acc"``). ``loss`` is ``"min"`` unless configured otherwise: the loss
    is what the step minimises. Nothing else is guessed from a name: a metric without a
    configured direction has none.

    ``best`` is checked here, at construction, with an error naming ``plugin``, the option and
    the entry: a mapping whose keys are non-empty names and whose values are ``"min"`` or
    ``"max"``. What ``best`` leaves without one can come from a training run (:meth:`learn`)."""

    def __init__(self, best: Mapping[str, str] | None, *, plugin: str = "metrics", option: str = "best") -> None:
        if best is None:
            best = {}
        if not isinstance(best, Mapping):
            raise option_error(plugin, option, best, "be a mapping of metric names ('loss', 'valid/acc') to "
                               "'min' or 'max', or None", TypeError)
        for key, mode in best.items():
            if not isinstance(key, str) or not key.strip() or key.endswith("/") or key.startswith("/"):
                raise option_error(plugin, option, key, "have metric names as keys ('acc', or '<stage>/<name>' "
                                   "like 'valid/acc'); one key is not", shown=f"the key {key!r}")
            if key.split("/", 1)[0] in STAGES and not key.split("/", 1)[1:]:
                raise option_error(plugin, option, key, "name a metric after the stage", shown=repr(key))
            if not isinstance(mode, str) or mode not in MODES:
                raise option_error(plugin, f"{option}[{key!r}]", mode, "be 'min' (lower is better) or 'max' "
                                   "(higher is better)")
        self.given: Mapping[str, str] = MappingProxyType(dict(best))
        """The directions as configured (read-only)."""
        self.trained: Mapping[str, str] = MappingProxyType({})
        """``"<stage>/<name>"`` -> direction, of a training run (:meth:`learn`)."""
        self._cache: dict[tuple[str, tuple[str, ...]], Mapping[str, str]] = {}

    def learn(self, trained: Mapping[str, str]) -> None:
        """Take the directions a training run recorded (``"<stage>/<name>"`` -> ``"min"`` or
        ``"max"``, its metrics log's ``"best"`` line) for the metrics that ``best`` gives none, after
        ``best``'s and before ``loss``'s default: an evaluation of that run's checkpoint judges its
        metrics as the run did. ``{}`` forgets them."""
        self.trained = MappingProxyType({str(k): v for k, v in trained.items() if v in MODES})
        self._cache.clear()

    def key(self, stage: str, name: str) -> str | None:
        """The key of ``best`` that gives metric ``name`` of ``stage`` its direction, or ``None``."""
        base = name.rsplit("/", 1)[-1]
        keys = (f"{stage}/{name}", name) if base == name else (f"{stage}/{name}", name, f"{stage}/{base}", base)
        return next((key for key in keys if key in self.given), None)

    def direction(self, stage: str, name: str) -> str | None:
        """The direction of metric ``name`` of ``stage``, or ``None`` when it has none."""
        key = self.key(stage, name)
        if key is not None:
            return self.given[key]
        return self.trained.get(f"{stage}/{name}") or ("min" if name.rsplit("/", 1)[-1] == "loss" else None)

    def of(self, stage: str, names: Iterable[str]) -> Mapping[str, str]:
        """The directions of ``stage``'s metrics ``names`` that have one (read-only), for
        :attr:`hookfit.payloads.MetricsSnapshot.best`: those the user configured in the order
        of their keys in ``best`` (a reader takes the first one as the metric a run is judged
        by, :func:`hookfit.tools.runs.default_metric`), then those a training run gave (:meth:`learn`),
        in its order, then ``loss``'s default; names that one key gives in the order of ``names``."""
        key = (stage, tuple(names))
        found = self._cache.get(key)
        if found is None:
            if len(self._cache) >= _CACHED:
                self._cache.clear()
            given = {name: i for i, name in enumerate(self.given)}
            trained = {name: i for i, name in enumerate(self.trained)}

            def rank(name: str) -> tuple[int, int]:
                configured = self.key(stage, name)
                if configured is not None:
                    return 0, given[configured]
                return (1, trained[f"{stage}/{name}"]) if f"{stage}/{name}" in trained else (2, 0)

            named = sorted((name for name in key[1] if self.direction(stage, name) is not None), key=rank)
            found = self._cache[key] = MappingProxyType({name: str(self.direction(stage, name)) for name in named})
        return found

    def __repr__(self) -> str:
        return f"Directions({dict(self.given)!r})"
