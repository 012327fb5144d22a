"""``hookfit export RUN model.pt``: the model of a run's latest checkpoint (or of a given one),
sharded or not, as one plain state dict that ``torch.load`` and ``load_state_dict`` take: the
plain module's keys, even from a checkpoint written from a ``torch.compile``d model before its
wrapper was looked through (``_orig_mod.``-prefixed keys)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hookfit.plugins.checkpoint import sharded
from hookfit.plugins.checkpoint.storage import CheckpointError, atomic_save, checkpoint_files, read
from hookfit.plugins.support import unwrap_state_dict


def find(source: str | os.PathLike[str]) -> Path:
    """The checkpoint ``source`` names: a checkpoint (a file, or a sharded checkpoint's
    folder), or the newest in a folder of checkpoints or in a run folder's ``checkpoints``."""
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"hookfit export: {path}: no such checkpoint or run folder")
    if path.is_file() or sharded.is_sharded(path):
        return path
    for folder in (path / "checkpoints", path):
        found = checkpoint_files(folder)
        if found:
            return found[0]
    raise FileNotFoundError(f"hookfit export: no checkpoint in {path} (nor in {path / 'checkpoints'})")


def export(source: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write the model of the checkpoint that ``source`` names (see :func:`find`) to ``out``
    as a plain state dict (every tensor whole, on the CPU), atomically; returns the checkpoint
    used. Runs in one process: a sharded checkpoint's tensors are read whole. ``out`` may not be
    the checkpoint itself nor inside its folder: that would replace what the run resumes from."""
    path = find(source)
    _refuse_input(Path(out), path)
    data = read(path)
    if sharded.placeholders(data):
        data = sharded.load(data, path, None)
    model = data["model"]
    if model is None:
        raise CheckpointError(f"hookfit export: {path} holds no model")
    atomic_save(_plain(model), Path(out))
    return path


def _plain(state: Any) -> Any:
    """A checkpoint's model state with ``torch.compile``'s ``_orig_mod.`` taken off the keys
    (:func:`~hookfit.plugins.support.unwrap_state_dict`) of every module's state dict: of the
    model, or of each model of a dict or a list of them."""
    if isinstance(state, Mapping):
        state = unwrap_state_dict(state)
        if any(isinstance(value, (Mapping, list)) for value in state.values()):  # a dict of models
            return {key: _plain(value) for key, value in state.items()}
        return state
    if isinstance(state, list):
        return [_plain(value) for value in state]
    return state


def _refuse_input(out: Path, checkpoint: Path) -> None:
    """A :class:`CheckpointError` when writing ``out`` would change ``checkpoint`` (the same
    file or folder, by name or by a link, or a file inside a sharded checkpoint's folder)."""
    target, used = out.resolve(), checkpoint.resolve()
    same = target == used or used in target.parents
    if not same and out.exists():
        try:
            same = os.path.samefile(out, checkpoint)
        except OSError:
            pass
    if same:
        where = "is the checkpoint it would read" if target == used else "is inside the checkpoint it would read"
        raise CheckpointError(
            f"hookfit export: {out} {where} ({checkpoint}): writing the plain state dict there would replace "
            f"the checkpoint (the run could no longer resume from it); give another file, such as model.pt")


def add_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``hookfit export`` (the checkpoint plugin's ``add_commands``)."""
    p = commands.add_parser("export", help="write a run's model as one plain state dict (sharded checkpoints too)")
    p.add_argument("source", help="a run folder, a folder of checkpoints, or a checkpoint")
    p.add_argument("out", help="the file to write, such as model.pt")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        used = export(args.source, args.out)
    except (OSError, CheckpointError) as error:
        print(f"hookfit export: {error}" if not str(error).startswith("hookfit export") else str(error),
              file=sys.stderr)
        return 2
    print(f"wrote {args.out}: the model of {used}")
    return 0
