"""metrics: aggregates every scalar a step returns and publishes read-only snapshots.

* Each value of a step output that is a real number (a Python number or ``bool``, a NumPy
  scalar or 0-d array), or a tensor with one element, is
  aggregated under its key, weighted by the batch size: last value, running mean over the last
  ``window`` batches, and epoch mean; train and valid apart. Other values (strings, vectors,
  images) are ignored, without error, except a dict holding numbers (Lightning's ``{"log": {"acc": acc}}``,
  whose numbers it never aggregates): one ``HookfitWarning`` a step function, at the first batch
  that returns one, names the key and says to return them at the top level. A scalar that cannot be aggregated (a complex number or
  tensor) or a key that is not a string is refused at the batch it first appears in, with a
  ``TypeError`` naming the step function and the key; a key ``epoch`` or ``step`` (fields of
  the history's entries, which it would overwrite) with a ``ValueError`` alike. (Another field
  of a log's row, ``time`` or ``lr_<optimizer>``, is written there as ``metric.<name>``.)
  Values are checked only when a key is
  seen for the first time (in the stage, or since the last publication): the per-batch cost
  stays one append per value. The batch size is the output's ``batch_size`` key if present
  (not itself aggregated), else the first dimension of the batch's first tensor, else 1; a batch
  whose items show another first dimension than the one taken (``(T, B, F)`` inputs beside ``(B,)``
  targets) gets one ``MetricsWarning`` a step function and stage, at the stage's first batch, the
  only one looked at (see :mod:`~hookfit.plugins.metrics.batches`).
* ``torchmetrics.Metric`` objects in an output are the step's to update; this plugin computes
  them at the end of the stage (published in ``epoch_metrics``) and resets them.
* Tensors on an accelerator stay there until the publishing interval: one host read per
  publication, never one per step. On the CPU, where reading is no synchronisation, each value
  is read at once (the cheapest path). ``defer=True`` forces the deferred path anywhere.
* Publishes ``metrics_update`` at most every ``interval`` seconds and ``epoch_metrics`` at the
  end of every stage; keeps a per-epoch history (``history_epochs`` long) for plots. A run
  that stops inside a stage (a stop request, ``max_steps``) publishes that stage's epoch as
  it got at ``fit_end`` (``batches`` fewer than ``total``), so the console, the loggers and the
  metric log see the last, partial epoch too; the history a checkpoint keeps never counts it.
* ``best={"acc": "max", "valid/loss": "min"}``: which value of a metric is best, published in
  every snapshot's ``best``. A key is a metric's name (every stage) or ``"<stage>/<name>"``,
  which wins for its stage; with several validation sets ``"noisy/acc"`` (or
  ``"valid/noisy/acc"``) names one set's metric and ``"acc"`` every set's. ``loss`` is
  ``"min"`` unless configured otherwise (the loss is what the step minimises); nothing else is
  guessed from a name: a metric not configured has no direction (no best value is marked).
  An evaluation of a run's checkpoint (``Loop.validate(resume=...)``, the checkpoint in that
  run folder's ``checkpoints/``) takes the directions the run's ``metrics.jsonl`` records for the
  metrics ``best`` leaves without one. Checked at construction: names as keys, ``"min"`` or
  ``"max"`` as values.
* ``derived={"ppl": lambda m: math.exp(m["loss"])}``: metrics computed from the aggregated
  ones at every publication and at each stage's end, train and valid (per validation set), never
  averaged batch by batch: the epoch's ``ppl`` is ``exp`` of the epoch's mean loss. They are
  published with the others, so every consumer shows them; ``best={"ppl": "min"}`` gives one a
  direction; ``"train/ppl"`` derives it in one stage only (see
  :mod:`~hookfit.plugins.metrics.derived`).
* ``sums=("nll_sum", "ntok")``: those keys are added up over the stage's batches (every process's)
  instead of averaged, in every stage and validation set, and kept across a resume: the epoch
  value is the sum, the running value the sum so far, the last the batch's; derived metrics see
  the sums, so ``derived={"ppl": lambda m: math.exp(m["nll_sum"] / m["ntok"])}`` is the corpus
  perplexity. No cost per batch (the batch size is left out as the values are folded). A summed
  key takes one real number a batch (else refused at that batch) and a name no step returns is
  warned of once each stage of the run ended (see :mod:`~hookfit.plugins.metrics.sums`).
* A metric object a step returns (torchmetrics' ``Metric``: ``update``, ``compute``, ``reset``) is
  computed and reset at the stage's end; with several validation sets, a set's objects as the
  next set begins (one object shared by the sets gives each its own value). Its value is one
  number, or a mapping of names to numbers (torchmetrics' ``ClasswiseWrapper``, a
  ``MetricCollection``), each published as ``<key>/<name>``; one that computes anything else (a
  vector: ``F1Score(average=None)``) is published nowhere, said in one warning. A checkpoint inside
  the training stage keeps its objects' states (``metric_state``), and the resumed stage merges
  them back into the object the step returns (``merge_state``), so its epoch value is the
  uninterrupted run's; an object that cannot be merged (no ``merge_state``, one that refuses, a
  run of several processes) counts the batches since the resume only, said in one warning.
* Results (``fit()``'s ``state.results``): ``state.results["metrics"]`` is each metric's last
  epoch value by ``"<stage>/<name>"``, ``state.results["best"]`` its best ``(value, epoch counted
  from 1)`` for the metrics with a direction; over every epoch of the run, those before a resume
  and a partial last one included (``Loop.validate()``: its validation), but for ``best`` a stage
  cut short by a stop that interrupted the run (status ``"interrupted"``: the mean of some of its
  batches; ``max_steps`` and early stopping complete a run).
* The run's metric log, ``metrics.jsonl``, is not this plugin's: the ``metrics_log`` plugin
  writes it from the snapshots; leave it out with ``Loop(disable=["metrics_log"])``.
* Several processes (a plugin implements ``all_reduce`` and ``loop.state.world_size > 1``):
  sums and counts are added up over the processes before each publication, so every snapshot
  carries global, sample-weighted numbers (``last`` is the mean of the processes' last
  values). Publications then happen every ``sync_every`` batches, at the same batch on every
  process, instead of by time.
* Checkpoints: ``save_state`` carries the history and the aggregate of a training stage in
  progress, so a resumed run publishes the same epoch means as an uninterrupted one.
"""

from __future__ import annotations

from hookfit.payloads import MetricsSnapshot, Value
from hookfit.plugins.metrics.batches import MetricsWarning, batch_size
from hookfit.plugins.metrics.plugin import Metrics

__all__ = ["Metrics", "MetricsSnapshot", "MetricsWarning", "Value", "batch_size"]
