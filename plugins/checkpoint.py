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

import os
import random
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from hookfit import HookfitWarning, hookimpl

FORMAT = "hookfit-checkpoint"
FORMAT_VERSION = 1
SUFFIX = ".pt"


class CheckpointWarning(HookfitWarning):
    """A checkpoint could not be written, or a bad one was skipped at resume."""


class CheckpointError(RuntimeError):
    """A checkpoint file cannot be used: torn, foreign, or from a newer format."""


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
        files = sorted((p for p in folder.glob(f"epoch*{SUFFIX}") if p.is_file()),
                       key=lambda p: (p.name, p.stat().st_mtime), reverse=True)
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


# -- files ----------------------------------------------------------------------------------


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` so that a crash leaves the old file or the new, never a torn
    one: temporary file in the same folder, flush, fsync, rename, fsync of the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            sink = _Sink(f)
            try:
                torch.save(obj, sink)
            except RuntimeError:
                if sink.error is not None:  # torch's writer hides the OSError (disk full...)
                    raise sink.error from None
                raise
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Sink:
    """A file for ``torch.save`` that remembers the operating system's error on a write."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.file.flush()


def read(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True`` and check its format and version."""
    path = Path(path)
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(
            f"checkpoint: {path} is not a whole hookfit checkpoint (torn, truncated or not a "
            f"torch file): {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        ) from error
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint: {path} is not a hookfit checkpoint (no '{FORMAT}' format marker)")
    version = data.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint: {path} has format version {version!r}, newer than this hookfit reads "
            f"({FORMAT_VERSION}); upgrade hookfit to resume from it")
    return data


def _snapshot(obj: Any) -> Any:
    """A copy in which every tensor is cloned: later training cannot change it."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_snapshot(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_snapshot(v) for v in obj)
    return obj


def _unwrap(module: Any) -> Any:
    """The user's module inside a (Distributed)DataParallel wrapper."""
    parallel = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    return module.module if isinstance(module, parallel) else module


def _model_state(model: Any) -> Any:
    if model is None:
        return None
    if isinstance(model, torch.nn.Module):
        return _unwrap(model).state_dict()
    if isinstance(model, Mapping):
        return {k: _model_state(v) for k, v in model.items()}
    return [_model_state(v) for v in model]


def _load_model(model: Any, state: Any, path: Path) -> None:
    if model is None or state is None:
        if (model is None) != (state is None):
            raise CheckpointError(f"checkpoint: {path} {'has' if state is not None else 'lacks'} a model, this run {'lacks' if model is None else 'has'} one")
        return
    if isinstance(model, torch.nn.Module):
        try:
            _unwrap(model).load_state_dict(state)
        except RuntimeError as error:
            raise CheckpointError(f"checkpoint: the model in {path} does not fit this run's model: {error}") from error
    elif isinstance(model, Mapping):
        if set(model) != set(state):
            raise CheckpointError(f"checkpoint: {path} has models {sorted(state)}, this run {sorted(model)}")
        for key, module in model.items():
            _load_model(module, state[key], path)
    else:
        for module, sub in zip(model, state, strict=True):
            _load_model(module, sub, path)


def _rng_state() -> dict[str, Any]:
    version, keys, gauss = random.getstate()
    out: dict[str, Any] = {"python": [version, list(keys), gauss], "torch": torch.get_rng_state()}
    try:
        import numpy
    except ImportError:
        numpy = None  # type: ignore[assignment]
    if numpy is not None:
        name, keys_np, pos, has_gauss, cached = numpy.random.get_state()
        out["numpy"] = [name, torch.from_numpy(keys_np.astype("int64")), pos, has_gauss, cached]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _set_rng_state(state: Mapping[str, Any]) -> None:
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy

        name, keys_np, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((name, keys_np.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
