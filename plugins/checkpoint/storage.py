"""checkpoint storage: the file format, atomic writes, format checks and the listing of a
folder's checkpoints. The policy (when to save, what to keep, which file to resume from) is
in :mod:`hookfit.plugins.checkpoint.plugin`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

FORMAT = "hookfit-checkpoint"
FORMAT_VERSION = 1
SUFFIX = ".pt"


class CheckpointError(RuntimeError):
    """A checkpoint file cannot be used: torn, foreign, or from a newer format."""


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


def checkpoint_files(folder: Path) -> list[Path]:
    """The checkpoints ``epoch*.pt`` in ``folder``, newest first (``failed-*.pt`` files are not
    listed)."""
    return sorted((p for p in folder.glob(f"epoch*{SUFFIX}") if p.is_file()),
                  key=lambda p: (p.name, p.stat().st_mtime), reverse=True)
