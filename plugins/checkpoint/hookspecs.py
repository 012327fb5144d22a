"""Events of the checkpoint plugin, and the checkpoint role: what a plugin that saves and
resumes runs does, whether it is the built-in ``checkpoint`` or a replacement.

The checkpoint role. The run owns its position; a checkpoint
plugin is policy (when to save, which files to keep) and storage. What it must do, all of it:

* Save: at ``after_batch`` and/or ``after_epoch`` (when its policy says), and from
  a ``tryfirst`` ``fit_end`` after a graceful stop (``loop.state.status == "interrupted"``
  and a ``stop_reason`` other than ``"KeyboardInterrupt"``, which is the abort: a second Ctrl-C,
  or a first one without the interrupter, ended the run mid-batch) and after a run that completed
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
* What a state holds, and a store that is not pickle. ``loop.state_dict()`` is JSON-safe by
  construction where it is the core's (:mod:`hookfit.position`): string keys, numbers,
  strings, booleans, ``None``, lists (never tuples) and dicts of them, and tensors; a store
  that writes the tensors apart (safetensors) and the rest as JSON gives it back exactly. Two
  parts of it are the user's: the data's own ``state_dict()`` (``"data"``) and the step's
  ``loop.carry`` (``"carry"``), which may hold tuples. ``loop.plugin_states()`` is the
  plugins' answers, and torch's own states are not JSON-safe: an optimizer's state dict has
  int keys (``state[0]``), a plugin may answer tuples. ``torch.save``/``torch.load(...,
  weights_only=True)`` keep all of it (the built-in stores so). A store of another format
  keeps what JSON loses, tagging int keys and tuples as it writes and rebuilding them as it
  reads; dropping them silently resumes an optimizer without its state.
* When the data's iterator is made, and who keeps the data's order (:mod:`hookfit.position`):
  ``resume`` (and the ``load_state`` it causes) runs before the first epoch; then, each epoch,
  ``set_epoch(epoch)`` on data that has it, ``epoch_start``, ``stage_start("train")``, and
  only then the iterator (``iter(train_data)``, or ``iter_from(batch)``), before the first
  ``batch_start``. The run rebuilds the order of lists, :class:`hookfit.data.Batches`, and of a
  ``DataLoader`` shuffling with the global generator or with one of its own
  (``generator=``, or a ``RandomSampler``'s): ``loop.state_dict()`` holds those generators'
  states (``rng["data"]``, ``data_rng["data"]``) and puts them back before it makes the
  iterator again. Data with ``state_dict()``/``load_state_dict()`` (torchdata's
  ``StatefulDataLoader``) keeps its own order in ``"data"``: that is how a plugin or a
  script tells the run the order is kept. A ``DataLoader`` with persistent workers whose
  iterator was made at that position is named in ``"persistent_iterators"``: the run makes
  its iterator again as it loads the state, so its next epoch resets it as the run it
  continues did. A resume says, with one warning, "the order of the
  training data's batches cannot be rebuilt" only where it truly cannot (a custom sampler, a
  generator whose state the saved state lacks, an iterable with a generator of its own and no
  ``set_epoch``).
* Name files from ``loop.position`` (:class:`hookfit.position.Position`: ``epoch`` from 0,
  ``step``, ``batch`` done in that epoch, ``stage``, ``val_due``): where a state dict taken
  now resumes. At an epoch's boundary (``after_epoch``) it is the start of the next epoch
  (``epoch`` one more, ``batch`` 0), at the same ``step`` as the epoch's last batch: a save
  there and one after the last batch (``after_batch``) have the same step, and the epoch's
  end is further along (its validation and ``epoch_end`` are done). The built-in names a file
  ``epochNNNN-stepNNNNNNNNN.pt`` with the epoch counted from 1, the one in progress or, at an
  epoch's boundary, the one just completed (``epoch0001-step000000024.pt`` is the end of the
  first epoch of 24 steps), so that users read epochs as everything else of hookfit counts
  them; both saves of that step then share a name, and the built-in writes it once (in a run of one
  process): the last batch's, from which a resume runs the rest of that epoch (its validation and ``epoch_end``)
  first; the epoch's end writes it again only with a score the last batch's lacked. The newest checkpoint of a run is the one whose position is furthest along:
  :meth:`hookfit.position.Position.key` orders positions (the global step, then the epoch,
  then a complete training stage after an open one, then a validation due before the same
  step without one); the built-in's names sort so. A file's time says nothing of that (a
  copy or a restore changes it); the built-in uses times only to order several run folders
  of one identity (the folder written last first); several runs' checkpoints in one folder (each
  run's names carry its tag, ``-vT``) are ordered by the time their newest records (``meta["time"]``).
* Resume: implement ``resume(loop, source)``; choose the file (``source`` is ``"latest"`` or a
  path; ``Loop(resume=...)`` or ``HOOKFIT_RESUME``), load the weights into the model, then
  call ``loop.load_plugin_states(saved_plugins, strict=...)`` and
  ``loop.load_state_dict(saved_run)``, and return the file's path (or ``False`` when there is
  nothing to resume: the run starts afresh). Returning a path without calling
  ``loop.load_state_dict`` is an error. The core then fires ``resumed`` and continues exactly:
  it skips the training batches already done (never twice for data that restores its own
  position), runs first a validation that was due at that step (``val_every_n_steps``), or
  goes straight to the epoch's validation when its training stage was complete.
* ``strict``: ``loop.load_plugin_states(states, strict=True)`` (its default) raises
  :class:`hookfit.StateMismatch` when the saved states do not match the run's plugins (a
  plugin with a state to keep and no saved entry, new to the run; a saved entry no enabled
  plugin restores, a plugin since removed); ``strict=False`` warns once
  (:class:`hookfit.HookfitWarning`, naming them), starts the new ones fresh and restores the
  rest. The built-in passes ``strict=False`` unless ``Checkpoint(strict=True)``: a run
  resumed with a plugin added or removed goes on, with the warning. A replacement chooses
  its own default and says it.
* A run's own checkpoints: ``"latest"`` never crosses to another run. Look in
  ``loop.run_dir`` when ``loop.run_dir_given`` (or the given folder), taking only the checkpoints a run of
  this identity wrote (``loop.identity.key``; the built-in records it in each checkpoint's ``meta``: a
  folder shared by the folds of a k-fold CV holds several names' checkpoints); else in the folders of this run's name,
  ``hookfit.records.RUNS / loop.name / *`` (``runs/<name>/<date>-<time>``), taking only those
  of this run's identity: ``loop.identity`` (:func:`hookfit.records.identify`:
  ``Loop(name=...)``, else the run folder, else the script's or the notebook's path) matches
  a folder when ``loop.identity.matches(hookfit.records.recorded_identity(folder))`` (the
  identity that folder's ``run.jsonl`` records; a script of the same file name in another
  folder is another identity). Of those, the newest checkpoint as above. To go on writing in
  the folder of the run it continues, choose the file at ``configure`` (``tryfirst``, before
  any plugin uses ``loop.run_dir``) and call ``loop.continue_in(folder)`` there. In a fit, call
  ``loop.resumes_apart()`` in ``resume`` when the file is not of the run written last in the folder
  the run's checkpoints go to (an earlier run's checkpoint, given by its path, beside a later
  run's): that folder's records go on from the later run, and the loggers set them aside.
* Evaluations and smoke runs. ``Loop.validate(resume=path_or_latest)`` (``loop.mode ==
  "validate"``) resumes the weights to evaluate them: it reads and restores as above and
  writes nothing (no save, no pruning, no ``continue_in``: it changes nothing there);
  ``after_batch`` and ``after_epoch`` do not fire in it. A smoke run (``loop.smoke``, made by
  the built-in ``smoke`` plugin, whose ``configure`` is a ``tryfirst`` wrapper) has its
  ``resume`` cleared and a temporary run folder placed before any other ``configure`` runs
  (a wrapper runs before every plain implementation, ``tryfirst`` ones included): read
  ``loop.resume`` and ``loop.run_dir`` in ``configure``, never earlier, and keep the smoke
  run's files in ``loop.run_dir`` (a temporary folder), not in a folder of your own.
* Failures: a save that cannot be written (a full disk, a read-only folder) costs that file,
  never the run (the README's promise for every run): keep the files written before whole
  (write to a temporary name, then rename), warn once (``warnings.warn`` with a category of
  your own, naming the file and the error) and let training go on; failing the run instead is
  an option the user chooses (the built-in's ``on_save_error="raise"``). A ``kill -9`` in the
  middle of a write leaves a temporary file: remove it at the next run's start, never read it.
  The built-in counts such saves in ``results`` (``failed_saves``, and ``skipped_saves`` for
  saves a busy writer skipped); a replacement that counts them uses those names.
* Report: answer the core's ``results`` event (after ``fit_end``, on every process) with
  ``"best_checkpoint"``, the path of the best checkpoint by the plugin's monitor (``None``
  without one, or without a finite value of it), and ``"last_checkpoint"``, the newest
  checkpoint of the run (what ``resume="latest"`` would take; ``None`` if there is none); a
  user reads them in ``fit().results`` and evaluates the best with
  ``Loop(..., model=model).validate(resume=state.results["best_checkpoint"])``; after
  ``validate(resume=...)`` the last is the checkpoint evaluated and the best that checkpoint's
  run's best as it knew it, itself included (after ``resume="best"``, both name it; ``None``
  where that best's file is gone and the checkpoint evaluated scored no better). Both are
  known on every process: only the main one writes, but the epoch metrics a monitor compares
  are the same on every rank and a file's name comes from ``loop.position``, so each process
  names the file the main one writes (told once where the main one writes, its run folder
  being one the others would name differently).
* What the rest of hookfit reads from the role: ``checkpoint_saved`` (declared by the
  ``checkpoint`` plugin and always registered) when a file is whole, for the dashboard and for
  plugins that copy checkpoints elsewhere. Nothing else: a replacement that saves and resumes
  as above gives the same bit-for-bit resume as the built-in one.
* Replacing the built-in: name your entry point ``checkpoint`` and declare the replacement
  in your distribution's ``hookfit.replaces`` entry points (``checkpoint = "hookfit"``; see
  :func:`hookfit.discovery.entry_points`): yours then holds the role wherever it sits on
  ``sys.path``, no clash is warned about, and ``hookfit plugins`` shows it with what it
  replaced. Any other distribution registering ``checkpoint`` still warns. Disabling the
  built-in (``HOOKFIT_DISABLE_PLUGINS=checkpoint``) and installing a plugin of another name
  works too.
* ``hookfit export RUN model.pt`` is the built-in's own command: it reads the built-in's
  files. A replacement that has a way to export a model adds its own ``export`` command
  through ``add_commands`` (the built-in, replaced, adds none, so the name is free); without
  one, ``hookfit export`` says that the built-in is replaced (or disabled) and which plugin
  holds the role, and exits with status 2.

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
    ``"max_steps"``, ``"completed"``, ``"failure"``, or ``"best"``: a validation scored the
    weights as the best of the run where no save was due), at global step ``step``.

    Fired by the checkpoint plugin on the training thread, once the write has finished: a
    checkpoint written in the background is announced at the plugin's next save, epoch end,
    checked batch or ``fit_end``, whichever comes first (a sharded one at the next save or
    ``fit_end``), never from the writer thread. A write
    that failed is not announced. For observers (a dashboard marks it on its curve) and for
    plugins that act on finished checkpoints (copy them elsewhere, upload them): they must not
    change or delete ``path``, whose keeping is the checkpoint plugin's. Main process only.
    The return value is ignored.
    """
