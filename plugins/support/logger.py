"""What the loggers (``tensorboard``, ``csv``, the trackers) share: when a discovered logger is on, their
files in the run folder under :mod:`hookfit.files`' policy, which of an earlier run's records a resumed run
writes again, and names as a logger can take them (:class:`SafeNames`)."""

from __future__ import annotations

import csv
import os
import re
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hookfit.errors import HookfitWarning, user_level
from hookfit.files import FileWarning, RunFile

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.payloads import ResumeInfo
    from hookfit.run import Run


def wanted(loop: Run, plugin: Any, enabled: bool | None) -> bool:
    """Whether a logger takes part in this run: ``enabled`` when given; else when the user
    chose it (:func:`hookfit.manager.chosen`: given to ``Loop(plugins=[...])``, registered by
    hand, or named by a table of the configuration file, even an empty one), and not when it
    was merely discovered."""
    from hookfit.manager import chosen

    return enabled if enabled is not None else chosen(loop.pm, plugin)


def inert(self: Any, chosen: bool) -> str | None:
    """A logger's answer to ``hookfit plugins`` (bound as its ``inert`` method, see
    :func:`hookfit.discovery.inert`): what turns it on, or ``None`` when it takes part."""
    cls = type(self).__name__
    if self.enabled is False:
        return f"enabled is not False ({cls}(enabled=False) switches it off)"
    if self.enabled or chosen:
        return None
    return f"given to Loop(plugins=[{cls}()]), or named by a [plugins.{self.name}] table in hookfit.toml (even empty)"


def run_file(loop: Run, name: str, owner: str, binary: bool = False) -> RunFile:
    """A :class:`~hookfit.files.RunFile` for ``name`` in the run folder. A run folder that
    cannot be made warns once (:class:`~hookfit.files.FileWarning`) and gives a file that
    has failed already, which drops every write."""
    try:
        folder = loop.run_dir  # made on first use: it may fail as a write does
    except OSError as error:
        file = RunFile(Path(name), owner, binary=binary)
        file.failed = error
        warnings.warn(f"{owner}: could not create the run folder for {name} ({type(error).__name__}: "
                      f"{error}); training goes on without it", FileWarning, stacklevel=user_level())
        return file
    return RunFile(folder / name, owner, binary=binary)


def fail(file: RunFile, error: OSError) -> None:
    """Mark ``file`` failed with one :class:`~hookfit.files.FileWarning`, as
    :class:`~hookfit.files.RunFile` does for a failed write (for what a logger writes around it:
    a rewrite through a temporary file)."""
    file.close()
    file.failed = error
    warnings.warn(
        f"{file.owner}: could not write {file.path} ({type(error).__name__}: {error}); "
        f"it is left as it is and training goes on without it",
        FileWarning,
        stacklevel=user_level(),
    )


def written_again(info: ResumeInfo, val_due: bool) -> Callable[[int | None, int, str], bool]:
    """Whether a run resumed from the checkpoint ``info`` names writes again a record an earlier
    run wrote in its folder, ``(epoch, step, stage)``: a stage's means (``epoch`` counted from
    1) or a publication (``epoch`` ``None``), at the global ``step``. A logger drops such a
    record, so that what it keeps reads as the run that never stopped: a record of a step after
    the checkpoint's; at its step, a validation's when that validation runs again (``val_due``,
    or a resume at the epoch's validation), and the training means of the epoch the resumed run
    continues in, which a stop inside that epoch wrote with the batches it had got (the resumed
    run writes them whole at the epoch's end). What was written up to the checkpoint stays."""
    again = info.stage == "valid" or val_due

    def written(epoch: int | None, step: int, stage: str) -> bool:
        if step != info.step:
            return step > info.step
        if stage == "valid":
            return again
        return stage == "train" and info.stage == "train" and epoch == info.epoch + 1

    return written


class SafeNames:
    """Names (a metric's, an optimizer's, a parameter group's) as a logger takes them: ``clean(name)``, kept
    apart from the run's other names (``_2``, ``_3``...), each one changed said once a run in a
    :class:`hookfit.HookfitWarning` naming both (``rule``: what the logger's names take)."""

    def __init__(self, plugin: str, clean: Callable[[str], str], rule: str) -> None:
        self.plugin, self.clean, self.rule = plugin, clean, rule
        self.names: dict[str, str] = {}  # a name -> as the logger takes it, this run

    def reset(self) -> None:
        """A new run: no name said or taken yet."""
        self.names = {}

    def of(self, name: str) -> str:
        """``name`` as this run's logger takes it."""
        known = self.names.get(name)
        if known is not None:
            return known
        base = safe = self.clean(name)
        taken = set(self.names.values())
        n = 1
        while safe in taken:
            n += 1
            safe = f"{base}_{n}"
        self.names[name] = safe
        if safe != name:
            warnings.warn(f"{self.plugin}: {name!r} is written as {safe!r} {self.rule}"
                          f"{'; ' + repr(base) + ' was taken by another name' if safe != base else ''})",
                          HookfitWarning, stacklevel=3)
        return safe


def afresh(loop: Run) -> bool:
    """Whether ``loop`` writes its records afresh, setting aside those an earlier run left where it
    writes (:func:`set_aside`), its evaluations' with them: a fit that does not continue them
    (``loop.state.continues``, known once the run has resumed: ask at the first write or at ``resumed``, never
    at ``fit_start``; a ``resume="latest"`` that found no checkpoint starts afresh, and so does a run resumed
    from an earlier run's checkpoint that a later run's records follow). An evaluation never
    does: the evaluations of one run's checkpoints in its folder add up to one record."""
    return loop.mode == "fit" and not loop.state.continues


def set_aside(folder: Path, names: list[str], owner: str, renamed: Callable[[str, int], str],
              fresh: Callable[[list[str]], str], *, stuck: str, advice: str, least: int,
              also: Iterable[str] = ()) -> list[str]:
    """Before a run that writes afresh (:func:`afresh`) writes in ``folder``, its run folder: ``names``, what an
    earlier run wrote there, renamed ``renamed(name, N)``, never deleted nor written over. ``N`` is
    one more than the highest number of an ``earlier-run-N`` taken for any of them or for the names ``also``
    (what the logger sets aside there on other runs), a subfolder as a whole, and at least ``least``: the run's
    ``loop.earlier_run`` (:attr:`hookfit.run.Run.earlier_run`), the one ``N`` every plugin of the run sets one
    earlier run's files aside under (:func:`move_aside`); later runs count up. One :class:`~hookfit.HookfitWarning` names what
    moved and where (``fresh(stayed)``: what this run writes instead, given the names that stayed; ``advice``:
    how to keep runs apart). One that cannot be moved stays, with a :class:`~hookfit.files.FileWarning`
    naming it (``stuck``: what becomes of it); the run goes on. Returns the names that stayed."""
    number, moved, failed = move_aside(folder, names, renamed, also, least=least)
    for name, error in failed.items():
        warnings.warn(f"{owner}: could not set {folder / name} of an earlier run aside as "
                      f"{folder / renamed(name, number)} ({type(error).__name__}: {error}); {stuck}", FileWarning,
                      stacklevel=user_level())
    stayed = list(failed)
    if moved:
        shown = [renamed(name, number) for name in moved]
        warnings.warn(f"{owner}: {folder} holds {', '.join(moved)} of an earlier run, which this run does not "
                      f"continue: set aside as {', '.join(shown)}; {fresh(stayed)}. {advice}", HookfitWarning,
                      stacklevel=user_level())
    return stayed


def move_aside(folder: Path, names: list[str], renamed: Callable[[str, int], str], also: Iterable[str] = (),
               least: int = 1) -> tuple[int, list[str], dict[str, OSError]]:
    """``names`` (files or folders in ``folder``) renamed ``renamed(name, N)``, never deleted nor
    written over: ``N`` is one more than the highest number taken for any of them or of the names
    ``also``, a subfolder (``earlier-run-N/``) taken as a whole, so one ``N`` is one earlier run's and
    later runs count up, the newest the highest even after an earlier one was deleted; and at least
    ``least``: in the run folder, the run's ``loop.earlier_run`` (:attr:`hookfit.run.Run.earlier_run`), so that
    what each plugin sets aside of one earlier run has one ``N``. Returns ``N``, the names moved, and those that could not be, each with its error."""
    def taken(new: Path) -> bool:  # (a subfolder of the folder, such as earlier-run-1/, is taken whole)
        return os.path.lexists(folder / new.relative_to(folder).parts[0])

    numbers = _numbers(folder)  # (candidates: only those taken by a name renamed count)
    number = max(least, 1 + max((n for n in numbers if any(taken(folder / renamed(name, n))
                                                           for name in [*names, *also])), default=0))
    moved: list[str] = []
    failed: dict[str, OSError] = {}
    for name in names:
        new = folder / renamed(name, number)
        try:
            new.parent.mkdir(parents=True, exist_ok=True)
            os.rename(folder / name, new)
            moved.append(name)
        except OSError as error:
            failed[name] = error
    return number, moved, failed


def _entries(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:  # (a folder that cannot be listed: the moves there say so)
        return []


def _numbers(folder: Path) -> set[int]:
    """The numbers ``N`` of the names holding ``earlier-run-N`` in ``folder``."""
    return {int(n) for entry in _entries(folder) for n in re.findall(r"earlier-run-(\d+)", entry)}


def table_of(path: Path, leading: tuple[str, ...]) -> bool:
    """Whether ``path`` is a regular file holding a CSV table whose header starts with the columns ``leading``
    (a logger's own), checked before it is opened: a FIFO of that name would block its open."""
    if not path.is_file():
        return False
    try:
        with open(path, newline="", encoding="utf-8", errors="replace") as text:
            return tuple(next(csv.reader(text), [])[:len(leading)]) == leading
    except (OSError, csv.Error):
        return False
