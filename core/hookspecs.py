"""The core's events: the loop's own vocabulary, about twenty events, each declared below with
its contract.

What no single event's contract repeats is ``core/loop.md`` (``hookfit/loop.md`` once installed),
the opening of the generated reference ``core/hooks.md``: the loop as pseudocode with where each
event fires and where a pending stop is honoured; one training batch traced (``file:line`` of
every function of hookfit that runs for it, checked by ``tests/integration/test_one_batch.py``);
the ten events a first plugin needs; the events the plugins declare; stopping; the order of
implementations; saving and resuming; firing events; plugin names and observers; and what every
hook may rely on and what none may do. Read it before implementing an event."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Mapping

import pluggy

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    import os

    import torch

    from hookfit.payloads import ResumeInfo, StopRequest
    from hookfit.run import Run

hookspec = pluggy.HookspecMarker("hookfit")


@hookspec
def configure(loop: Run) -> None:
    """The run is about to start: change its set-up here, before any plugin starts.

    Fires once, first of all events, after every plugin is registered and checked. A plugin
    that changes what the run is made of does it here: wrap ``loop.model`` (distributed data
    parallel), replace ``loop.train_data`` or ``loop.val_data`` (sharding), put the objects the
    step function drives into ``loop.optimizers`` (an optimizer plugin), set
    ``loop.state.rank`` and ``loop.state.world_size``, or unregister other plugins
    (``loop.pm.unregister``) that must not run in this process. A plugin unregistered here
    receives no later event of the run, not even ``fit_start`` or ``fit_end`` (it may still
    get this ``configure`` call, which pluggy has already started). The return value is
    ignored. If an implementation raises, the run fails as for ``fit_start``.
    """


@hookspec
def fit_start(loop: Run) -> None:
    """The run begins: ``loop.fit()`` was called and every plugin is registered and valid.

    Fires once, before the first epoch, with ``loop.state.status == "running"``. Plugins set
    up here what they need for the run (signal handlers, screens, files). The return value is
    ignored. If an implementation raises, the run fails: ``exception`` and ``fit_end`` still
    fire, so a plugin must be ready to have ``fit_end`` called after a partial ``fit_start`` or none.
    """


@hookspec
def epoch_start(loop: Run, epoch: int) -> None:
    """An epoch begins. ``epoch`` counts from 0 and equals ``loop.state.epoch``.

    Fires before the training stage of that epoch. The return value is ignored.
    """


@hookspec
def stage_start(loop: Run, stage: str) -> None:
    """A stage of the current epoch begins: ``stage`` is ``"train"`` or ``"valid"``.

    Fires after the model was put in the stage's mode: for ``"valid"`` the model is already in
    eval mode and autograd is off, and ``loop.training`` is False. The return value is ignored.

    Stages nest one deep: with ``Loop(val_every_n_steps=N)`` a ``"valid"`` stage runs inside
    the ``"train"`` stage, between two training batches (``loop.state.val_due`` is true
    throughout it). Its ``stage_start``/``stage_end`` pair fires between the training stage's,
    ``loop.state.stage`` is ``"valid"`` during it and ``"train"`` again after, with no second
    ``stage_start("train")``. A plugin that keeps state per stage keeps the training stage's
    while the validation runs, as it would across any other event.

    A plugin that changes the model for the stage (validates with averaged weights) swaps in
    after the ``yield`` of a ``wrapper=True`` implementation and gives the model back in every
    outcome, nested with any other doing the same: see "Changing the model for a stage" in the
    stated orders, at the top of this reference.

    In the epoch a resumed run continues, the training stage starts where the run stopped:
    ``loop.state.batch_idx`` is the first batch it will run (the batches before it are done,
    ``loop.position.batch`` of them) and ``loop.state.step`` counts the steps already done; a
    run resumed after that epoch's training stage ends starts at its ``"valid"`` stage.
    """


@hookspec
def batch_start(loop: Run, batch: Any, batch_idx: int) -> None:
    """A batch is about to be given to the step function.

    ``batch`` is the object the data yielded; ``batch_idx`` its position in the current stage
    of the current epoch (also ``loop.state.batch_idx``). Fires for training and validation
    batches alike; ``loop.training`` tells which. This is the per-batch hot path: keep it
    cheap. The return value is ignored; a plugin must not replace or keep the batch.
    """


@hookspec
def step_output(loop: Run, output: Mapping[str, Any], batch: Any) -> None:
    """The step function returned something to report.

    ``output`` is the step's return value as a mapping: a mapping is passed on unchanged (no
    ``"loss"`` key is required), a tensor arrives as ``{"loss": tensor}``. With several
    validation sets (``Loop(val_data={name: data})``) each key of a validation output arrives
    prefixed with its set's name (``noisy/loss``; ``batch_size`` stays as it is), and
    ``loop.state.val_set`` names the set: so per-set metrics stay apart. Not fired when the
    step returned ``None`` (a skipped batch). Fires after the step and before ``batch_end``.
    Plugins read the output here (metrics aggregation); they must not keep it after the call,
    and must not mutate it (a plugin publishes a number of its own with the metrics role's
    ``metrics_values``). A training step's loss is still part of the autograd graph: read it
    as ``float(output["loss"].detach())`` (``float()`` of a tensor that requires grad warns).
    ``loop.state.step`` does not count this batch yet (``batch_end`` sees it counted). The
    return value is ignored.
    """


@hookspec
def batch_end(loop: Run, output: Mapping[str, Any] | None, batch: Any, batch_idx: int) -> None:
    """A batch is finished.

    Fires after every batch of every stage (training, validation, prediction), including
    skipped ones, where ``output`` is ``None``. For a training batch ``loop.state.step``
    already counts it; during a validation it stays at the step the validation follows, so a
    plugin acting every N training steps tests ``loop.training`` first. The return value is
    ignored.
    """


@hookspec
def after_batch(loop: Run, batch_idx: int) -> None:
    """After everything else of training batch ``batch_idx``: the moment to save the run.

    Fired by the core after the batch's ``batch_end`` (training stage only), before
    ``should_stop``, the stop boundary and a validation due at this step.
    ``loop.state_dict()`` already counts the batch as done: a run resumed from a checkpoint
    saved here continues with the next batch, running first the validation due here, if any.
    Modelled on Composer's ``BATCH_CHECKPOINT``: a plugin that saves the run's state saves
    here, never from a ``trylast`` ``batch_end``. The return value is ignored.
    """


@hookspec
def should_stop(loop: Run) -> bool | str | StopRequest | None:
    """Asked after every batch, training and validation alike: should the run stop now?

    For plugins with a per-batch criterion of their own (a time budget checked per batch, a
    loss threshold). Return a true value to stop the run after this batch; a string is taken as
    the reason; a :class:`~hookfit.payloads.StopRequest` as the whole request, so a rule that
    ends the run by design answers ``StopRequest("loss under 0.01", complete=True)`` and the
    run ends ``"completed"`` (``by`` may be left ``None``: the plugin is named). Every
    implementation is asked (this is not first-result); the true answers become one stop
    request, as ``loop.request_stop(reason)`` would, naming the plugins that answered as who
    asked, ``complete`` only if every answer was. ``None`` or a false value means "carry on".
    A plugin that decides at another moment (an epoch's end) calls ``loop.request_stop(reason)``
    there instead: the loop honours it at that boundary, without a further batch, and one that
    ends the run by its rule (early stopping) passes ``complete=True``. The run then ends with status ``"interrupted"``
    (``"completed"`` for a ``complete`` request): ``stage_end`` and ``epoch_end`` are *not*
    fired for a cut-short epoch, ``fit_end`` is. A stop is not part of ``loop.state_dict()``: a
    rule whose stop must hold in a run resumed from the last checkpoint keeps its decision in its
    ``save_state`` and asks again as the resumed run begins (the built-in ``early_stopping`` does at
    ``epoch_start``).
    """


@hookspec
def stop_requested(loop: Run, request: StopRequest) -> None:
    """A graceful stop was requested: ``request`` says why and who asked.

    Fires once per run, for the first request, on the thread that asked: through
    ``loop.request_stop(reason)`` (any plugin, the step function, another thread: a
    dashboard's key, a signal handler) or a true ``should_stop`` answer. The loop stops at its
    next boundary (see the module documentation); this event only tells plugins that it will
    (a renderer shows "stopping"). Implementations must be quick and thread-safe. An error of
    one is never the asker's when the asker is another thread: an observer's switches it off as
    always; a participant's (the first) fails the run at that next boundary, its plugin named,
    and the asking thread gets its request. The return value is ignored.
    """


@hookspec(firstresult=True)
def agree_stop(loop: Run, request: StopRequest | None, boundary: str) -> StopRequest | Literal[False] | None:
    """Asked at every boundary where the loop may stop, when a plugin implements it: do the
    processes of the run agree to stop here?

    For the plugin that runs the loop on several processes, whose processes must stop at the
    same boundary (or their collective operations would not match). ``request`` is this
    process's pending stop request, ``None`` if there is none; ``boundary`` is where the loop
    is: ``"start"``, ``"epoch_start"``, ``"stage_start"``, ``"batch"``, ``"batches_end"`` (a
    validation's, after its last batch, before its ``stage_end``), ``"stage_end"`` or
    ``"epoch_end"``. Every process reaches the same boundaries in the same order, with one
    exception: the ``"batch"`` boundaries of a validation stage (``loop.training`` is False),
    where processes may run different numbers of batches (each validates its own part of the
    data, every sample exactly once). There, and at its ``"batches_end"``, a collective
    operation is possible only once every process is known to be at one of them: the processes
    decide, without one, whether the validation stops (then every process takes the collective
    at the first of those boundaries where it knows of the decision: a process with no request
    of its own may look for it only every few batches, as the plugin's options say, and at the
    latest at its ``"batches_end"``) or runs to its end (then none takes it there, and a request
    waits for ``"stage_end"``). A stop inside a validation resumes at its start. Return
    the agreed :class:`~hookfit.payloads.StopRequest` to stop every process here, ``False`` to
    carry on (a pending request then waits for a later boundary), or ``None`` to leave the
    decision to this process's own request. First result.
    """


@hookspec
def stage_end(loop: Run, stage: str) -> None:
    """A stage of the current epoch has run all its batches: ``stage`` as in ``stage_start``.

    For ``"valid"`` it fires while the model is still in eval mode; every module gets its own
    previous training flag back right after. Not fired for a stage cut short by a stop or an
    error: a plugin that changed the model for the stage gives it back here, before the
    ``yield`` of a ``wrapper=True`` implementation, and also in a ``wrapper=True`` ``fit_end``
    and in ``exception`` (see "Changing the model for a stage"). Order is stated: a plugin
    that finishes the stage's work (an optimizer plugin stepping the last, partial accumulation
    window) implements it ``tryfirst``; a plugin that reports on the finished stage (a metrics
    plugin, which fires ``epoch_metrics`` from here) implements it ``trylast``. The return
    value is ignored.

    ``loop.state.time_split[stage]`` (:class:`~hookfit.payloads.TimeSplit`) counts the stage's
    batches, summed over this ``fit()``'s epochs: seconds waiting for data, in the step and in
    plugins (this event's own time is added after it).
    """


@hookspec
def epoch_end(loop: Run, epoch: int) -> None:
    """An epoch, with its validation if any, is complete. ``epoch`` as in ``epoch_start``.

    Not fired for an epoch cut short by a stop or an error. The return value is ignored.
    """


@hookspec
def after_epoch(loop: Run, epoch: int) -> None:
    """After everything else of epoch ``epoch``: the moment to save the run at an epoch's end.

    Fired by the core after ``epoch_end`` has run to its end (its validation included), before
    the stop boundary that follows it. ``loop.state_dict()`` already points at the start of
    the next epoch. Modelled on Composer's ``EPOCH_CHECKPOINT``: a plugin that saves the run's
    state saves here, never from a ``trylast`` ``epoch_end``. The return value is ignored.
    """


@hookspec
def exception(loop: Run, error: BaseException) -> None:
    """The run failed: ``error`` was raised by the step function, the data or a plugin.

    Fires once, before ``fit_end``, with ``loop.state.status == "failed"``. The exception then
    propagates unchanged to the caller of ``fit()``, with a note naming where it came from. A
    note an implementation adds (``error.add_note``: what it knows of the cause, such as the
    rank of a distributed run that failed first) is part of ``loop.state.stop_reason`` too.
    An implementation must not raise; if one does, its error is reported as a warning and the
    original error still propagates. Every implementation runs even if another raised,
    wrappers and call tracing included. A plugin that changed the model for the stage that
    failed gives it back here (no ``stage_end`` fires; see "Changing the model for a stage").
    The return value is ignored.
    """


@hookspec
def fit_end(loop: Run) -> None:
    """The run is over. Fires exactly once for every run that fired ``configure``, one that failed
    before ``fit_start`` too (a refused ``batch_events`` answer): release only what was set up.

    ``loop.state.status`` is ``"completed"``, ``"interrupted"`` or ``"failed"`` (an error raised here
    or in ``results`` fails the run after it: ``fit()`` raises, ``run.jsonl``'s end line says failed),
    ``loop.state.stop_reason`` says why and ``loop.state.stopped_by`` who asked for a stop;
    ``loop.state.time_split`` says where each stage's time went (data, step, plugins), stages
    cut short included. This is where plugins restore what they changed (terminal, signal
    handlers) and write final summaries; a model changed for a stage that a stop or an error cut
    short is given back before the ``yield`` of a ``wrapper=True`` implementation, as the
    checkpoint role saves from a ``tryfirst`` one (see "Changing the model for a stage").
    Every implementation runs even if another raised, wrappers and call tracing included; the
    first such error fails the run (or is reported as a warning if the run failed already),
    naming the plugin. An observer switched off during the run (one of its other hooks raised)
    still gets it, after the others, so that it can release what it holds (a thread, a file, a
    tracker's run); its error here is one more :class:`hookfit.ObserverWarning`. Return ignored.

    After a stop or a failure ``loop.state.epoch`` and ``loop.state.step`` are where the run
    was (``loop.state.stage`` is ``None``), and ``loop.position`` says where a run resumed from
    a state dict taken now continues (inside the epoch, after its last whole batch). The run's
    folder gets ``run.jsonl``'s end line after every ``fit_end`` implementation ran, if the
    run has a folder: one is made the first time a plugin reads ``loop.run_dir``.
    """


@hookspec
def results(loop: Run) -> Mapping[str, Any] | None:
    """The run is over: return what this plugin reports about it (``{"best_checkpoint": path}``), or ``None``.

    Asked once on every process, right after ``fit_end``, in every outcome (completed, stopped, failed: then
    with what is known of the part that ran, and the run's error propagates after it), ``Loop.validate()``
    too. The answers are merged into ``loop.state.results`` (read-only), which ``fit()`` and ``validate()``
    return; the core reads none of it. Two plugins answering one key, or an answer that is not a mapping with
    string keys, fail the run naming the plugins (a warning if it failed already). Every implementation is
    asked even if one raised; the first error fails the run. Off rank 0 of a distributed run the observers
    do not answer. Built in: ``"metrics"``, ``"best"`` (metrics), ``"best_checkpoint"``, ``"last_checkpoint"``,
    ``"failed_saves"``, ``"skipped_saves"`` (checkpoint).
    """


# -- state of a run: checkpoints and resume ---------------------------------------------------


@hookspec
def save_state(loop: Run) -> Any:
    """Return this plugin's state, to be stored in a checkpoint; ``None`` if it has none now.

    A checkpoint plugin calls every implementation through ``loop.plugin_states()``, which keys each answer by
    the name of the plugin that gave it, so a third-party plugin's state is saved without the checkpoint plugin
    knowing it. Return plain data (tensors, numbers, strings, lists, dicts): a checkpoint is read back with
    ``torch.load(weights_only=True)``, so arbitrary objects cannot be restored. Tuples and non-string keys (an
    optimizer's state dict has int keys) survive ``torch.save``; a checkpoint store of another format (JSON)
    keeps them as the checkpoint role says (under the ``checkpoint`` plugin's events). The state must be a snapshot:
    later training must not change what was returned (copy tensors that training updates in place). Everything a
    resumed run needs to continue as if never stopped belongs here: an optimizer plugin saves the gradients of
    an open accumulation window (a model's state dict holds none). Called on the training thread between
    batches.

    A checkpoint stores three things: the model's state, every plugin's state (this event, through
    ``loop.plugin_states()``) and the run's own, ``loop.state_dict()`` (its position, random state and the
    data's state), which ``resume`` gives back with ``loop.load_state_dict(saved)``.

    Sharded tensors (``DTensor``: under FSDP2 the parameters, their gradients and optimizer states) may be
    returned as they are, on every process: a checkpoint plugin writes each process's shards with
    ``torch.distributed.checkpoint`` and, at resume, gives back a ``DTensor`` with the same placements on the
    device mesh of the run's model (resharded when the number of processes changed), or a whole tensor in a run
    without a mesh. So such a state is asked for on every process, not only the main one.
    """


@hookspec
def load_state(loop: Run, state: Any) -> None:
    """Restore what this plugin's ``save_state`` returned in an earlier run.

    Called through ``loop.load_plugin_states(states)``, with this plugin's own entry, after
    ``fit_start`` of the resumed run and before its first epoch. A plugin that cannot use
    ``state`` raises an error that says why. The return value is ignored.
    """


@hookspec(firstresult=True)
def resume(loop: Run, source: str) -> str | os.PathLike[str] | Literal[False] | None:
    """``Loop(resume=source)``: continue an earlier run. ``source`` is ``"latest"``, a path, or a name
    the checkpoint plugin gives a meaning (the built-in's ``"best"``, for ``Loop.validate()``).

    Fires once, after ``fit_start`` and before the first epoch. The plugin that keeps
    checkpoints chooses and reads its checkpoint, restores the model and the plugins' states
    (``loop.load_plugin_states(states)``), and gives the run its own saved position back with
    ``loop.load_state_dict(saved)``, where ``saved`` is what ``loop.state_dict()`` returned
    when it saved (a mapping of plain data and tensors: the position, the random state, the
    data's own state). It writes nothing of ``loop.state`` itself; it calls ``loop.resumes_apart()`` when the
    checkpoint is not the one the records in the run's folder go on from (``loop.state.continues``). The whole of what a
    checkpoint plugin does (``strict``, which checkpoint is newest and a run's own, evaluations
    and smoke runs) is the checkpoint role, under the ``checkpoint`` plugin's events. The core then fires
    ``resumed`` and starts where the run was: it skips the training batches of the epoch
    already done (data with an ``iter_from(start)`` method starts there without producing the
    earlier ones; nothing is skipped for data that restores its own position through
    ``state_dict``/``load_state_dict``, such as torchdata's ``StatefulDataLoader``), runs first
    a validation that was due and had not run to its end, or goes straight to the epoch's
    validation when its training stage was complete. The implementation returns what it
    resumed from (a path), or ``False`` when there was nothing to resume from and the run
    starts afresh; a true answer without ``loop.load_state_dict`` fails the run. First result;
    the run fails with a clear error when no enabled plugin implements this event.
    """


@hookspec
def resumed(loop: Run, info: ResumeInfo) -> None:
    """The run resumed: ``info`` (:class:`~hookfit.payloads.ResumeInfo`) says from what (the
    checkpoint file) and where it continues (epoch, step, training batches already done).

    Fired by the core once a ``resume`` implementation returned what it resumed from and the
    run's position was given back, before the first epoch; also kept in
    ``loop.state.resumed_from``, and ``loop.state.continues`` says whether the run continues the records in its
    folder (a logger appends to them) or sets them aside (``loop.resumes_apart()``). Renderers and loggers say it (the console prints it, the
    dashboard shows it, the metrics log records it), so a user always knows which run and
    which point a run continued from. The return value is ignored.
    """


# -- the backward pass (loop.backward; the optimizer steps are the optim plugin's events) -----


@hookspec(firstresult=True)
def backward(loop: Run, loss: torch.Tensor) -> Any:
    """``loop.backward(loss)`` was called from a step function: run the backward pass.

    First result: the first implementation that returns something other than ``None`` has
    handled it and no other is called (so a replacement plugin can take over with
    ``tryfirst``). ``loop.backward`` fails with an error naming the disabled plugins when no
    enabled plugin implements this event. An implementation must not read ``loss`` on the host
    when it is on an accelerator (``item()``, ``bool()``...): that waits for the device at every
    step. The built-in ``optim`` keeps its non-finite check on the device there and acts on it
    at the next host read (see ``hookfit.plugins.optim.Optim``).
    """
