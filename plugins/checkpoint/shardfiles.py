"""checkpoint shardfiles: the files of a sharded checkpoint's folder (see
:mod:`hookfit.plugins.checkpoint.sharded`) given the one-file checkpoint's guarantees.

Digests
    When a sharded checkpoint is written, every rank hashes the shard files it wrote
    (``__<rank>_<n>.distcp``) and rank 0 DCP's ``.metadata``; ``state.pt`` records them
    (``meta["files"]``: file name to ``"crc32:<8 hex digits>"``, a CRC-32 that finds torn and
    flipped bytes, not deliberate tampering), and ``state.pt`` itself is covered by the
    checkpoint's digest. Before anything of the folder but ``state.pt`` (read with
    ``weights_only=True``) is read, :func:`verify` checks every recorded file: one that is
    missing (a rank's shard lost, a torn copy) or whose bytes changed is a
    :class:`CheckpointError` naming it, so ``fallback=True`` skips the checkpoint and ``hookfit
    export`` refuses it. A folder written by an older hookfit records no digests: it is read
    with one :class:`CheckpointWarning`.

DCP's metadata
    ``.metadata`` is a pickle, and DCP's ``FileSystemReader.read_metadata`` unpickles it with
    :mod:`pickle` (any class, any callable). hookfit never lets DCP read it: :func:`metadata`
    unpickles it with an unpickler that builds nothing but DCP's own metadata types and the few
    torch values they hold (``torch.Size``, dtypes, layouts), never sets attributes of a class,
    takes no persistent ids, and then checks what it got (every tensor to load is stored as a
    tensor of its shape, since DCP reads anything stored as bytes with ``torch.load(weights_only=False)``;
    every file named is a plain name in the folder, and a recorded one). DCP is then given that
    checked object (:class:`CheckedReader`); its tensors are read with ``weights_only=True``.
"""

from __future__ import annotations

import io
import math
import pickle
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch

from hookfit.errors import user_level
from hookfit.plugins.checkpoint.digests import DIGEST, Crc32
from hookfit.plugins.checkpoint.storage import CheckpointError, CheckpointWarning

METADATA = ".metadata"
"""DCP's metadata file in a sharded checkpoint's folder."""
FILES = "files"
"""The entry of ``state.pt``'s ``meta`` that records the digest of every other file of the folder."""

_DCP = "torch.distributed.checkpoint.metadata"
_ALLOWED = frozenset({
    *((_DCP, name) for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
})
"""What a DCP ``.metadata`` may name (besides torch's dtypes): DCP's dataclasses, and the values
they hold. Each builds a value from plain data; none runs anything the file could choose."""


# -- digests --------------------------------------------------------------------------------


def file_digest(path: Path) -> str:
    """``"crc32:<8 hex digits>"`` of the bytes of the file ``path`` (finds a torn or flipped
    shard, not deliberate tampering: see :data:`hookfit.plugins.checkpoint.digests.DIGEST`)."""
    h = Crc32()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return f"{DIGEST}:{h.hexdigest()}"


def own_files(folder: Path, metadata: Any, rank: int, main: bool) -> dict[str, str]:
    """After DCP wrote a checkpoint into ``folder``: the digest of each shard file of this
    ``rank`` that ``metadata`` (what DCP's save returned) names, and of ``.metadata`` on the
    ``main`` process."""
    names = {info.relative_path for info in getattr(metadata, "storage_data", {}).values()}
    mine = sorted(name for name in names if name.startswith(f"__{rank}_"))
    if main:
        mine.append(METADATA)
    return {name: file_digest(folder / name) for name in mine}


def missing_digests(files: Mapping[str, str], metadata: Any) -> list[str]:
    """The files ``metadata`` names that ``files`` (every rank's :func:`own_files`) has no digest of."""
    names = {info.relative_path for info in getattr(metadata, "storage_data", {}).values()} | {METADATA}
    return sorted(names - set(files))


def verify(folder: Path, data: Mapping[str, Any]) -> None:
    """Check the files of the sharded checkpoint ``folder`` against the digests its
    ``state.pt`` (``data``, already checked) records, then its metadata (:func:`metadata`):
    a :class:`CheckpointError` naming the first file that is missing or changed."""
    files = _recorded(data, folder)
    if files is None:
        warnings.warn(f"checkpoint: {folder} records no digests of its shard files (written by an older "
                      f"hookfit): a changed shard cannot be found before it is read", CheckpointWarning, stacklevel=user_level())
    for name, saved in (files or {}).items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(
                f"checkpoint: {folder} lacks {name}, one of its files (a rank's shard, or DCP's metadata): "
                f"a torn or partly copied sharded checkpoint")
        if file_digest(path) != saved:
            raise CheckpointError(
                f"checkpoint: {path}: its bytes do not match the digest state.pt records ({str(saved)[:24]}...): "
                f"it changed since it was written (bit flips on the disk, or an edit)")
    metadata(folder, _wanted(data), None if files is None else set(files))


def _recorded(data: Mapping[str, Any], folder: Path) -> dict[str, str] | None:
    """The digests of the folder's files that ``state.pt`` (``data``) records; ``None`` when it
    records none (an older hookfit's)."""
    meta = data.get("meta")
    files = meta.get(FILES) if isinstance(meta, Mapping) else None
    if files is None:
        return None
    if not isinstance(files, Mapping) or METADATA not in files or not all(isinstance(v, str) for v in files.values()):
        raise CheckpointError(f"checkpoint: {folder}/state.pt: its record of the folder's files is not one "
                              f"hookfit writes (a digest of each, {METADATA} among them)")
    return {_plain(name, folder): str(value) for name, value in files.items()}


def _wanted(data: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The places of the sharded tensors that ``state.pt`` (``data``) names, and their shapes."""
    from hookfit.plugins.checkpoint import sharded

    return {str(mark[sharded.MARK]): tuple(int(n) for n in mark["shape"]) for mark in sharded.placeholders(data)}


def _plain(name: Any, folder: Path) -> str:
    """``name``, if it is a plain file name (no folder, not ``.`` or ``..``)."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise CheckpointError(f"checkpoint: {folder} names the file {name!r}, which is not a plain file name "
                              f"in the checkpoint's folder")
    return name


# -- DCP's metadata, read without running code ----------------------------------------------


class _Unpickler(pickle._Unpickler):
    """The pure-Python unpickler, restricted: only :data:`_ALLOWED` globals and torch dtypes; no
    persistent ids; no attributes set on a class (``BUILD`` on a class object)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP's metadata never holds")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it refers to persistent objects, which DCP's metadata never holds")

    def _load_build(self) -> None:
        stack: list[Any] = getattr(self, "stack")  # (the pure-Python unpickler's; typeshed leaves it out)
        if isinstance(stack[-2], type):  # the object BUILD would change, under its state
            raise pickle.UnpicklingError(f"it sets attributes of the class {stack[-2].__name__}")
        getattr(pickle._Unpickler, "load_build")(self)

    dispatch[pickle.BUILD[0]] = cast(Any, _load_build)


def metadata(folder: Path, tensors: Mapping[str, tuple[int, ...]], recorded: set[str] | None) -> Any:
    """DCP's metadata of ``folder``, unpickled without running code (see the module's
    documentation) and checked: ``tensors`` (the places to load and their shapes) are each
    stored as a tensor of that shape, whole (its chunks hold every element), and every file it
    names is a plain name (among ``recorded``, the files ``state.pt`` has digests of, when it
    has). A :class:`CheckpointError` naming ``.metadata`` and what is wrong otherwise."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    path = folder / METADATA
    try:
        with open(path, "rb") as f:
            loaded = _Unpickler(io.BytesIO(f.read())).load()
    except OSError as error:
        raise CheckpointError(f"checkpoint: {path} cannot be read: {error}") from error
    except Exception as error:  # noqa: BLE001 - any failure of a crafted or torn pickle is named
        raise CheckpointError(f"checkpoint: {path} is refused, not DCP's metadata as hookfit writes it: "
                              f"{type(error).__name__}: {error}") from error

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint: {path} is refused: {what}")

    if not isinstance(loaded, Metadata):
        raise bad(f"it holds a {type(loaded).__name__}, not DCP's Metadata")
    stored, storage = loaded.state_dict_metadata, loaded.storage_data
    if not isinstance(stored, dict) or not isinstance(storage, dict):
        raise bad("its tables of tensors and of files are not mappings")
    for key, shape in tensors.items():
        entry = stored.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            kind = type(entry).__name__ if entry is not None else "nothing"
            raise bad(f"it stores {key!r} as {kind}, not as a tensor")
        if tuple(entry.size) != shape:
            raise bad(f"it stores {key!r} with the shape {tuple(entry.size)}, state.pt says {shape}")
        held, whole = sum(math.prod(chunk.sizes) for chunk in entry.chunks), math.prod(shape)
        if held != whole:  # (DCP stores each element once: its chunks do not overlap)
            raise bad(f"its chunks of {key!r} hold {held} of its {whole} elements: a checkpoint that not every "
                      f"process of the run wrote its part of")
    for info in storage.values():
        if not isinstance(info, _StorageInfo):
            raise bad(f"a tensor's place is a {type(info).__name__}, not DCP's _StorageInfo")
        name = _plain(info.relative_path, folder)
        if getattr(info, "transform_descriptors", None):  # (hookfit's saves transform nothing)
            raise bad(f"it has {name!r} read through the transforms {info.transform_descriptors!r}, which hookfit's "
                      f"saves never use")
        if recorded is not None and name not in recorded:
            raise bad(f"it names the file {name!r}, of which state.pt records no digest")
    return loaded


def _checked_reader() -> type:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class CheckedReader(FileSystemReader):
        """DCP's reader of a folder, given the metadata :func:`metadata` read and checked: it
        never reads ``.metadata`` (nor a rank's ``__<rank>.metadata``) itself."""

        def __init__(self, path: Path, checked: Any) -> None:
            super().__init__(str(path))
            self.checked = checked

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("rank") is not None:
                raise CheckpointError(f"checkpoint: {self.path}: a rank's own metadata file is never read")
            if getattr(self.checked, "storage_meta", None) is None:
                self.checked.storage_meta = StorageMeta()
            self.checked.storage_meta.load_id = self.load_id
            return self.checked

    return CheckedReader


def reader(folder: Path, data: Mapping[str, Any]) -> Any:
    """A DCP storage reader of the sharded checkpoint ``folder`` (its ``state.pt``: ``data``)
    whose metadata is read and checked by :func:`metadata` first (the files' digests are
    checked when ``state.pt`` is read: :func:`verify`)."""
    files = _recorded(data, folder)
    return _checked_reader()(folder, metadata(folder, _wanted(data), None if files is None else set(files)))


# -- saving ---------------------------------------------------------------------------------


SHORT_WRITE = "unexpected pos"
"""What torch's zip writer says when a write it made did not land (``[enforce fail at
inline_container.cc] . unexpected pos 704 vs 598``): most often a full device, whose ``OSError``
it does not pass on."""


def failure(error: BaseException, where: Path | None = None) -> tuple[str, int | None]:
    """What a failed write says (a DCP ``CheckpointException`` gathers every rank's error: the
    first rank's, with its number) and the operating system's error number, if any. Torch's zip
    writer's :data:`SHORT_WRITE` says, besides, how many bytes the device of ``where`` (the
    folder written) has free now."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        first = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        text, number = failure(first, where)
        return f"rank {rank}: {text}", number
    if isinstance(error, OSError):  # "[Errno 28] No space left on device: '<file>'"
        return str(error), error.errno if isinstance(error.errno, int) else None
    text = f"{type(error).__name__}: {error}"
    if SHORT_WRITE in text and where is not None:
        text += f" (torch's writer wrote less than it asked to: {free_space(where)}; most often a full device)"
    return text, None


def free_space(where: Path) -> str:
    """``the device has N bytes free`` for the device of ``where`` (its nearest folder that
    exists), or why that is not known."""
    folder = where
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return f"the device has {shutil.disk_usage(folder).free} bytes free"
    except OSError as error:
        return f"the free space of {folder} is not known ({error})"
