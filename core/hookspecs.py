"""The core's events: the loop's own vocabulary, about twenty events.

The loop, as the core runs it, and where each event fires (``boundary``: where a pending stop
is honoured, see below)::

    configure                                   # plugins change the run's set-up
    fit_start
    if Loop(resume=source):
        resume(source)                          # a plugin reads its checkpoint: the model, the
                                                # plugins' states, loop.load_state_dict(saved)
        resumed(info)                           # the run then starts where it was saved
    boundary "start"
    for epoch in range(epoch, max_epochs):      # from the epoch a resumed run continues in
        epoch_start(epoch);  boundary
        stage_start("train");  boundary
        for batch_idx, batch in train_data:     # after the batches a resumed run already did
            batch_start(batch, batch_idx)
            output = train_step(loop, batch)    # loop.backward(loss) fires backward (optim's
                                                # before/after_backward around it), and
                                                # loop.optimizers.step() optim's
                                                # before/after_optimizer_step
            step_output(output, batch)          # unless the step returned None
            batch_end(output, batch, batch_idx) # loop.state.step counts the batch; the metrics
                                                # plugin publishes metrics_update from here
            after_batch(batch_idx)         # after everything else of the batch: save here
            should_stop;  boundary
            [a validation due (val_every_n_steps): the "valid" stage below, nested here]
            [max_steps reached inside the epoch: the run ends here, completed]
        stage_end("train");  boundary           # metrics: epoch_metrics from a trylast stage_end
        if validation this epoch (val_every_n_epochs):
            stage_start("valid");  boundary     # eval mode, no autograd
            for batch_idx, batch in val_data:
                batch_start, val_step, step_output, batch_end, should_stop;  boundary
            stage_end("valid");  boundary
        epoch_end(epoch)
        after_epoch(epoch)                 # after everything else of the epoch: save here
        boundary "epoch_end"
    exception(error)                            # only when the run failed
    fit_end                                     # exactly once, whatever happened
    results                                     # each plugin's report: loop.state.results

One training batch, traced: everything of hookfit's that runs for a training batch with the default
plugins, in a step that calls ``loop.backward(loss)``, ``loop.optimizers.step()`` and
``loop.optimizers.zero_grad()`` (the second epoch, a batch that publishes no metrics; ``file:line`` is
where each function's definition starts, its decorators included;
``tests/integration/test_one_batch.py`` checks that exactly these run)::

    core/training.py:248              run_stage                 the loop's body: the lists of batch_start, step_output,
                                                                batch_end and after_batch (empty ones cost a loop test)
    core/run.py:223                   Run.backward              loop.backward(loss): the backward event's handler list
    plugins/optim/plugin.py:167       Optim.backward            the loss checked, divided for its window, back-propagated
    plugins/optim/checks.py:42        HostCheck.admits          the non-finite check chosen at configure (a CPU loss)
    plugins/optim/managed.py:327      Optimizers.step           loop.optimizers.step(): each managed optimizer
    plugins/optim/managed.py:81       ManagedOptimizer.step     steps unless its window is open
    plugins/optim/managed.py:122      ManagedOptimizer._step    the torch optimizer's step, clipping and scaling around it
    plugins/optim/managed.py:331      Optimizers.zero_grad      loop.optimizers.zero_grad(): each managed optimizer
    plugins/optim/managed.py:89       ManagedOptimizer.zero_grad  unless its window is open
    plugins/metrics/plugin.py:101     Metrics.batch_end         the output's numbers added to the running sums

Besides: ``stop_requested`` fires once, on the thread that asked, when a stop is first asked; ``agree_stop``
is asked at every boundary when a plugin runs several processes; ``save_state``/``load_state`` are called by
a checkpoint plugin (``loop.plugin_states()``, ``loop.load_plugin_states(states)``); the ``hookfit`` command's
one event, ``add_commands``, outside any run, is the command line's (:mod:`hookfit.tools.hookspecs`).

The ten events a first plugin needs:

* ``fit_start(loop)``: the run begins; open what the plugin needs (a file, a screen).
* ``epoch_start(loop, epoch)``: an epoch begins (``epoch`` counts from 0).
* ``stage_start(loop, stage)``: the ``"train"`` or ``"valid"`` stage of the epoch begins.
* ``batch_start(loop, batch, batch_idx)``: a batch is about to go to the step function.
* ``step_output(loop, output, batch)``: what the step returned, as a mapping; read, never keep.
* ``batch_end(loop, output, batch, batch_idx)``: the batch is done (``output`` ``None`` if skipped).
* ``should_stop(loop)``: return a reason to stop the run after this batch.
* ``stage_end(loop, stage)``: the stage ran all its batches.
* ``epoch_end(loop, epoch)``: the epoch, its validation included, is complete.
* ``fit_end(loop)``: the run is over, whatever happened (``loop.state.status``); clean up here.

Then, as a plugin grows: ``epoch_metrics``/``metrics_update`` (the metrics plugin's aggregated values, for
loggers), ``save_state``/``load_state`` (a plugin whose state checkpoints keep),
``after_batch``/``after_epoch`` (a plugin that saves the run).

Plugins implement events with the :data:`hookfit.hookimpl` marker; an implementation may accept any subset
of the arguments a spec names, in any order, and pluggy passes it only those. (On the per-batch path, an
implementation that accepts every argument in the spec's order is called directly; one that accepts fewer
goes through a small adapter: one Python call more per batch.) Every event's ``loop`` argument is the
:class:`hookfit.run.Run` of the current ``fit()``: the run's state, model, optimizers and data, its plugin
manager and its resolved events. Payloads that travel between plugins are core types from
:mod:`hookfit.payloads` (:class:`~hookfit.payloads.MetricsSnapshot`,
:class:`~hookfit.payloads.StopRequest`), so a plugin from one package can replace a built-in and still be
understood by the others.

Events of the plugins: this module declares only the loop's own events. An event that a plugin fires or
answers is declared by that plugin (as pytest's ``pytest_addhooks`` lets plugins do): a ``hookspecs``
attribute on the plugin names a class or module whose functions are marked with ``@hookfit.hookspec``. The
built-in plugins declare theirs this way (optim: the backward pass and optimizer steps and
``should_sync_gradients``; metrics: ``metrics_update`` and ``epoch_metrics``; checkpoint:
``checkpoint_saved``; distributed: ``all_reduce``; tui: ``claim_output``), documented below under each
plugin. The declarations of every built-in plugin are added to every run before any plugin is registered,
whether that plugin is enabled, disabled, replaced by a plugin of the same name given to ``Loop`` or
shadowed by another package's entry point of that name; so a replacement fires the events of the built-in it
replaces (``loop.hooks.metrics_update``) and their consumers still hear them. Any other plugin's
declarations are added while it is enabled (a disabled plugin is never imported); a plugin given to ``Loop``
may declare events too. A consumer of events that a plugin not always installed declares marks its
implementation ``@hookfit.hookimpl(optionalhook=True)``, so that it keeps working without it.

Stopping is the core's: ``loop.request_stop(reason)`` (any thread, any hook, the step) or a true
``should_stop`` answer records a :class:`~hookfit.payloads.StopRequest`, and the loop honours it at the next
*boundary*: after ``resume`` (before the first epoch), after ``epoch_start``, ``stage_start``, every batch
(after ``should_stop``), ``stage_end`` and ``epoch_end`` (after ``after_epoch``). So a stop asked in
``epoch_end`` runs no further batch. Events of the part of the run that did not happen are not fired (a stop
after a batch fires no ``stage_end`` or ``epoch_end`` for that epoch); ``fit_end`` always fires. A run that
reaches ``max_steps`` inside an epoch ends the same way (status ``"completed"``): the rest of that epoch,
its ``stage_end``, validation and ``epoch_end`` belong to a longer run, which resuming with a larger
``max_steps`` continues exactly. With several processes a plugin implementing ``agree_stop`` makes them stop
at the same boundary.

Order of implementations of one event follows pluggy: the plugin registered last is called first,
``tryfirst``/``trylast`` move an implementation to the front or back, and wrappers surround the rest.
Plugins are registered in a fixed order (sorted by entry-point name, then those given to ``Loop``; see
:mod:`hookfit.manager`), but no plugin may rely on that order: where order matters it is stated below, with
``tryfirst``/``trylast`` or by an event that fires at the right moment. The stated orders are:

* ``configure``: a plugin that changes what the run is made of (starts processes, wraps the model,
  unregisters plugins) is ``tryfirst``, so the others configure what is left.
* ``stage_end``: plugins that finish the stage's work (an optimizer plugin stepping a last, partial
  accumulation window) are ``tryfirst``; plugins that report on the finished stage (a metrics plugin
  publishing ``epoch_metrics``) are ``trylast``, so reports see the finished work.
* Saving the run: a plugin that saves the run's state (checkpoints) saves in ``after_batch`` and
  ``after_epoch``, events that fire after every plugin took the batch or the epoch into account (never
  from a ``trylast`` ``batch_end``/``epoch_end``), and from a ``tryfirst`` ``fit_end`` (before any plugin
  lets go of its state).

Saving and resuming a run: the run owns its position (``loop.state_dict()``, ``loop.load_state_dict()``,
``loop.position``); what a checkpoint plugin must do, all of it, is the checkpoint role, under the
``checkpoint`` plugin's events below.

Firing events: through ``loop.hooks.<event>`` (:class:`hookfit.dispatch.Dispatch`), a callable taking the
spec's arguments in order, or ``None`` when nothing implements the event (resolved once per run).
``loop.pm.hook.<event>(...)`` is pluggy's bare call, without hookfit's guarantees (an observer's error is
not contained there).

Plugins are named by their entry point (discovered plugins) or their ``name`` attribute (plugins given to
``Loop``, where one replaces the discovered plugin of the same name); that name keys their state in
checkpoints and names them in messages and in ``loop.state.stopped_by``. Two distributions registering one
entry-point name clash (a warning names both; the first on ``sys.path`` is used), unless one declares that
it replaces the other's plugin in its ``hookfit.replaces`` entry points (``checkpoint = "hookfit"`` for the
built-in checkpoint): that one is used, without a warning, and ``hookfit plugins`` says what it replaced
(see :func:`hookfit.discovery.entry_points`). A plugin whose class says
``observer = True`` only watches the run (renderers, loggers): if one of its implementations raises, it is
switched off for the rest of the run with one warning instead of failing it. Every other plugin takes part
in training, and its errors fail the run.

What every hook may rely on: ``loop.state`` is up to date when the event fires (epoch, step, batch index,
stage, status). ``loop.optimizers`` is what ``Loop(optimizers=...)`` was given (a ``torch.optim.Optimizer``,
or a mapping of names to them) or, from ``fit_start`` on, what an optimizer plugin put there at
``configure``: for one optimizer an object with ``step()``, ``zero_grad()`` and ``param_groups``, for
several a mapping of names to such objects. Step functions call ``loop.optimizers.step()`` and
``zero_grad()`` every batch; inside a gradient-accumulation window an optimizer plugin makes them wait for
the window's end. A single optimizer is named ``"default"`` wherever optimizers are named (learning rates,
checkpoints); plugins that report learning rates read ``param_groups[0]["lr"]``. What no hook may do: keep
step outputs or batches beyond the event (the core promises flat memory), or register and unregister plugins
from another thread while a run is in progress. """

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
    fire, so a plugin must be ready to have ``fit_end`` called after a partial ``fit_start``.
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
    and must not mutate it. The return value is ignored.
    """


@hookspec
def batch_end(loop: Run, output: Mapping[str, Any] | None, batch: Any, batch_idx: int) -> None:
    """A batch is finished.

    Fires after every batch, including skipped ones, where ``output`` is ``None``. For a
    training batch ``loop.state.step`` already counts it. The return value is ignored.
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
def should_stop(loop: Run) -> bool | str | None:
    """Asked after every batch, training and validation alike: should the run stop now?

    For plugins with a per-batch criterion of their own (a time budget checked per batch, a
    loss threshold). Return a true value to stop the run after this batch; a string is taken as
    the reason. Every implementation is asked (this is not first-result); the true answers
    become one stop request, as ``loop.request_stop(reason)`` would, naming the plugins that
    answered as who asked. ``None`` or a false value means "carry on". A plugin that decides at
    another moment (an epoch's end) calls ``loop.request_stop(reason)`` there instead: the loop
    honours it at that boundary, without a further batch, and one that ends the run by its rule
    (early stopping) passes ``complete=True``. The run then ends with status ``"interrupted"``
    (``"completed"`` for a ``complete`` request): ``stage_end`` and ``epoch_end`` are *not*
    fired for a cut-short epoch, ``fit_end`` is.
    """


@hookspec
def stop_requested(loop: Run, request: StopRequest) -> None:
    """A graceful stop was requested: ``request`` says why and who asked.

    Fires once per run, for the first request, on the thread that asked: through
    ``loop.request_stop(reason)`` (any plugin, the step function, another thread: a
    dashboard's key, a signal handler) or a true ``should_stop`` answer. The loop stops at its
    next boundary (see the module documentation); this event only tells plugins that it will
    (a renderer shows "stopping"). Implementations must be quick and thread-safe. The return
    value is ignored.
    """


@hookspec(firstresult=True)
def agree_stop(loop: Run, request: StopRequest | None, boundary: str) -> StopRequest | Literal[False] | None:
    """Asked at every boundary where the loop may stop, when a plugin implements it: do the
    processes of the run agree to stop here?

    For the plugin that runs the loop on several processes, whose processes must stop at the
    same boundary (or their collective operations would not match). ``request`` is this
    process's pending stop request, ``None`` if there is none; ``boundary`` is where the loop
    is: ``"start"``, ``"epoch_start"``, ``"stage_start"``, ``"batch"``, ``"stage_end"`` or
    ``"epoch_end"``. Every process reaches the same boundaries in the same order, with one
    exception: the ``"batch"`` boundaries of a validation stage (``loop.training`` is False),
    where processes may run different numbers of batches (each validates its own part of the
    data, every sample exactly once). There an implementation runs no collective operation and
    answers ``False``: a stop asked during a validation waits for its ``"stage_end"``. Return
    the agreed :class:`~hookfit.payloads.StopRequest` to stop every process here, ``False`` to
    carry on (a pending request then waits for a later boundary), or ``None`` to leave the
    decision to this process's own request. First result.
    """


@hookspec
def stage_end(loop: Run, stage: str) -> None:
    """A stage of the current epoch has run all its batches: ``stage`` as in ``stage_start``.

    For ``"valid"`` it fires while the model is still in eval mode; every module gets its own
    previous training flag back right after. Not fired for a stage cut short by a stop or an
    error. Order is stated: a plugin that finishes the stage's work (an optimizer plugin
    stepping the last, partial accumulation window) implements it ``tryfirst``; a plugin that
    reports on the finished stage (a metrics plugin, which fires ``epoch_metrics`` from here)
    implements it ``trylast``. The return value is ignored.

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
    propagates unchanged to the caller of ``fit()``, with a note naming where it came from.
    An implementation must not raise; if one does, its error is reported as a warning and the
    original error still propagates. Every implementation runs even if another raised,
    wrappers and call tracing included. The return value is ignored.
    """


@hookspec
def fit_end(loop: Run) -> None:
    """The run is over. Fires exactly once for every run that fired ``fit_start``.

    ``loop.state.status`` is ``"completed"``, ``"interrupted"`` or ``"failed"``,
    ``loop.state.stop_reason`` says why and ``loop.state.stopped_by`` who asked for a stop;
    ``loop.state.time_split`` says where each stage's time went (data, step, plugins), stages
    cut short included. This is where plugins restore what they changed (terminal, signal
    handlers) and write final summaries. Every implementation runs even if another raised,
    wrappers and call tracing included; the first such error fails the run (or is reported as
    a warning if the run failed already), naming the plugin. The return value is ignored.

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
    do not answer. Built in: ``"metrics"``, ``"best"`` (metrics), ``"best_checkpoint"``, ``"last_checkpoint"``.
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
    """``Loop(resume=source)``: continue an earlier run. ``source`` is ``"latest"`` or a path.

    Fires once, after ``fit_start`` and before the first epoch. The plugin that keeps
    checkpoints chooses and reads its checkpoint, restores the model and the plugins' states
    (``loop.load_plugin_states(states)``), and gives the run its own saved position back with
    ``loop.load_state_dict(saved)``, where ``saved`` is what ``loop.state_dict()`` returned
    when it saved (a mapping of plain data and tensors: the position, the random state, the
    data's own state). It writes nothing of ``loop.state`` itself. The whole of what a
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
    ``loop.state.resumed_from``. Renderers and loggers say it (the console prints it, the
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
