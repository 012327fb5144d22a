"""Events of the metrics plugin, and the metrics role: what a plugin that aggregates step
outputs does, whether it is the built-in ``metrics`` or a replacement.

The metrics role. What the rest of hookfit reads from it, all of it:

* ``metrics_update(loop, stage, snapshot)`` while a stage runs, at a bounded rate (never per
  batch), with a :class:`~hookfit.payloads.MetricsSnapshot` (``final=False``): the dashboard's
  table, curves and progress, the console's lines.
* ``epoch_metrics(loop, stage, snapshot)`` once per completed stage, from a ``trylast``
  ``stage_end`` (so an optimizer plugin's last partial window is stepped first), with
  ``final=True`` and the stage's per-epoch ``history``: the console's and dashboard's summary,
  the loggers (csv, TensorBoard), early stopping and the checkpoint's ``monitor``.
* Snapshots are never changed after publication (a renderer hands them to another thread).
  With several processes, sums and counts are reduced with ``all_reduce`` (declared by the
  distributed plugin) at the same batch on every process, and in a validation only at its
  ``stage_end``.
* The run's metric log, ``loop.run_dir / "metrics.jsonl"``, main process only, one JSON object
  a line: ``{"event": "epoch", **snapshot.row()}`` for every ``epoch_metrics`` snapshot
  (``stage``, ``epoch`` counted from 1, ``step``, ``batches``, ``samples``, ``time``,
  ``samples_per_s``, each metric's epoch mean by name, ``lr_<optimizer>``); optionally
  ``{"event": "step", **row}`` lines while training; ``{"event": "resume", "from": source,
  "epoch": epoch + 1, "batch": ..., "step": ...}`` at ``resumed``; and ``{"event": "end",
  "status", "reason", "by", "epoch", "step", "time"}`` at ``fit_end``. ``hookfit runs``,
  ``hookfit show`` and ``hookfit compare`` read only this file for metrics: a replacement that
  wants them writes it (``MetricsSnapshot.row()`` gives the fields).

Both events are declared by :class:`hookfit.plugins.metrics.Metrics` (its ``hookspecs``
attribute) and added to every run whether ``metrics`` is enabled, disabled or replaced, so a
replacement publishes them with ``loop.hooks.metrics_update`` and ``loop.hooks.epoch_metrics``.
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
