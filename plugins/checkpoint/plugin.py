"""checkpoint plugin: the policy. When to save (epochs, steps, seconds, a graceful stop, a
failure), which checkpoints to keep (``keep_last``, the best by ``monitor``), the background
writer thread, and which checkpoint to resume from and how to restore it. The file format and
the atomic writes are in :mod:`hookfit.plugins.checkpoint.storage`, what a checkpoint holds
beyond the plugins' states in :mod:`hookfit.plugins.checkpoint.state`."""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from hookfit import HookfitWarning, hookimpl
from hookfit.plugins.checkpoint.state import _load_model, _model_state, _rng_state, _set_rng_state, _snapshot
from hookfit.plugins.checkpoint.storage import (
    FORMAT,
    FORMAT_VERSION,
    SUFFIX,
    CheckpointError,
    atomic_save,
    checkpoint_files,
    read,
)


class CheckpointWarning(HookfitWarning):
    """A checkpoint could not be written, or a bad one was skipped at resume."""


class Checkpoint:
    """Atomic checkpoints of model, optimizers, plugins, position and RNG; exact resume."""

    name = "checkpoint"

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
        strict: bool = True,
        fallback: bool = False,
        background: bool = True,
    ) -> None:
        for what, value in (("every_n_epochs", every_n_epochs), ("every_n_steps", every_n_steps)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"checkpoint: {what} must be a positive integer or None, got {value!r}")
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"checkpoint: keep_last must be a positive integer, got {keep_last!r}")
        if mode not in ("min", "max"):
            raise ValueError(f"checkpoint: mode must be 'min' or 'max', got {mode!r}")
        if on_save_error not in ("warn", "raise"):
            raise ValueError(f"checkpoint: on_save_error must be 'warn' or 'raise', got {on_save_error!r}")
        if monitor is not None and monitor.count("/") != 1:
            raise ValueError(f"checkpoint: monitor must look like 'valid/loss' (stage/metric), got {monitor!r}")
        self.dir = Path(dir) if dir is not None else None
        self.every_n_epochs = every_n_epochs
        self.every_n_steps = every_n_steps
        self.every_seconds = every_seconds
        self.keep_last = keep_last
        self.monitor = monitor
        self.mode = mode
        self.on_interrupt = on_interrupt
        self.on_failure = on_failure
        self.on_save_error = on_save_error
        self.strict = strict
        self.fallback = fallback
        self.background = background
        self.saved: list[Path] = []  # this run's checkpoints still on disk, oldest first
        self.failed_saves = 0
        self.resumed_from: Path | None = None
        self.best: tuple[float, Path] | None = None
        self._loop: Any = None
        self._stage: str | None = None
        self._done = (0, 0, "train")  # the position to save: epoch, training batches done, next stage
        self._last_time = 0.0
        self._last_value: float | None = None
        self._writer: threading.Thread | None = None
        self._write_error: BaseException | None = None
        self._warned: set[str] = set()

    # -- events ---------------------------------------------------------------------------
    @hookimpl
    def configure(self, loop: Any) -> None:
        if self.every_n_steps is not None or self.every_seconds is not None:
            # a per-batch hook only when saves can fall mid-epoch: otherwise batches cost nothing
            loop.pm.register(_EveryStep(self), name="checkpoint.steps")

    @hookimpl
    def fit_start(self, loop: Any) -> None:
        self._loop = loop
        self._last_time = time.monotonic()
        self._done = (loop.state.epoch, 0, "train")

    @hookimpl
    def resume(self, loop: Any, source: str) -> Any:
        path = self._resolve(loop, source)
        if path is None:
            return False
        self._restore(loop, path)
        self.resumed_from = path
        return path

    @hookimpl
    def stage_start(self, stage: str) -> None:
        self._stage = stage

    @hookimpl
    def stage_end(self, loop: Any, stage: str) -> None:
        if stage == "train":
            self._done = (loop.state.epoch, loop.state.batch_idx + 1, "valid")
        self._stage = None

    @hookimpl
    def epoch_metrics(self, stage: str, metrics: Any) -> None:
        if self.monitor is None:
            return
        want_stage, key = self.monitor.split("/")
        if stage == want_stage and key in metrics.values:
            self._last_value = float(metrics.values[key].epoch)

    @hookimpl(trylast=True)
    def epoch_end(self, loop: Any, epoch: int) -> None:
        self._done = (epoch + 1, 0, "train")
        if self.every_n_epochs is not None and (epoch + 1) % self.every_n_epochs == 0:
            self.save(loop, "epoch", metric=self._last_value)

    @hookimpl(tryfirst=True)  # before other plugins let go of their state
    def fit_end(self, loop: Any) -> None:
        state = loop.state
        if self._stage == "train":  # stopped after a whole training batch
            self._done = (state.epoch, state.batch_idx + 1, "train")
        try:
            graceful = state.status == "interrupted" and state.stop_reason != "KeyboardInterrupt"
            if graceful and self.on_interrupt:
                self.save(loop, "interrupt")
            elif state.status == "failed" and self.on_failure:
                self.save(loop, "failure")
        finally:
            self._wait()
            self._loop = None

    @hookimpl
    def save_state(self) -> dict[str, Any]:
        best = None if self.best is None else [self.best[0], str(self.best[1])]
        return {"best": best, "saved": [str(p) for p in self.saved]}

    @hookimpl
    def load_state(self, state: Mapping[str, Any]) -> None:
        if state.get("best") is not None:
            value, path = state["best"]
            if Path(path).exists():
                self.best = (value, Path(path))
        self.saved = [Path(p) for p in state.get("saved", []) if Path(p).exists()]

    # -- saving ---------------------------------------------------------------------------
    def directory(self, loop: Any) -> Path:
        """Where this run's checkpoints go."""
        return self.dir if self.dir is not None else loop.run_dir / "checkpoints"

    def save(self, loop: Any, reason: str, metric: float | None = None) -> Path | None:
        """Write a checkpoint of the run as it is now; returns its path (main process only)."""
        self._last_time = time.monotonic()
        self._raise_write_error()
        payload = self.payload(loop, *self._done, reason=reason, metric=metric)  # also on other ranks: collectives
        if not loop.is_main:
            return None
        folder = self.directory(loop)
        stem = "failed-" if reason == "failure" else ""
        path = folder / f"{stem}epoch{self._done[0]:04d}-step{loop.state.step:09d}{SUFFIX}"
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
        return path

    def payload(self, loop: Any, epoch: int, done: int, stage: str, *, reason: str,
                metric: float | None) -> dict[str, Any]:
        """Everything a checkpoint holds, as plain data and tensors."""
        state = loop.state
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "loop": {"epoch": epoch, "step": state.step, "resume_batch": done, "resume_stage": stage},
            "model": _model_state(loop.model),
            "plugins": {k: v for k, v in loop.plugin_states().items() if v is not None},
            "rng": _rng_state(),
            "data": {k: d.state_dict() for k, d in (("train", loop.train_data), ("valid", loop.val_data))
                     if hasattr(d, "state_dict") and hasattr(d, "load_state_dict")},
            "meta": {"reason": reason, "time": time.time(), "metric": metric, "monitor": self.monitor,
                     "status": state.status},
        }

    def _write(self, payload: dict[str, Any], path: Path, metric: float | None, reason: str) -> None:
        try:
            atomic_save(payload, path)
        except Exception as error:  # noqa: BLE001 - reported below, as configured
            self.failed_saves += 1
            if self.on_save_error == "raise":
                self._write_error = error
                return
            kind = f"{type(error).__name__}:{getattr(error, 'errno', '')}"
            if kind not in self._warned:
                self._warned.add(kind)
                warnings.warn(
                    f"checkpoint: could not write {path} ({type(error).__name__}: {error}); the "
                    f"previous checkpoints are kept and training goes on",
                    CheckpointWarning, stacklevel=2)
            return
        if reason == "failure":
            return
        self.saved.append(path)
        if metric is not None and self.monitor is not None and (
            self.best is None or (metric < self.best[0] if self.mode == "min" else metric > self.best[0])
        ):
            self.best = (metric, path)
        self._prune()

    def _prune(self) -> None:
        keep = set(self.saved[-self.keep_last:])
        if self.best is not None:
            keep.add(self.best[1])
        for old in [p for p in self.saved if p not in keep]:
            try:
                old.unlink()
            except FileNotFoundError:
                pass
            self.saved.remove(old)

    def _wait(self) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def _raise_write_error(self) -> None:
        error, self._write_error = self._write_error, None
        if error is not None:
            raise error

    # -- resuming -------------------------------------------------------------------------
    def _resolve(self, loop: Any, source: str) -> Path | None:
        if source != "latest":
            path = Path(source)
            if path.is_dir():
                return self._newest(path, required=True)
            if not path.exists():
                raise FileNotFoundError(f"checkpoint: resume={source!r}: no such file")
            return path
        if self.dir is not None or loop.run_dir_given:
            return self._newest(self.directory(loop), required=False)
        runs = sorted((p for p in Path("runs").glob("*/checkpoints") if p.is_dir()),
                      key=lambda p: p.stat().st_mtime, reverse=True)
        for folder in runs:
            found = self._newest(folder, required=False)
            if found is not None:
                return found
        return None

    def _newest(self, folder: Path, required: bool) -> Path | None:
        files = checkpoint_files(folder)
        if not files:
            if required:
                raise FileNotFoundError(f"checkpoint: no checkpoint in {folder}")
            return None
        if not self.fallback:
            return files[0]
        for path in files:
            try:
                read(path)
                return path
            except CheckpointError as error:
                warnings.warn(f"{error}; trying an older one (fallback=True)", CheckpointWarning, stacklevel=2)
        raise CheckpointError(f"checkpoint: none of the {len(files)} checkpoints in {folder} is usable")

    def _restore(self, loop: Any, path: Path) -> None:
        data = read(path)
        _load_model(loop.model, data["model"], path)
        loop.load_plugin_states(data["plugins"], strict=self.strict)
        for key, target in (("train", loop.train_data), ("valid", loop.val_data)):
            if key in data["data"] and hasattr(target, "load_state_dict"):
                target.load_state_dict(data["data"][key])
        _set_rng_state(data["rng"])
        position = data["loop"]
        loop.state.epoch = position["epoch"]
        loop.state.step = position["step"]
        loop.state.resume_batch = position["resume_batch"]
        loop.state.resume_stage = position["resume_stage"]
        self._done = (position["epoch"], position["resume_batch"], position["resume_stage"])


class _EveryStep:
    """The checkpoint plugin's per-batch part, registered only when saves are due by step or
    by time."""

    def __init__(self, owner: Checkpoint) -> None:
        self.owner = owner

    @hookimpl(trylast=True)  # after every other plugin took the batch into account
    def batch_end(self, loop: Any, batch_idx: int) -> None:
        owner = self.owner
        if owner._stage != "train":
            return
        step = loop.state.step
        if (owner.every_n_steps is not None and step % owner.every_n_steps == 0) or (
            owner.every_seconds is not None and time.monotonic() - owner._last_time >= owner.every_seconds
        ):
            owner._done = (loop.state.epoch, batch_idx + 1, "train")
            owner.save(loop, "step")
