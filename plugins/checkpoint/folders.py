"""checkpoint's folders: the lock that keeps a second process out of the folder a run's
checkpoints go to (:class:`hookfit.locks.FolderLock`), the temporary files a killed
write left there, and the tag that keeps a run's checkpoint names apart from those of the other runs
whose checkpoints the folder holds (:func:`tag`): no run moves, prunes or writes over another run's
checkpoint, so a path a run reported (``state.results``, its lines, ``run.jsonl``) names that run's file for
good."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hookfit.plugins.checkpoint import sharded
from hookfit.plugins.checkpoint.storage import checkpoint_files, listed, run_files, run_of, stale_temporaries, tag_of
from hookfit.locks import FolderLock

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

__all__ = ["FolderLock", "adoptable", "continued", "latest_run", "lock", "prepare", "tag", "written_by"]


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


def prepare(folder: Path) -> None:
    """Before a run writes in ``folder`` (main process, at ``fit_start``): the temporary files of writes that a
    killed process left removed. The checkpoints there stay where they are, whoever wrote them."""
    for path in stale_temporaries(folder):
        try:
            sharded.remove(path)
        except OSError:
            pass


def tag(folder: Path, resuming: Path | None, identity: str) -> int:
    """The tag of the names a run of ``identity`` (``loop.identity.key``) resuming from ``resuming`` (``None``: from no
    checkpoint) gives its checkpoints in ``folder`` (:func:`~hookfit.plugins.checkpoint.storage.tag_of`): the tag of
    ``resuming`` where the run continues the checkpoints there (:func:`continued`); else 0 in a folder holding no
    checkpoint, and one more than the highest tag there in one that does (a run's, a failure's, a sharded one's, an
    earlier run's listed in :data:`~hookfit.plugins.checkpoint.storage.EARLIER`), so that no name of this run is one
    of theirs: a run forking another identity's checkpoint never writes over that run's files. The main process's tag is
    every process's, broadcast at ``fit_start`` before any of them saves: another node's listing at the path of the
    main process's folder may differ (a relative ``dir``, a filesystem not shared)."""
    if resuming is not None and continued(folder, resuming, identity):
        return tag_of(resuming)
    names = run_files(folder)
    return 1 + max(tag_of(folder / name) for name in names) if names else 0


def continued(folder: Path, resumed: Path | None, identity: str) -> bool:
    """Whether a run of ``identity`` (``loop.identity.key``) resumed from ``resumed`` (``None``: no checkpoint)
    continues the checkpoints in ``folder``, where it writes: it resumed from one of them (not from one that an earlier
    run left there, listed in :data:`~hookfit.plugins.checkpoint.storage.EARLIER`) that a run of its own identity
    wrote (``meta["identity"]``; a checkpoint that records none, written before they were recorded, is any run's). A
    run resuming another identity's checkpoint by its path forks it: it names its checkpoints apart (:func:`tag`),
    takes none of that run's as its own (:func:`adoptable`: ``keep_last`` never prunes them) and leaves its records
    (:func:`latest_run`)."""
    if resumed is None or resumed.parent.resolve() != folder.resolve() or resumed.name in listed(folder):
        return False
    return written_by(resumed, identity)


def written_by(checkpoint: Path, identity: str) -> bool:
    """Whether a run of ``identity`` (``loop.identity.key``) wrote ``checkpoint``, as its ``meta["identity"]`` says (a
    checkpoint that records none, written before they were recorded, is any run's). A run resuming one it did not write
    forks it: it continues neither that run's checkpoints (:func:`continued`) nor its run folder, getting one of its
    own (the checkpoint plugin's ``configure`` calls ``loop.continue_in`` for its own identity's alone)."""
    return run_of(checkpoint)[0] in (None, identity)


def latest_run(folder: Path, resumed: Path, identity: str) -> bool:
    """Whether a run of ``identity`` resumed from ``resumed`` continues the run written last in ``folder`` (the one
    whose records, its tables and events, a run folder holds): it continues the checkpoints there (:func:`continued`)
    and ``resumed`` is of the tag of the newest there (:func:`~hookfit.plugins.checkpoint.storage.checkpoint_files`).
    An earlier run resumed by the path of its checkpoint beside a later run's continues its checkpoints, not the later
    run's records, which the loggers set aside (``loop.resumes_apart()``)."""
    if not continued(folder, resumed, identity):
        return False
    newest = checkpoint_files(folder)
    return not newest or tag_of(newest[0]) == tag_of(resumed)


def adoptable(folder: Path, resumed: Path, identity: str) -> list[Path]:
    """The checkpoints in ``folder`` a run of ``identity`` resumed from ``resumed`` takes as its own (``keep_last``
    prunes them): where it continues them (:func:`continued`), those of the tag of ``resumed`` (the run that wrote
    it, and its resumes; another run's checkpoints in the folder are never pruned); none otherwise."""
    if not continued(folder, resumed, identity):
        return []
    return [path for path in checkpoint_files(folder) if tag_of(path) == tag_of(resumed)]
