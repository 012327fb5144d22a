"""checkpoint's folders: the lock that keeps a second process out of the folder a run's
checkpoints go to (:class:`hookfit.locks.FolderLock`), the temporary files a killed
write left there, and an earlier run's checkpoints there, moved aside into ``earlier-run-N/``
by a run that does not continue them."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from hookfit.errors import user_level
from hookfit.plugins.checkpoint import sharded
from hookfit.plugins.checkpoint.storage import (EARLIER, CheckpointWarning, checkpoint_files, list_earlier, listed,
                                                run_files, stale_temporaries)
from hookfit.plugins.support.logger import move_aside
from hookfit.locks import FolderLock

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

__all__ = ["FolderLock", "Preparing", "adoptable", "lock", "prepare"]


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


def prepare(folder: Path, continues: bool, least: int = 1) -> None:
    """Before a run writes in ``folder`` (main process, at ``fit_start``): the temporary files of writes that a
    killed process left removed; unless the run ``continues`` the checkpoints there (it resumed from one of them),
    every checkpoint an earlier run left there (``epoch*.pt``, sharded ``epoch*.dcp``, ``failed-*`` ones) moved
    into the subfolder ``earlier-run-N/`` (``N`` one more than the highest there, and at least ``least``: in the
    run folder, the run's ``loop.earlier_run``, under which the loggers set the same run's files aside:
    :func:`~hookfit.plugins.support.logger.move_aside`), never deleted nor written over, and warned of
    once. One that cannot be moved stays, listed in :data:`~hookfit.plugins.checkpoint.storage.EARLIER`,
    with a warning naming it: no listing takes it, no ``keep_last`` prunes it, and this run's save of that name
    fails (``on_save_error``) rather than write over it. The run goes on either way."""
    for path in stale_temporaries(folder):
        try:
            sharded.remove(path)
        except OSError:
            pass
    names = [] if continues else run_files(folder)
    if not names:
        return
    number, moved, failed = move_aside(folder, names, lambda name, n: f"earlier-run-{n}/{name}", least=least)
    into = folder / f"earlier-run-{number}"
    if moved:
        shown = [name for name in moved if not name.startswith("failed-")] or moved
        warnings.warn(f"checkpoint: {folder} held {len(moved)} checkpoint(s) of an earlier run (newest by name: "
                      f"{shown[-1]}) and this run does not continue them: moved into {into}, where they stay (resume "
                      f"or export one by its path there); resume='latest', hookfit export and keep_last take this "
                      f"run's checkpoints only. Give each run its own run_dir or name, or resume "
                      f"(resume='latest')", CheckpointWarning, stacklevel=user_level())
    try:
        list_earlier(folder, (listed(folder) - set(moved)) | set(failed))
        kept = (f"listed in {folder / EARLIER}; resume='latest', hookfit export and keep_last leave it alone, and "
                f"this run's checkpoint of that name is not written over it (a failed save, as on_save_error says)")
    except OSError as unlisted:
        kept = (f"and could not be listed in {folder / EARLIER} either ({type(unlisted).__name__}: {unlisted}): "
                f"resume='latest', hookfit export and keep_last take it as this run's")
    for name, error in failed.items():
        warnings.warn(f"checkpoint: could not move {folder / name}, an earlier run's checkpoint, into {into} "
                      f"({type(error).__name__}: {error}): it stays where it is, {kept}", CheckpointWarning,
                      stacklevel=user_level())


class Preparing:
    """The folder a run's checkpoints go to, prepared (:func:`prepare`) before the run writes there: at once for a
    run that resumes from no checkpoint, after the restore for one that does, so that a resume that fails (another
    model's checkpoint) leaves an earlier run's files where they were."""

    def __init__(self) -> None:
        self.pending: tuple[Path, bool, int] | None = None

    def start(self, folder: Path | None, resuming: Path | None, least: int = 1) -> None:
        """The run starts writing in ``folder`` (``None``: none known here), resuming from ``resuming``; what it
        moves aside goes under an ``N`` of at least ``least`` (:func:`prepare`)."""
        self.pending = None if folder is None else (folder, continued(folder, resuming), least)
        if resuming is None:
            self.done()

    def done(self) -> None:
        """The run resumed (or resumes from nothing): prepare its folder now, once."""
        if (pending := self.pending) is not None:
            self.pending = None
            prepare(*pending)


def continued(folder: Path, resumed: Path | None) -> bool:
    """Whether a run resumed from ``resumed`` (``None``: no checkpoint) continues the checkpoints in ``folder``,
    where it writes: it resumed from one of them (not from one that an earlier run left there, listed in
    :data:`~hookfit.plugins.checkpoint.storage.EARLIER`)."""
    return (resumed is not None and resumed.parent.resolve() == folder.resolve()
            and resumed.name not in listed(folder))


def adoptable(folder: Path, resumed: Path) -> list[Path]:
    """The checkpoints in ``folder`` a run resumed from ``resumed`` takes as its own (``keep_last`` prunes them):
    those listed there when it continues them (:func:`continued`); none otherwise, a run that does not having
    moved them aside before it began (:func:`prepare`)."""
    return checkpoint_files(folder) if continued(folder, resumed) else []
