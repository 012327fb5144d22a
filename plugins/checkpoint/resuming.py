"""checkpoint's resume side: which checkpoint a run resumes from (``"latest"``, a file, a
folder; with ``fallback``, the next newest when one fails its checks) and how its contents are
restored into the run (the model, every plugin's state, the run's own state). Plain functions
of the run; the plugin (:mod:`hookfit.plugins.checkpoint.plugin`) calls them at ``configure``
and ``resume``, and keeps the save side."""

from __future__ import annotations

import difflib
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hookfit import HookfitWarning, StateMismatch
from hookfit.data import Batches
from hookfit.errors import user_level
from hookfit.records import recorded_identity
from hookfit.plugins.checkpoint import ranks, sharded
from hookfit.plugins.checkpoint.export import best
from hookfit.plugins.checkpoint.state import SWITCHED_OFF, load_model, model_mismatch, model_state
from hookfit.plugins.checkpoint.storage import (CheckpointError, CheckpointWarning, checkpoint_files, earlier, read,
                                                run_of, written_at)

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

OWN_KEYS = frozenset({"format", "version", "model", "plugins", "meta", "digest", ranks.KEY})
"""A checkpoint's entries that are not the run's own state (``loop.state_dict()``, whose
entries sit beside them: ``loop``, ``rng``, ``data``...)."""


def choose(loop: Run, source: str, directory: Path | None, fallback: bool
           ) -> tuple[Path | None, dict[str, Any] | None]:
    """The checkpoint to resume from and its checked contents, or ``(None, None)`` when
    ``"latest"`` finds none (the run starts afresh, said in one line on stderr). ``directory``: ``Checkpoint(dir=...)``;
    ``fallback``: a checkpoint that fails its checks is warned about and the next newest taken."""
    trains = loop.train_data if loop.mode == "fit" else None  # (an evaluation trains from no position)
    if source == "best":  # an evaluation of the newest run's best checkpoint, as hookfit export --best takes it
        if loop.mode == "fit":
            raise ValueError("checkpoint: resume='best' is for Loop.validate(): training goes on from the newest "
                             "checkpoint (resume='latest'); to train on from the best, give its path")
        candidates, where = latest(loop, directory)
        if not candidates:
            raise FileNotFoundError(f"checkpoint: resume='best' found no checkpoint in {where}"
                                    f"{_aside_note(loop, Path(where))}; {_elsewhere(directory)}")
        path = best(candidates[0], "checkpoint: resume='best'", "resume='latest' takes the newest")[0]
        return path, _read(loop, path, trains)
    if source != "latest":
        path = Path(source)
        if path.is_dir() and not sharded.is_sharded(path):
            candidates, where = checkpoint_files(path), str(path)
            if not candidates:
                raise FileNotFoundError(f"checkpoint: no checkpoint in {path}{_aside_note(None, path)}")
        elif not path.exists():
            meant = "".join(f"; did you mean resume={close!r}?" for close in difflib.get_close_matches(
                source, ["latest", "best"], n=1))
            raise FileNotFoundError(f"checkpoint: resume={source!r}: no such file{meant}")
        else:
            return path, _read(loop, path, trains)
    else:
        candidates, where = latest(loop, directory)
        if not candidates:  # said: a script run from another folder finds no runs/ of its own
            if loop.is_main:
                then = ("the run starts from the beginning" if loop.mode == "fit" else
                        f"the model's weights as they are; {_elsewhere(directory)}")
                print(f"hookfit checkpoint: resume='latest' found no checkpoint in {where}"
                      f"{_aside_note(loop, Path(where))}: {then}", file=sys.stderr, flush=True)
            return None, None
    if not fallback:
        try:
            return candidates[0], _read(loop, candidates[0], trains)
        except CheckpointError as error:
            if len(candidates) < 2:
                raise
            raise CheckpointError(f"{error}; Checkpoint(fallback=True) would skip it and take the newest checkpoint "
                                  f"before it that reads whole ({len(candidates) - 1} older in {where})") from error
    for path in candidates:
        try:
            return path, _read(loop, path, trains)
        except CheckpointError as error:
            warnings.warn(f"{error}; trying an older one (fallback=True)", CheckpointWarning, stacklevel=user_level())
    raise CheckpointError(f"checkpoint: none of the {len(candidates)} checkpoints in {where} is usable")


def _elsewhere(directory: Path | None) -> str:
    """How to point an evaluation at the run it meant, where the folders :func:`latest` searches hold no
    checkpoint (``directory``: ``Checkpoint(dir=...)``, the one searched where given): the one wording both
    ``resume='best'`` (an error) and an evaluation's ``resume='latest'`` (a line on stderr) end with."""
    where = ("Checkpoint(dir=<its checkpoints' folder>)" if directory is not None else
             "Loop(run_dir=<that run's folder>) (a run given a run_dir is found there only)")
    return (f"to evaluate another run, give {where}, or resume=<a checkpoint's path> (a training run's "
            f"state.results['best_checkpoint'])")


def _aside_note(loop: Run | None, folder: Path) -> str:
    """What else ``folder`` holds where a run found no checkpoint of its own there: checkpoints of other runs, which
    ``resume="latest"`` of ``loop`` (``None``: a folder given by its path, whose every checkpoint is taken) leaves
    (:func:`own`); earlier runs' checkpoints set aside in its ``earlier-run-N/`` subfolders."""
    note = ""
    if loop is not None:
        found = checkpoint_files(folder)
        mine = set(own(loop, found))
        if theirs := [path for path in found if path not in mine]:
            names = sorted({name or "?" for name in (run_of(path)[1] for path in theirs)})
            shown = ", ".join(map(repr, names[:5])) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            note = (f" (it holds {len(theirs)} checkpoint(s) of other runs, named {shown}: "
                    f"resume='latest' and resume='best' take those of {describe(loop)} only; resume one of theirs by "
                    f"its path: resume={str(theirs[0])!r})")
    if not (aside := earlier(folder)):
        return note
    return (f"{note} (it holds {len(aside)} checkpoint(s) of earlier runs, set aside in earlier-run-N/ subfolders; "
            f"resume one by its path: resume={str(aside[0])!r})")


def own(loop: Run, files: list[Path]) -> list[Path]:
    """Of ``files``, the checkpoints of a folder that runs of several identities may share (a given ``dir`` or
    ``run_dir``), those ``resume="latest"`` and ``"best"`` take, in their order: in a training run, those a run of its
    identity wrote (``meta["identity"]``, ``loop.identity.key``: of its ``Loop(name=...)``, else its script or
    notebook), never another name's, which would hand the run another run's weights and position (a fold of
    k-fold CV taking fold 0's finished checkpoint, training nothing); in an evaluation given ``Loop(name=...)``,
    those of that name; in an evaluation otherwise, every one (the folder given names the run to evaluate).
    A checkpoint that records no identity is any run's."""
    if loop.mode != "fit" and not loop.config.name:
        return files
    key = loop.identity.key
    return [path for path in files if (recorded := run_of(path)[0]) is None or recorded == key]


def _read(loop: Run, path: Path, trains: Any) -> dict[str, Any]:
    """:func:`read`, a checkpoint of another model said as such: its position may be one this run's data
    cannot hold, which would hide the mistake behind it."""
    try:
        return read(path, trains)
    except CheckpointError as error:
        if trains is None:
            raise
        failed = error
    try:
        why = model_mismatch(loop.model, read(path)["model"])
    except CheckpointError:  # unreadable without the data as well: the first error says why
        raise failed from None
    if why is None:
        raise failed
    raise CheckpointError(f"checkpoint: the model in {path} does not fit this run's model ({why}): a checkpoint "
                          f"of another model, or of this one before a change") from failed


def latest(loop: Run, directory: Path | None) -> tuple[list[Path], str]:
    """The candidates for ``"latest"``, newest first, and where they were looked for: the checkpoints of the
    given ``dir`` (``directory``), else of ``<run_dir>/checkpoints`` of a given ``run_dir``, that this run takes
    (:func:`own`: of its identity, the run written last first); else the checkpoints of this run's identity under
    ``runs/<name>/*/checkpoints`` (never another identity's: a script of the same file name in another folder,
    another notebook; a folder whose ``run.jsonl`` records no identity is any run's), the folder written last
    first."""
    if directory is not None:
        return own(loop, checkpoint_files(directory)), str(directory)
    run_dir = loop.config.run_dir
    if loop.run_dir_given and run_dir is not None:  # (None only in a smoke run, which never resumes)
        folder = run_dir / "checkpoints"
        return own(loop, checkpoint_files(folder)), str(folder)
    from hookfit import run as run_module

    base = (run_module.RUNS / loop.name).absolute()
    folders = []
    for folder in base.glob("*/checkpoints"):
        files = checkpoint_files(folder) if folder.is_dir() else []
        if files and loop.identity.matches(recorded_identity(folder.parent)):
            folders.append(files)
    folders.sort(key=lambda files: max(p.stat().st_mtime for p in files), reverse=True)
    return [p for files in folders for p in files], f"{base / '*' / 'checkpoints'} (runs of {describe(loop)})"


def describe(loop: Run) -> str:
    """The run's identity as a message says it: ``train.py at /abs/path``, ``notebook ...``."""
    key = loop.identity.key
    if loop.identity.explicit:
        return f"the name {loop.name!r}" if key.startswith("name:") else f"the folder {key[4:]}"
    if key.startswith("kernel:"):
        return "this kernel alone (it names no notebook)"
    if key.startswith("notebook:"):
        return f"the notebook {key[9:]}"
    return f"the script {key}"


def announce(loop: Run, path: Path, directory: Path | None, source: str = "latest") -> None:
    """One line on stderr (main process), before the checkpoint is restored (the warnings of its
    restore are about the file it names), saying which checkpoint ``resume="latest"`` took: the
    newest of the run's identity (:func:`latest`, ``directory`` as there), or the newest that read whole, naming the
    newer ones ``fallback`` skipped; which ``resume="best"`` took. Each names whose and where it looked: the run's
    identity (:func:`describe`; none in an evaluation without a name, which takes any), in the folder ``directory``
    or a given ``run_dir``'s where searched; in such a shared folder, the checkpoints of other runs written after
    ``path`` that it left (:func:`own`) are counted and their runs named."""
    if not loop.is_main:
        return
    candidates, where = latest(loop, directory)
    shared = directory is not None or (loop.run_dir_given and loop.config.run_dir is not None)
    anyones = shared and loop.mode != "fit" and not loop.config.name  # (own(): every checkpoint of the folder)
    whose = ("" if anyones else f" of {describe(loop)}") + (f" in {where}" if shared else "")
    if source == "best":
        print(f"hookfit checkpoint: resume='best' took {path} (the best checkpoint of the newest run{whose})",
              file=sys.stderr, flush=True)
    else:
        skipped = candidates[:candidates.index(path)] if path in candidates else []
        which = (f"the newest checkpoint{whose} that reads whole; skipped: "
                 f"{', '.join(str(p) for p in skipped)} (fallback=True)") if skipped else f"the newest checkpoint{whose}"
        left = _left(candidates, Path(where), path) if shared else ""
        print(f"hookfit checkpoint: resume='latest' took {path} ({which}){left}", file=sys.stderr, flush=True)


def _left(candidates: list[Path], folder: Path, path: Path) -> str:
    """What :func:`announce` adds where ``resume="latest"`` took ``path`` of ``candidates`` (the run's own) in the
    shared folder ``folder``: the checkpoints of other runs there written after it (``meta["time"]``), counted,
    their runs named; nothing where there are none."""
    mine, when = set(candidates), written_at(path)
    newer = [other for other in checkpoint_files(folder) if other not in mine and written_at(other) > when]
    if not newer:
        return ""
    names = sorted({name or "?" for name in (run_of(other)[1] for other in newer)})
    files = ", ".join(other.name for other in newer[:3]) + (f" and {len(newer) - 3} more" if len(newer) > 3 else "")
    return (f" ({len(newer)} newer checkpoint(s) of other runs left: {files}, of the runs named "
            f"{', '.join(map(repr, names))})")


def restore(loop: Run, path: Path, data: dict[str, Any], strict: bool) -> None:
    """Restore the checkpoint ``path`` (its checked contents ``data``) into the run: the model
    (a sharded checkpoint's shards read by DCP into this run's tensors), every plugin's state
    (``strict``: a state that does not match the run's plugins is an error, not a warning) and
    the run's own state, its position included."""
    here = model_state(loop.model)
    if sharded.placeholders(data):
        data = sharded.load(data, path, here)
    elif sharded.split(here)[1]:
        raise CheckpointError(
            f"checkpoint: {path} was written by a run without sharded parameters, and this run's "
            f"model is sharded (Distributed(strategy='fsdp')): resume it with the strategy that wrote "
            f"it, or start the sharded run from its weights (hookfit export, then load_state_dict "
            f"before Loop.fit())")
    load_model(loop.model, data["model"], path)
    restore_plugins(loop, path, data, strict)
    run = {key: value for key, value in data.items() if key not in OWN_KEYS}
    loop.load_state_dict(ranks.own(loop, validation_batching(loop, run), data.get(ranks.KEY), path,
                                 ranks.writers(data)))


def restore_plugins(loop: Run, path: Path, data: Mapping[str, Any], strict: bool) -> None:
    """Restore every plugin's state saved in the checkpoint ``path`` (contents ``data``). A
    plugin of the run with a state to keep and none saved starts fresh, with a warning at the
    script's line: one that the checkpoint's run switched off (an observer that raised, named
    in ``meta``'s :data:`~hookfit.plugins.checkpoint.state.SWITCHED_OFF`) is said to be so,
    whether ``strict`` or not, since no checkpoint of that run holds its state; any other
    plugin is new to the run, and a saved state no plugin restores is left unused, each an
    error with ``strict``. Nothing is restored before that is known."""
    states = dict(data["plugins"])
    meta = data["meta"]
    off = meta.get(SWITCHED_OFF) if isinstance(meta, Mapping) else None
    try:
        loop.load_plugin_states(states, strict=True)
        return
    except StateMismatch as error:
        mismatch = error
    if was_off := [name for name in mismatch.missing if name in (off or ())]:
        some = len(was_off) > 1
        warnings.warn(
            f"checkpoint: {path} has no saved state for {', '.join(map(loop.pm.describe, was_off))}: "
            f"{'they were observers' if some else 'it was an observer'} switched off after an error in the "
            f"run that wrote the checkpoint (that run's ObserverWarning named the error), so "
            f"{'their states were' if some else 'its state was'} not saved; {'they start' if some else 'it starts'} "
            f"fresh", HookfitWarning,
            stacklevel=user_level())
        states.update(dict.fromkeys(was_off))
        try:  # what is left of the mismatch, in words that no longer name them
            loop.load_plugin_states(states, strict=True)
            return
        except StateMismatch as error:
            mismatch = error
    if strict:
        raise ValueError(
            f"checkpoint: {path}: {mismatch.detail}. Pass Checkpoint(strict=False) in "
            f"Loop(plugins=[...]) to start those plugins fresh (and leave saved states that no plugin "
            f"restores unused)") from mismatch
    warnings.warn(f"checkpoint: {path}: {mismatch.detail}; restoring the rest", HookfitWarning,
                  stacklevel=user_level())
    states.update(dict.fromkeys([*mismatch.missing, *mismatch.extra]))  # (None: nothing to restore)
    loop.load_plugin_states(states, strict=True)


BATCHING = ("batch_size", "world_size", "rank")
"""What of a :class:`hookfit.data.Batches` state says how its samples are cut into batches and
shared among the processes, not which samples or in what order."""


def validation_batching(loop: Run, run_state: dict[str, Any]) -> dict[str, Any]:
    """``run_state`` (``loop.state_dict()`` as saved) with its validation data's state cut into
    batches as this run cuts ``loop.val_data``: a resumed run runs a validation from its start
    (never from a batch inside it), and every validation covers all its samples whatever their
    batches, so the validation batch size and the number of processes sharing the validation
    may differ from the run that wrote the checkpoint (2 processes with validation batches of 32
    resumed as one plain process that keeps 32). Only the seed and epoch (the order of a
    shuffled validation) are taken; other data, another ``shuffle`` or ``drop_last`` is still
    refused. Before, the state of the validation data had to match as the training data's must
    (same global batch), and such a resume failed with ``world_size 2 saved, 1 here``."""
    data, target = run_state.get("data"), loop.val_data
    if not isinstance(target, Batches) or not isinstance(data, Mapping):
        return run_state
    saved = data.get("valid")
    if not isinstance(saved, Mapping):
        return run_state
    mine = target.state_dict()
    if all(saved.get(key) == mine[key] for key in BATCHING) or not all(key in saved for key in BATCHING):
        return run_state
    valid = {**saved, **{key: mine[key] for key in BATCHING}}
    return {**run_state, "data": {**data, "valid": valid}}
