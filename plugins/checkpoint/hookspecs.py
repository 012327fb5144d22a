"""Events of the checkpoint plugin, and the checkpoint role: what a plugin that saves and
resumes runs does, whether it is the built-in ``checkpoint`` or a replacement.

The checkpoint role. The run owns its position; a checkpoint
plugin is policy (when to save, which files to keep) and storage. What it must do, all of it:

* Save: at ``after_batch`` and/or ``after_epoch`` (when its policy says), and from
  a ``tryfirst`` ``fit_end`` after a graceful stop (``loop.state.status == "interrupted"``
  and a ``stop_reason`` other than ``"KeyboardInterrupt"``) and after a run that completed
  inside an epoch's training stage (``max_steps``, or a rule such as early stopping:
  ``loop.position.stage == "train"`` and ``loop.position.batch > 0``), which a longer run
  continues. A save stores three things: ``loop.state_dict()`` (the run's position, random
  state and the data's own states: plain data and tensors, to store whole and untouched),
  the model's weights (``loop.model``: a module, or a mapping or list of modules; unwrap
  ``module.module`` of a ``DistributedDataParallel``, ``_orig_mod`` of a compiled model:
  :func:`hookfit.plugins.support.unwrap_model`) and ``loop.plugin_states()`` (every plugin's
  ``save_state``, keyed by plugin name; an optimizer plugin keeps the optimizers' states
  there). A state dict taken at any moment is consistent: inside a validation it describes
  the moment that validation began. Take copies of tensors before writing in the background
  (training goes on changing them). With several processes, call ``loop.state_dict()`` and
  ``loop.plugin_states()`` on every process (a plugin's ``save_state`` may run collectives
  or answer its own shards) and write from the main process (``loop.is_main``), except for
  sharded tensors, which every process writes (``torch.distributed.checkpoint``).
* Name files from ``loop.position`` (:class:`hookfit.position.Position`: ``epoch`` from 0,
  ``step``, ``batch`` done in that epoch, ``stage``, ``val_due``): where a state dict taken
  now resumes. After ``epoch_end`` it points at the start of the next epoch.
* Resume: implement ``resume(loop, source)``; choose the file (``source`` is ``"latest"`` or a
  path; ``Loop(resume=...)`` or ``HOOKFIT_RESUME``), load the weights into the model, then
  call ``loop.load_plugin_states(saved_plugins)`` and ``loop.load_state_dict(saved_run)``,
  and return the file's path (or ``False`` when there is nothing to resume: the run starts
  afresh). Returning a path without calling ``loop.load_state_dict`` is an error. The core
  then fires ``resumed`` and continues exactly: it skips the training batches already done
  (never twice for data that restores its own position), runs first a validation that was due
  at that step (``val_every_n_steps``), or goes straight to the epoch's validation when its
  training stage was complete. ``"latest"`` never crosses to another run: look in
  ``loop.run_dir`` when ``loop.run_dir_given``, else in the folders of this run's name,
  ``hookfit.records.RUNS / loop.name / *`` (``runs/<name>/<date>-<time>``), newest first. To
  go on writing in the folder of the run it continues, choose the file at ``configure``
  (``tryfirst``, before any plugin uses ``loop.run_dir``) and call
  ``loop.continue_in(folder)`` there.
* Report: answer the core's ``results`` event (after ``fit_end``, on every process) with
  ``"best_checkpoint"``, the path of the best checkpoint by the plugin's monitor (``None``
  without one, or without a finite value of it), and ``"last_checkpoint"``, the newest
  checkpoint of the run (what ``resume="latest"`` would take; ``None`` if there is none); a
  user reads them in ``fit().results`` and evaluates the best with
  ``Loop(..., model=model).validate(resume=state.results["best_checkpoint"])``. Both are
  known on every process: only the main one writes, but the epoch metrics a monitor compares
  are the same on every rank and a file's name comes from ``loop.position``, so each process
  names the file the main one writes (told once where the main one writes, its run folder
  being one the others would name differently).
* What the rest of hookfit reads from the role: ``checkpoint_saved`` (declared by the
  ``checkpoint`` plugin and always registered) when a file is whole, for the dashboard and for
  plugins that copy checkpoints elsewhere. Nothing else: a replacement that saves and resumes
  as above gives the same bit-for-bit resume as the built-in one. Replace the built-in by
  disabling it (``HOOKFIT_DISABLE_PLUGINS=checkpoint``) or by naming your entry point
  ``checkpoint``.

``checkpoint_saved`` is declared by :class:`hookfit.plugins.checkpoint.Checkpoint` (its
``hookspecs`` attribute) and added to every run whether ``checkpoint`` is enabled, disabled or
replaced, so a checkpoint plugin of another package announces its checkpoints to the same
listeners.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hookfit import hookspec

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run


@hookspec
def checkpoint_saved(loop: Run, path: str, reason: str, step: int) -> None:
    """A checkpoint of the run is complete on disk: ``path`` (a file, or a sharded
    checkpoint's folder), written for ``reason`` (``"epoch"``, ``"step"``, ``"interrupt"``,
    ``"max_steps"``, ``"completed"``, ``"failure"``), at global step ``step``.

    Fired by the checkpoint plugin on the training thread, once the write has finished: a
    checkpoint written in the background is announced at the plugin's next save, epoch end,
    checked batch or ``fit_end``, whichever comes first, never from the writer thread. A write
    that failed is not announced. For observers (a dashboard marks it on its curve) and for
    plugins that act on finished checkpoints (copy them elsewhere, upload them): they must not
    change or delete ``path``, whose keeping is the checkpoint plugin's. Main process only.
    The return value is ignored.
    """
