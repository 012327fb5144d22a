"""Events of the metrics plugin, and the metrics role: what a plugin that aggregates step
outputs does, whether it is the built-in ``metrics`` or a replacement.

The metrics role. What the rest of hookfit reads from it, all of it, is what it publishes:

* ``metrics_update(loop, stage, snapshot)`` while a stage runs, at a bounded rate (never per
  batch), with a :class:`~hookfit.payloads.MetricsSnapshot` (``final=False``): the dashboard's
  table, curves and progress, the console's lines, the metric log's step lines.
* ``epoch_metrics(loop, stage, snapshot)`` once per stage of every epoch, with ``final=True``
  and the stage's per-epoch ``history``: the console's and dashboard's summary, the loggers
  (the metric log, csv, TensorBoard), early stopping and the checkpoint's ``monitor``. For a
  completed stage, from a ``trylast`` ``stage_end`` (so an optimizer plugin's last partial
  window is stepped first). For a stage a stop cut short (``loop.request_stop``, a
  ``should_stop`` answer, ``max_steps``; the core fires no ``stage_end`` for it), from a plain
  ``fit_end``, the innermost stage first (a validation inside training, then the training
  stage), with the ``batches`` it got (fewer than ``total``, unless the stop came right after
  the last): after the checkpoint role's
  ``tryfirst`` ``fit_end``, so a checkpoint saved at the stop counts no partial stage (the run
  resumed from it publishes that epoch once, whole), and before the ``trylast`` ones of the
  renderers and the metric log, which close in ``fit_end``. A stage with no batch of this run
  (a stop at its start; a resumed stage stopped before its next batch) publishes nothing, and
  so does a failed or aborted run (a second Ctrl-C), which ended at no boundary.
* Every snapshot's ``best`` says which value of its metrics is best (``"min"``/``"max"``), for
  the metrics that have a direction, and only those: configured by the user, never guessed
  from a name, except ``loss``, which is ``"min"`` unless configured otherwise (the loss is
  what the step minimises). The built-in takes them from ``Metrics(best={...})``.
* Values of other plugins: for each snapshot it builds (as often as ``metrics_update``), the role
  asks ``metrics_values(loop, stage)`` (declared here) and adds every answer to the snapshot's
  ``values`` as a gauge, ``Value(v, v, v)``, the value at the publication, before any metric it
  derives from them; a final snapshot's ``history`` entry holds it too. What it refuses, and
  how, is in that event's docstring. So a plugin's number reaches every consumer of the
  snapshots with no change of theirs; a replacement that does not ask leaves it unseen.
* Snapshots are never changed after publication (a renderer hands them to another thread).
  With several processes, sums and counts are reduced with ``all_reduce`` (declared by the
  distributed plugin) at the same batch on every process, and in a validation only for its
  ``epoch_metrics``; only the main process's publications are shown and written.

* Optionally, when the run is over, an answer to the core's ``results`` event (merged into
  ``loop.state.results``, what ``fit()`` returns). The built-in answers ``{"metrics":
  {"<stage>/<name>": last epoch value}, "best": {"<stage>/<name>": (best value, epoch counted
  from 1)}}``, ``best`` only for the metrics with a direction, over every epoch of the run (a
  resumed run's earlier epochs included, a partial last one too where the run completed there
  (``max_steps``, early stopping), not where a stop interrupted it before its last batch: the
  mean of some of its batches, :func:`hookfit.plugins.support.best.cut_short`); a replacement that
  answers the same keys keeps scripts that read them working.

That is the whole duty: the run's metric log (``metrics.jsonl``, which ``hookfit runs``,
``show`` and ``compare`` read) is written by the ``metrics_log`` plugin from these events
alone, so a replacement that publishes snapshots gets it without writing a file (its format is
in :mod:`hookfit.plugins.metrics_log`).

The three events are declared by :class:`hookfit.plugins.metrics.Metrics` (its ``hookspecs``
attribute) and added to every run whether ``metrics`` is enabled, disabled or replaced, so a
replacement publishes them with ``loop.hooks.metrics_update`` and ``loop.hooks.epoch_metrics``, and
adds the values with ``hookfit.plugins.metrics.gauges.add(loop, stage, values, taken)`` (``values``:
the snapshot's, changed in place; ``taken``: names it publishes that are not in ``values`` yet), as
the built-in does: it asks the event and makes the refusals the event's docstring lists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from hookfit import hookspec

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    import torch

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
    A run that stops inside a stage (a stop request, ``max_steps``) fires it for that stage
    too, from the metrics plugin's plain ``fit_end`` (after the ``tryfirst`` ones, where a
    checkpoint is saved), with ``metrics.batches`` the batches done (fewer than
    ``metrics.total`` unless the stop came right after the last): ``loop.state.stage`` is then
    ``None``. ``metrics`` is a
    :class:`~hookfit.payloads.MetricsSnapshot` with ``final=True``, whose epoch means are final
    and which carries the per-epoch ``history`` of the stage (a partial epoch last). Renderers
    print summaries here, loggers write them, a checkpoint plugin reads the value it monitors.
    A plugin that closes in ``fit_end`` what it writes here implements that ``fit_end``
    ``trylast``. The return value is ignored.
    """


@hookspec
def metrics_values(loop: Run, stage: str) -> Mapping[str, float | torch.Tensor] | None:
    """Values a plugin publishes with the metrics of ``stage`` (``"train"`` or ``"valid"``): asked by
    the metrics role at each publication, for every ``metrics_update`` and ``epoch_metrics``
    snapshot it builds, as often as ``metrics_update`` fires (the built-in: at most every
    ``Metrics(interval=0.5)`` seconds; every batch with ``interval=0``, or with several processes
    and ``sync_every=1``), and at each stage's end.

    Answer a mapping of metric names to values, or ``None`` for none. A value is a real number
    (a Python or NumPy number, a ``bool``) or a tensor of one real element, read on the host at
    the publication (one read per publication, wherever it lives: keep a per-step value as a
    tensor and answer the latest). Each joins the snapshot's ``values`` as a gauge,
    ``Value(v, v, v)``: last, running and epoch are the value at the publication, so the stage's
    ``epoch_metrics`` and its ``history`` hold its value at the stage's end. The console, the
    dashboard, the loggers, the metric log and ``state.results`` show it as any other metric;
    ``Metrics(best={"<name>": "min"})`` gives it a direction, early stopping and the checkpoint's
    ``monitor`` watch it as ``"<stage>/<name>"``, and the built-in's derived metrics see it.

    With several validation sets (``Loop(val_data={"clean": ..., "noisy": ...})``) the validation is
    one stage: the answer is asked for it as a whole (at its end ``loop.state.val_set`` is
    ``None``; a publication during a set has it) and published unprefixed, ``valid/temp``, beside
    each set's ``valid/<set>/<name>``; each set's derived metrics read it (``noisy/r`` from
    ``noisy/loss`` and ``temp``).

    Refused at the first publication that has it, naming the plugin, this event and the key: an
    answer that is not a mapping, a key that is not a non-empty string or that is a field of the
    stage's history entries (``epoch``, ``step``), a value that is no real number (text, a vector,
    a complex number), a name a step output of the stage (a metric object's too) or another
    plugin's answer publishes already. A name a metric log's row has for a field of its own
    (``time``, ``lr_<optimizer>``) is written there as ``metric.<name>``, as a step output's is.
    An observer plugin whose answer is refused (or that raises) is switched off with one
    warning; any other fails the run. A stage a stop cut short is published from ``fit_end``
    (``loop.state.stage`` is then ``None``: read ``stage``).

    With several processes each process answers its own value, and it is not reduced: the main
    process's publications are shown and written, so reduce it yourself where the processes'
    values differ. A gauge that early stopping or the checkpoint's ``monitor`` watches must be
    answered on every process, with the same value on each: each process compares its own
    epoch metrics (early stopping fails the run on one without it). Fires on the training
    thread: be quick.
    """
