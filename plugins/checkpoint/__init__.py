"""checkpoint: atomic checkpoints of the whole run, and exact resume.

What a checkpoint holds (format ``hookfit-checkpoint``, version :data:`FORMAT_VERSION`): the
model's state dict, every plugin's state through the ``save_state`` event keyed by plugin name
(the optim plugin's optimizers, schedulers, scaler and counters; the metrics plugin's history;
any third-party plugin's), the loop's position (epoch, global step, training batches of the
epoch already done), the random number generators (Python, NumPy when installed, torch CPU and
CUDA; in a run of several processes every process's own too, under ``ranks``:
:mod:`hookfit.plugins.checkpoint.ranks`), the state of data that has ``state_dict()`` (:class:`hookfit.data.Batches`), and a
``digest`` (CRC-32 over every tensor's dtype, shape and bytes and every other value, in a
fixed order: it finds torn writes and flipped bits, as zip and gzip do, not deliberate
tampering). Only plain data and tensors: it is read back with
``torch.load(weights_only=True)``, so loading a checkpoint never runs code from the file.

When: every ``every_n_epochs`` epochs (default 1), every ``every_n_steps`` training steps,
every ``every_seconds`` seconds (checked after each training batch; under ``torchrun`` by the main
process's clock, read about once a second of training: :class:`~hookfit.plugins.checkpoint.ranks.Clock`), when the run stops
gracefully (``on_interrupt``, default on: a stop request, SIGINT or SIGTERM through the
interrupter), when the run completes (``max_epochs``, ``max_steps``, or a rule such as early
stopping) inside an epoch, at that exact position (``reason`` ``"max_steps"`` or
``"completed"``: a run resumed with a larger ``max_steps`` equals one that never stopped), or
at an epoch's end when it saves on a schedule (any ``every_n_*``) and its last save is of an
earlier step (so the newest checkpoint of a completed run, which ``"latest"`` and ``hookfit
export`` take, holds its final weights: ``every_n_epochs=None, every_n_steps=5`` over 48 steps
saves step 48 too; a run saving on no schedule saves nothing at its end) and, if asked, when it
fails (``on_failure``: a ``failed-*.pt`` file, never chosen by ``"latest"``; its position is
after the last training batch whose step completed, so the failing batch runs again). A run
whose end stands at the position it started or resumed at (it trained no batch and ended no
epoch: stopped before its first batch, as ``LRFinder(then="stop")`` stops it) writes no
checkpoint at its end but ``on_failure``'s, so that the next run of its name does not resume
its untrained state (:mod:`hookfit.plugins.checkpoint.ending`). The last ``keep_last``
checkpoints are kept, plus the ``keep_best`` (1) best by ``monitor`` (``"valid/loss"``:
the epoch mean of ``loss`` in the validation stage, published by the metrics plugin, compared
in the direction it publishes for it unless ``mode`` is given, which needs a ``monitor``; a monitored metric the run
does not produce, or never publishes (no validation, every validation past the run's end, no
metrics plugin), is warned about once: :meth:`~hookfit.plugins.checkpoint.scores.Scores.begin`,
:meth:`~hookfit.plugins.checkpoint.scores.Scores.end`). A checkpoint's metric (``meta["metric"]``) is the
score of its own weights: the value a validation of them published, else ``None`` (a
checkpoint saved after more training than its validation saw carries none). A validation of
the monitored stage is followed by a save of the weights it scored when that save is due anyway,
or when the score is a new best (``reason="best"``), so the best checkpoint holds the
best-scored weights. At an epoch's end that is the epoch's save. With
``Loop(val_every_n_steps=N)`` the validation runs after the step's save point: the state is
copied there (one copy, as a save makes) and written once the validation has published,
with its score, if the step's save was due or the score is a new best, else let go; its
position says the validation is due, so a run resumed from it runs that validation again
first. A validation cut short scores nothing, and a sharded run writes its saves at such steps
at once, without a metric (:mod:`hookfit.plugins.checkpoint.scores`). ``fit().results`` names
both, on every process: ``"best_checkpoint"`` and ``"last_checkpoint"`` (paths, or ``None``;
a ``failed-*`` file is never the last). Names count epochs from 1:
``epoch0001-step000000003.pt`` is a save during the first epoch, ``epoch0001-step000000007.pt``
the one at its end, so names sort in run order. A run without a model saves nothing (one
:class:`CheckpointWarning`), and resuming one is an error. A module the step function reads from its
closure or globals, not given to ``Loop(model=...)``, is in no checkpoint: one the run changed is warned
of at the first save (:mod:`hookfit.plugins.checkpoint.unsaved`).

Sharded runs (FSDP2: the model's parameters are ``DTensor`` shards): the checkpoint is a
folder ``epochNNNN-stepNNNNNNNNN.dcp`` written with :mod:`torch.distributed.checkpoint` by
every process (its own shards, in parallel; see :mod:`hookfit.plugins.checkpoint.sharded`),
atomically as a whole: a temporary folder renamed once every part is written. With
``background=True`` (default) a save blocks each process for one copy of its state into host
memory and DCP's ``async_save`` writes it, on a process group of the checkpoint's own, while
training goes on (:mod:`hookfit.plugins.checkpoint.shardwriter`): one write is in flight at most,
a save asked during it follows ``when_busy`` on every process alike, and the write's outcome is
taken at the next save and at the run's end. It resumes on any number of processes,
or in a plain process; ``hookfit export RUN model.pt`` writes its model as one plain state
dict. A plain process's run prunes the folder's ``.dcp`` checkpoints by ``keep_last`` as any
others (a budget of the folder's checkpoints, sharded or not): to resume sharded again from the
last ``.dcp``, give that run a larger ``keep_last`` or copy the folder aside first. The digest covers ``state.pt`` (everything but the shards, whose places, shapes and
dtypes it names, with a digest of every shard file and of DCP's ``.metadata``, checked before
DCP reads anything; ``.metadata`` is read without unpickling anything a file could craft; see
:mod:`hookfit.plugins.checkpoint.shardfiles`). A checkpoint of an unsharded run is not resumed by a
sharded one (an error says what to do instead).

Atomic: each file is written to a temporary file ``.<name>.<pid>.tmp`` in the same folder,
flushed, fsynced, renamed over its final name, and the folder is fsynced. A process killed at
any moment leaves the previous checkpoint or the new one, never a torn one; the temporary
files of killed processes are removed at the next start of the run. With ``background=True``
(default) a save blocks the loop only while the state is copied into host buffers made at the
first save and reused while the tensors keep their shapes and dtypes (pinned, on a copy stream of
their own, for tensors on a GPU); the digest, the file, its fsyncs and rename and the pruning to
``keep_last`` are a writer thread's, which steps aside while a save copies. One write is in flight
and one snapshot waits at most (one copy of the state in host memory, two when saves come faster
than writes); a save asked while both are taken follows ``when_busy``: ``"wait"`` (default) waits
for the write in flight, ``"skip"`` skips it, counts it in ``skipped_saves`` and warns once a run;
the saves of the run's end always wait. ``fit_end``, however the run ended, waits for every write
and reports a failed one as ``on_save_error`` says.

Resume: ``Loop(resume="latest" | path)`` (or ``HOOKFIT_RESUME``). ``"latest"`` is the newest
checkpoint of this run's identity (its ``Loop(name=...)``, else its script or notebook: each checkpoint
records the identity and name of the run that wrote it, ``meta["identity"]``, ``meta["name"]``) in ``dir``, or,
when no folder was given, in ``<run_dir>/checkpoints`` if the run has a fixed ``run_dir``, else the newest of
this run's name, in ``runs/<name>/*/checkpoints`` (never another name's: a checkpoint of another name in a
shared folder, ``[plugins.checkpoint] dir`` in ``hookfit.toml`` or one ``run_dir`` for the folds of a k-fold
CV, is left, and where it is all the folder holds the line that says the run starts afresh names those
runs and how to resume one by its path); with none, the run starts afresh. The file is chosen at ``configure``,
and a run without a ``run_dir`` of its own continues in the folder of the run it resumes
(``loop.continue_in``): its checkpoints, its metrics log; one resuming another identity's checkpoint by its
path forks it, in a run folder of its own, that run's folder left as it was. The checkpoints of the run it
resumed there are this run's too, so ``keep_last`` holds across resumes. A run never moves, writes over nor prunes a
checkpoint of a run it does not continue, so a path a run reported (``state.results``, its lines,
``run.jsonl``) names that run's file for good: one that begins in a folder holding checkpoints it does not
continue (run afresh, or resumed from elsewhere) gives its own names a tag, ``-vT`` before the suffix
(``epoch0004-step000000060-v1.pt``; ``T`` one more than the highest there), which a run resumed from them
keeps; in a folder several runs wrote in, ``"latest"`` takes the run of its identity written last, and
``hookfit export`` of the folder the run written last (:mod:`hookfit.plugins.checkpoint.folders`). The
checkpoints in a folder's ``earlier-run-N/`` subfolders (which no run makes) are resumed or exported by their
path, their run's best read as the one beside them, and those its ``.earlier-runs`` file lists are taken by no
listing, pruned by no ``keep_last`` and written over by no save
(:mod:`hookfit.plugins.checkpoint.folders`). Contents are checked before use: a file
that is torn, not a hookfit checkpoint, newer, lacking entries, with a bad RNG state or an
impossible position, or whose contents do not match its digest is a :class:`CheckpointError`
naming it and what does not match; ``fallback=True`` warns and takes the next newest instead
(the line that says which checkpoint ``"latest"`` took names those it skipped).
Plugin states that do not match the run (a plugin new to it, a saved state nobody restores)
are warned about by default and those plugins start fresh; ``strict=True`` makes it an error.

Failed saves (full disk, read-only folder): ``on_save_error="warn"`` (default) warns once a
run with a :class:`CheckpointWarning` (a :class:`hookfit.files.FileWarning`: one policy for the
files of a run), counts them in ``failed_saves`` and keeps the previous checkpoints; ``"raise"``
fails the run. With several processes only the main process (rank 0) writes and warns; every
process loads, and ends with the main process's results (last, best, failed and skipped saves).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from hookfit.plugins.checkpoint.digests import digest
    from hookfit.plugins.checkpoint.plugin import Checkpoint
    from hookfit.plugins.checkpoint.storage import (
        FORMAT,
        FORMAT_VERSION,
        SUFFIX,
        CheckpointError,
        CheckpointWarning,
        atomic_save,
        read,
    )

__all__ = [
    "FORMAT", "FORMAT_VERSION", "SUFFIX", "Checkpoint", "CheckpointError", "CheckpointWarning", "atomic_save",
    "digest", "read",
]


def __getattr__(name: str) -> Any:
    """The public names, imported on first use (their modules import torch): ``hookfit export``
    is added to the command line through :mod:`hookfit.plugins.checkpoint.command` alone."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = {"Checkpoint": "plugin", "digest": "digests"}.get(name, "storage")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    """The public names with the module's own, those imported on first use included (tab completion)."""
    return sorted({*globals(), *__all__})
