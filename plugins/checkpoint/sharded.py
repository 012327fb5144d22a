"""checkpoint sharded: checkpoints of a run whose state holds sharded tensors (``DTensor``,
as FSDP2 makes of parameters, gradients and optimizer states), written and read with
:mod:`torch.distributed.checkpoint` (DCP).

Such a checkpoint is a folder ``epochNNNN-stepNNNNNNNNN.dcp``: DCP's files (each rank writes
its own shards, in parallel, and rank 0 DCP's ``.metadata``) and ``state.pt``, the rest of the
checkpoint as a one-file checkpoint holds it (position, plugin states, RNG, digest), in which
every sharded tensor is replaced by a *placeholder*: a plain mapping that names the tensor's
key in DCP, its global shape, dtype and placements. The whole folder is written under a
temporary name and renamed when every rank's part is on disk: a crash leaves the old
checkpoints and a temporary folder, never a checkpoint that looks whole and is not. A write
that fails on any rank (a full or read-only disk) fails on every rank alike: the temporary
folder is removed and each rank raises the same error, which the plugin reports as it does a
one-file checkpoint's (a warning, training goes on).

With ``Checkpoint(background=True)`` (the default) a save blocks training for one copy of the
state into host memory and the ranks write in the background, with DCP's ``async_save`` on a
process group of the checkpoint's own, then :func:`finish` the folder as above
(:mod:`hookfit.plugins.checkpoint.shardwriter`); with ``background=False`` every rank writes in
the foreground (:func:`write`).

``state.pt`` records the digest of every other file of the folder (each rank's shards, DCP's
``.metadata``), checked before DCP reads anything, and DCP's metadata (a pickle) is read by
hookfit without running code: :mod:`hookfit.plugins.checkpoint.shardfiles`.

At resume every placeholder is loaded, by DCP, into a tensor of this run: the tensor at the
same place of the model's state dict when there is one of that shape (a sharded model's own
``DTensor``: each rank reads only its part, whatever the world size that wrote it); else a
``DTensor`` with the saved placements on the device mesh of the model's parameters; else (a
run without sharding) a whole tensor. So a checkpoint of 2 processes resumes on 1 or 4, and
one of an FSDP run on one process resumes on two.
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, cast

import torch

from hookfit.plugins.checkpoint import shardfiles
from hookfit.plugins.checkpoint.storage import CheckpointError, refuse_listed

SHARDED_SUFFIX = ".dcp"
STATE_FILE = "state.pt"
"""The file of a sharded checkpoint's folder that holds all but the sharded tensors."""
MARK = "__hookfit_shard__"
"""The key that makes a mapping in ``state.pt`` a placeholder of a sharded tensor."""


def _dtensor_type() -> Any:
    if "torch.distributed.tensor" not in sys.modules:  # never imported: no DTensor exists
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - a torch without torch.distributed
        return None
    return DTensor


def split(payload: Any) -> tuple[Any, dict[str, Any]]:
    """``payload`` with every ``DTensor`` replaced by a placeholder, and those tensors keyed by
    their place (``"model/0.weight"``); no tensors when nothing is sharded."""
    kind = _dtensor_type()
    shards: dict[str, Any] = {}
    if kind is None:
        return payload, shards

    def walk(obj: Any, path: tuple[str, ...]) -> Any:
        if isinstance(obj, kind):
            key = "/".join(path)
            shards[key] = obj
            return {MARK: key, "shape": list(obj.shape), "dtype": str(obj.dtype).removeprefix("torch."),
                    "placements": [_placement(p) for p in obj.placements]}
        if isinstance(obj, dict):
            return {k: walk(v, (*path, _part(k))) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v, (*path, str(i))) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(walk(v, (*path, str(i))) for i, v in enumerate(obj))
        return obj

    rest = walk(payload, ())
    return rest, shards


def _part(key: Any) -> str:
    """A mapping key as a part of a place: ``int`` keys (an optimizer's parameter indices)
    and ``str`` keys cannot collide (``#3`` against ``3``)."""
    return f"#{key}" if isinstance(key, int) else str(key).replace("/", "//")


def _placement(placement: Any) -> list[Any]:
    if placement.is_shard():
        return ["shard", int(placement.dim)]
    if placement.is_replicate():
        return ["replicate"]
    return ["partial"]


def _placements(saved: list[list[Any]]) -> list[Any] | None:
    from torch.distributed.tensor import Replicate, Shard

    out: list[Any] = []
    for item in saved:
        if item[0] == "shard":
            out.append(Shard(int(item[1])))
        elif item[0] == "replicate":
            out.append(Replicate())
        else:
            return None
    return out


def placeholders(obj: Any) -> list[Mapping[str, Any]]:
    """Every placeholder in ``obj`` (the contents of a ``state.pt``)."""
    found: list[Mapping[str, Any]] = []

    def walk(value: Any) -> None:
        if isinstance(value, Mapping):
            if MARK in value:
                found.append(value)
                return
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(obj)
    return found


def _dtype(name: Any, where: Path) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"checkpoint: {where}: a sharded tensor has the unknown dtype {name!r}")
    return dtype


def load(data: Mapping[str, Any], folder: Path, model_state: Any) -> dict[str, Any]:
    """``data`` (a sharded checkpoint's ``state.pt``) with every placeholder replaced by its
    tensor, loaded by DCP from ``folder`` into this run's tensors (see the module's
    documentation); ``model_state`` is the run's model state dict now (``None`` to load every
    tensor whole, as ``hookfit export`` does)."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    kind = _dtensor_type()
    here: dict[str, Any] = {}
    mesh = None
    if model_state is not None:
        _, here = split({"model": model_state})
        mesh = next((t.device_mesh for t in here.values()), None)
    targets: dict[str, Any] = {}
    for mark in placeholders(data):
        key = mark[MARK]
        shape = tuple(int(n) for n in mark["shape"])
        dtype = _dtype(mark["dtype"], folder)
        current = here.get(key)
        if current is not None and tuple(current.shape) == shape and current.dtype == dtype:
            targets[key] = current  # loaded in place: the model's own shards
            continue
        placements = _placements(mark.get("placements", [])) if mesh is not None else None
        if kind is not None and mesh is not None and placements is not None and len(placements) == mesh.ndim:
            from torch.distributed.tensor import empty

            targets[key] = empty(shape, dtype=dtype, device_mesh=mesh, placements=placements)
        else:
            targets[key] = torch.empty(shape, dtype=dtype)
    import torch.distributed as dist

    alone = not (dist.is_available() and dist.is_initialized())
    checked = shardfiles.reader(folder, data)  # DCP's metadata, unpickled by hookfit without running code
    try:
        with warnings.catch_warnings():  # DCP warns that one process reads alone: intended here
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp_load(targets, storage_reader=checked, no_dist=alone)
    except (Exception, CheckpointException) as error:  # (DCP's gathers every rank's: a BaseException)
        text, _ = shardfiles.failure(error)
        raise CheckpointError(f"checkpoint: the sharded tensors of {folder} cannot be read: "
                              f"{text.strip().splitlines()[0] if text.strip() else ''}") from error

    def fill(value: Any) -> Any:
        if isinstance(value, Mapping):
            if MARK in value:
                return targets[value[MARK]]
            return {k: fill(v) for k, v in value.items()}
        if isinstance(value, list):
            return [fill(v) for v in value]
        if isinstance(value, tuple):
            return tuple(fill(v) for v in value)
        return value

    return cast(dict[str, Any], fill(dict(data)))  # a mapping in, a dict out


def destination(path: Path | None, count: int) -> tuple[Path, Path]:
    """Every rank: the folder of the sharded checkpoint rank 0 writes (``path`` on rank 0,
    anything elsewhere) and its temporary name, ``.<name>.<pid>-<count>.tmp`` (``count``: rank
    0's sharded saves so far); one broadcast when ``torch.distributed`` runs."""
    import torch.distributed as dist

    where: list[Any] = [None]
    if path is not None:
        path = path.with_suffix(SHARDED_SUFFIX)
        where = [(str(path), f".{path.name}.{os.getpid()}-{count}.tmp")]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(where, src=0)
    folder, tmp = Path(where[0][0]), where[0][1]
    return folder, folder.with_name(tmp)


def write(rest: dict[str, Any], shards: dict[str, Any], tmp: Path, path: Path, main: bool,
          save_state: Callable[[dict[str, Any], Path], None]) -> None:
    """Every rank, in the foreground: its shards into the folder ``tmp`` with DCP's ``save``
    (a collective operation that ends when every rank's files and the metadata are written),
    then :func:`finish`."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    finish(rest, tmp, path, main, save_state,
           lambda: dcp_save(shards, storage_writer=FileSystemWriter(str(tmp), sync_files=True)))


def finish(rest: dict[str, Any], tmp: Path, path: Path, main: bool, save_state: Callable[[dict[str, Any], Path], None],
           written: Callable[[], Any], group: Any = None) -> None:
    """Every rank, once DCP wrote (or failed to write) its part of the checkpoint into the
    folder ``tmp``: ``written()`` returns what DCP's save returned (its metadata) or raises its
    error. Then the digests of the files this rank wrote
    (:func:`hookfit.plugins.checkpoint.shardfiles.own_files`), gathered by every rank of
    ``group`` (a process group of every rank; ``None``: the default one). Rank 0 (``main``) then:
    ``state.pt`` with ``save_state`` (an atomic write), recording those digests, and the rename
    of ``tmp`` to ``path``. Any rank's failure is every rank's: the ranks agree on the outcome,
    rank 0 removes ``tmp`` (no folder that looks whole is left), and every rank raises the same
    error (an ``OSError`` with the first failing rank's ``errno`` when it had one, else a
    :class:`CheckpointError`), naming that rank and its error."""
    from torch.distributed.checkpoint.api import CheckpointException
    import torch.distributed as dist

    together = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(group) if together else 0
    files: dict[str, str] = {}
    outcome: tuple[str, int | None] | None = None
    metadata = None
    try:
        metadata = written()
        files = shardfiles.own_files(tmp, metadata, rank, main)
    except (Exception, CheckpointException) as error:  # (DCP's gathers every rank's: a BaseException)
        text, number = shardfiles.failure(error, tmp)
        outcome = (text if text.startswith("rank ") else f"rank {rank}: {text}", number)
    parts: list[Any] = [(files, outcome)]
    if together:
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, (files, outcome), group=group)
    outcome = next((failed for _, failed in parts if failed is not None), None)
    if main:
        if outcome is None:
            recorded = {name: value for done, _ in parts for name, value in done.items()}
            missing = shardfiles.missing_digests(recorded, metadata)
            if missing:
                outcome = (f"no rank hashed {', '.join(missing)}, which DCP's metadata names", None)
        if outcome is None:
            try:
                rest["meta"] = {**rest["meta"], shardfiles.FILES: recorded}
                save_state(rest, tmp / STATE_FILE)
                _rename(tmp, path)
            except Exception as error:  # noqa: BLE001 - every rank is told, then it is raised
                text, number = shardfiles.failure(error, tmp)
                outcome = (f"rank {rank}: {text}", number)
        if outcome is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if together:
        told: list[Any] = [outcome]
        dist.broadcast_object_list(told, src=0, group=group)
        outcome = told[0]
    if outcome is not None:
        raise error_of(outcome)


def error_of(outcome: tuple[str, int | None]) -> Exception:
    """The error every rank raises for a sharded save's agreed failure ``outcome`` (what failed,
    naming the first failing rank, and that rank's operating system error number, if any): an
    ``OSError`` with that ``errno`` when there is one, else a :class:`CheckpointError`."""
    text, number = outcome
    if number is None:
        return CheckpointError(text)
    raised = OSError(text)
    raised.errno = number
    return raised


def _rename(tmp: Path, path: Path) -> None:
    """``tmp``, whole, to ``path`` (replacing a checkpoint of the same position), and the fsync
    of the folder."""
    refuse_listed(path)
    old = None
    if path.exists():  # the same position written again: the new one replaces it
        old = path.with_name(f".{path.name}.{os.getpid()}.old.tmp")
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_folder(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_sharded(path: Path) -> bool:
    """Whether ``path`` is a sharded checkpoint's folder."""
    return path.suffix == SHARDED_SUFFIX and path.is_dir()


def remove(path: Path) -> None:
    """Delete a checkpoint: a file, or a sharded checkpoint's folder."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
