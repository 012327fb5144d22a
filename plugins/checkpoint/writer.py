"""checkpoint writer: writes checkpoints off the training thread.

The training thread hands a state to :meth:`Writer.submit`, which copies its tensors into
reusable host buffers (:class:`hookfit.plugins.checkpoint.staging.Staging`) and returns; the
writer's thread then does everything else: the digest, the file (temporary file, fsyncs,
rename: the ``save`` function it was given) and the removal of pruned files. It holds at most
two snapshots, one being written and one waiting, each in its own buffers (the second set is
only made when a save is asked during a write, so a run whose saves are further apart than a
write's length holds one copy of its state). A save asked while both are taken waits for the
write in flight to end (``when_busy="wait"``) or is skipped and counted in :attr:`Writer.skipped`
(``"skip"``; a save that must not be lost, ``must=True``, always waits). While the training
thread builds and copies a snapshot (:meth:`Writer.aside`) the writer's thread waits: before a
job, and between the 4 MiB pieces it hashes and writes, so it takes neither the interpreter
nor the memory bandwidth from the copy.

Nothing the writer does reaches the caller but through :meth:`Writer.outcomes`: each finished
write (with its error, if it failed) and each file it could not remove, in order, for the
training thread to act on (announce, prune, report as configured). With ``background=False``
the same work is done on the caller's thread.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from hookfit.plugins.checkpoint.staging import Staging
from hookfit.plugins.checkpoint.digests import digest
from hookfit.plugins.checkpoint.storage import atomic_save

__all__ = ["Done", "Held", "Kept", "Writer", "write_file"]

Save = Callable[[dict[str, Any], Path, Callable[[], None]], None]
"""Writes a state to a path, calling its third argument between pieces of the work."""


def write_file(state: dict[str, Any], path: Path, between: Callable[[], None] | None = None) -> None:
    """A one-file checkpoint: ``state`` with its ``digest`` added, written atomically
    (:func:`hookfit.plugins.checkpoint.storage.atomic_save`); ``between`` is called before each
    tensor hashed and each piece written."""
    state["digest"] = digest(state, between)
    atomic_save(state, path, between)


@dataclass(frozen=True)
class Done:
    """A write that ended: ``tag`` is what the caller gave with it; ``error`` why it failed
    (``None``: the file is whole at ``path``)."""

    path: Path
    tag: Any
    error: BaseException | None = None


@dataclass(frozen=True)
class Held:
    """A snapshot copied and not yet written (:meth:`Writer.hold`): ``state`` is the copy."""

    slot: int
    state: dict[str, Any]


@dataclass(frozen=True)
class Kept:
    """A file the writer was asked to remove and could not (``error``): it is still there."""

    path: Path
    error: Exception


def _go_on() -> None:
    """``between`` of a write on the caller's thread: nothing to wait for."""


class Writer:
    """Writes checkpoints on a thread of its own, from reusable host buffers (see the
    module): the training thread pays one copy of the state per save and never waits for an
    earlier write, except when a save comes while one write is in flight and another waits
    and ``when_busy="wait"`` (with ``"skip"`` that save is skipped and counted)."""

    SLOTS = 2
    """Snapshots held at most: the one being written and the one waiting."""

    def __init__(self, save: Save, remove: Callable[[Path], None], *, background: bool = True,
                 when_busy: Literal["wait", "skip"] = "wait", name: str = "hookfit-checkpoint") -> None:
        self.background = background
        self.when_busy = when_busy
        self.skipped = 0
        """Saves skipped because both snapshots were taken (``when_busy="skip"``)."""
        self.waited = 0.0
        """Seconds saves waited for a free snapshot (``when_busy="wait"``, ``must``), since it was made."""
        self._writing: Path | None = None  # the file of the write the thread is doing
        self._save, self._remove, self._name = save, remove, name
        self._slots: list[Staging | None] = [None] * self.SLOTS
        self._taken: set[int] = set()  # slots staged or being written
        self._jobs: collections.deque[tuple[Any, ...]] = collections.deque()
        self._running = False  # the thread is doing a job
        self._waiting = 0
        self._closing = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._aside = False  # the training thread is saving: the writer waits between pieces
        self._go = threading.Event()  # set while the writer may work
        self._go.set()
        self._outcomes: collections.deque[Done | Kept] = collections.deque()

    # -- what the training thread calls -----------------------------------------------------
    def submit(self, state: dict[str, Any], path: Path, tag: Any, *, must: bool = False) -> bool:
        """Copy ``state``'s tensors into a free snapshot and have it written to ``path`` on the
        writer's thread; ``False`` when it was skipped (both snapshots taken, ``when_busy="skip"``
        and not ``must``). Without ``background``, written now (:meth:`write`)."""
        if not self.background:
            self.write(state, path, tag)
            return True
        held = self.hold(state, must=must)
        if held is None:
            return False
        self._queue(("write", held.slot, held.state, path, tag))
        return True

    def hold(self, state: dict[str, Any], *, must: bool = False) -> Held | None:
        """Copy ``state``'s tensors into a free snapshot now, for a write decided later:
        :meth:`release` writes it, :meth:`drop` lets it go (a checkpoint whose metric is known
        only after the state is taken). ``None`` when it was skipped, as :meth:`submit` skips.
        Without ``background`` too: the state is then copied as well, and written by
        :meth:`release` on the caller's thread."""
        with self._cond:
            slot = self._free()
            while slot is None:
                if self.when_busy == "skip" and not must:
                    self.skipped += 1
                    return None
                self._waiting += 1
                self._go.set()  # the write in flight must go on for a snapshot to be free
                began = time.monotonic()
                self._cond.wait()
                self.waited += time.monotonic() - began
                self._waiting -= 1
                if self._aside:
                    self._go.clear()
                slot = self._free()
            self._taken.add(slot)
            staging = self._slots[slot]
            if staging is None:
                staging = self._slots[slot] = Staging()
        try:  # the writer never reads a slot before it is queued: the copy needs no lock
            return Held(slot, staging.stage(state))
        except BaseException:
            self.drop(Held(slot, {}))
            raise

    def release(self, held: Held, path: Path, tag: Any) -> None:
        """Write the snapshot :meth:`hold` took to ``path`` (``held.state``, its plain values
        changed since if need be: the state's own dicts were copied)."""
        if self.background:
            self._queue(("write", held.slot, held.state, path, tag))
            return
        try:
            self.wait()
            staging = self._slots[held.slot]
            if staging is not None:
                staging.ready()
            self._write(held.state, path, tag, self._save, _go_on)
        finally:
            self.drop(held)

    def drop(self, held: Held) -> None:
        """Let a snapshot :meth:`hold` took go, unwritten (its buffers kept for the next save)."""
        with self._cond:
            self._taken.discard(held.slot)
            self._cond.notify_all()

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """While the training thread builds and copies a snapshot: the writer's thread waits
        at its next piece of work (a tensor hashed, a piece of file written), so that it takes
        neither the interpreter nor the memory bandwidth from the copy. Waiting for the writer
        (:meth:`wait`, a save that waits for a snapshot) lets it go on."""
        self._aside = True
        self._go.clear()
        try:
            yield
        finally:
            self._aside = False
            self._go.set()

    def between(self) -> None:
        """Called on the writer's thread by the save function between pieces of its work:
        returns at once, or once the training thread's snapshot is copied (:meth:`aside`)."""
        self._go.wait()

    def write(self, state: dict[str, Any], path: Path, tag: Any, save: Save | None = None) -> None:
        """Write ``state`` to ``path`` on this thread, once every earlier job is done (with
        ``save``, not the writer's own: a sharded checkpoint's write, a collective)."""
        self.wait()
        self._write(state, path, tag, save or self._save, _go_on)  # (this thread is the one copying)

    def remove(self, paths: list[Path]) -> None:
        """Remove ``paths`` after the jobs already queued (on this thread without ``background``);
        each that cannot be is told back as :class:`Kept`."""
        if not paths:
            return
        if self.background:
            self._queue(("remove", list(paths)))
        else:
            self._remove_all(paths)

    def outcomes(self) -> list[Done | Kept]:
        """What ended since the last call, in order (never blocks)."""
        out = []
        while self._outcomes:
            out.append(self._outcomes.popleft())
        return out

    @property
    def pending(self) -> int:
        """Snapshots staged or being written."""
        with self._cond:
            return len(self._taken)

    @property
    def waiting(self) -> int:
        """Saves waiting for a snapshot to be free (``when_busy="wait"``)."""
        with self._cond:
            return self._waiting

    @property
    def staged(self) -> list[Staging]:
        """The snapshots' buffers made so far (the first is the one used whenever it is free)."""
        return [s for s in self._slots if s is not None]

    @property
    def in_flight(self) -> list[Path]:
        """The files of the writes not done yet: the one being written, then those queued."""
        with self._cond:
            queued = [job[3] for job in self._jobs if job[0] == "write"]
            return [self._writing, *queued] if self._writing is not None else queued

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every queued job is done (at most ``timeout`` seconds, ``None``: as long as it
        takes); whether they are."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._go.set()
            while self._jobs or self._running:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left)
            done = not (self._jobs or self._running)
            if self._aside:
                self._go.clear()
        return done

    def close(self) -> None:
        """Wait for every job, end the thread and let go of the buffers (a later save starts
        them again)."""
        self.wait()
        thread = self._thread
        if thread is not None:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            thread.join()
        self._thread, self._closing = None, False
        with self._cond:
            self._taken.clear()  # (a snapshot still held: let go with the rest)
        for staging in self.staged:
            staging.release()
        self._slots = [None] * self.SLOTS

    # -- the writer's thread ----------------------------------------------------------------
    def _free(self) -> int | None:
        return next((i for i in range(self.SLOTS) if i not in self._taken), None)

    def _queue(self, job: tuple[Any, ...]) -> None:
        with self._cond:
            self._jobs.append(job)
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closing:
                    self._cond.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._running = True
                self._writing = job[3] if job[0] == "write" else None
            self.between()  # no work of this thread while the training thread copies
            try:  # nothing escapes: a thread that died would leave every later wait() waiting forever
                if job[0] == "write":
                    _, slot, staged, path, tag = job
                    staging = self._slots[slot]
                    try:
                        if staging is not None:
                            staging.ready()
                    except BaseException as error:  # (a device's copy that failed)
                        self._outcomes.append(Done(path, tag, error))
                    else:
                        self._write(staged, path, tag, self._save, self.between, BaseException)
                else:
                    self._remove_all(job[1])
            finally:
                with self._cond:
                    if job[0] == "write":
                        self._taken.discard(job[1])
                    self._running, self._writing = False, None
                    self._cond.notify_all()

    def _write(self, state: dict[str, Any], path: Path, tag: Any, save: Save, between: Callable[[], None],
               caught: type[BaseException] = Exception) -> None:
        try:
            save(state, path, between)
        except caught as error:  # told to the training thread, which reports it as configured
            self._outcomes.append(Done(path, tag, error))
            return
        self._outcomes.append(Done(path, tag))

    def _remove_all(self, paths: list[Path]) -> None:
        for path in paths:
            try:
                self._remove(path)
            except FileNotFoundError:
                pass
            except Exception as error:  # (an error of the writer's thread would end it: see _loop)
                self._outcomes.append(Kept(path, error))
