"""One process a folder: the lock that keeps a second process out of a folder a live run writes.

The process that writes a run folder holds an exclusive ``fcntl.flock`` on ``run.lock`` in it
(with its pid and host written there for others to read) until its ``fit()`` ends: a second process that would write the same folder (the same
``run_dir``, or a resume of a live run) is refused when it first uses the folder, with a
:class:`FolderInUse` naming the live process. The kernel releases the lock when the process
dies, whatever killed it (``kill -9`` included), so it is never stale; a child it forks (a
``DataLoader`` worker, which outlives its parent for a few seconds) closes its copy at once.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import sys
import time
import warnings
import weakref
from pathlib import Path
from typing import IO

from hookfit.errors import user_level
from hookfit.files import FileWarning

__all__ = ["LOCK", "FolderInUse", "FolderLock"]

LOCK = "run.lock"
"""The lock file of a folder a live process writes (see :class:`FolderLock`)."""


class FolderInUse(RuntimeError):
    """A folder this run would write is held by another live process (see :class:`FolderLock`)."""


class FolderLock:
    """An exclusive lock on ``folder`` for this process: ``fcntl.flock`` on its ``run.lock``,
    which also holds the holder's pid, host and start, for the message another process gets.
    :meth:`acquire` raises :class:`FolderInUse` when a live process holds it; the lock goes
    with the process (a ``kill -9`` cannot leave it stale) or at :meth:`release`. A forked child
    (a ``DataLoader`` worker, which outlives a ``kill -9`` of its parent for seconds) closes its
    copy at once: a lock shared with a child would go only with the child."""

    def __init__(self, folder: Path, owner: str) -> None:
        self.folder = folder
        self.owner = owner
        self._file: IO[str] | None = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self, what: str = "this run",
                fix: str = "give this run a run_dir of its own, or resume from a checkpoint file into a new folder",
                ) -> None:
        """Take the lock, or raise :class:`FolderInUse` naming the live process that holds it, ``what``
        would write there, and ``fix``: what the user can do besides waiting for it to end."""
        if self._file is not None:
            return
        path = self.folder / LOCK
        try:
            file = open(path, "a+", encoding="utf-8")
        except OSError as error:
            if error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                return  # a folder no process can write needs no lock (its writes warn, hookfit.files' policy)
            warnings.warn(f"{self.owner}: could not create {path} ({type(error).__name__}: {error}); this "
                          f"run goes on without the lock that keeps a second process out of {self.folder}",
                          FileWarning, stacklevel=user_level())
            return
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            file.seek(0)
            holder = file.read(400).strip() or "a process that wrote no pid"
            file.close()
            if error.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                raise
            raise FolderInUse(
                f"{self.owner}: {self.folder} is in use by another live process ({holder}); {what} would write "
                f"the same files. Wait for it to end, or {fix}") from None
        file.seek(0)
        file.truncate()
        file.write(f"pid {os.getpid()} on host {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}, "
                   f"argv {' '.join(sys.argv)[:200]}\n")
        file.flush()
        self._file = file
        _HELD.add(self)

    def release(self) -> None:
        file, self._file = self._file, None
        _HELD.discard(self)
        if file is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(file.fileno(), fcntl.LOCK_UN)
            file.close()

    def forget(self) -> None:
        """In a forked child: close this process's copy of the parent's lock, which stays the parent's."""
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):
                file.close()


_HELD: weakref.WeakSet[FolderLock] = weakref.WeakSet()
"""The locks this process holds, which a child it forks forgets."""


def _forget_in_child() -> None:
    for lock in list(_HELD):
        lock.forget()
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_in_child)
