"""The loop: epochs, stages, batches and the boundaries between them, as functions of the
:class:`hookfit.run.Run` they drive (the way pytest's ``pytest_runtestloop`` drives a session)::

    execute:    configure; fit_start; resume -> epochs; fit_end (whatever happened); results
    epochs:     for each epoch, in scope("epoch"):          epoch_start ... epoch_end, after_epoch
                    run_stage("train"), then validate() when due
    run_stage:  in scope("stage"):                         stage_start ... stage_end
                    for each batch: batch_start, the step, step_output, batch_end,
                    after_batch (training), should_stop and the stop boundary,
                    a validation due at this step (nested), max_steps;
                    a validation's boundary "batches_end" before its stage_end
    validate:   eval mode and no autograd around run_stage("valid")

:func:`scope` gives every scope its start event and boundary, and its end event and boundary
when the body ran to its end, as fastai's ``_with_events`` does. Stops are
:mod:`hookfit.stopping`'s, the run's position :mod:`hookfit.position`'s, the time split
:mod:`hookfit.timing`'s, the error's note :mod:`hookfit.blame`'s, a resumed stage's iterator :mod:`hookfit.replay`'s,
the warnings of a validation cadence that validates nothing :mod:`hookfit.cadence`'s.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Callable

import torch

from hookfit import modes
from hookfit.cadence import foreseen, never_validated, unvalidated
from hookfit.data import length, one_pass, tell_epoch
from hookfit.ending import fail, finish
from hookfit.errors import HookfitWarning, user_level
from hookfit.outputs import as_mapping, check_output
from hookfit.payloads import ResumeInfo
from hookfit.order import unrebuilt_order
from hookfit.persistent import unrebuilt_workers
from hookfit.position import Position, weights_of
from hookfit.replay import iterate
from hookfit.reproducibility import Deterministic, seed_run
from hookfit.stopping import Budget, Stop, epoch_left, nothing_left
from hookfit.timing import store_split
from hookfit.valsets import ValSets, per_set

if TYPE_CHECKING:  # pragma: no cover
    from hookfit.run import Run, Step
    from hookfit.state import State

__all__ = ["execute", "run_stage", "scope", "validate"]

_Tensor = torch.Tensor
_END = object()
EMPTY = " (len() is 0; a DataLoader with drop_last=True and fewer samples than its batch_size has no batch)"

def execute(run: Run) -> State:
    """Run to the end (``Loop.fit()``, ``Loop.validate()``): ``fit_end`` fires exactly
    once, whatever happened."""
    state = run.state
    state.status = "running"
    state.started_at = time.perf_counter()
    # seeded before configure, whose plugins draw too; the loaders' own generators are the script's
    with (Deterministic() if run.deterministic else contextlib.nullcontext(),
          seed_run(run.seed, run.train_data if run.mode == "fit" else None, run.val_data) as unseeded):
        try:
            fire(run, "configure")
            run.folder.claim()  # a folder a live process holds: refused before any plugin writes there
            run.hooks.start()  # the plugins are configured: their batch_events answers count
            run.check_configured()
            epochs_for_steps(run)
            fire(run, "fit_start")
            unvalidated(run)
            resume(run)
            run.hooks.resolve()  # batch_events asked again: an answer may follow what fit_start set up or load_state restored
            if unseeded and run.state.resumed_from is None:  # (a resumed run has its generators' states restored)
                warnings.warn(unseeded, HookfitWarning, stacklevel=user_level())
            epochs(run)
            never_validated(run)
        except BaseException as error:
            try:
                fail(run, error)  # a second Ctrl-C in an exception hook aborts it: still finish
            finally:
                finish(run, failed=True)
            raise
        else:
            finish(run, failed=False)
    return state


def fire(run: Run, event: str, *args: Any) -> None:
    """Fire an event whose results the loop ignores."""
    if (call := getattr(run.hooks, event)) is not None:
        call(run, *args)


@contextlib.contextmanager
def scope(run: Run, name: str, arg: Any, after: Callable[[], None] | None = None,
          before: str | None = None) -> Iterator[None]:
    """One scope of the loop (an epoch, a stage): ``<name>_start`` and its boundary, the
    body, the boundary ``before`` (when given), then ``<name>_end``, ``after`` and the end's
    boundary. A body cut short (a stop, ``max_steps``, an error) fires no end: that part of
    the run did not happen."""
    fire(run, f"{name}_start", arg)
    run.stopping.boundary(f"{name}_start")
    yield
    if before is not None:
        run.stopping.boundary(before)
    fire(run, f"{name}_end", arg)
    if after is not None:
        after()
    run.stopping.boundary(f"{name}_end")


def resume(run: Run) -> None:
    source = run.resume
    if source is None:
        return
    if (call := run.hooks.resume) is None:
        raise RuntimeError(f"resume={source!r} needs a plugin that implements the 'resume' event "
                           f"and no enabled plugin does ({run.unserved('resume')})")
    resumed_from = call(run, source)
    if not resumed_from:
        if run.cursor.start is not None:  # (a run that does not resume is never given a position)
            raise RuntimeError(f"resume={source!r}: plugin {', '.join(run.hooks.plugins('resume'))} gave the run its "
                               f"position (loop.load_state_dict) but returned {resumed_from!r}: return what it resumed "
                               "from (the checkpoint's path), which the resumed event and the run's records name")
        return
    if (at := run.cursor.start) is None:
        raise RuntimeError(
            f"resume={source!r}: plugin {', '.join(run.hooks.plugins('resume'))} returned "
            f"{resumed_from!r} but never gave the run its position: a resume implementation "
            f"calls loop.load_state_dict(saved) with what loop.state_dict() returned")
    where = os.fspath(resumed_from) if isinstance(resumed_from, (str, os.PathLike)) else source
    if run.mode == "validate":  # labelled with the epoch whose weights it validates
        at = weights_of(at)
        run.state.epoch = at.epoch
    info = ResumeInfo(where, at.epoch, at.step, at.batch, at.stage)
    run.state.resumed_from = info
    run.state.continues = run.mode == "fit" and not run.apart
    if run.mode == "fit":
        level = user_level()  # at the user's fit()
        if why := unrebuilt_order(run.train_data, "train" in run.cursor.restored, run.cursor.held):
            warnings.warn(f"resume={source!r}: the order of the training data's batches cannot be rebuilt, so the "
                          f"resumed run trains on other batches than the run it continues would have: train_data "
                          f"is a {why}", HookfitWarning, stacklevel=level)
        if why := unrebuilt_workers(run.train_data, run.val_data, run.cursor.made_before):
            warnings.warn(f"resume={source!r}: {why}", HookfitWarning, stacklevel=level)
        if why := nothing_left(where, at, run.max_steps, run.max_epochs if _epochs_bound(run) else None, length(run.train_data)):
            warnings.warn(f"resume={source!r}: {why}", HookfitWarning, stacklevel=level)
    fire(run, "resumed", info)


def epochs(run: Run) -> None:
    state, cursor = run.state, run.cursor
    run.started, resumed_at = True, cursor.start
    budget = f"max_steps={run.max_steps} reached"
    try:
        if run.mode == "validate":  # Loop.validate(): the validation stage alone
            run.stopping.boundary("start")
            validate(run)
            state.stop_reason, state.status = "validation done", "completed"
            return
        if run.max_steps is not None and state.step >= run.max_steps and not epoch_left(  # resumed at the end (what
                cursor.start, run.max_steps, length(run.train_data)):  # is left of its epoch, a due validation, runs first)
            state.stop_reason, state.status = budget, "completed"
            _last_epoch_done(run, cursor.start)
            return
        run.stopping.boundary("start")
        at, cursor.start = cursor.start, None
        first_epoch = state.epoch
        for epoch in range(state.epoch, run.max_epochs if _epochs_bound(run) else run.max_steps or 0):
            state.epoch = epoch
            tell_epoch(run.train_data, epoch, again=epoch == first_epoch + 1)  # not val_data: see tell_epoch
            start, first = (at.batch, at.stage) if at is not None else (0, "train")
            at = None
            cursor.epoch_begins(epoch, start, first)
            with scope(run, "epoch", epoch, after=functools.partial(epoch_done, run, epoch)):
                if first == "train":
                    if epoch == first_epoch:
                        modes.warn_eval_mode(run.model)
                    run_stage(run, "train", run.train_step, run.train_data, start)
                every = run.val_every_n_epochs
                if run.val_step is not None and every is not None and (epoch + 1) % every == 0:
                    validate(run)
            if run.max_steps is not None and state.step >= run.max_steps:
                state.stop_reason = budget
                break
        else:
            state.stop_reason = f"max_epochs={run.max_epochs} reached"
            _last_epoch_done(run, at)  # (at: still the start when no epoch was left to run)
        state.status = "completed"
    except Budget:  # max_steps inside an epoch: the rest of it is for a longer run
        state.stop_reason, state.status = budget, "completed"
    except Stop as stop:
        state.status = "completed" if stop.request.complete else "interrupted"
        state.stop_reason, state.stopped_by = stop.request.reason, stop.request.by
        if resumed_at is not None and (state.epoch, state.step) == (resumed_at.epoch, resumed_at.step):
            _last_epoch_done(run, resumed_at)  # stopped before the first batch of the epoch it resumed at
    finally:
        run.training = False


def _epochs_bound(run: Run) -> bool:
    """Whether ``max_epochs`` ends the run (else ``max_steps`` alone does)."""
    return run.config.epochs_given or run.max_steps is None


def _last_epoch_done(run: Run, at: Position | None) -> None:
    """A run resumed at the start of an epoch it has no reason to run (a completed run, resumed
    from the checkpoint of its last epoch's end, or one that stops before it, as early stopping's
    state asks) ended in the epoch before: its end says so, as the run it continues did
    (``epochs=20``, not 21)."""
    if at is not None and at.epoch > 0 and at.batch == 0 and at.stage == "train" and not at.val_due:
        run.state.epoch = at.epoch - 1


def epochs_for_steps(run: Run) -> None:
    """With ``max_steps`` and no ``max_epochs``, tell the plugins how many epochs the run
    takes (``loop.max_epochs``) when the training data, as ``configure`` left it (sharded), has
    a length; the loop itself goes on until ``max_steps`` whatever that says. A validation
    interval known to be over the run is ``loop.no_validation`` (:func:`hookfit.cadence.foreseen`)."""
    per_epoch = length(run.train_data) if run.mode == "fit" else None
    if per_epoch and not _epochs_bound(run) and run.max_steps is not None:
        run.max_epochs = -(-run.max_steps // per_epoch)
    run.no_validation = foreseen(run)


def epoch_done(run: Run, epoch: int) -> None:
    run.cursor.epoch_ends()
    fire(run, "after_epoch", epoch)


def validate(run: Run) -> None:
    step, data = run.val_step, run.val_data
    if step is None or data is None:  # never: Loop() takes both or neither, and callers check
        raise RuntimeError("a validation needs both val_step and val_data")
    run.cursor.valid_begins(data)  # a state dict taken during it resumes at its start
    with modes.eval_modes(run.model), modes.grad_mode(run.val_grad_mode), modes.trains_nothing():
        if isinstance(data, Mapping):  # several validation sets: one stage
            run_stage(run, "valid", per_set(step, run.state), ValSets(data, run.state))
        else:
            run_stage(run, "valid", step, data)


def stage_done(run: Run, train: bool) -> None:
    if train:
        run.cursor.train_ends()
    else:
        run.state.val_due = False  # a validation due inside training has run to its end
        run.cursor.valid_ends()


def run_stage(run: Run, stage: str, step: Step, data: Iterable[Any], start: int = 0) -> None:
    """Run one stage over ``data`` from batch ``start``. The per-batch body is the hot
    path: each event is a plain tuple of callables (:class:`hookfit.handlers.PerBatch`), empty
    when nothing implements it. Where the time goes costs three clock reads a batch (four with a
    ``batch_start``), two sums in locals and one comparison; ``plugins`` is what is left of the
    stage's time, and the split is stored at the stage's end or every ``TIME_SPLIT_INTERVAL`` s."""
    state, per_batch, stop = run.state, run.hooks.per_batch, run.stopping
    clock = time.perf_counter
    began = clock()
    waited = stepping = nested = 0.0  # seconds in next(), in the step, in validations inside
    due = began + run.TIME_SPLIT_INTERVAL
    past = state.time_split.get(stage)  # this stage's earlier epochs
    train = stage == "train"
    limit = run.max_steps if train and run.max_steps is not None else sys.maxsize
    every = run.val_every_n_steps if train and run.val_step is not None else None
    state.stage, state.batch_idx, run.training = stage, start, train
    batch_idx = start - 1
    # a validation's own carry; the training stage's is given back after it
    outer = run.enter_carry(run.cursor.train_begins(start) if train else {})
    try:
        # a validation's "batches_end": where processes that ran different numbers of its batches meet
        with scope(run, "stage", stage, after=functools.partial(stage_done, run, train),
                   before=None if train else "batches_end"):
            if train and state.val_due:  # resumed where a validation inside training was due
                if run.val_step is not None:
                    inner = clock()
                    try:
                        validate_inside(run, batch_idx)
                    finally:  # its time is the "valid" stage's, even when it stops the run
                        nested += clock() - inner
                state.val_due = False  # (a run resumed without validation has none to run)
            act = mark(run, limit, every)  # the next step at which the loop acts: one test a batch
            t0 = clock()  # from here on, until next() returns, the loop waits for data
            batches = iterate(run, data, start, train)
            if start:  # passing the batches a resumed stage already did is the resume's time, not the stage's
                began, t0 = began + (clock() - t0), clock()
            if state.step >= limit and _more(batches, data, start - 1):  # resumed at max_steps, its due validation run
                raise Budget
            checked = False  # the first output of the stage is checked once
            for batch_idx, batch in enumerate(batches, start):
                t1 = clock()
                waited += t1 - t0
                state.batch_idx = batch_idx
                if per_batch.batch_start:
                    for call in per_batch.batch_start:
                        call(run, batch, batch_idx)
                    t1 = clock()  # the step starts now: batch_start's time is the plugins'
                try:
                    output = step(run, batch)
                finally:  # a step that raises: its time until then is the step's too
                    stepping += clock() - t1
                if output is not None:
                    if type(output) is not dict:  # a tensor is the common case: before the Mapping ABC
                        output = {"loss": output} if type(output) is _Tensor or isinstance(output, _Tensor) else as_mapping(output, step)
                    if not checked:
                        checked = check_output(output, step)
                    for call in per_batch.step_output:
                        call(run, output, batch)
                if train:
                    state.step += 1
                    if state.step >= act and every is not None:
                        state.val_due = state.step % every == 0
                for call in per_batch.batch_end:
                    call(run, output, batch, batch_idx)
                if train:
                    for call in per_batch.after_batch:
                        call(run, batch_idx)
                if per_batch.asks or stop.request is not None:
                    stop.after_batch()
                t0 = clock()  # the batch is done: what follows until next() returns is data
                if t0 >= due:  # a live split, for a dashboard
                    store_split(state, stage, past, t0 - began - nested, waited, stepping, batch_idx - start + 1)
                    due = t0 + run.TIME_SPLIT_INTERVAL
                if state.step >= act:
                    if state.val_due:
                        try:
                            validate_inside(run, batch_idx)
                        finally:  # its time is the "valid" stage's, even when it stops the run
                            inner, t0 = t0, clock()
                            nested += t0 - inner
                    if state.step >= limit:
                        if _more(batches, data, batch_idx):
                            raise Budget
                        break
                    act = mark(run, limit, every)
            waited += clock() - t0  # the last next(), which ended the stage (or _more's)
            if batch_idx < 0:
                used = _used_up(data) or ("an iterator or generator" if state.epoch else "")
                raise ValueError(
                    f"{stage} data yielded no batches in epoch {state.epoch + 1}" + (EMPTY if length(data) == 0 else "")
                    + (f" ({used} is used up after one pass; pass a list, a DataLoader or a generator "
                       f"factory: an object whose __iter__ is a generator function)" if used else ""))
            if (total := length(data)) is not None and batch_idx >= total:  # (said once a run: the same words)
                warnings.warn(f"{stage} data yielded {batch_idx + 1} batches, more than its length says (len() = "
                              f"{total}): the progress, an accumulation window's last divisor and schedules counted "
                              f"by it are off (a DataLoader over an IterableDataset whose workers each end with a "
                              f"partial batch: its len() counts whole batches of the dataset's __len__)",
                              HookfitWarning, stacklevel=user_level())
            # stage_end sees the stage's batches counted; its own time is added after it
            store_split(state, stage, past, clock() - began - nested, waited, stepping, batch_idx - start + 1)
    finally:
        store_split(state, stage, past, clock() - began - nested, waited, stepping, batch_idx - start + 1)
        if not train:
            run.enter_carry(outer)


def mark(run: Run, limit: int, every: int | None) -> int:
    """The next global step at which the training stage must act: ``max_steps``, or a
    multiple of ``val_every_n_steps`` (``sys.maxsize`` outside training)."""
    return limit if every is None else min(limit, (run.state.step // every + 1) * every)


def validate_inside(run: Run, batch_idx: int) -> None:
    """The validation due inside the training stage (``val_every_n_steps``): a
    ``"valid"`` stage nested in the ``"train"`` one, which then goes on where it was."""
    validate(run)
    state = run.state
    state.stage, state.batch_idx, run.training = "train", batch_idx, True


def _more(batches: Any, data: Any, batch_idx: int) -> bool:
    """Whether the stage has batches after ``batch_idx`` (``max_steps`` was reached): the
    data's length says, else one more batch is drawn (and dropped: the run ends)."""
    total = length(data)
    if total is not None:
        return batch_idx + 1 < total
    return next(batches, _END) is not _END


def _used_up(data: Any) -> str:
    """What of ``data`` gives its batches once only: a one-pass iterator (or one of several
    validation sets), else ``""``."""
    if one_pass(data):
        return f"the {type(data).__name__} iterator"
    sets = data.sets if isinstance(data, ValSets) else {}
    return next((f"validation set {name!r}, a {type(part).__name__} iterator,"
                 for name, part in sets.items() if one_pass(part)), "")
