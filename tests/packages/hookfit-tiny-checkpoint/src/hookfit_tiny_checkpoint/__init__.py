"""hookfit-tiny-checkpoint: a checkpoint plugin that replaces hookfit's built-in ``checkpoint``.

A test fixture written only against hookfit's ``README.md`` and ``core/hooks.md`` ("Saving and
resuming a run (the checkpoint role)"). Run it with the built-in disabled
(``HOOKFIT_DISABLE_PLUGINS=checkpoint``). It writes one ``torch.save`` file per save into
``<run folder>/tiny``: every ``every_n_steps`` training steps (``after_batch``), every epoch
(``after_epoch``) and at ``fit_end`` after a graceful stop; each holds ``loop.state_dict()``,
the model's state dict and ``loop.plugin_states()``. ``Loop(resume="latest")`` or a file's path
resumes. Not done: keeping the last K, best, background writes, sharded (FSDP) states.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hookfit import hookimpl

__all__ = ["FORMAT", "TinyCheckpoint"]
FORMAT = "hookfit-tiny-checkpoint/1"
FILE = re.compile(r"^(\d{6})-epoch\d+-step\d+-\w+\.pt$")  # <counter>-epoch<E>-step<S>-<reason>.pt


def _module(model: Any) -> Any:
    """hooks.md: unwrap ``module.module`` of a DDP model and ``_orig_mod`` of a compiled one."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    return getattr(model, "_orig_mod", model)


def model_state(model: Any) -> Any:
    if isinstance(model, Mapping):
        return {key: model_state(value) for key, value in model.items()}
    if isinstance(model, (list, tuple)):
        return [model_state(value) for value in model]
    return None if model is None else _module(model).state_dict()


def load_model(model: Any, state: Any) -> None:
    if isinstance(model, Mapping):
        for key, value in model.items():
            load_model(value, state[key])
    elif isinstance(model, (list, tuple)):
        for value, saved in zip(model, state, strict=True):
            load_model(value, saved)
    elif model is not None:
        _module(model).load_state_dict(state)


def files(folder: Path) -> list[Path]:
    """The checkpoints in ``folder``, oldest first (by their counter)."""
    names = os.listdir(folder) if folder.is_dir() else []
    found = sorted((int(m[1]), name) for name in names if (m := FILE.match(name)))
    return [folder / name for _, name in found]


class TinyCheckpoint:
    """Saves the run every ``every_n_steps`` steps (none by default), every epoch, and at a
    graceful stop; resumes from ``"latest"`` (this run's folder) or a path."""

    name = "tiny_checkpoint"

    def __init__(self, every_n_steps: int | None = None) -> None:
        if every_n_steps is not None and (isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int)
                                          or every_n_steps < 1):
            raise ValueError(f"tiny_checkpoint: every_n_steps must be a positive integer, got {every_n_steps!r}")
        self.every_n_steps = every_n_steps

    def save(self, loop: Any, reason: str) -> None:
        if not loop.is_main:  # hooks.md: the main process only writes
            return
        folder = Path(loop.run_dir) / "tiny"
        folder.mkdir(parents=True, exist_ok=True)
        existing = files(folder)
        counter = int(FILE.match(existing[-1].name)[1]) + 1 if existing else 1
        position = loop.position  # hooks.md: "for naming files"
        path = folder / f"{counter:06d}-epoch{position.epoch + 1:04d}-step{position.step:09d}-{reason}.pt"
        saved = {"format": FORMAT, "reason": reason, "run": loop.state_dict(), "model": model_state(loop.model),
                 "plugins": loop.plugin_states()}
        temporary = path.with_name(path.name + ".tmp")
        torch.save(saved, temporary)  # written now, on the training thread: no copies needed
        os.replace(temporary, path)
        if (announce := loop.hooks.checkpoint_saved) is not None:
            announce(loop, str(path), reason, loop.state.step)

    @hookimpl
    def after_batch(self, loop: Any) -> None:
        if self.every_n_steps and loop.state.step % self.every_n_steps == 0:
            self.save(loop, "step")

    @hookimpl
    def after_epoch(self, loop: Any) -> None:
        self.save(loop, "epoch")

    @hookimpl(tryfirst=True)  # hooks.md: before any plugin lets go of its state
    def fit_end(self, loop: Any) -> None:
        if loop.state.status == "interrupted":
            self.save(loop, "interrupt")

    def latest(self, loop: Any) -> Path | None:
        """The newest checkpoint of this run: in its folder, else in the newest of the other
        folders of runs of its name (``runs/<name>/<date>-<time>``)."""
        here = Path(loop.run_dir)
        found = files(here / "tiny")
        if not found and here.parent.name == loop.name:
            for other in sorted(here.parent.iterdir(), reverse=True):
                if other != here and (found := files(other / "tiny")):
                    break
        return found[-1] if found else None

    @hookimpl
    def resume(self, loop: Any, source: str) -> str | bool:
        path = self.latest(loop) if source == "latest" else Path(source)
        if path is None:
            return False  # nothing to resume: the run starts afresh
        if not path.is_file():
            raise FileNotFoundError(f"tiny_checkpoint: no checkpoint file {path}")
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(saved, Mapping) or saved.get("format") != FORMAT:
            raise ValueError(f"tiny_checkpoint: {path} is not a {FORMAT} file")
        load_model(loop.model, saved["model"])
        loop.load_plugin_states(saved["plugins"])
        loop.load_state_dict(saved["run"])
        return str(path)
