"""distributed: data-parallel training on several processes and machines with ``torchrun``.

The same script runs on one process (``python train.py``) and on many
(``torchrun --nproc-per-node 4 train.py``, on one machine or several). This plugin uses
PyTorch's own engine, :mod:`torch.distributed` and ``DistributedDataParallel`` (DDP); it adds
no communication of its own beyond a small flag per batch (see stopping below) and one
check of the parameters per run.

When it is active
    When the process was started by ``torchrun`` (``RANK`` and ``WORLD_SIZE`` in the
    environment) or the script initialised ``torch.distributed`` itself. Otherwise it
    unregisters itself in ``configure``: a one-process run pays nothing for it, not even a
    function call per batch.

What it does, in ``configure`` (before every other plugin starts)
    * Initialises the default process group from ``torchrun``'s environment, unless the script
      did or an earlier run of the job (a ``Loop`` after a ``Loop``) did: ``gloo`` for a model
      on the CPU, ``nccl`` for a model on a GPU (then each process uses GPU ``LOCAL_RANK``; a
      model on another GPU is moved there). Collectives time out after ``timeout`` seconds
      (``HOOKFIT_DIST_TIMEOUT`` overrides it). A group it finds initialised is reused, never
      destroyed; the one it made is kept for the job's later runs (see "The process group").
    * Sets ``loop.state.rank`` and ``loop.state.world_size``; ``loop.is_main`` is rank 0.
    * On every rank but 0, unregisters every *observer* plugin (class attribute
      ``observer = True``: the console, the dashboard, loggers, and an observer you give the
      ``Loop``), so only rank 0 renders: such a plugin receives no event at all there, not even
      ``fit_start`` or ``fit_end``. An observer that must see every rank's run (a per-rank
      logger, one that keeps numbers the script reads on every rank) says so with the class
      attribute ``every_rank = True``, and stays registered on every rank. The metrics plugin
      is no observer: it stays on every rank (it takes part in the reductions) and writes its
      log on rank 0 only.
    * Wraps ``loop.model`` (one ``torch.nn.Module``) in ``DistributedDataParallel``, which
      also copies rank 0's parameters and buffers to every rank. **The step functions must
      call the wrapped model, ``loop.model(x)``**: calls on the original module (a variable
      of the script) compute the same values but do not synchronise gradients, and the ranks
      drift apart. The plugin checks this after the first training batch that produced
      gradients and fails the run with an error that says so. The wrapper is the run's own
      ``loop.model``: the ``Loop``'s configuration keeps the user's module.
    * Shards ``loop.train_data`` and ``loop.val_data`` so that each rank sees its own part.
      Training data gets the same number of batches on every rank (checked: the ranks must
      run the same batches, or their collective operations would not match). Validation data
      is sharded exactly: every sample in one rank's part, none repeated or left out, so the
      validation metrics of ``n`` processes are one process's (the parts may differ by one
      sample or batch; the loop runs no collective per validation batch, and the metrics are
      reduced once, at the validation's end). The rules, for training (validation: below):

      - data with a ``shard(rank, world_size)`` method (:class:`hookfit.data.Batches`): that
        method; every rank gets the same number of samples, the last ones wrapping around to
        the start of the data (or dropped, with ``drop_last``), like ``DistributedSampler``;
      - a ``torch.utils.data.DataLoader``: the same loader rebuilt with a
        ``DistributedSampler`` (same batch size, collate function, workers, ``drop_last``;
        shuffled iff the original shuffled, with ``seed``); the sampler is told the epoch at
        every ``epoch_start`` so each epoch has its own order. A loader that already has a
        ``DistributedSampler`` is kept as it is (and told the epoch);
      - a list or tuple of batches: rank ``r`` takes batches ``r, r + world_size, ...``, cut
        to ``len(data) // world_size`` batches on every rank (up to ``world_size - 1`` batches
        at the end are left out);
      - anything else (a generator, an ``IterableDataset``): an error saying what to pass;
        shard such data yourself and give ``Distributed(shard_data=False)``. Each rank then
        needs as many batches an epoch: compared at configure where the data has a length;
        a stream without one is checked as it runs out (:mod:`~hookfit.plugins.distributed.streams`).

      For validation the same, without evening out: ``Batches.shard(rank, world_size,
      even=False)`` (a ``shard`` method that takes ``even``; one that does not is called as
      for training), a ``DataLoader`` rebuilt with an ``ExactSampler`` (a
      ``DistributedSampler`` that neither pads nor drops), and a list cut to no length: rank
      ``r`` takes batches ``r, r + world_size, ...`` to the end. Every rank needs at least one
      validation batch (checked). A validation sampler is never told the epoch (nor is any
      validation data): each validation reads the same part on each rank. A validation loader with torch's own ``DistributedSampler`` is
      kept where it splits exactly, and otherwise (it pads the parts by repeating samples, or
      ``drop_last`` leaves some out) rebuilt with an ``ExactSampler`` in its order (its
      ``shuffle`` and ``seed``), checked as a set given without a sampler (a sample on every
      rank). One made for another rank or size is kept, with one ``HookfitWarning`` on each
      process that finds its own so (naming the set, its rank and ``num_replicas`` and the
      process's), whether or not the size divides; one the plugin cannot judge otherwise (a
      subclass, another dataset) that pads or drops is kept, with one ``HookfitWarning`` naming
      the set, the samples and the fix.

      With ``world_size`` ranks and a per-rank batch of ``b``, one step trains on
      ``world_size * b`` samples: DDP averages the ranks' gradients, so a run on ``n``
      processes with batch ``b`` computes the same updates as one process with batch
      ``n * b`` (over the same samples).

Every training pass and batch
    * Before every training forward pass of the data-parallel model (``loop.training``, with
      gradients enabled; a forward pre-hook on the DDP wrapper, or on the FSDP2 root), the
      plugin asks ``should_sync_gradients`` (the optimizer role's answer: see the optimizer
      plugin's events in ``core/hooks.md``). Answered ``False``, that pass runs as under DDP's
      ``no_sync()`` (DDP decides in the forward whether the backward all-reduces), or, with
      FSDP2, its backward keeps the gradients unsharded in the model
      (``set_requires_gradient_sync(False)``). So gradients are all-reduced once per optimizer
      step inside accumulation windows (on the window's last micro-batch, and on the training
      stage's last batch, where the partial window is stepped), and an optimizer that runs
      several passes per batch (Sharpness-Aware Minimization's closure) keeps the passes it
      does not step with free of communication. Validation, ``predict`` and forwards under
      ``no_grad`` ask nothing; a run without a data-parallel module (``wrap_model=False`` and
      none in ``loop.model``) gets no hook at all.
    * ``agree_stop``: every ``stop_check_every`` batches, and at every stage and epoch
      boundary, the ranks agree on stopping with one all-reduce of a flag. If any rank has a
      stop request (``loop.request_stop`` from anywhere: Ctrl-C or SIGTERM through the
      interrupter, the dashboard, a plugin, the step; a true ``should_stop`` answer), every
      rank stops at the same boundary with the same :class:`~hookfit.payloads.StopRequest`:
      ``by`` the asker's name (``"time_budget"`` once, however many ranks asked; different
      askers joined by ``", "``), ``ranks`` the ranks that asked, and the reason naming them
      (``"stop requested on rank 1: ..."``, ``"stop requested on ranks 0, 1: SIGINT"``); after
      it ``loop.stop_requested`` is that request on every rank. A request between two checks
      waits for the next. No rank is left waiting in a collective operation that the others
      have left. Inside a validation, where the ranks' parts may differ by a batch, no rank
      can wait in a collective at a batch the others may not reach: a rank with a request says
      so in the job's store at its next validation batch, a rank without a request looks there
      only every ``stop_check_every`` of its validation batches (one store lookup each, no
      collective), and each takes the same all-reduce at the first check that finds the stop,
      or as its batches end; the run resumes at the validation's
      start. A rank whose batches ended first settles it the other way: the validation runs to
      its end and the stop lands at its ``stage_end``.
    * Once a run, at the first agreement after an optimizer of the ``Loop`` stepped (after the
      first training batch when it was given none), the flag also says so, and the ranks
      compare a checksum of every trainable parameter (one gather; nothing per batch after
      it): data-parallel processes hold the same values after every step. Where some differ
      (a module left out of ``DistributedDataParallel`` under ``wrap_model=False``, whose
      gradients nothing synchronised) the run fails on every rank, naming them
      (:mod:`~hookfit.plugins.distributed.replicas`). Gradients a step all-reduces itself
      pass; sharded parameters (FSDP2's ``DTensor``) and parameters some ranks lack are not
      compared.
    * ``all_reduce``: sums a tensor over the ranks (``dist.all_reduce``); the metrics plugin
      uses it so that every published number is global and sample-weighted.

Failures
    A rank whose step or plugin raises prints ``hookfit distributed: rank N of W failed: ...``
    on stderr, records that it failed first, with its error, in the c10d store the ranks met
    through (torchrun's agent hosts it), and closes its process group; its process ends with
    the error and the other ranks' next collective operation fails at once (the connection is
    closed) instead of waiting; ``torchrun`` then ends the others and exits non-zero. Those
    ranks read the record: their line (``rank 0 of 2 stopped: a collective operation failed:
    rank 1 of 2 failed first: RuntimeError: ...; here: ...``) and their error's note name the
    rank that failed and its error. A rank that hangs makes the others fail after ``timeout``
    seconds; it records nothing (nor does a killed one), and the message then says that no
    rank recorded a failure and another rank probably failed, stopped or hung first. (The
    first rank to see its collective fail records that too, so a rank that was hanging learns,
    if it wakes, that it was left.) Where the store's server went with a failed process (a
    group initialised without torchrun, with rank 0 hosting it), the message cannot name the
    rank either.

The process group
    At ``fit_end``, after a completed or agreed stop, a barrier; the process group stays, so a
    script runs a ``Loop`` after a ``Loop`` in one ``torchrun`` job (``fit()``, then
    ``validate()`` a test set on a new ``Loop``): the next run finds it and reuses it. The group this plugin
    made is destroyed at the job's end (an ``atexit`` handler) or when the script calls
    :func:`shutdown` (on every rank, after its last run); at once when a run fails. A group
    the script initialised is the script's to destroy.

Sharding the model: ``strategy="fsdp"``
    Instead of wrapping the model in DDP, ``configure`` applies FSDP2's ``fully_shard`` to the
    submodules that ``shard_policy`` picks (by default every direct child with parameters),
    deepest first, then to the model; ``fsdp_options`` go to every call (mixed precision, CPU
    offload, ``reshard_after_forward``, a mesh). The model stays ``loop.model`` (sharded in
    place, and still sharded after the run); the ``Loop``'s optimizers are pointed at the
    sharded parameters, so they must not have stepped before. Inside accumulation windows the
    plugin calls ``set_requires_gradient_sync(False)``: FSDP2 keeps the window's gradients
    unsharded inside the model and reduce-scatters them once, at the window's end (so a
    checkpoint inside a window cannot hold them: one warning says so). Checkpoints of such a
    run are sharded, written by every rank (see the checkpoint plugin).

Checkpoints: a checkpoint plugin saves on rank 0 only (``loop.is_main``) and loads on every
rank; ``loop.model`` is then the DDP wrapper, whose ``module`` is the user's model (save that,
so checkpoints of one and of several processes are interchangeable).
"""

from __future__ import annotations

from hookfit.plugins.distributed.group import shutdown
from hookfit.plugins.distributed.plugin import Distributed, launched

__all__ = ["Distributed", "launched", "shutdown"]
