"""checkpoint ranks: every process's own random state, in a checkpoint of a run of several
processes.

``loop.state_dict()`` differs between the processes of a run in its random state: ``rng`` (a
script that seeds each process's stream for its own dropout or augmentation) and ``data_rng``
(the stream the epoch's data iterator was made from). The main process writes the checkpoint,
so without this every process of the resumed run would continue the main process's streams.
:func:`gather` collects each process's (a collective: every process builds the checkpoint's
contents) into the checkpoint's ``ranks`` entry, and :func:`own` gives each process of the
resumed run its own before ``loop.load_state_dict``. Resumed on more processes than wrote it (one
process's checkpoint, which has no ``ranks`` entry, included), a process beyond those keeps the main
process's, with one warning.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from hookfit.data import Batches
from hookfit.errors import HookfitWarning, user_level

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

__all__ = ["KEY", "SAME", "TIMED_SPACING", "WRITERS", "Clock", "from_main", "gather", "main_directory", "own", "writers"]

KEY = "ranks"
"""The checkpoint's entry of every process's own part of the run's state."""
WRITERS = "world_size"
"""The entry of a checkpoint's ``meta``: the number of processes of the run that wrote it (every checkpoint
has it, a failed run's too, whose ``ranks`` entry is missing where the process group was already gone)."""
OWN = ("rng", "data_rng")
"""What of ``loop.state_dict()`` is each process's own."""


def _group() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def gather(loop: Run, run_state: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """Every process's ``rng`` and ``data_rng`` (of its ``loop.state_dict()``), in rank
    order, on every process; ``None`` in a run of one process."""
    dist = _group()
    if loop.state.world_size <= 1 or dist is None:
        return None
    mine = {key: run_state[key] for key in OWN if key in run_state}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def writers(data: Mapping[str, Any]) -> int:
    """The number of processes that wrote the checkpoint ``data``: its ``meta``'s :data:`WRITERS`; in a
    file without it (an older hookfit's), the length of its ``ranks`` entry, or 1 where it has none."""
    meta, saved = data.get("meta"), data.get(KEY)
    size = meta.get(WRITERS) if isinstance(meta, Mapping) else None
    if isinstance(size, int) and not isinstance(size, bool) and size >= 1:
        return size
    return len(saved) if isinstance(saved, list) and saved else 1


def _trained(loop: Run, position: Mapping[str, Any]) -> bool:
    """Whether the run resumed at ``position`` (the checkpoint's, checked) has no training batch left: its
    ``max_steps`` done, or its ``max_epochs`` where they bound it (given, or no ``max_steps``)."""
    step, epoch = position.get("step", 0), position.get("epoch", 0)
    return (loop.max_steps is not None and step >= loop.max_steps) or (
        (loop.config.epochs_given or loop.max_steps is None) and epoch >= loop.max_epochs)


def own(loop: Run, run_state: dict[str, Any], saved: Any, path: object, size: int) -> dict[str, Any]:
    """``run_state`` (the main process's, as saved) with this process's own part of it, from
    the checkpoint's ``ranks`` entry ``saved`` (absent: as it is), written by ``size`` processes
    (:func:`writers`). Resumed inside a training
    epoch on another number of processes than wrote it, over data that keeps no position of its
    own, the rest of that epoch is another share of the data: one warning says so. Resumed on another
    number of processes otherwise (at an epoch's end, or over data that keeps its own position), with
    training left, one warning says what changes from there on (each step's global batch, an epoch's steps); none over
    :class:`hookfit.data.Batches`, whose load refuses another global batch and goes on exactly with the same.
    A process whose random states the checkpoint lacks (more processes than ``saved`` holds; a file without
    it holds the main process's alone: one process's, or a failed run's) takes the main process's: said in
    that warning, or in one of its own. An evaluation (``Loop.validate``) continues no run: no warning."""
    position = run_state.get("loop") or {}
    inside = position.get("resume_stage") == "train" and position.get("resume_batch") and not run_state.get("data")
    left = loop.mode == "fit" and not _trained(loop, position)  # (an evaluation, or nothing left to train: no word)
    held = len(saved) if isinstance(saved, list) and saved else 1  # the processes whose random states it holds
    world = loop.state.world_size
    beyond = f"the processes beyond {held} take the main process's random states" if held < world else ""
    changed = size != world and loop.is_main and not inside and loop.mode == "fit" and not isinstance(
        loop.train_data, Batches) and left  # (Batches refuses another global batch, and goes on exactly with the same)
    if changed:
        shared = "read by one process" if world == 1 else f"shared among {world} processes"
        warnings.warn(
            f"checkpoint: {path} was written by {size} process(es) and is resumed in {world}: "
            f"from here on the data is {shared} instead of {size}, so each "
            f"optimizer step's global batch (the processes' batches together), the batches each process sees "
            f"and the steps an epoch takes change, and counts in steps (max_steps, a scheduler's steps, "
            f"every_n_steps) count other batches{f', and {beyond}' if beyond else ''}: the run goes on as another "
            f"run would; resume with {size} process(es) to continue it as it was, or over hookfit.data.Batches whose "
            f"global batch (batch_size x processes) is the same",
            HookfitWarning, stacklevel=user_level())
    elif size != world and loop.is_main and inside and left:
        warnings.warn(
            f"checkpoint: {path} was written by {size} process(es) inside epoch {position.get('epoch', 0) + 1} "
            f"({position['resume_batch']} batches of it done by each) and this run has {world}: each "
            f"process's batches of that epoch are another share of the data, so the rest of it repeats or skips "
            f"samples of the run it continues{f', and {beyond}' if beyond else ''}; resume with {size} process(es), "
            f"from a checkpoint at an epoch's end, or over data that keeps its own position (hookfit.data.Batches, "
            f"StatefulDataLoader)", HookfitWarning, stacklevel=user_level())
    elif beyond and loop.is_main and left:
        why = (f" (a checkpoint of {size} processes written after the process group was gone, as a failed run's "
               f"is, holds the main process's alone)" if size > held else "")
        warnings.warn(f"checkpoint: {path} holds the random states of {held} process(es){why} and this run has "
                      f"{world}: each process resumes its own where it has one, the others the main process's "
                      f"(random draws of those processes differ from the run it continues)",
                      HookfitWarning, stacklevel=user_level())
    rank = loop.state.rank
    if not isinstance(saved, list) or rank >= len(saved) or not isinstance(saved[rank], Mapping):
        return run_state
    mine = {key: value for key, value in run_state.items() if key not in OWN}
    mine.update(saved[rank])
    return mine


SAME = ("every_n_epochs", "every_n_steps", "every_seconds", "keep_last", "keep_best", "monitor", "mode",
        "on_interrupt", "on_failure", "on_save_error", "strict", "fallback", "background", "when_busy")
"""The options of the checkpoint every process must share (each save is a collective all of them take); ``dir``
aside, the main process's folder being every process's."""


def main_directory(loop: Run, folder: Path | None, checkpoint: object) -> Path | None:
    """Off the main process, where the main one writes its checkpoints (``folder``, given by
    the main process: its run folder may be one the others would name differently), so that
    every process knows the best and the last checkpoint's path; ``None`` on the main process
    or without ``torch.distributed``. One all-gather: every process calls it at ``fit_start``, and
    every process raises where one's ``checkpoint`` options (:data:`SAME`) are not the main one's."""
    dist = _group()
    if dist is None:
        return None
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (str(folder) if loop.is_main else None,
                                      {option: getattr(checkpoint, option) for option in SAME}))
    main = everyone[0][1]
    differ = {option: [f"{theirs[option]!r} on rank {rank}" for rank, (_, theirs) in enumerate(everyone)
                       if theirs[option] != main[option]] for option in SAME}
    if listed := "; ".join(f"{option}={main[option]!r} on the main process, {', '.join(others)}"
                           for option, others in differ.items() if others):
        raise ValueError(f"checkpoint: the processes were given different checkpoint options ({listed}): give "
                         f"every process the same Checkpoint(...), not the main process alone: each save is a "
                         f"collective every process takes, and differing options would hang the job")
    return None if loop.is_main else Path(everyone[0][0])


TIMED_SPACING = 1.0
"""With several processes, the most seconds of training between two readings of the main process's clock
for ``every_seconds`` (and never more than a tenth of ``every_seconds``): each reading is a broadcast (under
NCCL, a wait for the device), so it is spaced to about this much training whatever a step takes."""


class Clock:
    """When a save by time is due: ``every`` seconds after the run's start or its last save (never, ``None``).

    In a run of one process its clock is read after every batch. With several, the main process's clock
    decides for all, at steps every process knows: each reading is one broadcast that also names the step
    of the next, about :data:`TIMED_SPACING` seconds of training later by the steps' pace so far. A save
    is so late by at most that much, whether a step takes a millisecond or a minute."""

    def __init__(self, every: float | None) -> None:
        self.every = every
        self._last = self._read_at = 0.0
        self._read_step: int | None = None  # the step of the last reading; None before the run's first
        self._next = 0

    def start(self) -> None:
        """The run starts (its step is not known yet: a resume sets it after ``fit_start``): the first
        reading is after its first batch, the second after the next, from when the pace is known."""
        self._last = time.monotonic()
        self._read_step, self._next = None, 0

    def saved(self) -> None:
        """A checkpoint was saved (for any reason): the next one by time is ``every`` seconds from now."""
        self._last = time.monotonic()

    def due(self, loop: Run) -> bool:
        """Whether a save by time is due after this batch (the same answer on every process)."""
        if self.every is None:
            return False
        now, step = time.monotonic(), loop.state.step
        if loop.state.world_size <= 1:
            return now - self._last >= self.every
        if step < self._next:
            return False
        ahead = 1
        if self._read_step is not None and (pace := (now - self._read_at) / max(step - self._read_step, 1)) > 0:
            ahead = max(1, int(min(TIMED_SPACING, self.every / 10) / pace))  # (pace: seconds a step since the last)
        due, self._next = from_main(loop, (now - self._last >= self.every, step + ahead))
        self._read_at, self._read_step = now, step
        return bool(due)


def from_main(loop: Run, value: Any) -> Any:
    """The main process's ``value``, on every process (one broadcast of the run's default group:
    every process calls it at the same point); ``value`` itself in a run of one process."""
    if loop.state.world_size <= 1 or (dist := _group()) is None:
        return value
    told: list[Any] = [value if loop.is_main else None]
    dist.broadcast_object_list(told, src=0)
    return told[0]
