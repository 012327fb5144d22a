"""checkpoint shardwriter: sharded checkpoints (:mod:`hookfit.plugins.checkpoint.sharded`)
written in the background, with :func:`torch.distributed.checkpoint.async_save`.

A save blocks training for one copy of the state into host memory: the sharded tensors (each
rank's shards) are staged by DCP's :class:`~torch.distributed.checkpoint.staging.DefaultStager`,
whose host buffers (pinned where CUDA is) are made at the first save and reused while the
tensors keep their storages; the rest of the checkpoint (``state.pt``'s contents, no sharded
tensor in it) as a one-file checkpoint's state is
(:class:`~hookfit.plugins.checkpoint.staging.Staging`). Whether every rank's copy succeeded, the
ranks agree (one small collective of the training's group, the one that agrees whether a write
is in flight): when it failed on any rank (no host memory for it), nothing of that save is
written on any rank, every rank lets go of its staging buffers, and the save is a failed save
on every rank at its step, reported as a failed write is (``on_save_error``), naming the first
failing rank and its error. A copy stopped on some rank by what is no :class:`Exception` (a
``KeyboardInterrupt``, a ``SystemExit``) stops every rank there, whatever ``on_save_error`` says:
the ranks agree all the same, let go of their buffers, and that rank raises its own, every
other rank the same kind, naming that rank (a ``KeyboardInterrupt``; a ``SystemExit`` of the
same code), so the run ends the same way on every rank. DCP's own thread then writes each rank's
files; its collectives run on a gloo process group of the checkpoint's own, made once
(``dist.new_group(backend="gloo")``), so the training's collectives never wait on them. When a
rank's part is written, a thread of this module finishes the checkpoint as the foreground
save does (:func:`hookfit.plugins.checkpoint.sharded.finish`, on the same group): the digests of
every rank's files, gathered; ``state.pt`` and the rename of the temporary folder by rank 0;
the outcome (written, or one error) told to every rank.

At most one write is in flight. Whether one still is, the ranks agree at each save (one small
collective of the training's group, on the training thread): a rank whose part is done may
wait for a rank whose part is not. A save asked while a write is in flight on any rank waits
for it on every rank (``when_busy="wait"``, and the saves of the run's end) or is skipped on
every rank (``"skip"``). A finished write's outcome is taken only where every rank takes it at
the same point of the run (at the next save, when no write is in flight any more, and at the
run's end, after :meth:`ShardWriter.wait`): a checkpoint is announced, and a failed write
reported, at the same step on every rank.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, cast

import torch

from hookfit.plugins.checkpoint import sharded, shardfiles
from hookfit.plugins.checkpoint.staging import Staging
from hookfit.plugins.checkpoint.storage import CheckpointError
from hookfit.plugins.checkpoint.writer import Done, write_file

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.plugins.checkpoint.plugin import Checkpoint
    from hookfit.position import Position
    from hookfit.run import Run

__all__ = ["ShardWriter", "save_sharded"]


def save_sharded(checkpoint: Checkpoint, loop: Run, position: Position, rest: dict[str, Any],
                 shards: dict[str, Any], asked: tuple[str, int, float | None, bool]) -> Path | None:
    """``checkpoint``'s save of a sharded run (``asked``: reason, step, metric, and whether it
    must not be skipped), on every rank: a folder every rank writes its part of (see
    :mod:`~hookfit.plugins.checkpoint.sharded`); with ``background``, staged and written in the
    background (see the module; a copy into host memory that failed on some rank is reported at
    once, on every rank), else in the foreground. Rank 0's folder, or ``None`` (another
    rank, or a save skipped: ``when_busy="skip"``). A run of several processes whose process
    group is gone (it failed: ``on_failure``) writes nothing: a failed save, reported as
    ``on_save_error`` says, never a folder of some ranks' parts."""
    reason, step, metric, must = asked
    if loop.state.world_size > 1 and _dist() is None:  # (a failed run: its process group ended with the failure)
        named = checkpoint.filename(position, reason, checkpoint.tag)
        folder = (checkpoint.directory(loop).absolute() / named).with_suffix(sharded.SHARDED_SUFFIX)
        checkpoint.collect(loop, [Done(folder, (reason, step, metric, loop.is_main), CheckpointError(
            f"checkpoint: every process writes its part of a sharded checkpoint, and the {loop.state.world_size} "
            f"processes of this run can no longer work together (their process group ended with the run's failure): "
            f"nothing of {folder.name} is written"))])
        return None
    checkpoint.writer.wait()  # (pruning the one-file writer was asked to do)
    checkpoint.collect(loop)  # (the plugin's own: announced, pruned, failures reported)
    writer = checkpoint.shards
    if checkpoint.background:
        if not writer.ready(must):  # the same answer on every rank
            checkpoint.reports.skip(step, loop.is_main)
            checkpoint.written.lost(step)
            return None
        checkpoint.collect(loop, writer.take())
    main = loop.is_main
    named = checkpoint.filename(position, reason, checkpoint.tag)
    path = checkpoint.directory(loop).absolute() / named if main else None
    writer.saves += 1
    path, tmp = sharded.destination(path, writer.saves)  # rank 0's, on every rank
    tag = (reason, step, metric, main)
    if checkpoint.background:
        failed = writer.submit(rest, shards, tmp, path, main, tag, write_file)
        if failed is not None:  # the same on every rank
            checkpoint.collect(loop, [failed])
    else:
        checkpoint.writer.write(rest, path, tag, save=lambda state, to, between: sharded.write(
            state, shards, tmp, to, main, write_file))
        checkpoint.collect(loop)
    return path if main else None


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _everyone(value: Any) -> list[Any]:
    """``value`` of every rank, in rank order (one small collective of the training's group,
    on the training thread; ``[value]`` without ``torch.distributed`` or with one rank)."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return [value]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def _stop(error: BaseException | None, rank: int) -> tuple[str, str, int | str | None] | None:
    """How ``error``, a stop that is no :class:`Exception` (``KeyboardInterrupt``, ``SystemExit``),
    ended ``rank``'s copy into host memory, as plain values another rank can be told: its kind
    (the loop makes ``"KeyboardInterrupt"`` an interrupted run, any other a failed one), what
    happened, naming the rank, and ``SystemExit``'s code; ``None`` for no stop."""
    if error is None:
        return None
    where = f"rank {rank}: {{}} while copying its state into host memory"
    if isinstance(error, KeyboardInterrupt):
        return "KeyboardInterrupt", where.format("interrupted"), None
    if isinstance(error, SystemExit):
        code = error.code if error.code is None or isinstance(error.code, int) else str(error.code)
        return "SystemExit", where.format(f"exited (SystemExit({code!r}))"), code
    return "BaseException", where.format(f"stopped ({type(error).__name__}: {error})"), None


def _stopping(kind: str, text: str, code: int | str | None) -> BaseException:
    """What a rank raises when another rank's copy into host memory was stopped (:func:`_stop`):
    the loop ends it as that rank's run ends (interrupted, or failed; with ``SystemExit``, the
    same exit code), whatever ``on_save_error`` says."""
    if kind == "KeyboardInterrupt":
        return KeyboardInterrupt(text)
    if kind == "SystemExit":
        stop = SystemExit(code)
        stop.add_note(text)
        return stop
    return BaseException(text)


class _Staged:
    """DCP's stager for shards already staged (by :meth:`ShardWriter.submit`, before the ranks
    agreed to write them): hands them on as they are."""

    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        """Nothing to wait for: staged already."""

    def close(self) -> None:
        """Nothing held: the buffers are the writer's stager's."""


class ShardWriter:
    """Writes sharded checkpoints in the background, one at a time (see the module)."""

    def __init__(self, when_busy: Literal["wait", "skip"] = "wait") -> None:
        self.when_busy = when_busy
        self.saves = 0
        """Sharded saves of this process so far (the temporary folders' names count them)."""
        self.waited = 0.0
        """Seconds saves waited for the write in flight (``when_busy="wait"``, ``must``), since it was made."""
        self._thread: threading.Thread | None = None
        self._path: Path | None = None  # the folder of the write in flight
        self._done: list[Done] = []
        self._stager: Any = None  # DCP's, for the shards
        self._rest = Staging()  # the one-file checkpoint's, for the rest (state.pt): no DTensor in it
        self._group: tuple[Any, Any] | None = None  # (the default group it was made in, the checkpoint's group)

    @property
    def group(self) -> Any:
        """The checkpoint's own gloo process group of every rank (made once per default group,
        a collective: every rank asks for it at the same save); ``None`` without
        ``torch.distributed``."""
        dist = _dist()
        if dist is None:
            return None
        world = dist.group.WORLD
        if self._group is None or self._group[0] is not world:
            self._group = (world, dist.new_group(backend="gloo"))
        return self._group[1]

    def in_flight(self) -> bool:
        """Whether this rank's last write is still going (DCP's part or its finish)."""
        return self._thread is not None and self._thread.is_alive()

    def ready(self, must: bool) -> bool:
        """Every rank, before a sharded save: ``True`` once no write is in flight on any rank
        (waiting for it when one is and ``when_busy="wait"`` or ``must``); ``False`` when the save
        is to be skipped (a write in flight on some rank, ``when_busy="skip"``): the same answer
        on every rank."""
        busy = any(_everyone(self.in_flight()))
        if busy and self.when_busy == "skip" and not must:
            return False
        began = time.monotonic()
        self.wait()
        if busy:
            self.waited += time.monotonic() - began
        return True

    def submit(self, rest: dict[str, Any], shards: dict[str, Any], tmp: Path, path: Path, main: bool, tag: Any,
               save_state: Callable[[dict[str, Any], Path], None]) -> Done | None:
        """Every rank, once :meth:`ready`: stage ``rest`` and ``shards`` into host memory and agree
        that every rank did; then start DCP's write of the shards into the folder ``tmp`` and
        return ``None``; the checkpoint is finished in the background
        (:func:`hookfit.plugins.checkpoint.sharded.finish`: ``state.pt`` with ``save_state``, the
        rename to ``path``) and its outcome, a :class:`~hookfit.plugins.checkpoint.writer.Done`
        with ``tag``, kept for :meth:`take`. When the copy failed on any rank, nothing is written
        and every rank lets go of its staging buffers: the failed save's outcome is returned, the
        same on every rank (the error :func:`~hookfit.plugins.checkpoint.sharded.finish` would
        raise, naming the first failing rank), to be reported at once. When the copy was stopped
        on any rank (a ``KeyboardInterrupt``, a ``SystemExit``: see the module), every rank lets
        go of its buffers and raises."""
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save

        group = self.group
        dist = _dist()
        rank = dist.get_rank() if dist is not None else 0
        failed: tuple[str, int | None] | None = None
        stopped: BaseException | None = None
        try:
            staged = self._rest.stage(rest)
            shards = self._stage(shards)
        except Exception as error:  # noqa: BLE001 - a failed save on every rank, reported as configured
            text, number = shardfiles.failure(error)
            failed = (f"rank {rank}: copying its state into host memory: {text}", number)
        except BaseException as error:  # the run is stopped (Ctrl-C, an exit): on every rank, below
            stopped = error
        mine = _stop(stopped, rank)
        outcomes = _everyone((failed, mine))  # every rank, whatever it raised
        stop = next((outcome for _, outcome in outcomes if outcome is not None), None)
        failed = next((outcome for outcome, _ in outcomes if outcome is not None), None)
        if failed is not None or stop is not None:
            if torch.cuda.is_available():  # CUDA's non-blocking copies may still read the buffers
                torch.cuda.synchronize()
            self._let_go()
        if stop is not None:  # the first stopped rank's kind: a rank stopped so raises its own
            if stopped is None or mine is None or mine[0] != stop[0]:
                raise _stopping(*stop) from stopped
            raise stopped
        if failed is not None:
            return Done(path, tag, sharded.error_of(failed))
        response = async_save(shards, storage_writer=FileSystemWriter(str(tmp), sync_files=True),
                              process_group=group, async_stager=_Staged())
        future = response.upload_completion if isinstance(response, AsyncSaveResponse) else response

        def finish() -> None:
            try:
                self._rest.ready()
                sharded.finish(staged, tmp, path, main, save_state, future.result, group)
            except BaseException as error:  # noqa: BLE001 - taken on the training thread, reported as configured
                self._done.append(Done(path, tag, error))
                return
            self._done.append(Done(path, tag))

        self._thread = threading.Thread(target=finish, name="hookfit-checkpoint-shards", daemon=True)
        self._path = path
        self._thread.start()
        return None

    def _stage(self, shards: dict[str, Any]) -> dict[str, Any]:
        """``shards`` copied into host memory by DCP's stager, on this thread, into buffers it
        keeps for the next save (made at the first)."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._stager is None:
            device = torch.cuda.is_available()  # (pinned buffers and copies synchronised once, from a GPU)
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=device, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=device))
        return cast(dict[str, Any], self._stager.stage(shards))  # (a dict: staged synchronously)

    @property
    def writing(self) -> list[Path]:
        """The folder of this rank's write in flight (rank 0's checkpoint), if any."""
        return [self._path] if self.in_flight() and self._path is not None else []

    def wait(self) -> None:
        """Block until this rank's write in flight, if any, is finished."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def join(self, timeout: float) -> bool:
        """Block until this rank's write in flight, if any, is finished, or ``timeout`` seconds
        have passed; whether it is (:meth:`wait` then takes it)."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.in_flight()

    def take(self) -> list[Done]:
        """The outcomes of the writes finished since the last call (call it where every rank
        does: after :meth:`ready` or :meth:`wait`)."""
        done, self._done = self._done, []
        return done

    def close(self) -> None:
        """Wait for the write in flight and let go of the staging buffers."""
        self.wait()
        self._let_go()

    def _let_go(self) -> None:
        """Let go of the staging buffers (no write in flight reads them): the next save makes them again."""
        self._rest.release()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
