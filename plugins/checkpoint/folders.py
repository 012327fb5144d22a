"""checkpoint's folders: the lock that keeps a second process out of the folder a run's
checkpoints go to (:class:`hookfit.locks.FolderLock`), and the temporary files a killed
write left there."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from hookfit.errors import user_level
from hookfit.plugins.checkpoint import sharded
from hookfit.plugins.checkpoint.storage import (EARLIER, CheckpointWarning, aside, checkpoint_files, set_aside,
                                                stale_temporaries)
from hookfit.locks import FolderLock

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

__all__ = ["FolderLock", "adoptable", "lock", "prepare"]


def lock(loop: Run, directory: Path | None, continued: bool, owner: str) -> FolderLock | None:
    """Lock the folder this run's checkpoints go to, at ``fit_start`` (main process): a given
    ``dir`` (``directory``) gets a lock of its own, returned for ``fit_end`` to release; a given
    ``run_dir`` or the folder of a resumed run (``continued``) is locked by the core as it is
    first used (:class:`hookfit.records.RunFolder`), which this does now. Either way a live
    process there refuses this one with a :class:`hookfit.locks.FolderInUse` naming it. A new
    run folder is this process's alone and is not touched."""
    if directory is not None and not loop.smoke:
        _make(directory, owner)
        held = FolderLock(directory, owner)
        held.acquire(f"this run's checkpoints ({owner}(dir={str(directory)!r}))",
                     f"give this run's {owner} a dir of its own, or leave dir out to save into the run folder")
        return held if held.held else None
    if loop.run_dir_given or continued:
        loop.run_dir  # noqa: B018 - the folder's first use takes its lock
    return None


def _make(directory: Path, owner: str) -> None:
    """Make the checkpoint folder ``directory`` (and its parents) if it is missing; a path that
    is there and not a folder (a file, ``/dev/null``) is refused with a ``NotADirectoryError``
    that says so, and any other failure gets a note naming the option."""
    given = f"{owner}(dir={str(directory)!r})"
    if directory.exists() and not directory.is_dir():
        kind = "a file" if directory.is_file() else "not a regular file (a device, a socket or a pipe)"
        raise NotADirectoryError(f"{given}: the checkpoints' folder is {kind}, not a folder: give the path of a "
                                 f"folder (it is made if it does not exist), or leave dir out to save into the "
                                 f"run folder")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        error.add_note(f"{given}: could not make the checkpoints' folder {str(directory)!r}")
        raise


def prepare(folder: Path, resumes: bool) -> None:
    """Before a run writes in ``folder``: the temporary files of writes that a killed process
    left removed; the checkpoints of an earlier run there, when this run does not resume, set
    aside (:func:`~hookfit.plugins.checkpoint.storage.set_aside`) and warned of once."""
    for path in stale_temporaries(folder):
        try:
            sharded.remove(path)
        except OSError:
            pass
    earlier = [] if resumes else checkpoint_files(folder)
    if earlier:
        set_aside(folder, earlier)
        warnings.warn(f"checkpoint: {folder} already holds {len(earlier)} checkpoint(s) of an earlier run (newest by "
                      f"name: {earlier[0].name}) and this run does not resume: they stay there, set aside (listed in "
                      f"{EARLIER}), until this run writes a checkpoint of the same name: resume='latest', hookfit "
                      f"export and keep_last take this run's checkpoints only; one of them is resumed or exported by "
                      f"its path. Give each run its own run_dir or name, or "
                      f"resume (resume='latest')", CheckpointWarning, stacklevel=user_level())


def adoptable(folder: Path, resumed: Path) -> list[Path]:
    """The checkpoints in ``folder`` a run resumed from ``resumed`` takes as its own (``keep_last`` prunes them):
    those listed there; none where ``resumed`` is an earlier run's that a later run set aside (a resume by its path,
    as the warning of :func:`prepare` says), whose own are set aside in turn, warned of once, and never pruned."""
    if resumed.parent.resolve() != folder.resolve() or resumed.resolve() not in {p.resolve() for p in aside(folder)}:
        return checkpoint_files(folder)
    if later := checkpoint_files(folder):
        set_aside(folder, later)
        warnings.warn(f"checkpoint: {resumed.name} was set aside in {folder} by a later run, whose {len(later)} "
                      f"checkpoint(s) there (newest by name: {later[0].name}) are set aside in turn (listed in "
                      f"{EARLIER}): resume='latest', hookfit export and keep_last take this run's from now on",
                      CheckpointWarning, stacklevel=user_level())
    return []
