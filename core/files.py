"""Files a run writes, and the one policy every plugin follows when it cannot: warn once, keep
training.

A full disk, a file-size limit or a read-only run folder must never end a run that is
otherwise fine: losing a log line is better than losing the training. A plugin that writes a
file of the run (the metrics log, the dashboard's captured output, checkpoints) reports the
first failure with one :class:`FileWarning` naming itself, the file and the error, and goes on
without that file (checkpoints keep trying at the next save: a later one may fit).

A run folder that cannot be made at all (under a read-only folder, a script started from a
read-only folder with the default ``runs/``) is said once by the core, naming the folder
(:func:`folder_lost`); the files a plugin would write in it then fail without a warning of
their own, for the run's one warning has said that they are lost.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import IO, Any

from hookfit.errors import HookfitWarning, user_level

__all__ = ["FileWarning", "RunFile", "folder_found", "folder_lost", "in_lost_folder"]

_lost: dict[Path, OSError] = {}  # run folders that could not be made (said once), and why


def folder_lost(folder: Path, error: OSError) -> None:
    """Record that the run folder ``folder`` could not be made (``error``), once the run has
    said so in a :class:`FileWarning`: a :class:`RunFile` in it or below then fails quietly."""
    _lost[Path(folder).absolute()] = error


def folder_found(folder: Path) -> None:
    """Forget :func:`folder_lost`'s record of ``folder`` (its run is over)."""
    _lost.pop(Path(folder).absolute(), None)


def in_lost_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` lies in a run folder that could not be made (:func:`folder_lost`): the run
    has said so once, and a plugin that writes ``path`` by other means than :class:`RunFile` (a
    profiler's trace, a checkpoint) may fail without a warning of its own."""
    if not _lost:
        return False
    return any(parent in _lost for parent in Path(path).absolute().parents)


class FileWarning(HookfitWarning):
    """A plugin could not write a file of the run; training goes on without it."""


class RunFile:
    """A file of the run that a plugin appends to, opened on the first write.

    :meth:`write` returns whether the data was written. The first :class:`OSError` (opening or
    writing) closes the file and warns once with a :class:`FileWarning` that names ``owner``
    (the plugin), the file and the error; every later write is dropped, so the run goes on.
    ``binary`` files take bytes, others text (UTF-8). Every write is flushed, so what a run
    wrote survives a ``kill -9``.
    """

    def __init__(self, path: str | os.PathLike[str], owner: str, binary: bool = False) -> None:
        self.path = Path(path)
        self.owner = owner
        self.binary = binary
        self.failed: OSError | None = None
        self._file: IO[Any] | None = None

    def write(self, data: str | bytes) -> bool:
        """Append ``data`` and flush; ``False`` once the file has failed."""
        if self.failed is not None:
            return False
        try:
            if self._file is None:
                self._file = self._open()
            self._file.write(data)
            self._file.flush()
            return True
        except OSError as error:
            self._fail(error)
            return False

    def _open(self) -> IO[Any]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return open(self.path, "ab") if self.binary else open(self.path, "a", encoding="utf-8")

    def _fail(self, error: OSError) -> None:
        self.failed = error
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError:
                pass  # the data that did not fit is what failed to be written
        if file is None and in_lost_folder(self.path):
            return  # a run folder that could not be made: the run's one warning named it
        warnings.warn(
            f"{self.owner}: could not write {self.path} ({type(error).__name__}: {error}); "
            f"it is left as it is and training goes on without it",
            FileWarning,
            stacklevel=user_level(),
        )

    def close(self) -> None:
        """Close the file (a later write opens it again, unless it failed)."""
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError as error:
                if self.failed is None:
                    self._fail(error)
