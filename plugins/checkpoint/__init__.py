"""checkpoint: atomic checkpoints of the whole run, and exact resume.

What a checkpoint holds (format ``hookfit-checkpoint``, version :data:`FORMAT_VERSION`): the
model's state dict, every plugin's state through the ``save_state`` event keyed by plugin name
(the optim plugin's optimizers, schedulers, scaler and counters; the metrics plugin's history;
any third-party plugin's), the loop's position (epoch, global step, training batches of the
epoch already done), the random number generators (Python, NumPy when installed, torch CPU and
CUDA) and the state of data that has ``state_dict()`` (:class:`hookfit.data.Batches`). Only
plain data and tensors: it is read back with ``torch.load(weights_only=True)``, so loading a
checkpoint never runs code from the file.

When: every ``every_n_epochs`` epochs (default 1), every ``every_n_steps`` training steps,
every ``every_seconds`` seconds (checked after each training batch), when the run stops
gracefully (``on_interrupt``, default on: a stop request, SIGINT or SIGTERM through the
interrupter) and, if asked, when it fails (``on_failure``: a ``failed-*.pt`` file, never
chosen by ``"latest"``, since the failing batch may be half done). The last ``keep_last``
checkpoints are kept, plus the best one by ``monitor`` (``"valid/loss"``: the epoch mean of
``loss`` in the validation stage, published by the metrics plugin) when set.

Atomic: each file is written to a temporary file in the same folder, flushed, fsynced, renamed
over its final name, and the folder is fsynced. A process killed at any moment leaves the
previous checkpoint or the new one, never a torn one. With ``background=True`` (default) the
loop is blocked only while the state is copied; the file is written by a thread, one at a
time, and ``fit_end`` waits for the last one.

Resume: ``Loop(resume="latest" | path)`` (or ``HOOKFIT_RESUME``). ``"latest"`` is the newest
checkpoint in ``dir``, or, when no folder was given, in ``<run_dir>/checkpoints`` if the run
has a fixed ``run_dir``, else in the newest ``runs/*/checkpoints``; with none, the run starts
afresh. A file that is torn or not a hookfit checkpoint is an error naming it;
``fallback=True`` warns and takes the next newest instead. Plugin states that do not match
the run fail the resume (``strict=True``) or are warned about (``strict=False``).

Failed saves (full disk, read-only folder): ``on_save_error="warn"`` (default) warns once per
kind of error with a :class:`CheckpointWarning`, counts them in ``failed_saves`` and keeps the
previous checkpoints; ``"raise"`` fails the run. With several processes only the main process
(rank 0) writes; every process loads.
"""

from __future__ import annotations

from hookfit.plugins.checkpoint.plugin import Checkpoint, CheckpointWarning
from hookfit.plugins.checkpoint.storage import FORMAT, FORMAT_VERSION, SUFFIX, CheckpointError, atomic_save, read

__all__ = [
    "FORMAT", "FORMAT_VERSION", "SUFFIX", "Checkpoint", "CheckpointError", "CheckpointWarning", "atomic_save", "read",
]
