"""Where a run is: :class:`State`, ``loop.state`` during a run and what ``fit()`` returns."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, Mapping

from hookfit import errors
from hookfit.payloads import TimeSplit

__all__ = ["State", "Status"]

Status = Literal["idle", "running", "completed", "interrupted", "failed"]


@dataclass
class State:
    """Where a run is. ``loop.state``; returned by ``fit()``.

    ``epoch`` counts from 0; ``step`` counts training batches whose step ran (the global step,
    skipped batches included, optimizer steps not); ``batch_idx`` is the position in the
    current stage; ``stage`` is ``"train"``, ``"valid"`` or ``None`` outside a stage.
    ``status`` ends as ``"completed"``, ``"interrupted"`` or ``"failed"``, with ``stop_reason``
    saying why and, for a stop somebody asked for, ``stopped_by`` saying who asked.
    ``time_split`` says where each stage's time went (data, step, plugins). ``results`` is
    what the plugins answered ``results`` with when the run ended (final and best metrics, the
    best checkpoint): read it from what ``fit()`` or ``validate()`` returns.
    """

    if not TYPE_CHECKING:  # (an attribute that is not there stays a type error) state.global_step: state.step
        __getattr__ = errors.no_attribute

    epoch: int = 0
    step: int = 0
    batch_idx: int = 0
    stage: str | None = None
    val_set: str | None = None
    """The validation set being run, when ``Loop(val_data={name: data, ...})`` has several, or
    predicted, when ``Loop.predict({name: data, ...})`` is given named sets; else ``None`` (a
    ``predict()`` of other data has no set, whatever the ``Loop``'s ``val_data``)."""
    status: Status = "idle"
    stop_reason: str | None = None
    stopped_by: str | None = None
    """Who asked for the stop that ended the run (:class:`hookfit.payloads.StopRequest`)."""
    error: BaseException | None = None
    """What failed the run (``status == "failed"``), else ``None``. While the run ends (its
    ``exception``, ``fit_end`` and ``results`` events) it is the exception itself, which
    ``fit()`` then raises unchanged, traceback and all. Once the run is over it is a copy
    (:func:`hookfit.ending.detached`): the class, ``args``, attributes and ``__notes__``, and the
    ``__cause__``/``__context__`` chain copied likewise, without traceback, whose frames would
    keep the whole run alive (model, optimizers, data loaders' workers, a loss's autograd graph)
    as long as the state is kept. Debug the exception ``fit()`` raises, not this copy."""
    started_at: float | None = None
    ended_at: float | None = None
    val_due: bool = False
    """A validation is due inside the training stage (``Loop(val_every_n_steps=N)``): set when
    the training batch that makes ``step`` a multiple of N is done (before its ``batch_end``),
    cleared when that validation's ``stage_end`` has fired. A checkpoint taken in between (by
    step, or on a stop or a failure before the validation finished) records it, and a resumed
    run validates first, before its next training batch. The rest of where a run is, as a
    checkpoint keeps it, is the run's own: ``loop.position`` and ``loop.state_dict()``."""
    resumed_from: Any = None
    """Where this run resumed from (:class:`hookfit.payloads.ResumeInfo`), or ``None``."""
    continues: bool = False
    """Whether this fit continues the records an earlier run left in its folder (its tables, event files,
    checkpoints), which a logger then appends to: set by the core once the run has resumed (:attr:`resumed_from`),
    unless the plugin that resumed it said that the checkpoint is not the one they go on from
    (:meth:`hookfit.run.Run.resumes_apart`: an earlier run's, which a later run's records there follow); such
    a run sets them aside, as a run that did not resume does. ``False`` until the run has resumed, for a run
    that did not, and in ``Loop.validate()``."""
    rank: int = 0
    """This process's rank among ``world_size`` processes (set by a distributed plugin)."""
    world_size: int = 1
    silenced: list[Any] = field(default_factory=list)
    """Observer plugins switched off during the run (:class:`hookfit.errors.Silenced`); once the
    run is over, each one's ``error`` is a copy without traceback, as :attr:`error` is."""
    time_split: Mapping[str, TimeSplit] = field(default_factory=lambda: MappingProxyType({}))
    """Stage name -> :class:`hookfit.payloads.TimeSplit`: the seconds each stage of this
    ``fit()`` has spent waiting for data, in the step function and in plugins, summed over its
    epochs, measured by the loop (no device synchronisation). A read-only mapping that the loop
    replaces, never changes: a renderer on another thread may keep the one it read. Updated
    while a stage runs (at most every ``Run.TIME_SPLIT_INTERVAL`` seconds), before its
    ``stage_end`` (which then sees the stage's batches counted) and once more after it, and
    when a stage is cut short (a stop, ``max_steps``, an error), so ``fit_end`` sees the whole
    run. A stage that drew no batch has no entry. A resumed run counts from zero."""
    results: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """What the run's plugins report when it is over, one read-only mapping: every
    ``results`` answer (the event asked right after ``fit_end``, on every process, whatever the
    outcome) merged, each key from the one plugin that answered it. With the built-in plugins:
    ``"metrics"`` and ``"best"`` (the metrics plugin), ``"best_checkpoint"`` and
    ``"last_checkpoint"`` (the checkpoint plugin). Empty while the run is going on, and after a
    run no plugin answered for."""
    run_dir: Path | None = None
    """The folder the run's files went to (``run.jsonl``, checkpoints, logs) once a plugin wrote there: what
    ``hookfit runs``/``show``/``compare`` read; ``None`` while no plugin has, and for a run that wrote no file."""

    @property
    def elapsed(self) -> float:
        """Seconds since ``fit()`` started, until the run ended (``fit_end`` is not counted: a
        dashboard held on screen after the run adds nothing)."""
        if self.started_at is None:
            return 0.0
        end = self.ended_at if self.ended_at is not None else time.perf_counter()
        return end - self.started_at
