"""checkpoint's resume side: the plugin states a checkpoint holds, and what a resume says of
a plugin whose state it lacks (an observer switched off in the run that wrote it, a plugin new
to the run), at the script's line."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint, digest, read
from hookfit.plugins.optim import Optim


class Flaky:
    """An observer with a state, whose ``batch_end`` raises at the batch ``fail_at`` it counts."""

    name = "flaky"
    observer = True

    def __init__(self, fail_at: int | None = None) -> None:
        self.count = 0
        self.fail_at = fail_at

    @hookfit.hookimpl
    def batch_end(self) -> None:
        self.count += 1
        if self.count == self.fail_at:
            raise ValueError("the observer's own fault")

    @hookfit.hookimpl
    def save_state(self) -> dict[str, int]:
        return {"count": self.count}

    @hookfit.hookimpl
    def load_state(self, state: dict[str, int]) -> None:
        self.count = state["count"]


def run(run_dir: Path, *plugins: Any, epochs: int, resume: str | None = None, strict: bool = False) -> hookfit.Run:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)

    def step(loop: hookfit.Run, batch: torch.Tensor) -> torch.Tensor:
        loss = model(batch).square().mean()
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return loss

    loop = hookfit.Loop(step, [torch.ones(4, 2)] * 3, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                        max_epochs=epochs, run_dir=run_dir, resume=resume,
                        plugins=[Optim(), Checkpoint(every_n_epochs=1, background=False, strict=strict), *plugins])
    loop.fit()
    return loop


def resumed(run_dir: Path, *plugins: Any, strict: bool = False) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run(run_dir, *plugins, epochs=2, resume="latest", strict=strict).state.status == "completed"
    return [w for w in caught if "no saved state" in str(w.message)]


@pytest.mark.fault
@pytest.mark.parametrize("strict", [False, True])
def test_an_observer_switched_off_when_the_checkpoint_was_written_is_said_so_at_resume(
        tmp_path: Path, strict: bool) -> None:
    """The checkpoint names the observers switched off before it was written; a resume says
    such a one has no saved state because it was switched off, not that it is new to the run,
    warning at the script's line (strict or not: no checkpoint of that run holds its state)."""
    with pytest.warns(hookfit.ObserverWarning, match="'flaky'"):
        run(tmp_path, Flaky(fail_at=2), epochs=1)
    (path,) = (tmp_path / "checkpoints").glob("*.pt")
    data = read(path)
    assert data["meta"]["switched_off"] == ["flaky"] and "flaky" not in data["plugins"]
    again = Flaky()
    (said,) = resumed(tmp_path, again, strict=strict)
    message = str(said.message)
    assert said.category is hookfit.HookfitWarning and said.filename == __file__, (said.filename, message)
    assert f"{path} has no saved state for plugin 'flaky'" in message
    assert "switched off after an error in the run that wrote the checkpoint" in message
    assert message.endswith("it starts fresh") and "new to the run" not in message
    assert again.count == 3  # this run's batches, counted from 0


@pytest.mark.fault
def test_a_checkpoint_naming_no_switched_off_observer_says_the_plugin_is_new_at_the_script_s_line(
        tmp_path: Path) -> None:
    """A checkpoint that names none (one written before checkpoints named them, or a plugin
    really new to the run): the plugin is new to the run, said at the script's line."""
    run(tmp_path, epochs=1)
    (path,) = (tmp_path / "checkpoints").glob("*.pt")
    data = read(path)
    assert data["meta"]["switched_off"] == []
    del data["meta"]["switched_off"]
    data["digest"] = digest(data)
    torch.save(data, path)
    (said,) = resumed(tmp_path, Flaky())
    message = str(said.message)
    assert said.filename == __file__, (said.filename, message)
    assert message.startswith(f"checkpoint: {path}: plugin states do not match this run: no saved state for plugin "
                              f"'flaky'") and "(new to the run: it starts fresh); restoring the rest" in message
