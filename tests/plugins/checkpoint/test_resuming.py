"""checkpoint's resume side: the plugin states a checkpoint holds (never one it could not be read
back with), what a resume says of a plugin whose state it lacks (an observer switched off in the
run that wrote it, a plugin new to the run), at the script's line, and what an evaluation of a
checkpoint leaves unused without a word."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint, CheckpointError, digest, read
from hookfit.plugins.metrics import Metrics
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


def training_step(model: torch.nn.Module) -> Any:
    """A step that trains ``model`` on a batch's mean square through the optimizer role."""

    def step(loop: hookfit.Run, batch: torch.Tensor) -> torch.Tensor:
        loss = model(batch).square().mean()
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return loss

    return step


def run(run_dir: Path, *plugins: Any, epochs: int, resume: str | None = None, strict: bool = False) -> hookfit.Run:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)

    step = training_step(model)

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


class Best:
    """A plugin whose state holds a numpy scalar (``np.min`` of a list), which a checkpoint cannot be read back with."""

    name = "best_so_far"

    @hookfit.hookimpl
    def save_state(self) -> dict[str, Any]:
        return {"best": np.float64(1.5)}

    @hookfit.hookimpl
    def load_state(self, state: dict[str, Any]) -> None:
        pass


@pytest.mark.bad_input
def test_a_plugin_state_a_checkpoint_could_not_be_read_back_with_fails_the_run_before_any_file_is_written(
        tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"plugin 'best_so_far' .*returned from save_state a state that no "
                                        r"checkpoint could be read back with: state\['best'\] is a numpy\.float64") as info:
        run(tmp_path, Best(), epochs=2)
    # the note blames the plugin whose state it is, not the checkpoint plugin whose save gathered it
    assert info.value.__notes__[0].startswith("hookfit: raised by plugin 'best_so_far' ("), info.value.__notes__
    assert "in hook 'save_state', called from plugin 'checkpoint' (" in info.value.__notes__[0], info.value.__notes__
    assert not list(tmp_path.rglob("*.pt")), list(tmp_path.rglob("*.pt"))  # none that could not be read back


@pytest.mark.bad_input
def test_a_whole_checkpoint_holding_an_object_a_safe_load_refuses_is_said_so_not_torn(tmp_path: Path) -> None:
    """A file whose plugin state holds a numpy scalar (written where states were not checked) is whole: the
    error says it holds an object a safe load refuses, and which, rather than that it is torn."""
    run(tmp_path, epochs=1)
    (path,) = (tmp_path / "checkpoints").glob("*.pt")
    data = read(path)
    data["plugins"]["best_so_far"] = {"best": np.float64(1.5)}
    data["digest"] = digest(data)
    torch.save(data, path)
    with pytest.raises(CheckpointError) as caught:
        run(tmp_path, Best(), epochs=2, resume="latest")
    message = str(caught.value)
    assert message.startswith(f"checkpoint: {path} holds an object that a safe load refuses, "
                              f"numpy._core.multiarray.scalar: "), message
    assert "truncated" not in message and "not a whole" not in message and "weights_only" not in message, message


def _early_stopped_checkpoint(run_dir: Path) -> tuple[Path, Any, Any]:
    """The best checkpoint of a run with early stopping (its state saved), the step and the data to evaluate it."""
    from hookfit.plugins.early_stopping import EarlyStopping

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    data = [torch.ones(4, 2)] * 3

    step = training_step(model)

    def val_step(loop: hookfit.Run, batch: torch.Tensor) -> torch.Tensor:
        return model(batch).square().mean()

    state = hookfit.Loop(step, data, val_step=val_step, val_data=data, model=model,
                         optimizers=torch.optim.SGD(model.parameters(), lr=0.1), max_epochs=2, run_dir=run_dir,
                         plugins=[Optim(), Metrics(), Checkpoint(monitor="valid/loss", background=False),
                                  EarlyStopping(monitor="valid/loss")]).fit()
    path = state.results["best_checkpoint"]
    assert "early_stopping" in read(path)["plugins"]
    return path, val_step, (model, data)


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("how", ["discovered", "given without a monitor", "absent"])
def test_evaluating_a_checkpoint_leaves_training_only_states_unused_without_a_word(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strict: bool, how: str) -> None:
    """Loop.validate(resume=...) of a run that stopped early: early stopping, installed, sits the evaluation out,
    and its saved state is left without a warning, strict or not. An evaluation without the plugin at all still
    says so (a plugin it lacks may have held what it evaluates: an average of the weights)."""
    from hookfit.plugins.early_stopping import EarlyStopping

    path, val_step, (model, data) = _early_stopped_checkpoint(tmp_path / "train")
    if how == "discovered":
        monkeypatch.setenv("HOOKFIT_PLUGINS", "early_stopping")
    given = [EarlyStopping()] if how == "given without a monitor" else []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        evaluation = hookfit.Loop(val_step=val_step, val_data=data, model=model, run_dir=tmp_path / "eval",
                                  plugins=[Optim(), Metrics(), Checkpoint(strict=strict), *given])
        if how == "absent" and strict:
            with pytest.raises(ValueError, match="'early_stopping' that no enabled plugin"):
                evaluation.validate(resume=path)
            return
        assert evaluation.validate(resume=path).status == "completed"
    said = [str(w.message) for w in caught if "plugin states" in str(w.message)]
    assert said == ([] if how != "absent" else [f"checkpoint: {path}: plugin states do not match this run: saved "
                                                f"state of plugin(s) 'early_stopping' that no enabled plugin of "
                                                f"this run restores (left unused); restoring the rest"]), said


@pytest.mark.bad_input
def test_evaluating_a_checkpoint_still_fails_on_a_state_a_present_plugin_cannot_load(tmp_path: Path) -> None:
    path, val_step, (model, data) = _early_stopped_checkpoint(tmp_path / "train")

    class Refuses:
        name = "early_stopping"

        @hookfit.hookimpl
        def load_state(self, state: dict[str, Any]) -> None:
            raise ValueError(f"cannot use {sorted(state)}")

    with pytest.raises(ValueError, match=r"cannot use \['best'"):
        hookfit.Loop(val_step=val_step, val_data=data, model=model, run_dir=tmp_path / "eval",
                     plugins=[Optim(), Metrics(), Checkpoint(), Refuses()]).validate(resume=path)


ORDER = '''
import sys, torch, hookfit
from hookfit.plugins.checkpoint import Checkpoint


class Kept:
    name = "kept"

    @hookfit.hookimpl
    def save_state(self):
        return {"n": 1}

    @hookfit.hookimpl
    def load_state(self, state):
        pass


first = sys.argv[1] == "first"
hookfit.Loop(lambda loop, batch: {"loss": torch.tensor(1.0)}, [0, 1, 2], model=torch.nn.Linear(1, 1),
             max_epochs=1 if first else 2, run_dir="run", resume=None if first else "latest",
             plugins=[Checkpoint(strict=False), *([Kept()] if first else [])]).fit()
'''


@pytest.mark.slow
def test_the_line_naming_the_checkpoint_latest_took_comes_before_the_warnings_of_its_restore(tmp_path: Path) -> None:
    """A state saved by a plugin the resumed run lacks (``strict=False``: a warning): on stderr,
    'resume='latest' took <file>' first, then the warning about that file, which it explains."""
    import os
    import subprocess
    import sys

    (tmp_path / "order.py").write_text(ORDER)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")}, "HOOKFIT_PLUGINS": ""}
    for which in ("first", "resumed"):
        done = subprocess.run([sys.executable, "order.py", which], cwd=tmp_path, capture_output=True, text=True,
                              env=env, timeout=120)
        assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    took = [i for i, line in enumerate(lines) if line.startswith("hookfit checkpoint: resume='latest' took ")]
    warned = [i for i, line in enumerate(lines) if "HookfitWarning: checkpoint: " in line and "restoring the rest" in line]
    assert len(took) == 1 and len(warned) == 1 and took[0] < warned[0], done.stderr
