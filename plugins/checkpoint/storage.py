"""checkpoint storage: the file format, atomic writes, the digest, the checks of a file's
contents and the listing of a folder's checkpoints. The policy (when to save, what to keep,
which file to resume from) is in :mod:`hookfit.plugins.checkpoint.plugin`."""

from __future__ import annotations

import hashlib
import math
import os
import random
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hookfit.files import FileWarning

FORMAT = "hookfit-checkpoint"
FORMAT_VERSION = 1
SUFFIX = ".pt"
DIGEST = "blake2b"
"""The hash of a checkpoint's ``digest`` entry (:func:`digest`)."""
KEYS = ("loop", "model", "plugins", "rng", "data", "meta")
"""What a checkpoint holds besides ``format``, ``version`` and ``digest``."""
STAGES = ("train", "valid")


class CheckpointError(RuntimeError):
    """A checkpoint file cannot be used: torn, foreign, from a newer format, or with contents
    that do not match what a checkpoint holds (missing keys, a bad RNG state, an impossible
    position, tensors or values that changed since it was written)."""


class CheckpointWarning(FileWarning):
    """A checkpoint could not be written (the one policy for files: warn once, keep
    training), a bad one was skipped at resume, or checkpoints cannot do what was asked in
    this run (no model to save, a monitored metric the run does not produce)."""


# -- files ----------------------------------------------------------------------------------


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` so that a crash leaves the old file or the new, never a torn
    one: temporary file ``.<name>.<pid>.tmp`` in the same folder, flush, fsync, rename, fsync
    of the folder."""
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


_TMP = re.compile(r"^\..+\.(\d+)(?:-\d+|\.old)?\.tmp$")


def stale_temporaries(folder: Path) -> list[Path]:
    """The temporary files ``.<name>.<pid>.tmp`` (and folders of sharded checkpoints,
    ``.<name>.<pid>-<n>.tmp``) in ``folder`` left by a process that no longer runs (killed
    during a write): their pid is not a running process."""
    if not folder.is_dir():
        return []
    stale = []
    for path in folder.iterdir():
        match = _TMP.match(path.name)
        if match is None or not (path.is_file() or path.is_dir()):
            continue
        pid = int(match[1])
        if pid == os.getpid() or _running(pid):
            continue
        stale.append(path)
    return stale


def _running(pid: int) -> bool:
    if pid <= 0:
        return True  # not a process of ours to judge: leave the file alone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # somebody else's process
        return True
    except OverflowError:
        return False
    return True


# -- digest ---------------------------------------------------------------------------------


def digest(payload: Mapping[str, Any]) -> str:
    """``"blake2b:<hex>"`` over everything in ``payload`` but its ``digest`` entry: every
    tensor's dtype, shape and bytes and every other value, in a fixed order (mappings by
    their keys, sorted), so a bit that changed in a file after it was written is found."""
    h = hashlib.blake2b(digest_size=32)
    _feed(h, {k: v for k, v in payload.items() if k != "digest"})
    return f"{DIGEST}:{h.hexdigest()}"


def _feed(h: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        tensor = obj.detach()
        if tensor.layout != torch.strided:
            tensor = tensor.to_dense()
        tensor = tensor.cpu().contiguous().reshape(-1)
        h.update(f"T{tensor.dtype}{tuple(obj.shape)}:".encode())
        data = tensor.view(torch.uint8) if tensor.element_size() and tensor.dtype != torch.uint8 else tensor
        h.update(memoryview(data.numpy()) if data.numel() else b"")
    elif isinstance(obj, Mapping):
        h.update(f"D{len(obj)}:".encode())
        for key, value in sorted(obj.items(), key=lambda kv: (type(kv[0]).__name__, repr(kv[0]))):
            _feed(h, key)
            _feed(h, value)
    elif isinstance(obj, (list, tuple)):
        h.update(f"{'L' if isinstance(obj, list) else 'U'}{len(obj)}:".encode())
        for value in obj:
            _feed(h, value)
    else:
        text = repr(obj)
        h.update(f"V{type(obj).__name__}:{len(text)}:{text}".encode())


# -- reading and checking -------------------------------------------------------------------


def read(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a checkpoint (a file, or the ``state.pt`` of a sharded checkpoint's folder, whose
    sharded tensors stay placeholders) with ``weights_only=True`` and check it: its format and version,
    that it holds every entry of a checkpoint, a usable RNG state, a possible position, and
    contents that match its digest. Each problem is a :class:`CheckpointError` naming the
    file and what does not match."""
    path = Path(path)
    source = path
    if path.is_dir():  # a sharded checkpoint (see hookfit.plugins.checkpoint.sharded)
        source = path / "state.pt"
        if not source.is_file() or not (path / ".metadata").is_file():
            raise CheckpointError(f"checkpoint: {path} is not a whole sharded checkpoint (it lacks "
                                  f"{'state.pt' if not source.is_file() else 'the DCP .metadata'})")
    try:
        data = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(
            f"checkpoint: {path} is not a whole hookfit checkpoint (torn, truncated or not a "
            f"torch file): {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        ) from error
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint: {path} is not a hookfit checkpoint (no '{FORMAT}' format marker)")
    version = data.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint: {path} has format version {version!r}, newer than this hookfit reads "
            f"({FORMAT_VERSION}); upgrade hookfit to resume from it")
    check(data, path)
    return data


def check(data: Mapping[str, Any], path: Path) -> None:
    """The checks of :func:`read` after format and version (see there)."""
    missing = [key for key in KEYS if key not in data]
    if missing:
        raise CheckpointError(f"checkpoint: {path} lacks {', '.join(map(repr, missing))}: not a whole "
                              f"hookfit checkpoint (it has {', '.join(map(repr, data))})")
    for key in ("plugins", "rng", "data", "meta"):
        if not isinstance(data[key], Mapping):
            raise CheckpointError(f"checkpoint: {path}: '{key}' is a {type(data[key]).__name__}, not a mapping")
    _check_position(data["loop"], path)
    _check_rng(data["rng"], path)
    saved = data.get("digest")
    if saved is None:
        warnings.warn(f"checkpoint: {path} has no digest (written by an older hookfit): its tensors "
                      f"cannot be checked for changes since it was written", CheckpointWarning, stacklevel=3)
        return
    if saved != digest(data):
        raise CheckpointError(
            f"checkpoint: {path}: its contents do not match its digest ({str(saved)[:24]}...): a tensor or "
            f"value changed since it was written (bit flips on the disk, or an edit)")


def _natural(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 0


def _check_position(position: Any, path: Path) -> None:
    if not isinstance(position, Mapping):
        raise CheckpointError(f"checkpoint: {path}: 'loop' (the position) is a {type(position).__name__}, "
                              "not a mapping")
    for key in ("epoch", "step", "resume_batch"):
        if key not in position:
            raise CheckpointError(f"checkpoint: {path}: the position ('loop') lacks {key!r}")
        if not _natural(position[key]):
            raise CheckpointError(f"checkpoint: {path}: impossible position: loop[{key!r}] is "
                                  f"{position[key]!r}, not a count (an integer >= 0)")
    stage = position.get("resume_stage")
    if stage not in STAGES:
        raise CheckpointError(f"checkpoint: {path}: impossible position: loop['resume_stage'] is {stage!r}, "
                              f"not 'train' or 'valid'")
    if not isinstance(position.get("val_due", False), bool):
        raise CheckpointError(f"checkpoint: {path}: impossible position: loop['val_due'] is "
                              f"{position['val_due']!r}, not True or False")


def check_data_length(position: Mapping[str, Any], train_data: Any, path: Path) -> None:
    """The position's training batches done fit in ``train_data`` (when it has a length)."""
    try:
        length = len(train_data)
    except TypeError:
        return
    if position["resume_batch"] > length:
        raise CheckpointError(
            f"checkpoint: {path}: impossible position: {position['resume_batch']} training batches done "
            f"in epoch {position['epoch'] + 1}, and this run's training data has {length}")


def _check_rng(rng: Mapping[str, Any], path: Path) -> None:
    def bad(what: str, why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint: {path}: bad RNG state: rng[{what!r}] {why}")

    for key in ("python", "torch"):
        if key not in rng:
            raise bad(key, "is missing")
    py = rng["python"]
    keys_len = len(random.getstate()[1])
    if not isinstance(py, (list, tuple)) or len(py) != 3:
        raise bad("python", f"is a {type(py).__name__}, not [version, keys, gauss]")
    version, keys, gauss = py
    if not isinstance(version, int) or not isinstance(keys, (list, tuple)) or len(keys) != keys_len or not all(
            isinstance(k, int) and not isinstance(k, bool) for k in keys) or not (
            gauss is None or isinstance(gauss, float)):
        size = len(keys) if isinstance(keys, (list, tuple)) else type(keys).__name__
        raise bad("python", f"is not Python's random state (keys: {size}, expected {keys_len} integers)")
    here = torch.get_rng_state()
    state = rng["torch"]
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.shape != here.shape:
        what = (f"a {state.dtype} tensor of shape {tuple(state.shape)}" if isinstance(state, torch.Tensor)
                else f"a {type(state).__name__}")
        raise bad("torch", f"is {what}, expected a uint8 tensor of shape {tuple(here.shape)}")
    if "numpy" in rng:
        np_state = rng["numpy"]
        if not isinstance(np_state, (list, tuple)) or len(np_state) != 5:
            raise bad("numpy", f"is a {type(np_state).__name__}, not [name, keys, pos, has_gauss, cached]")
        name, np_keys, pos, has_gauss, cached = np_state
        if name != "MT19937" or not isinstance(np_keys, torch.Tensor) or np_keys.shape != (624,) or (
                np_keys.is_floating_point()) or not _natural(pos) or pos > 624 or not isinstance(has_gauss, int) or (
                not isinstance(cached, (int, float)) or not math.isfinite(float(cached))):
            raise bad("numpy", "is not NumPy's MT19937 state (name, 624 keys, position, gauss)")
    if "cuda" in rng:
        cuda = rng["cuda"]
        if not isinstance(cuda, (list, tuple)) or not all(
                isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 for t in cuda):
            raise bad("cuda", "is not a list of uint8 tensors (one per device)")


# -- listing --------------------------------------------------------------------------------

_NAME = re.compile(r"epoch(\d+)-step(\d+)")


def checkpoint_files(folder: Path) -> list[Path]:
    """The checkpoints in ``folder``, newest first: files ``epoch*.pt`` and sharded
    checkpoints' folders ``epoch*.dcp`` (``failed-*`` ones are not listed)."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob(f"epoch*{SUFFIX}") if p.is_file()]
    found += [p for p in folder.glob("epoch*.dcp") if p.is_dir()]
    return sorted(found, key=lambda p: (p.stem, p.stat().st_mtime), reverse=True)


def position_of(path: Path) -> tuple[int, int]:
    """``(step, epoch)`` as a checkpoint's name says (``epoch0003-step000000047.pt``), for
    sorting files in run order; ``(-1, -1)`` for a name that does not say."""
    match = _NAME.search(path.name)
    return (int(match[2]), int(match[1])) if match else (-1, -1)
