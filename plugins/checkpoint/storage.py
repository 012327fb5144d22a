"""checkpoint storage: the file format, atomic writes, the checks of a file's
contents and the listing of a folder's checkpoints. The policy (when to save, what to keep,
which file to resume from) is in :mod:`hookfit.plugins.checkpoint.plugin`."""

from __future__ import annotations

import errno
import math
import os
import pickle
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable

import torch

from hookfit.errors import user_level
from hookfit.files import FileWarning
from hookfit.plugins.checkpoint.digests import PIECE, digest
from hookfit.position import check_position, check_rng

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.position import Position

FORMAT = "hookfit-checkpoint"
FORMAT_VERSION = 1
SUFFIX = ".pt"
KEYS = ("loop", "model", "plugins", "rng", "data", "meta")
"""What a checkpoint holds besides ``format``, ``version`` and ``digest``."""


class CheckpointError(RuntimeError):
    """A checkpoint file cannot be used: torn, foreign, from a newer format, holding an object
    that a safe load refuses, or with contents that do not match what a checkpoint holds (missing
    keys, a bad RNG state, an impossible position, tensors or values that changed since it was written)."""


class CheckpointWarning(FileWarning):
    """A checkpoint could not be written (the one policy for files: warn once, keep
    training), a bad one was skipped at resume, or checkpoints cannot do what was asked in
    this run (no model to save, a monitored metric the run does not produce)."""


# -- files ----------------------------------------------------------------------------------


def atomic_save(obj: Any, path: Path, between: Callable[[], None] | None = None) -> None:
    """``torch.save`` to ``path`` so that a crash leaves the old file or the new, never a torn
    one: temporary file ``.<name>.<pid>.tmp`` in the same folder, flush, fsync, rename, fsync
    of the folder. ``between`` is called before each piece written (a background writer
    waits there while training needs the machine)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            sink = _Sink(f, between)
            try:
                torch.save(obj, sink)  # type: ignore[arg-type]  # takes any object with write(), annotated IO[bytes]
            except RuntimeError:
                if sink.error is not None:  # torch's writer hides the OSError (disk full...)
                    raise sink.error from None
                raise
            f.flush()
            os.fsync(f.fileno())
        refuse_listed(path)
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


def _why_unread(error: Exception) -> str:
    """What ``torch.load`` said of a file it could not read, without its advice to load with
    ``weights_only=False`` (wrong for a torn file, and unsafe): the unpickler's own reason."""
    text = str(error)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1].split("Check the documentation", 1)[0]
        return " ".join(text.split())
    return text.splitlines()[0] if text else ""


_REFUSED = re.compile(r"Unsupported global: GLOBAL (\S+)")
"""How torch's safe load names an object it refuses to make (a class or function the file names)."""


def _unreadable(path: Path, error: Exception) -> str:
    """Why ``torch.load`` could not read the checkpoint ``path``: a file holding an object that a safe load refuses
    (a plugin's state that was not plain data), or a file that is not a whole checkpoint."""
    why = _why_unread(error)
    refused = _REFUSED.search(why) if isinstance(error, pickle.UnpicklingError) else None
    if refused is not None:
        return (f"checkpoint: {path} holds an object that a safe load refuses, {refused[1]}: hookfit reads a "
                f"checkpoint as plain data and tensors, running no code from the file, and this one holds more (a "
                f"plugin's save_state that returned an object of another type wrote it, or it is no hookfit file): "
                f"it cannot be resumed from safely")
    return (f"checkpoint: {path} is not a whole hookfit checkpoint (torn, truncated or not a torch file): "
            f"{type(error).__name__}: {why}")


class _Sink:
    """A file for ``torch.save`` that remembers the operating system's error on a write."""

    def __init__(self, file: BinaryIO, between: Callable[[], None] | None = None) -> None:
        self.file = file
        self.between = between
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            if self.between is None:
                return self.file.write(data)
            view = memoryview(data).cast("B")
            for start in range(0, len(view), PIECE):
                self.between()
                self.file.write(view[start:start + PIECE])
            return len(view)
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


# -- reading and checking -------------------------------------------------------------------


def read(path: str | os.PathLike[str], train_data: Any = None) -> dict[str, Any]:
    """Load a checkpoint (a file, or the ``state.pt`` of a sharded checkpoint's folder, whose
    sharded tensors stay placeholders) with ``weights_only=True`` and check it: its format and version,
    that it holds every entry of a checkpoint, a usable RNG state, a possible position (one
    within ``train_data`` when that is given and has a length), and contents that match its
    digest; a sharded checkpoint's other files too, against the digests ``state.pt`` records,
    and DCP's metadata, read without running code
    (:func:`hookfit.plugins.checkpoint.shardfiles.verify`). Each problem is a
    :class:`CheckpointError` naming the file and what does not match."""
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
        raise CheckpointError(_unreadable(path, error)) from error
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint: {path} is not a hookfit checkpoint (no '{FORMAT}' format marker)")
    version = data.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint: {path} has format version {version!r}, newer than this hookfit reads "
            f"({FORMAT_VERSION}); upgrade hookfit to resume from it")
    check(data, path, train_data)
    if source is not path:  # a sharded checkpoint: its shards and DCP's metadata, before anything reads them
        from hookfit.plugins.checkpoint.shardfiles import verify

        verify(path, data)
    return data


def _meta(path: Path) -> Any:
    """A checkpoint file's ``meta``, read without reading its tensors (a memory map); raises what reading raised."""
    return torch.load(path / "state.pt" if path.is_dir() else path, map_location="cpu", weights_only=True,
                      mmap=True)["meta"]


def score_of(path: Path, monitor: str) -> float | None:
    """The finite ``monitor`` score a checkpoint file carries (``meta["metric"]``), read without reading its tensors
    (a memory map), or ``None``: another metric, none, a failure's file, or a file that cannot be read."""
    try:
        meta = _meta(path)
        metric = meta["metric"] if meta.get("monitor") == monitor and meta.get("reason") != "failure" else None
    except Exception:  # noqa: BLE001 - unreadable here is unscored: read() names what is wrong when it is used
        return None
    return float(metric) if isinstance(metric, (int, float)) and math.isfinite(metric) else None


def run_of(path: Path) -> tuple[str | None, str | None]:
    """``(identity, name)`` of the run that wrote the checkpoint ``path`` as its ``meta`` records them
    (:attr:`hookfit.run.Run.identity`'s ``key``, the run's name), read without reading its tensors; ``(None, None)``
    for a file that records none or cannot be read (:func:`read` says why where it is used)."""
    try:
        meta = _meta(path)
        recorded = meta.get("identity"), meta.get("name")
    except Exception:  # noqa: BLE001 - unreadable here is unattributed: read() names what is wrong when it is used
        return None, None
    return (recorded[0] if isinstance(recorded[0], str) else None, recorded[1] if isinstance(recorded[1], str) else None)


def check(data: Mapping[str, Any], path: Path, train_data: Any = None) -> None:
    """The checks of :func:`read` after format and version (see there)."""
    missing = [key for key in KEYS if key not in data]
    if missing:
        raise CheckpointError(f"checkpoint: {path} lacks {', '.join(map(repr, missing))}: not a whole "
                              f"hookfit checkpoint (it has {', '.join(map(repr, data))})")
    for key in ("plugins", "rng", "data", "meta"):
        if not isinstance(data[key], Mapping):
            raise CheckpointError(f"checkpoint: {path}: '{key}' is a {type(data[key]).__name__}, not a mapping")
    try:  # the run's own checks of the state it will be given back
        check_position(data["loop"], train_data)
        check_rng(data["rng"])
    except ValueError as error:
        raise CheckpointError(f"checkpoint: {path}: {error}") from error
    saved = data.get("digest")
    if saved is None:
        warnings.warn(f"checkpoint: {path} has no digest (written by an older hookfit): its tensors "
                      f"cannot be checked for changes since it was written", CheckpointWarning, stacklevel=user_level())
        return
    if saved != digest(data):
        raise CheckpointError(
            f"checkpoint: {path}: its contents do not match its digest ({str(saved)[:24]}...): a tensor or "
            f"value changed since it was written (bit flips on the disk, or an edit)")


# -- listing --------------------------------------------------------------------------------

_NAME = re.compile(r"epoch(\d+)-step(\d+)")


def filename(position: Position, reason: str, tag: int = 0) -> str:
    """``epochNNNN-stepNNNNNNNNN.pt``, the epoch counted from 1: the epoch in progress, or
    the one just completed at an epoch's boundary, so names sort in run order (``failed-``
    before it for a checkpoint of a failure); ``-vT`` before the suffix for a run of ``tag`` ``T``
    (:func:`tag_of`: a run that began in a folder holding checkpoints of another run)."""
    epoch, step = position.epoch, position.step
    at_start = position.stage == "train" and position.batch == 0 and not position.val_due
    shown = epoch if (at_start and epoch > 0) else epoch + 1
    stem = "failed-" if reason == "failure" else ""
    version = f"-v{tag}" if tag else ""
    return f"{stem}epoch{shown:04d}-step{step:09d}{version}{SUFFIX}"


_TAG = re.compile(r"-v(\d+)\.(?:pt|dcp)$")


def tag_of(path: Path) -> int:
    """The tag of the run that wrote the checkpoint ``path``, as its name says: ``T`` for ``...-vT.pt`` (or
    ``.dcp``), 0 for a name without one. A run that begins in a folder holding checkpoints it does not continue
    takes one more than the highest tag there (:func:`hookfit.plugins.checkpoint.folders.tag`), so its files never
    take the names of another run's, which stay where they are; a run that continues those of a folder keeps the
    tag of the one it resumed from. One tag, one run (and its resumes)."""
    match = _TAG.search(path.name)
    return int(match[1]) if match else 0


EARLIER = ".earlier-runs"
"""In a checkpoint folder: the names of earlier runs' checkpoints there, one a line, that no listing takes, no
run writes over (:func:`refuse_listed`) and no ``keep_last`` prunes. Read, written by no run: a run's
checkpoints stay where they were written, named apart from other runs' (:func:`tag_of`)."""

ASIDE = re.compile(r"earlier-run-(\d+)")
"""The name of a checkpoint folder's subfolder holding an earlier run's checkpoints moved there (``earlier-run-1/``,
``-2`` next): read (resumed or exported by their path), made by no run: a run's checkpoints stay where they were
written, named apart from other runs' (:func:`tag_of`)."""

PATTERNS = ("epoch*", "failed-epoch*")
"""The names of a run's checkpoints in a folder: ``epoch*.pt`` files and sharded checkpoints' folders
``epoch*.dcp``, and those of a failure, ``failed-`` before them."""


def checkpoint_files(folder: Path) -> list[Path]:
    """The checkpoints in ``folder``, newest first: files ``epoch*.pt`` and sharded
    checkpoints' folders ``epoch*.dcp`` (``failed-*`` ones are not listed, nor those of earlier
    runs moved into ``earlier-run-N/`` subfolders or listed in :data:`EARLIER`). A folder that several runs
    wrote in holds each run's under its tag (:func:`tag_of`): the run written last first (by the time its newest
    checkpoint records, ``meta["time"]``, which a copy keeps; the higher tag where two are equal), each run's
    checkpoints by name, the newest first."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob(f"epoch*{SUFFIX}") if p.is_file()]
    found += [p for p in folder.glob("epoch*.dcp") if p.is_dir()]
    if aside := listed(folder):
        found = [p for p in found if p.name not in aside]
    times = {p: p.stat().st_mtime for p in found}
    runs: dict[int, list[Path]] = {}
    for path in found:
        runs.setdefault(tag_of(path), []).append(path)
    if len(runs) < 2:
        return sorted(found, key=lambda p: (p.stem, times[p]), reverse=True)
    written = {tag: written_at(max(paths, key=lambda p: (p.stem, times[p]))) for tag, paths in runs.items()}
    return sorted(found, key=lambda p: (written[tag_of(p)], tag_of(p), p.stem, times[p]), reverse=True)


def written_at(path: Path) -> float:
    """When the checkpoint ``path`` was written, as it records (``meta["time"]``), else as the file's time says."""
    try:
        when = _meta(path).get("time")
    except Exception:  # noqa: BLE001 - unreadable here: the file's time (read() says what is wrong where it is used)
        when = None
    return float(when) if isinstance(when, (int, float)) and math.isfinite(when) else path.stat().st_mtime


def run_files(folder: Path) -> list[str]:
    """The names of every checkpoint of a run in ``folder`` (:data:`PATTERNS`: those of a failure too), sorted."""
    if not folder.is_dir():
        return []
    return sorted({p.name for pattern in PATTERNS for p in folder.glob(pattern)
                   if p.suffix in (SUFFIX, ".dcp") and (p.is_file() or p.is_dir())})


def earlier(folder: Path) -> list[Path]:
    """The checkpoints of earlier runs set aside in ``folder`` (``failed-*`` ones aside): those in its
    ``earlier-run-N/`` subfolders (:data:`ASIDE`), the last set aside (the highest ``N``) first, and those listed in
    :data:`EARLIER`; each group newest by name first."""
    if not folder.is_dir():
        return []
    subfolders = [p for p in folder.iterdir() if ASIDE.fullmatch(p.name) and p.is_dir()]
    found: list[Path] = []
    for subfolder in sorted(subfolders, key=lambda p: int(p.name.rsplit("-", 1)[1]), reverse=True):
        found += checkpoint_files(subfolder)
    return found + sorted((p for name in listed(folder) if (p := folder / name).exists()), key=lambda p: p.stem,
                          reverse=True)


def listed(folder: Path) -> set[str]:
    """The names :data:`EARLIER` lists in ``folder``."""
    try:
        return set((folder / EARLIER).read_text().split())
    except OSError:  # (none there)
        return set()


def refuse_listed(path: Path) -> None:
    """Before a checkpoint is written at ``path``: a ``FileExistsError`` when an earlier run's checkpoint of that
    name stays in the folder (:data:`EARLIER`), which no write replaces."""
    if path.name in listed(path.parent):
        raise FileExistsError(errno.EEXIST, f"an earlier run's checkpoint of that name, which could not be moved "
                                            f"aside (listed in {EARLIER}), is there and is not written over", str(path))


def position_of(path: Path) -> tuple[int, int]:
    """``(step, epoch)`` as a checkpoint's name says (``epoch0003-step000000047.pt``), for
    sorting files in run order; ``(-1, -1)`` for a name that does not say."""
    match = _NAME.search(path.name)
    return (int(match[2]), int(match[1])) if match else (-1, -1)
