"""checkpoint plugin: the policy and the save side. When to save (epochs, steps, seconds, a
graceful stop, a failure, ``max_steps`` reached inside an epoch), which checkpoints to keep
(``keep_last``, the best by ``monitor``), the background writer thread. Which checkpoint to
resume from and how to restore it is :mod:`hookfit.plugins.checkpoint.resuming`'s; the file
format, the digest, the checks of a file and the atomic writes are in
:mod:`hookfit.plugins.checkpoint.storage`, what a checkpoint holds beyond the plugins' states
in :mod:`hookfit.plugins.checkpoint.state`."""

from __future__ import annotations

import collections
import os
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from hookfit import hookimpl
from hookfit.plugins.checkpoint import folders, hookspecs, ranks, sharded
from hookfit.plugins.checkpoint.resuming import announce, choose, restore
from hookfit.plugins.checkpoint.state import _model_state, _snapshot
from hookfit.plugins.checkpoint.storage import (
    FORMAT,
    FORMAT_VERSION,
    SUFFIX,
    CheckpointWarning,
    atomic_save,
    checkpoint_files,
    digest,
    position_of,
)
from hookfit.plugins.support import Every, Monitor, choice, flag, path, positive_int, positive_number

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    import argparse

    from hookfit.payloads import MetricsSnapshot
    from hookfit.position import Position
    from hookfit.run import Run

__all__ = ["Checkpoint", "CheckpointWarning"]


class Checkpoint:
    """Atomic checkpoints of model, optimizers, plugins, position and RNG; exact resume."""

    name = "checkpoint"
    hookspecs = hookspecs  # the events it declares, added to every run (core/hooks.md)

    def __init__(
        self,
        dir: str | os.PathLike[str] | None = None,
        every_n_epochs: int | None = 1,
        every_n_steps: int | None = None,
        every_seconds: float | None = None,
        keep_last: int = 3,
        monitor: str | None = None,
        mode: Literal["min", "max"] = "min",
        on_interrupt: bool = True,
        on_failure: bool = False,
        on_save_error: Literal["warn", "raise"] = "warn",
        strict: bool = False,
        fallback: bool = False,
        background: bool = True,
    ) -> None:
        name = self.name  # every option checked here, the error naming it (hookfit.plugins.support)
        folder = path(name, "dir", dir, none=True, what="a folder")
        self.dir = Path(folder) if folder is not None else None
        self._epochs = Every(every_n_epochs, plugin=name, option="every_n_epochs")
        self._steps = Every(every_n_steps, plugin=name, option="every_n_steps")
        self.every_n_epochs = every_n_epochs
        self.every_n_steps = every_n_steps
        self.every_seconds = positive_number(name, "every_seconds", every_seconds, none=True, meaning="seconds")
        self.keep_last = positive_int(name, "keep_last", keep_last)
        self._monitor = Monitor(monitor, mode, plugin=name,  # keeps the best checkpoint
                                must="look like 'valid/loss' (stage/metric, stage train or valid) or be None")
        self.monitor = monitor
        self.mode = mode
        self.on_interrupt = flag(name, "on_interrupt", on_interrupt)
        self.on_failure = flag(name, "on_failure", on_failure)
        self.on_save_error = choice(name, "on_save_error", on_save_error, ("warn", "raise"))
        self.strict = flag(name, "strict", strict)
        self.fallback = flag(name, "fallback", fallback)
        self.background = flag(name, "background", background)
        self.saved: list[Path] = []  # this run's checkpoints still on disk, oldest first
        self.failed_saves = 0
        self.resumed_from: Path | None = None
        self.last: Path | None = None
        """The newest checkpoint of the run (what ``resume="latest"`` would take): the last this
        run wrote, else the one it resumed from; a ``failed-*`` file is not counted. Known on
        every process (off the main one, the path the main one writes)."""
        self.off = False
        """Whether checkpoints are off for the current run (it has no model)."""
        self._loop: Run | None = None
        self._last_time = 0.0
        self._last_value: float | None = None
        self._monitor_warned = False
        self._pending: tuple[str, Path | None, dict[str, Any] | None] | None = None
        self._continued = False
        self._writer: threading.Thread | None = None
        self._write_error: BaseException | None = None
        self._warned: set[str] = set()
        self._sharded_saves = 0  # this process's sharded saves: their temporary folders' names
        self._main_dir: Path | None = None  # off the main process: where the main one writes
        self._written: collections.deque[tuple[str, str, int]] = collections.deque()  # to announce
        self._lock: folders.FolderLock | None = None  # a given dir's, while a run writes there

    @property
    def best(self) -> tuple[float, Path] | None:
        """The best checkpoint by ``monitor`` still on disk: ``(its metric, its path)``, or
        ``None`` (no monitor, or no finite value yet: NaN and infinities are never best). Known
        on every process of a distributed run: the epoch metrics it compares are the same on
        every rank, and each rank names the file the main process writes."""
        return self._monitor.record

    @best.setter
    def best(self, best: tuple[float, Path] | None) -> None:
        self._monitor.reset(*(best or ()))

    # -- events ---------------------------------------------------------------------------
    def batch_events(self, loop: Run) -> tuple[str, ...]:
        """``after_batch`` only when saves can fall mid-epoch (by step or by time): otherwise
        batches cost nothing."""
        return () if self._steps.never and self.every_seconds is None else ("after_batch",)

    @hookimpl
    def after_batch(self, loop: Run) -> None:
        if self._written:
            self._announce(loop)
        if self._steps.due(loop.state.step) or (
            self.every_seconds is not None and time.monotonic() - self._last_time >= self.every_seconds
        ):
            self.save(loop, "step")

    @hookimpl(tryfirst=True)  # may change the run's folder (continue_in): before any plugin uses it
    def configure(self, loop: Run) -> None:
        self.saved, self.best, self.resumed_from, self.last, self.off = [], None, None, None, False
        self._main_dir = None
        self._pending, self._continued, self._monitor_warned, self._warned = None, False, False, set()
        self._written.clear()
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
        if path is not None and self.dir is None and not loop.run_dir_given and path.parent.name == "checkpoints":
            loop.continue_in(path.parent.parent.absolute())  # the resumed run goes on writing there
            self._continued = True

    @hookimpl
    def fit_start(self, loop: Run) -> None:
        self._loop = loop
        self._last_time = time.monotonic()
        self._last_value = None
        self.off = loop.model is None
        if self.off:
            warnings.warn(
                "checkpoint: checkpoints are off for this run: it has no model (Loop(model=...)), so a "
                "checkpoint would hold no weights and a resume would continue half a state; nothing is saved",
                CheckpointWarning, stacklevel=2)
        if loop.is_main and loop.mode == "fit" and not self.off:
            # before anything is written or removed there: refused if a live process holds it
            self._lock = folders.lock(loop, self.dir, self._continued, self.name)
            self._remove_stale_temporaries(loop)
        if not self.off and loop.state.world_size > 1:
            self._share_directory(loop)

    @hookimpl
    def resume(self, loop: Run, source: str) -> Path | Literal[False]:
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == source:
            _, path, data = pending
        else:
            path, data = choose(loop, source, self.dir, self.fallback)
        if path is None or data is None:
            return False
        restore(loop, path, data, self.strict)
        self.resumed_from = self.last = path
        if source == "latest":
            announce(loop, path)
        if loop.is_main and loop.mode == "fit":  # an evaluation prunes nothing
            self._adopt(loop, data["loop"])
        return path

    @hookimpl
    def epoch_metrics(self, stage: str, metrics: MetricsSnapshot) -> None:
        if self.monitor is None:
            return
        key = self._monitor.key
        if stage != self._monitor.stage:
            return
        if key is not None and key in metrics.values:  # (a key: there is a monitor)
            self._last_value = float(metrics.values[key].epoch)
            return
        self._last_value = None
        if not self._monitor_warned:
            self._monitor_warned = True
            have = ", ".join(sorted(metrics.values)) or "none"
            warnings.warn(
                f"checkpoint: monitor={self.monitor!r} names a metric this run does not produce: the {stage} "
                f"metrics of epoch {metrics.epoch + 1} are {have}; no best checkpoint is kept by it",
                CheckpointWarning, stacklevel=2)

    @hookimpl
    def after_epoch(self, loop: Run, epoch: int) -> None:
        self._announce(loop)
        if self._epochs.due(epoch + 1):
            self.save(loop, "epoch", metric=self._last_value)
        self._last_value = None  # a metric belongs to its epoch's checkpoint

    @hookimpl(tryfirst=True)  # before other plugins let go of their state
    def fit_end(self, loop: Run) -> None:
        state = loop.state
        try:
            if self.off or self._loop is None:  # no model, or the run failed before this plugin's fit_start
                return
            if loop.mode != "fit":  # Loop.validate(): nothing was trained, nothing to save
                return
            graceful = state.status == "interrupted" and state.stop_reason != "KeyboardInterrupt"
            if graceful and self.on_interrupt:
                self.save(loop, "interrupt")
            elif state.status == "failed" and self.on_failure:
                self.save(loop, "failure")
            elif state.status == "completed" and _inside_training(loop.position):
                # max_steps reached inside the epoch (a longer run continues from here), or a
                # rule ended the run there (early stopping after a validation inside training)
                budget = loop.max_steps is not None and state.step >= loop.max_steps
                self.save(loop, "max_steps" if budget else "completed")
        finally:
            self._wait()
            self._announce(loop)
            self._loop = None
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    @hookimpl
    def results(self) -> dict[str, Path | None]:
        """``"best_checkpoint"``: the path of the best checkpoint by ``monitor`` (``None``
        without a monitor or a finite value of it); ``"last_checkpoint"``: :attr:`last`. On
        every process; after ``Loop.validate(resume=...)``, what the checkpoint it read knew."""
        best = self.best
        return {"best_checkpoint": None if best is None else best[1], "last_checkpoint": self.last}

    @hookimpl
    def add_commands(self, commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
        from hookfit.plugins.checkpoint.export import add_command

        add_command(commands)

    @hookimpl
    def save_state(self) -> dict[str, Any]:
        best = None if self.best is None else [self.best[0], str(self.best[1])]
        return {"best": best, "saved": [str(p) for p in list(self.saved)]}

    @hookimpl
    def load_state(self, state: Mapping[str, Any]) -> None:
        if state.get("best") is not None:
            value, path = state["best"]
            if Path(path).exists():
                self.best = (value, Path(path))
        self.saved = [Path(p) for p in state.get("saved", []) if Path(p).exists()]

    # -- naming ---------------------------------------------------------------------------
    @staticmethod
    def filename(position: Position, reason: str) -> str:
        """``epochNNNN-stepNNNNNNNNN.pt``, the epoch counted from 1: the epoch in progress, or
        the one just completed at an epoch's boundary, so names sort in run order."""
        epoch, step = position.epoch, position.step
        at_start = position.stage == "train" and position.batch == 0 and not position.val_due
        shown = epoch if (at_start and epoch > 0) else epoch + 1
        stem = "failed-" if reason == "failure" else ""
        return f"{stem}epoch{shown:04d}-step{step:09d}{SUFFIX}"

    # -- saving ---------------------------------------------------------------------------
    def directory(self, loop: Run) -> Path:
        """Where this run's checkpoints go (in a smoke run, which keeps nothing, always in
        its temporary run folder)."""
        if self.dir is not None and not loop.smoke:
            return self.dir
        return loop.run_dir / "checkpoints"

    def _known_directory(self, loop: Run) -> Path | None:
        """This run's checkpoint folder when it may hold files already (a given ``dir`` or
        ``run_dir``, or the folder of the run this one continues), else ``None`` (a new run
        folder, which asking for would create)."""
        if (self.dir is not None and not loop.smoke) or loop.run_dir_given or self._continued:
            return self.directory(loop)
        return None

    def save(self, loop: Run, reason: str, metric: float | None = None) -> Path | None:
        """Write a checkpoint of the run as it is now; returns its path (main process only;
        ``None`` when checkpoints are off for this run: it has no model)."""
        if self.off:
            return None
        self._last_time = time.monotonic()
        self._raise_write_error()
        self._announce(loop)
        position = loop.position
        payload = self.payload(loop, reason=reason, metric=metric)  # also on other ranks: collectives
        rest, shards = sharded.split(payload)
        if shards:  # a sharded run: every rank writes its part
            return self._save_sharded(loop, position, rest, shards, metric, reason)
        if not loop.is_main:
            if self._main_dir is not None:  # the file the main process writes, for best and last
                self._follow(self._main_dir / self.filename(position, reason), metric, reason)
            return None
        path = self.directory(loop) / self.filename(position, reason)
        self._wait()
        self._raise_write_error()
        if self.background:
            payload = _snapshot(payload)
            self._writer = threading.Thread(
                target=self._write, args=(payload, path, metric, reason), name="hookfit-checkpoint", daemon=True)
            self._writer.start()
        else:
            self._write(payload, path, metric, reason)
            self._raise_write_error()
            self._announce(loop)
        return path

    def payload(self, loop: Run, *, reason: str, metric: float | None) -> dict[str, Any]:
        """Everything a checkpoint holds, as plain data and tensors (the ``digest`` is added
        when it is written): the run's own state (``loop.state_dict()``: ``loop``, ``rng`` and
        ``data``), the model's, every plugin's and what this plugin notes about the file."""
        run = loop.state_dict()
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            **run,
            **({ranks.KEY: own} if (own := ranks.gather(loop, run)) is not None else {}),
            "model": _model_state(loop.model),
            "plugins": {k: v for k, v in loop.plugin_states().items() if v is not None},
            "meta": {"reason": reason, "time": time.time(), "metric": metric, "monitor": self.monitor,
                     "status": loop.state.status},
        }

    def _save_sharded(self, loop: Run, position: Position, rest: dict[str, Any],
                      shards: dict[str, Any], metric: float | None, reason: str) -> Path | None:
        """A checkpoint of a sharded run (a folder, written by every rank: see
        :mod:`hookfit.plugins.checkpoint.sharded`), in the foreground: the ranks write together."""
        import torch.distributed as dist

        self._wait()
        self._raise_write_error()
        where: list[Any] = [None]
        if loop.is_main:
            path = self.directory(loop).absolute() / self.filename(position, reason)
            path = path.with_suffix(sharded.SHARDED_SUFFIX)
            self._sharded_saves += 1
            where = [(str(path), f".{path.name}.{os.getpid()}-{self._sharded_saves}.tmp")]
        if dist.is_available() and dist.is_initialized():
            dist.broadcast_object_list(where, src=0)  # rank 0's folder, for every rank's part
        folder, tmp_name = where[0]
        path = Path(folder)
        self._write(rest, path, metric, reason, shards=shards, tmp=path.with_name(tmp_name), main=loop.is_main)
        self._raise_write_error()
        self._announce(loop)
        return path if loop.is_main else None

    def _write(self, payload: dict[str, Any], path: Path, metric: float | None, reason: str,
               shards: dict[str, Any] | None = None, tmp: Path | None = None, main: bool = True) -> None:
        step = int(payload["loop"]["step"])
        try:
            if shards:
                assert tmp is not None  # given with the shards (_save_sharded)
                sharded.write(payload, shards, tmp, path, main, self._save_file)
            else:
                self._save_file(payload, path)  # on the writer thread for background saves
        except Exception as error:  # noqa: BLE001 - reported below, as configured
            self.failed_saves += 1
            if self.on_save_error == "raise":
                self._write_error = error
                return
            kind = f"{type(error).__name__}:{getattr(error, 'errno', '')}"
            if kind not in self._warned and main:
                self._warned.add(kind)
                warnings.warn(
                    f"checkpoint: could not write {path} ({type(error).__name__}: {error}); the "
                    f"previous checkpoints are kept and training goes on",
                    CheckpointWarning, stacklevel=2)
            return
        if not main:
            self._follow(path, metric, reason)
            return
        self._written.append((str(path), reason, step))  # announced on the training thread
        if reason == "failure":
            return
        if path in self.saved:  # the same position written again
            self.saved.remove(path)
        self.saved.append(path)
        self._follow(path, metric, reason)
        self._prune()

    def _follow(self, path: Path, metric: float | None, reason: str) -> None:
        """Take ``path``, a checkpoint written whole (by this process, or by the main one),
        as the last, and as the best if its metric improves on the best."""
        if reason == "failure":
            return
        self.last = path
        if metric is not None and self.monitor is not None:
            self._monitor.update(metric, at=path)

    def _share_directory(self, loop: Run) -> None:
        """Several processes: the main one says where it writes (its run folder may be one
        the others would name differently), so that every process knows the best and the last
        checkpoint's path. One broadcast at ``fit_start``, where every process is."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        where: list[Any] = [str(self.directory(loop)) if loop.is_main else None]  # as the main one names it
        dist.broadcast_object_list(where, src=0)
        self._main_dir = None if loop.is_main else Path(where[0])

    @staticmethod
    def _save_file(payload: dict[str, Any], path: Path) -> None:
        payload["digest"] = digest(payload)
        atomic_save(payload, path)

    def _prune(self) -> None:
        keep = set(self.saved[-self.keep_last:])
        if self.best is not None:
            keep.add(self.best[1])
        for old in [p for p in self.saved if p not in keep]:
            try:
                sharded.remove(old)
            except FileNotFoundError:
                pass
            except OSError:
                continue  # kept on the list: tried again at the next save
            self.saved.remove(old)

    def _announce(self, loop: Run) -> None:
        """``checkpoint_saved`` for every write finished since the last call (on the training
        thread: a background write only queues its completion)."""
        written = self._written
        if not written:
            return
        call = loop.hooks.checkpoint_saved
        while written:
            path, reason, step = written.popleft()
            if call is not None:
                call(loop, path, reason, step)

    def _wait(self) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def _raise_write_error(self) -> None:
        error, self._write_error = self._write_error, None
        if error is not None:
            raise error

    def _remove_stale_temporaries(self, loop: Run) -> None:
        """Temporary files of writes that a killed process left (``kill -9`` during a
        background write): removed at the next start of the run (main process only)."""
        folder = self._known_directory(loop)
        if folder is not None:
            folders.remove_stale_temporaries(folder)

    # -- resuming (which checkpoint, restored how: hookfit.plugins.checkpoint.resuming) ------
    def _adopt(self, loop: Run, position: Mapping[str, Any]) -> None:
        """Take the checkpoints already in this run's folder as this run's, so ``keep_last``
        holds across resumes (the file resumed from included): sorted by position, those
        beyond the one resumed from (an abandoned continuation) first, so pruned first."""
        folder = self._known_directory(loop)
        if folder is None:
            return
        step = position["step"]
        files = checkpoint_files(folder)
        files.sort(key=lambda p: (position_of(p)[0] <= step, position_of(p), p.stat().st_mtime))
        self.saved = files
        self._prune()


def _inside_training(position: Position) -> bool:
    """Whether the run stands inside an epoch's training stage (not at an epoch's start)."""
    return position.stage == "train" and (position.batch > 0 or position.val_due)
