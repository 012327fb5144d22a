"""Derived metrics: ``Metrics(derived={"ppl": lambda m: math.exp(m["loss"])})``, computed from the
aggregated values, never averaged batch by batch (the mean of ``exp(loss)`` is not the
perplexity). :class:`Derived` is that part of the metrics plugin.

Each entry is a metric name and a function of a mapping, metric name -> aggregated value, that
returns a number. At every publication and at each stage's end the function is called three
times, with the latest values, the running means and the epoch means of the stage, and the three
answers are the derived metric's :class:`~hookfit.payloads.Value`: its epoch value is the
function of the epoch means (the perplexity of the epoch's mean loss). It is then published with
the stage's other metrics, so the console, the dashboard, the metric log, ``hookfit runs`` and
``state.results`` show it as any other; ``Metrics(best={"ppl": "min"})`` gives it a direction.

* A bare name (``"ppl"``) is derived in every stage, a ``"<stage>/<name>"`` key (``"train/ppl"``)
  in that stage only. With several validation sets it is derived per set, from that set's
  metrics (``"noisy/ppl"`` from ``"noisy/loss"``) and the stage's unprefixed ones (a plugin's
  ``metrics_values``, asked for the whole stage: ``"noisy/r"`` from ``"noisy/loss"`` and
  ``"temp"``), a set's own metric first where both have a name; a function that reads only
  unprefixed metrics is derived once, unprefixed.
* Derived metrics are computed in the order given, each seeing the ones before it.
* A function that reads a metric the stage does not have (a ``KeyError``) derives nothing there;
  at the stage's end that is said once per run and stage (a :class:`hookfit.HookfitWarning`
  naming the metrics there are). An arithmetic error is no error: an overflow is ``inf``
  (``exp`` of a huge loss), a division by zero or a value outside a function's domain ``nan``.
  Any other error, or an answer that is not a real number, fails the run naming the derived metric.
* A derived metric named as one the step returns is an error: rename one.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from hookfit.errors import HookfitWarning, user_level
from hookfit.payloads import Value
from hookfit.plugins.metrics.aggregate import real, reserved
from hookfit.plugins.support import STAGES, option_error

__all__ = ["Derived"]

Function = Callable[[Mapping[str, float]], Any]


class Derived:
    """The derived metrics of ``Metrics(derived=...)``, checked at construction with errors
    naming ``plugin`` and the option."""

    def __init__(self, derived: Mapping[str, Function] | None, *, plugin: str = "metrics") -> None:
        self.plugin = plugin
        if derived is None:
            derived = {}
        if not isinstance(derived, Mapping):
            raise option_error(plugin, "derived", derived, "be a mapping of metric names to functions of the "
                               "aggregated metrics ({'ppl': lambda m: math.exp(m['loss'])}), or None", TypeError)
        self.given: dict[tuple[str | None, str], Function] = {}
        for key, function in derived.items():
            if not isinstance(key, str) or not key.strip() or key.startswith("/") or key.endswith("/"):
                raise option_error(plugin, "derived", key, "have metric names as keys ('ppl', or "
                                   "'<stage>/<name>' like 'train/ppl')", shown=f"the key {key!r}")
            first, _, rest = key.partition("/")
            stage, name = (first, rest) if first in STAGES and rest else (None, key)
            if first in STAGES and not rest:
                raise option_error(plugin, "derived", key, "name a metric after the stage", shown=repr(key))
            if (why := reserved(name)) is not None:
                raise option_error(plugin, "derived", key, f"name no field of the history: {why}", shown=repr(key))
            if not callable(function):
                raise option_error(plugin, f"derived[{key!r}]", function, "be a function of the aggregated "
                                   "metrics, lambda m: math.exp(m['loss'])", TypeError)
            self.given[(stage, name)] = function
        self._warned: set[tuple[str, str]] = set()

    def __bool__(self) -> bool:
        return bool(self.given)

    def reset(self) -> None:
        """A new run: its missing metrics are said again."""
        self._warned.clear()

    def add(self, stage: str, values: dict[str, Value], final: bool) -> None:
        """Add the derived metrics of ``stage`` to ``values`` (metric name -> Value, changed in
        place); ``final``: the stage's end, where a metric a function misses is said."""
        if not self.given:
            return
        groups: dict[str, list[str]] = {}  # a validation set's prefix ("noisy/", "" for none) -> names
        for key in values:
            prefix = key.rsplit("/", 1)[0] + "/" if "/" in key else ""
            groups.setdefault(prefix, []).append(key)
        for (only, name), function in self.given.items():
            if only is not None and only != stage:
                continue
            missing: list[KeyError] = []
            for prefix in sorted(groups, key=bool):  # unprefixed first: derived there, it is derived once
                error = self._derive(stage, prefix, name, function, values)
                if error is None and not prefix:
                    break
                if error is not None:
                    missing.append(error)
            if final and missing and len(missing) == len(groups) and (stage, name) not in self._warned:
                self._warned.add((stage, name))  # derived nowhere in the stage: said once
                warnings.warn(f"{self.plugin}: the derived metric {name!r} reads {missing[0]}, which stage {stage!r} "
                              f"does not have (it has {', '.join(sorted(values)) or 'no metrics'}): not derived "
                              f"there", HookfitWarning, stacklevel=user_level())

    def _derive(self, stage: str, prefix: str, name: str, function: Function,
                values: dict[str, Value]) -> KeyError | None:
        """Add ``prefix + name`` to ``values``, derived from the metrics named ``prefix...`` and the
        unprefixed ones (the set's own first); the ``KeyError`` of a function that reads a metric
        there is not, instead."""
        full = prefix + name
        mine = {key[len(prefix):]: value for key, value in values.items()
                if key.startswith(prefix) and "/" not in key[len(prefix):]}
        if prefix:  # a validation set's: the stage's unprefixed metrics too
            mine = {**{key: value for key, value in values.items() if "/" not in key}, **mine}
        if name in mine:
            raise ValueError(f"{self.plugin}: the derived metric {name!r} has the name of a metric of stage "
                             f"{stage!r} ({full!r}); rename one of them")
        try:
            values[full] = Value(*(self._call(name, function, {k: v[field] for k, v in mine.items()})
                                   for field in range(3)))
        except KeyError as missing:
            return missing
        return None

    def _call(self, name: str, function: Function, metrics: Mapping[str, float]) -> float:
        try:
            answer = function(metrics)
        except OverflowError:
            return math.inf
        except (ZeroDivisionError, ValueError):
            return math.nan
        except KeyError:
            raise
        except Exception as error:
            error.add_note(f"{self.plugin}: raised by the function of the derived metric {name!r}")
            raise
        number = real(answer)
        if number is None:
            raise TypeError(f"{self.plugin}: the derived metric {name!r} must be a real number, its function "
                            f"returned {type(answer).__name__} {answer!r}")
        return number

