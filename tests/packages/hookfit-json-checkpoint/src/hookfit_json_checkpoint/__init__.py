"""hookfit-json-checkpoint: a checkpoint plugin that replaces hookfit's built-in ``checkpoint`` on
purpose (see README.md), written against hookfit's ``core/hooks.md`` (the checkpoint role).

A checkpoint is ``<name>.safetensors`` (the tensors) and ``<name>.json`` (the rest, tensors named
by key; int keys and tuples tagged; the position; the tensor file's SHA-256), in
``<run folder>/checkpoints``. The JSON file is replaced last, so a checkpoint exists once it does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from hookfit import hookimpl, records
from hookfit.position import Position

__all__ = ["FORMAT", "CheckpointDamaged", "JsonCheckpoint", "read"]
FORMAT = "hookfit-json-checkpoint/1"


class CheckpointDamaged(ValueError):
    """A checkpoint whose files do not agree or cannot be read: refused, by name."""


# -- what JSON cannot say: tensors, tuples, non-string keys -----------------------------------


def encode(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(value, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = value.detach().to("cpu").clone().contiguous()
        return {"__tensor__": key}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: encode(v, tensors, f"{where}[{k!r}]") for k, v in value.items()}
        return {"__items__": [[encode(k, tensors, where), encode(v, tensors, f"{where}[{k!r}]")]
                              for k, v in value.items()]}
    raise TypeError(f"checkpoint: {where} is a {type(value).__name__}, which a JSON checkpoint cannot keep")


def decode(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [decode(v, tensors) for v in value]
    if isinstance(value, dict):
        if "__tensor__" in value:
            return tensors[value["__tensor__"]]
        if "__tuple__" in value:
            return tuple(decode(v, tensors) for v in value["__tuple__"])
        if "__items__" in value:
            return {decode(k, tensors): decode(v, tensors) for k, v in value["__items__"]}
        return {k: decode(v, tensors) for k, v in value.items()}
    return value


# -- files ------------------------------------------------------------------------------------


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write(path: Path, write: Any) -> None:
    """Write through a temporary file, synced, then renamed over ``path``."""
    temporary = path.with_name(f".{path.name}.tmp")
    write(temporary)
    with open(temporary, "rb") as file:
        os.fsync(file.fileno())
    os.replace(temporary, path)


def stem(position: Position) -> str:
    """``epochNNNN-stepNNNNNNNNN``: the epoch counted from 1, the one in progress or, at an
    epoch's boundary, the one just completed (as hookfit counts epochs everywhere)."""
    at_start = position.stage == "train" and position.batch == 0 and not position.val_due
    shown = position.epoch if at_start and position.epoch > 0 else position.epoch + 1
    return f"epoch{shown:04d}-step{position.step:09d}"


def _header(path: Path) -> dict[str, Any]:
    try:
        header = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CheckpointDamaged(f"checkpoint: {path} is damaged: {error}") from error
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CheckpointDamaged(f"checkpoint: {path} is not a {FORMAT} checkpoint")
    return header


def read(source: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint of ``source`` (its ``.json`` or ``.safetensors`` file), checked whole:
    ``{"model", "plugins", "run", "position"}``; :class:`CheckpointDamaged` names a bad one."""
    json_path = Path(source).with_suffix(".json")
    tensor_path = json_path.with_suffix(".safetensors")
    if not json_path.is_file():
        raise FileNotFoundError(f"checkpoint: no checkpoint {json_path}")
    header = _header(json_path)
    try:
        digest = _digest(tensor_path)
    except OSError as error:
        raise CheckpointDamaged(f"checkpoint: {tensor_path} is missing: {error}") from error
    if digest != header.get("sha256"):
        raise CheckpointDamaged(f"checkpoint: {tensor_path} is damaged: its SHA-256 is not the one {json_path.name} "
                                f"records")
    return decode(header["state"], load_file(str(tensor_path)))


def checkpoints(folder: Path) -> list[tuple[tuple[int, int, bool, bool], Path]]:
    """``(position key, json path)`` of the checkpoints in ``folder``, oldest first."""
    found = []
    for path in folder.glob("epoch*.json") if folder.is_dir() else ():
        try:
            position = Position.from_dict(_header(path)["state"]["run"]["loop"])
        except (CheckpointDamaged, KeyError, ValueError, TypeError):
            continue  # not a checkpoint of ours: never pruned, never resumed from
        found.append((position.key(), path))
    return sorted(found)


def newest(source: str | os.PathLike[str]) -> Path:
    """The checkpoint ``source`` names: a checkpoint's file, else the newest in a folder of
    checkpoints or in a run folder's ``checkpoints``."""
    path = Path(source)
    if path.is_file():
        return path
    for folder in (path / "checkpoints", path):
        if found := checkpoints(folder):
            return found[-1][1]
    raise FileNotFoundError(f"checkpoint: no checkpoint in {path} (nor in {path / 'checkpoints'})")


def _module(model: Any) -> Any:
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    return getattr(model, "_orig_mod", model)


# -- the plugin -------------------------------------------------------------------------------


class JsonCheckpoint:
    """Saves every ``every_n_steps`` steps, every epoch and at a graceful stop; keeps the
    last ``keep_last``; resumes ``"latest"`` (this run's own) or a path; ``strict`` plugin
    states."""

    name = "checkpoint"

    def __init__(self, every_n_steps: int | None = None, keep_last: int = 3, strict: bool = True) -> None:
        for option, value in (("every_n_steps", every_n_steps), ("keep_last", keep_last)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"checkpoint (hookfit-json-checkpoint): {option} must be a positive integer, "
                                 f"got {value!r}")
        if keep_last is None:
            raise ValueError("checkpoint (hookfit-json-checkpoint): keep_last must be a positive integer")
        self.every_n_steps, self.keep_last, self.strict = every_n_steps, keep_last, bool(strict)
        self.chosen: Path | None = None

    # -- saving
    def save(self, loop: Any, reason: str) -> None:
        if loop.mode != "fit" or loop.model is None:
            return
        state = {"run": loop.state_dict(), "model": _module(loop.model).state_dict(),
                 "plugins": loop.plugin_states()}
        if not loop.is_main:
            return
        folder = Path(loop.run_dir) / "checkpoints"
        folder.mkdir(parents=True, exist_ok=True)
        name = stem(loop.position)
        tensors: dict[str, torch.Tensor] = {}
        header = {"format": FORMAT, "reason": reason, "state": encode(state, tensors, "the checkpoint")}
        tensor_path = folder / f"{name}.safetensors"
        _write(tensor_path, lambda target: save_file(tensors, str(target)))
        header["sha256"] = _digest(tensor_path)
        _write(folder / f"{name}.json", lambda target: target.write_text(json.dumps(header), encoding="utf-8"))
        for _, old in checkpoints(folder)[:-self.keep_last]:
            old.with_suffix(".safetensors").unlink(missing_ok=True)
            old.unlink(missing_ok=True)
        if (announce := loop.hooks.checkpoint_saved) is not None:
            announce(loop, str(folder / f"{name}.json"), reason, loop.state.step)

    @hookimpl
    def after_batch(self, loop: Any) -> None:
        if self.every_n_steps and loop.state.step % self.every_n_steps == 0:
            self.save(loop, "step")

    @hookimpl
    def after_epoch(self, loop: Any) -> None:
        self.save(loop, "epoch")

    @hookimpl(tryfirst=True)
    def fit_end(self, loop: Any) -> None:
        state, position = loop.state, loop.position
        if state.status == "interrupted" and state.stop_reason != "KeyboardInterrupt":
            self.save(loop, "interrupt")
        elif state.status == "completed" and position.stage == "train" and position.batch > 0:
            self.save(loop, "completed")

    # -- resuming
    def latest(self, loop: Any) -> Path | None:
        """The newest checkpoint of this run's identity."""
        if loop.run_dir_given:
            folders = [Path(loop.run_dir) / "checkpoints"]
        else:
            folders = [f for f in (Path(records.RUNS) / loop.name).absolute().glob("*/checkpoints")
                       if loop.identity.matches(records.recorded_identity(f.parent))]
        found = [(key, path.stat().st_mtime, path) for folder in folders for key, path in checkpoints(folder)]
        return max(found)[2] if found else None

    @hookimpl(tryfirst=True)  # before any plugin uses loop.run_dir: the resumed run writes where it was
    def configure(self, loop: Any) -> None:
        self.chosen = None
        if loop.resume is None:
            return
        self.chosen = self.latest(loop) if loop.resume == "latest" else Path(loop.resume).with_suffix(".json")
        chosen = self.chosen
        if (chosen is not None and loop.mode == "fit" and not loop.run_dir_given
                and chosen.parent.name == "checkpoints"):
            loop.continue_in(chosen.parent.parent.absolute())

    @hookimpl
    def resume(self, loop: Any, source: str) -> str | bool:
        path = self.chosen if self.chosen is not None else (
            self.latest(loop) if source == "latest" else Path(source).with_suffix(".json"))
        if path is None:
            return False
        saved = read(path)
        _module(loop.model).load_state_dict(saved["model"])
        loop.load_plugin_states(saved["plugins"], strict=self.strict)
        loop.load_state_dict(saved["run"])
        return str(path)

    # -- the command line
    @hookimpl
    def add_commands(self, commands: Any) -> None:
        parser = commands.add_parser("export", help="write the model of a run's newest JSON checkpoint (or of a "
                                                    "given one) as a plain state dict (torch.save)")
        parser.add_argument("source", help="a run folder, a folder of checkpoints, or a checkpoint's file")
        parser.add_argument("out", help="the file to write")
        parser.set_defaults(run=export)


def export(args: argparse.Namespace) -> int:
    try:
        path = newest(args.source)
        model = read(path)["model"]
    except (FileNotFoundError, CheckpointDamaged) as error:
        print(f"hookfit export: {error}", file=sys.stderr)
        return 1
    torch.save(model, args.out)
    print(f"hookfit export: the model of {path} written to {args.out}")
    return 0
