"""Events of the metrics plugin: aggregated values, published for renderers and loggers.

Declared by :class:`hookfit.plugins.metrics.Metrics` (its ``hookspecs`` attribute) and added
to every run whether ``metrics`` is enabled, disabled or replaced: a metrics plugin of another
package publishes the same :class:`~hookfit.payloads.MetricsSnapshot` objects with
``loop.hooks.metrics_update`` and ``loop.hooks.epoch_metrics``, and the console, the dashboard,
the loggers, early stopping and the checkpoint plugin's ``monitor``, which read nothing else,
keep working. With several processes a metrics plugin sums over them with ``all_reduce``
(declared by the distributed plugin).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hookfit import hookspec

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.payloads import MetricsSnapshot
    from hookfit.run import Run


@hookspec
def metrics_update(loop: Run, stage: str, metrics: MetricsSnapshot) -> None:
    """Aggregated values of the running stage, published at a bounded rate (not per batch).

    Fired by the metrics plugin (the built-in ``metrics`` or any replacement) while a stage
    runs. ``metrics`` is a :class:`~hookfit.payloads.MetricsSnapshot` with ``final=False``:
    values with last, running and epoch means, progress, throughput and learning rates. It is
    never changed after publication, so a renderer may hand it to another thread as it is.
    Fires on the training thread; implementations must be quick (hand over, do not draw). The
    return value is ignored.
    """


@hookspec
def epoch_metrics(loop: Run, stage: str, metrics: MetricsSnapshot) -> None:
    """The final aggregate of a stage of an epoch: ``stage`` is ``"train"`` or ``"valid"``.

    Fires once per completed stage, from the metrics plugin's ``stage_end`` implementation,
    which is ``trylast``: after every other plugin's ``stage_end`` for that stage (an optimizer
    plugin has stepped the stage's last, partial window; learning rates are those after it).
    ``metrics`` is a :class:`~hookfit.payloads.MetricsSnapshot` with ``final=True``, whose
    epoch means are final and which carries the per-epoch ``history`` of the stage. Renderers
    print summaries here, loggers write them, a checkpoint plugin reads the value it monitors.
    The return value is ignored.
    """
