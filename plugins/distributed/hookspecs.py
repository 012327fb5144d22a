"""Events of the distributed plugin, and the distributed role: what a plugin that runs the loop
on several processes does, whether it is the built-in ``distributed`` or a replacement.

The distributed role. What it must do, all of it:

* Set the run up in a ``tryfirst`` ``configure``, so that every other plugin configures what
  is left:

  - the process group: use torch's default group (the checkpoint plugin broadcasts and writes
    sharded checkpoints through it), reusing one it finds initialised. One it initialises
    itself outlives the run, for the job's next run (a ``Loop`` after a ``Loop``: ``fit()``,
    then ``validate()`` a test set), and goes at the job's end or when the script asks
    (the built-in's :func:`hookfit.plugins.distributed.shutdown`), never at each run's end
    (gloo cannot make a group again in the same job). One the script initialised stays the
    script's;
  - ``loop.state.rank`` and ``loop.state.world_size``. ``loop.is_main`` (rank 0) then decides
    who writes: the metric log, ``run.jsonl``, checkpoints (sharded ones excepted: every rank
    writes its part), the loggers; every rank loads a checkpoint;
  - observers: on every rank but 0, unregister each plugin whose class says ``observer =
    True`` (renderers, loggers, an observer given to the ``Loop``), so only rank 0 renders and
    logs, unless its class also says ``every_rank = True``: an observer that must see every
    rank's run (a per-rank logger, one that keeps numbers the script reads on every rank)
    stays registered everywhere. An unregistered observer receives no event, not even
    ``fit_start`` or ``fit_end``. So an event that only observers listen to can have no
    listener on rank 1 while rank 0 has one (``loop.hooks.metrics_update`` is ``None`` there):
    a plugin that runs a collective operation (``all_reduce``) must run it on every rank
    alike, never only when someone listens, or the ranks wait for each other for ever;
  - the model: wrap ``loop.model`` (DDP; its ``module`` is the user's model, which
    checkpoints, EMA and the model summary reach through
    :func:`hookfit.plugins.support.unwrap_model`) or shard it in place (FSDP2, the ``Loop``'s
    torch optimizers pointed at the sharded parameters before the optimizer role's
    ``configure`` wraps them);
  - the data: shard ``loop.train_data`` so that every rank runs the same number of batches
    (their collective operations must match) and ``loop.val_data`` so that every sample is
    validated once over the ranks (the metrics equal one process's). A sharded data's own
    state is saved from the main process and loaded into every rank's: it describes the
    position in the data, never the rank.

* Gradient synchronisation: before every training forward pass of the data-parallel model
  (``loop.training``, gradients enabled), ask ``should_sync_gradients`` (the optimizer role's
  answer; ``None`` or no implementation: synchronise) and make that pass's backward
  synchronise or not (DDP decides in its forward: ``no_sync()`` for that pass; FSDP2 reads
  ``set_requires_gradient_sync`` in the backward). Nothing is asked, and nothing added per
  batch, without a data-parallel model.
* Stopping together: implement the core's ``agree_stop``, so that every process stops at the
  same boundary; at a validation's ``"batch"`` and ``"batches_end"`` boundaries, where the ranks
  may have run different numbers of batches, run a collective operation only once every rank
  is known to take it there (the ranks decide through their store whether the validation
  stops: then each takes it at its next such boundary), else answer ``False``. The agreed
  :class:`~hookfit.payloads.StopRequest` is the same on every rank: ``by`` the asker's name,
  once (``"time_budget"``, however many ranks asked; different askers joined by ``", "``),
  ``ranks`` the ranks that asked, ``complete`` only if every rank that asked says so, and a
  ``reason`` that names the ranks for a person (``"stop requested on ranks 0, 1: time budget
  spent"``). It becomes ``loop.stop_requested``, ``loop.state.stop_reason`` and
  ``loop.state.stopped_by`` on every rank: the console's end line and ``metrics.jsonl``'s
  ``end`` line show its reason and ``by``.
* Sums: answer ``all_reduce`` (below), which the metrics role asks for every published number.
* Every epoch: tell the data's samplers the epoch (``epoch_start``), so each epoch has its own
  order.
* Failures: in ``exception``, say which rank failed, and make the other ranks' next collective
  operation fail at once rather than at the timeout.
* The end: in a ``trylast`` ``fit_end``, give ``loop.model`` back as the user's module (after
  every other plugin's ``fit_end``, which may still save it).

Replace the built-in by giving ``Loop(plugins=[...])`` a plugin whose ``name`` is
``"distributed"``, by naming your entry point ``distributed``, or by disabling it
(``HOOKFIT_DISABLE_PLUGINS=distributed``). Without any such plugin a run has one process:
``all_reduce`` has no answer, ``agree_stop`` is not asked, ``should_sync_gradients`` neither.

``all_reduce`` is declared by :class:`hookfit.plugins.distributed.Distributed` (its
``hookspecs`` attribute) and added to every run whether ``distributed`` is enabled, disabled or
replaced: the plugin that runs the loop on several processes answers it, and the plugins that
need global numbers (metrics) ask it, or use their own value when nothing answers (one
process). Stopping every process at the same boundary is the core's ``agree_stop``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hookfit import hookspec

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    import torch

    from hookfit.run import Run


@hookspec(firstresult=True)
def all_reduce(loop: Run, tensor: torch.Tensor) -> torch.Tensor | None:
    """Sum ``tensor`` over every process of the run and return the sum (a tensor of the same
    shape); every process must call it at the same point, as for any collective operation.

    Implemented by the plugin that runs the loop on several processes; when no plugin does,
    the run has one process and callers use their own value. Metrics plugins call it to
    publish global numbers (sums and counts, so that means stay weighted); with several
    processes they therefore publish at the same batch on every process (every N batches),
    never by the clock. In a validation stage processes may run different numbers of batches
    (see ``agree_stop``): call it there only at ``stage_end``, never per batch. First result.
    """
