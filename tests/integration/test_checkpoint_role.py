"""What core/hooks.md's checkpoint role says a replacement may rely on in evaluations and smoke
runs: a plain ``configure``, even ``tryfirst``, sees a smoke run's ``resume`` already cleared
(the smoke plugin's ``configure`` is a ``tryfirst`` wrapper), and ``Loop.validate(resume=...)``
fires neither ``after_batch`` nor ``after_epoch``, and the built-in writes nothing there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint


class Role:
    """Records what a checkpoint plugin would see."""

    name = "role"

    def __init__(self) -> None:
        self.seen: dict = {}
        self.events: list[str] = []

    @hookfit.hookimpl(tryfirst=True)
    def configure(self, loop):
        self.seen.update(resume=loop.resume, smoke=loop.smoke, mode=loop.mode)

    @hookfit.hookimpl
    def after_batch(self):
        self.events.append("after_batch")

    @hookfit.hookimpl
    def after_epoch(self):
        self.events.append("after_epoch")


def test_a_tryfirst_configure_sees_a_smoke_runs_resume_cleared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOOKFIT_PLUGINS", "smoke")
    role = Role()
    state = hookfit.Loop(lambda loop, b: None, [torch.zeros(1)] * 4, model=torch.nn.Linear(1, 1), resume="latest",
                         smoke=True, plugins=[role]).fit()
    assert state.status == "completed"
    assert role.seen == {"resume": None, "smoke": True, "mode": "fit"}


def test_validate_with_resume_fires_no_save_event_and_the_builtin_writes_nothing(tmp_path: Path) -> None:
    def loop(**kwargs) -> hookfit.Loop:
        model = torch.nn.Linear(1, 1)
        step = lambda loop, b: loop.model(b).sum()  # noqa: E731
        return hookfit.Loop(step, [torch.ones(1)] * 3, val_step=step, val_data=[torch.ones(1)], model=model,
                            run_dir=tmp_path, max_epochs=1, **kwargs)

    loop(plugins=[Checkpoint(every_n_steps=1, background=False)]).fit()
    folder = tmp_path / "checkpoints"
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    role = Role()
    state = loop(plugins=[Checkpoint(every_n_steps=1, background=False), role]).validate(resume="latest")
    assert state.status == "completed" and state.resumed_from is not None
    assert role.seen["mode"] == "validate" and role.events == []
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before
