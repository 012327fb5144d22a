"""checkpoint plugin: the policy and the save side. When to save (epochs, steps, seconds, a
graceful stop, a failure, the final state of a run that completed: the end's save, none where the
run began, is :mod:`~hookfit.plugins.checkpoint.ending`'s rule); its parts: which checkpoints
to keep (:mod:`~hookfit.plugins.checkpoint.catalog`), one save asked now
(:mod:`~hookfit.plugins.checkpoint.saving`), the background writer and what it finished
(:mod:`~hookfit.plugins.checkpoint.writer`, :mod:`~hookfit.plugins.checkpoint.outcomes`), failed and skipped saves
(:mod:`~hookfit.plugins.checkpoint.reports`), the monitored metric's scores and the saves
they call for (:mod:`~hookfit.plugins.checkpoint.scores`), what a checkpoint holds
(:mod:`~hookfit.plugins.checkpoint.state`), the file format (:mod:`~hookfit.plugins.checkpoint.storage`)
and which checkpoint to resume from (:mod:`~hookfit.plugins.checkpoint.resuming`)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from hookfit import hookimpl
from hookfit.config import records_options
from hookfit.errors import user_level
from hookfit.plugins.checkpoint import folders, hookspecs, ranks, saving, sharded
from hookfit.plugins.checkpoint.ending import finish
from hookfit.plugins.checkpoint.outcomes import collect
from hookfit.plugins.checkpoint.resuming import announce, choose, restore
from hookfit.plugins.checkpoint.state import payload
from hookfit.plugins.checkpoint.catalog import Catalog
from hookfit.plugins.checkpoint.repeats import Written
from hookfit.plugins.checkpoint.reports import Reports
from hookfit.plugins.checkpoint.scores import Scores, hold, owed, settle, unscored
from hookfit.plugins.checkpoint.shardwriter import ShardWriter
from hookfit.plugins.checkpoint.storage import CheckpointWarning, filename
from hookfit.plugins.checkpoint.unsaved import Unsaved
from hookfit.plugins.checkpoint.writer import Done, Writer, write_file
from hookfit.plugins.support import Every, Monitor, choice, flag, path, positive_int, positive_number

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    import argparse

    from hookfit.payloads import MetricsSnapshot, ResumeInfo
    from hookfit.position import Position
    from hookfit.run import Run

__all__ = ["Checkpoint", "CheckpointWarning"]


@records_options
class Checkpoint:
    """Atomic checkpoints of model, optimizers, plugins, position and RNG; exact resume.

    With ``background=True`` (default) a save blocks training for one copy of the state into host
    buffers made at the first save and reused while the tensors keep their shapes and dtypes; the
    digest, the file, its fsyncs and rename and the pruning to ``keep_last`` are done by a writer thread
    (:class:`hookfit.plugins.checkpoint.writer.Writer`), which steps aside while a save copies. A save
    never waits for an earlier write: one write is in flight and one snapshot waits at most. A save
    asked while both are taken (saves coming faster than files are written) follows ``when_busy``:
    ``"wait"`` (default) waits for the write in flight to end, so every save asked is written;
    ``"skip"`` skips it, counts it in ``skipped_saves`` and warns once a run. The saves of the run's end
    (interrupt, failure, ``max_steps``) always wait. The run's end, however it ended, waits for every
    write and reports a failed one as ``on_save_error`` says.

    A sharded run's checkpoint (FSDP2; a folder every rank writes its part of:
    :mod:`~hookfit.plugins.checkpoint.sharded`) is written in the background too: a save blocks every
    rank for one copy of its state into host memory, and DCP's ``async_save`` writes it on a process
    group of its own (:mod:`~hookfit.plugins.checkpoint.shardwriter`). One write is in flight at most: a
    save asked during it waits for it, or with ``"skip"`` is skipped, on every rank alike; the write's
    outcome is taken at the next save and at the run's end, at the same step on every rank.
    ``background=False`` writes every checkpoint in the foreground.

    The best checkpoint is the one with the best ``monitor`` value in ``mode``; ``mode=None`` (default)
    is the direction the metrics snapshots publish for it (``Metrics(best=...)``), else ``"min"``; a
    given ``mode`` that contradicts it is kept, with one warning a run. A checkpoint's metric is the
    score of its own weights, and a validation of the monitored stage is followed by a save of the
    weights it scored when it is due or a new best (:mod:`~hookfit.plugins.checkpoint.scores`)."""

    name = "checkpoint"
    hookspecs = hookspecs  # the events it declares, added to every run (core/hooks.md)

    def __init__(
        self,
        dir: str | os.PathLike[str] | None = None,
        every_n_epochs: int | None = 1,
        every_n_steps: int | None = None,
        every_seconds: float | None = None,
        keep_last: int = 3,
        keep_best: int = 1,
        monitor: str | None = None,
        mode: Literal["min", "max"] | None = None,
        on_interrupt: bool = True,
        on_failure: bool = False,
        on_save_error: Literal["warn", "raise"] = "warn",
        strict: bool = False,
        fallback: bool = False,
        background: bool = True,
        when_busy: Literal["wait", "skip"] = "wait",
    ) -> None:
        name = self.name  # every option checked here, the error naming it (hookfit.plugins.support)
        folder = path(name, "dir", dir, none=True, what="a folder")
        self.dir = Path(folder) if folder is not None else None
        self._epochs = Every(every_n_epochs, plugin=name, option="every_n_epochs")
        self._steps = Every(every_n_steps, plugin=name, option="every_n_steps")
        self.every_n_epochs, self.every_n_steps = every_n_epochs, every_n_steps
        self.every_seconds = positive_number(name, "every_seconds", every_seconds, none=True, meaning="seconds")
        self.keep_last = positive_int(name, "keep_last", keep_last)
        self.scheduled = not (self._epochs.never and self._steps.never and self.every_seconds is None)  # (its end saved)
        self.scores = Scores(Monitor(monitor, mode, plugin=name, category=CheckpointWarning,
                                     must="look like 'valid/loss' (stage/metric, stage train or valid) or be None"))
        """The monitored metric's scores of the run's weights, and the save waiting for one."""
        self.scores.monitor.qualified(mode=mode)
        self.keep_best = positive_int(name, "keep_best", keep_best)
        self.catalog = Catalog(self.keep_last, self.scores.monitor, self.keep_best)
        """The checkpoints this run keeps: ``saved``, ``last``, ``best``, and what to prune."""
        self.monitor, self.mode = monitor, mode
        self.on_interrupt = flag(name, "on_interrupt", on_interrupt)
        self.on_failure = flag(name, "on_failure", on_failure)
        self.on_save_error = choice(name, "on_save_error", on_save_error, ("warn", "raise"))
        self.reports = Reports(self.on_save_error)
        self.strict = flag(name, "strict", strict)
        self.fallback = flag(name, "fallback", fallback)
        self.background = flag(name, "background", background)
        self.when_busy = choice(name, "when_busy", when_busy, ("wait", "skip"))
        self.writer = Writer(write_file, sharded.remove, background=self.background, when_busy=self.when_busy)
        """The part that writes files and prunes them (on its thread when ``background``)."""
        self.shards = ShardWriter(self.when_busy)
        """The part that writes a sharded run's checkpoints in the background (``background``)."""
        self.resumed_from: Path | None = None
        self.off = False
        """Whether checkpoints are off for the current run (it has no model)."""
        self._loop: Run | None = None
        self.clock = ranks.Clock(self.every_seconds)
        """When ``every_seconds`` calls for a save (the main process's clock), restarted by every save."""
        self._pending: tuple[str, Path | None, dict[str, Any] | None] | None = None
        self._continued = False
        self.tag = 0
        """The tag of this run's checkpoint names in its folder (:func:`folders.tag`): the main process's, found at
        ``fit_start``."""
        self._main_dir: Path | None = None  # off the main process: where the main one writes
        self.saved_step: int | None = None  # the global step of the last save asked, or of the one resumed from
        self.written = Written()  # the step of the last checkpoint written or in flight: saved once (repeats.py)
        self.began: Position | None = None  # where the run started or resumed: its end there saves nothing
        self._lock: folders.FolderLock | None = None  # a given dir's, while a run writes there
        self.unsaved = Unsaved()
        """The modules the step functions change that no checkpoint holds, warned of at the first save."""

    @property
    def best(self) -> tuple[float, Path] | None:
        """The best checkpoint by ``monitor`` still on disk: ``(its metric, its path)``, or
        ``None`` (no monitor, or no finite value yet: NaN and infinities are never best). Known
        on every process of a distributed run: the epoch metrics it compares are the same on
        every rank, and each rank names the file the main process writes."""
        return self.catalog.best

    @property
    def last(self) -> Path | None:
        """The newest checkpoint of the run (what ``resume="latest"`` would take): the last this
        run wrote, else the one it resumed from; a ``failed-*`` file is not counted. Known on
        every process (off the main one, the path the main one writes)."""
        return self.catalog.last

    @property
    def saved(self) -> list[Path]:
        """This run's checkpoints still on disk, oldest first."""
        return self.catalog.saved

    @property
    def failed_saves(self) -> int:
        """Writes that failed (``on_save_error="warn"``: the run went on)."""
        return self.reports.failed

    @property
    def skipped_saves(self) -> int:
        """Saves skipped with ``when_busy="skip"`` (a write was in flight and another waited)."""
        return self.reports.skipped

    # -- events ---------------------------------------------------------------------------
    def batch_events(self, loop: Run) -> tuple[str, ...]:
        """``after_batch`` only when saves can fall mid-epoch (by step, by time, or after a
        monitored validation inside training): otherwise batches cost nothing."""
        mid_epoch = not self._steps.never or self.every_seconds is not None or self.scores.inside(loop)
        return ("after_batch",) if mid_epoch else ()

    @hookimpl
    def after_batch(self, loop: Run) -> None:
        self.collect(loop)
        unscored(self, loop)  # a copy held for a validation inside training that published no score
        due = self._steps.due(loop.state.step) or self.clock.due(loop)
        if self.scores.follows(loop):  # written once its validation has scored these weights
            if due:
                self.clock.saved()
            hold(self, loop, due)
        elif due:
            self.save(loop, "step")

    @hookimpl(tryfirst=True)  # may change the run's folder (continue_in): before any plugin uses it
    def configure(self, loop: Run) -> None:
        self.catalog.reset()
        self.scores.start()
        self.reports.reset()
        self.resumed_from, self.off, self._main_dir = None, False, None
        self._pending, self._continued, self.saved_step, self.began, self.written = None, False, None, None, Written()
        self.tag = 0
        self.writer.outcomes(), self.shards.take()  # (a run before this one told everything at its end)
        source = loop.resume
        if source is None:
            return
        if loop.model is None:
            raise ValueError(
                f"checkpoint: resume={source!r} needs the run's model: this run has no Loop(model=...), so a "
                f"checkpoint would restore its plugins and position without the weights (half a state); "
                f"pass Loop(model=...)")
        path, data = choose(loop, source, self.dir, self.fallback)
        self._pending = (source, path, data)
        if loop.mode != "fit":  # Loop.validate(): reads the checkpoint, writes nothing into its run
            return
        # "latest" took a folder of this run's identity; a path, that folder where this identity wrote the file:
        # another identity's checkpoint is forked, the run writing in a run folder of its own
        if (path is not None and self.dir is None and not loop.run_dir_given and path.parent.name == "checkpoints"
                and (source == "latest" or folders.written_by(path, loop.identity.key))):
            loop.continue_in(path.parent.parent.absolute())  # the resumed run goes on writing there
            self._continued = True

    @hookimpl
    def fit_start(self, loop: Run) -> None:
        self._loop, self.began = loop, loop.position
        self.clock.start()
        self.off = loop.model is None
        if self.off:
            warnings.warn(
                "checkpoint: checkpoints are off for this run: it has no model (Loop(model=...)), so a "
                "checkpoint would hold no weights and a resume would continue half a state; nothing is saved",
                CheckpointWarning, stacklevel=user_level())
        else:
            self.scores.begin(loop)  # a monitor the run can never publish
            self.unsaved.start(loop)
        if not self.off and loop.state.world_size > 1:  # first: a run refused for its options changes no file
            self.off = True  # until the processes' options agree: a run refused for them saves nothing, no failure's
            folder = self.directory(loop) if loop.is_main else None
            self._main_dir, self.off = ranks.main_directory(loop, folder, self), False
        if loop.is_main and loop.mode == "fit" and not self.off:
            # before anything is written or removed there: refused if a live process holds it
            self._lock = folders.lock(loop, self.dir, self._continued, self.name)
            if (folder := self._known_directory(loop)) is not None:  # (a kill -9's files removed)
                folders.prepare(folder)
        if loop.mode == "fit" and not self.off:  # the main process's tag on every process (one broadcast): another
            folder = self._known_directory(loop)  # node's listing of the main folder's path may differ
            found = 0 if folder is None else folders.tag(folder, None if self._pending is None else self._pending[1],
                                                         loop.identity.key)
            self.tag = ranks.from_main(loop, found)

    @hookimpl
    def resume(self, loop: Run, source: str) -> Path | Literal[False]:
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == source:
            _, path, data = pending
        else:
            path, data = choose(loop, source, self.dir, self.fallback)
        if path is None or data is None:
            return False
        if source in ("latest", "best"):  # first: the warnings of its restore are about the file it names
            announce(loop, path, self.dir, source)
        self.catalog.reading = path  # (its state names files at the paths they were written at)
        restore(loop, path, data, self.strict)
        if loop.mode == "fit" and not self._continues(loop, path):  # (the loggers set the folder's records aside)
            loop.resumes_apart()
        self.resumed_from = self.catalog.resumed(path, data["meta"], loop.mode == "fit", data["plugins"].get(self.name))
        self.saved_step = data["loop"]["step"]
        if loop.is_main and loop.mode == "fit":  # those it continues are this run's: keep_last holds across resumes
            folder = self._known_directory(loop)  # (Catalog.adopt); a new run folder holds none
            adopted = [] if folder is None else folders.adoptable(folder, path, loop.identity.key)
            self.writer.remove(self.catalog.adopt(adopted, data["loop"]["step"]))
        owed(self, loop, data, self._steps.due(data["loop"]["step"]))  # its validation due, and unscored
        return path

    @hookimpl
    def resumed(self, loop: Run, info: ResumeInfo) -> None:
        self.began = loop.position  # (whichever plugin resumed the run)

    @hookimpl
    def epoch_metrics(self, loop: Run, stage: str, metrics: MetricsSnapshot) -> None:
        if stage == self.scores.stage:
            settle(self, loop, self.scores.publish(loop, metrics))

    @hookimpl
    def after_epoch(self, loop: Run, epoch: int) -> None:
        self.collect(loop)
        unscored(self, loop)
        if self._epochs.due(epoch + 1):
            self.save(loop, "epoch")
        elif ranks.from_main(loop, self.scores.improves(score := self.scores.current(loop)) or self.catalog.ranks(
                score)):  # the main process's scores, which alone know a failed write: a save is every process's
            self.save(loop, "best")

    @hookimpl(tryfirst=True)  # before other plugins let go of their state
    def fit_end(self, loop: Run) -> None:
        ran = not self.off and self._loop is not None and loop.mode == "fit"  # (no model; failed early; validate())
        try:  # the end's save, every write waited for, failures reported, the processes told (ending.py)
            finish(self, loop, ran)
        finally:
            self.shards.close()
            self.writer.close()  # the files pruned last removed; the buffers let go
            self._loop, self.unsaved = None, Unsaved()
            if self._lock is not None:
                self._lock.release()
                self._lock = None
        if ran and self.scores.stage is not None and self.best is None:
            self.scores.end(loop)

    @hookimpl
    def results(self) -> dict[str, Path | int | None]:
        """``"best_checkpoint"``: the path of the best checkpoint by ``monitor`` (``None`` without a monitor or a
        finite value of it); ``"last_checkpoint"``: :attr:`last`; ``"failed_saves"``, ``"skipped_saves"``: this run's
        saves that failed, that a busy writer skipped. On every process. After ``Loop.validate(resume=...)``: the
        last is the checkpoint evaluated, the best its run's as it knew it, itself included (:meth:`Catalog.resumed`)."""
        best, reports = self.best, self.reports
        return {"best_checkpoint": None if best is None else best[1], "last_checkpoint": self.last,
                "failed_saves": reports.run_failed, "skipped_saves": reports.run_skipped}

    @hookimpl
    def add_commands(self, commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
        from hookfit.plugins.checkpoint.command import add_command

        add_command(commands)

    @hookimpl
    def save_state(self) -> dict[str, Any]:
        return self.catalog.state()

    @hookimpl
    def load_state(self, state: Mapping[str, Any]) -> None:
        self.catalog.load(state)

    filename = staticmethod(filename)

    # -- saving ---------------------------------------------------------------------------
    def directory(self, loop: Run) -> Path:
        """Where this run's checkpoints go (in a smoke run, which keeps nothing, always in
        its temporary run folder)."""
        if self.dir is not None and not loop.smoke:
            return self.dir
        return loop.run_dir / "checkpoints"

    def destination(self, loop: Run, position: Position, reason: str) -> Path | None:
        """The file a save at ``position`` writes; off the main process, the main process's
        (``None`` where that is not known: checkpoints off)."""
        folder = self.directory(loop) if loop.is_main else self._main_dir
        return None if folder is None else folder / self.filename(position, reason, self.tag)

    def _known_directory(self, loop: Run) -> Path | None:
        """This run's checkpoint folder when it may hold files already (a given ``dir`` or
        ``run_dir``, or the folder of the run this one continues), else ``None`` (a new run
        folder, which asking for would create); off the main process, the main one's (``None`` without
        ``torch.distributed``)."""
        if (self.dir is not None and not loop.smoke) or loop.run_dir_given or self._continued:
            return self.directory(loop) if loop.is_main else self._main_dir
        return None

    def _continues(self, loop: Run, resumed: Path) -> bool:
        """Whether the run, resumed from ``resumed``, continues the run written last in the folder its checkpoints go
        to (:func:`folders.latest_run`), whose records the run folder holds: the same on every process, each deciding
        from the path and the main process's folder; ``True`` where that folder is a new one."""
        folder = self._known_directory(loop)
        return folder is None or folders.latest_run(folder, resumed, loop.identity.key)

    def save(self, loop: Run, reason: str, *, must: bool = False) -> Path | None:
        """Write a checkpoint of the run as it is now, its metric the score of the weights now
        (:meth:`Scores.current <hookfit.plugins.checkpoint.scores.Scores.current>`); returns its
        path (main process only; ``None`` when checkpoints are off for this run, it has no
        model, or the save was skipped: ``when_busy="skip"``; a step whose checkpoint is written or in
        flight: that checkpoint's path, not written again: :mod:`~hookfit.plugins.checkpoint.repeats`).
        ``must``: never skipped, a busy writer waited for (the run's end)."""
        return saving.save(self, loop, reason, must)

    def payload(self, loop: Run, *, reason: str, metric: float | None) -> dict[str, Any]:
        """Everything a checkpoint holds (:func:`hookfit.plugins.checkpoint.state.payload`)."""
        return payload(loop, reason=reason, metric=metric, monitor=self.monitor)

    def collect(self, loop: Run, more: list[Done] | None = None) -> None:
        """Act, on the training thread, on what the writer finished: each checkpoint written
        is taken (last, best, kept) and announced (``checkpoint_saved``), older ones pruned;
        each failed write is reported as ``on_save_error`` says (``"raise"``: the first failure
        is raised once every outcome is taken); a file pruning could not remove is kept on the
        list, to be tried again. ``more``: finished sharded writes, taken on every rank alike."""
        collect(self, loop, more)
