"""checkpoint shardwriter: sharded checkpoints (:mod:`hookfit.plugins.checkpoint.sharded`)
written in the background, with :func:`torch.distributed.checkpoint.async_save`.

A save blocks training for one copy of the state into host memory: the sharded tensors (each
rank's shards) are staged by DCP's :class:`~torch.distributed.checkpoint.staging.DefaultStager`,
whose host buffers (pinned where CUDA is) are made at the first save and reused while the
tensors keep their storages; the rest of the checkpoint (``state.pt``'s contents, no sharded
tensor in it) as a one-file checkpoint's state is
(:class:`~hookfit.plugins.checkpoint.staging.Staging`). DCP's own thread then writes each rank's
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
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

import torch

from hookfit.plugins.checkpoint import sharded
from hookfit.plugins.checkpoint.staging import Staging
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
    background (see the module), else in the foreground. Rank 0's folder, or ``None`` (another
    rank, or a save skipped: ``when_busy="skip"``)."""
    reason, step, metric, must = asked
    checkpoint.writer.wait()  # (pruning the one-file writer was asked to do)
    checkpoint.collect(loop)  # (the plugin's own: announced, pruned, failures reported)
    writer = checkpoint.shards
    if checkpoint.background:
        if not writer.ready(must):  # the same answer on every rank
            checkpoint.reports.skip(step)
            return None
        checkpoint.collect(loop, writer.take())
    main = loop.is_main
    path = checkpoint.directory(loop).absolute() / checkpoint.filename(position, reason) if main else None
    writer.saves += 1
    path, tmp = sharded.destination(path, writer.saves)  # rank 0's, on every rank
    tag = (reason, step, metric, main)
    if checkpoint.background:
        writer.submit(rest, shards, tmp, path, main, tag, write_file)
    else:
        checkpoint.writer.write(rest, path, tag, save=lambda state, to, between: sharded.write(
            state, shards, tmp, to, main, write_file))
        checkpoint.collect(loop)
    return path if main else None


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


class ShardWriter:
    """Writes sharded checkpoints in the background, one at a time (see the module)."""

    def __init__(self, when_busy: Literal["wait", "skip"] = "wait") -> None:
        self.when_busy = when_busy
        self.saves = 0
        """Sharded saves of this process so far (the temporary folders' names count them)."""
        self._thread: threading.Thread | None = None
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
        busy = self.in_flight()
        dist = _dist()
        if dist is not None and dist.get_world_size() > 1:
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, busy)
            busy = any(everyone)
        if busy and self.when_busy == "skip" and not must:
            return False
        self.wait()
        return True

    def submit(self, rest: dict[str, Any], shards: dict[str, Any], tmp: Path, path: Path, main: bool, tag: Any,
               save_state: Callable[[dict[str, Any], Path], None]) -> None:
        """Every rank, once :meth:`ready`: stage ``rest`` and ``shards`` into host memory, start
        DCP's write of the shards into the folder ``tmp`` and return; the checkpoint is finished
        in the background (:func:`hookfit.plugins.checkpoint.sharded.finish`: ``state.pt`` with
        ``save_state``, the rename to ``path``) and its outcome, a
        :class:`~hookfit.plugins.checkpoint.writer.Done` with ``tag``, kept for :meth:`take`."""
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save

        group = self.group
        if self._stager is None:  # to host memory, on this thread, into buffers it keeps for the next save
            device = torch.cuda.is_available()  # (pinned buffers and copies synchronised once, from a GPU)
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=device, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=device))
        staged = self._rest.stage(rest)
        response = async_save(shards, storage_writer=FileSystemWriter(str(tmp), sync_files=True),
                              process_group=group, async_stager=self._stager)
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
        self._thread.start()

    def wait(self) -> None:
        """Block until this rank's write in flight, if any, is finished."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def take(self) -> list[Done]:
        """The outcomes of the writes finished since the last call (call it where every rank
        does: after :meth:`ready` or :meth:`wait`)."""
        done, self._done = self._done, []
        return done

    def close(self) -> None:
        """Wait for the write in flight and let go of the staging buffers."""
        self.wait()
        self._rest.release()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
