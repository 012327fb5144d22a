"""``loop.carry``: what a step carries from one batch to the next (an RNN's hidden state). Each
stage has its own, emptied as it starts; the training stage's is saved with the run's position
(``loop.state_dict()["carry"]``) and given back to the stage a resumed run continues, so a run
killed with SIGKILL and resumed ends bitwise equal to one never stopped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TESTS
import warm

import hookfit

CHILD = TESTS / "scripts" / "carry_child.py"


def counting(log: list) -> Any:
    """A training step that counts its batches in ``loop.carry`` and logs what it found."""

    def step(loop: Any, batch: Any) -> None:
        log.append(("train", loop.state.epoch, dict(loop.carry)))
        loop.carry["n"] = loop.carry.get("n", 0) + 1
        loop.carry["h"] = torch.full((2,), float(batch), requires_grad=True) * 2  # has a grad_fn

    return step


class Saves:
    """Takes ``loop.state_dict()`` after the training batches and epochs named."""

    name = "saves"

    def __init__(self, at_steps: tuple[int, ...] = ()) -> None:
        self.at_steps = at_steps
        self.states: dict[Any, dict[str, Any]] = {}

    @hookfit.hookimpl
    def after_batch(self, loop: Any) -> None:
        if loop.state.step in self.at_steps:
            self.states[loop.state.step] = loop.state_dict()

    @hookfit.hookimpl
    def after_epoch(self, loop: Any, epoch: int) -> None:
        self.states[f"epoch {epoch}"] = loop.state_dict()


class ResumesFrom:
    """A resume plugin giving the run a state dict taken earlier."""

    name = "resumes"

    def __init__(self, saved: dict[str, Any]) -> None:
        self.saved = saved

    @hookfit.hookimpl
    def resume(self, loop: Any) -> str:
        loop.load_state_dict(self.saved)
        return "saved"


def test_each_stage_has_its_own_carry_emptied_as_it_starts() -> None:
    log: list = []

    def valid(loop: Any, batch: Any) -> None:
        log.append(("valid", loop.state.epoch, dict(loop.carry)))
        loop.carry["v"] = loop.carry.get("v", 0) + 1

    def train(loop: Any, batch: Any) -> None:
        log.append(("train", loop.state.epoch, {k: v for k, v in loop.carry.items() if k == "n"}))
        loop.carry["n"] = loop.carry.get("n", 0) + 1

    loop = hookfit.Loop(train, [1, 2, 3], val_step=valid, val_data=[1, 2], val_every_n_steps=2, max_epochs=2)
    loop.fit()
    assert log == [
        ("train", 0, {}), ("train", 0, {"n": 1}),
        ("valid", 0, {}), ("valid", 0, {"v": 1}),  # a validation inside training: its own, empty
        ("train", 0, {"n": 2}),  # the training's, as the validation found it
        ("train", 1, {}), ("valid", 1, {}), ("valid", 1, {"v": 1}),  # a new epoch: empty again
        ("train", 1, {"n": 1}), ("train", 1, {"n": 2}),
        ("valid", 1, {}), ("valid", 1, {"v": 1}),
    ]
    with pytest.raises(AttributeError):
        loop.run.carry = {}  # type: ignore[misc]  # one dict a stage: the step fills it, never replaces it


def test_the_training_carry_is_saved_with_the_position_detached_and_only_inside_training() -> None:
    saves = Saves(at_steps=(2,))
    inside: list[Any] = []

    def valid(loop: Any, batch: Any) -> None:
        loop.carry["v"] = 1
        inside.append(loop.state_dict()["carry"])

    hookfit.Loop(counting([]), [1, 2, 3], val_step=valid, val_data=[1], val_every_n_steps=2,
                 plugins=[saves]).fit()
    at_2 = saves.states[2]["carry"]
    assert at_2["n"] == 2 and torch.equal(at_2["h"], torch.full((2,), 4.0))
    assert at_2["h"].grad_fn is None and not at_2["h"].requires_grad  # detached: a checkpoint can hold it
    assert inside[0]["n"] == 2 and "v" not in inside[0]  # during a validation: the training's carry
    assert "carry" not in saves.states["epoch 0"]  # at an epoch's end the next stage starts empty


@pytest.mark.bad_input
@pytest.mark.parametrize("value, where", [
    (object(), r"loop\.carry\['h'\] is a object"),
    ([torch.zeros(1), {"state": open}], r"loop\.carry\['h'\]\[1\]\['state'\] is a builtin_function_or_method"),
])
def test_what_a_checkpoint_cannot_hold_is_named_when_the_state_is_taken(value: Any, where: str) -> None:
    def step(loop: Any, batch: Any) -> None:
        loop.carry["h"] = value

    loop = hookfit.Loop(step, [1, 2], plugins=[Saves(at_steps=(1,))])
    with pytest.raises(TypeError, match=where + r": what the step carries is saved with the run, and a checkpoint "
                                             r"keeps tensors, numbers, strings, None and lists, tuples and dicts"):
        loop.fit()


@pytest.mark.bad_input
def test_a_key_that_is_not_a_name_is_an_error() -> None:
    def step(loop: Any, batch: Any) -> None:
        loop.carry[0] = 1

    with pytest.raises(TypeError, match=r"loop\.carry has the key 0 \(int\): its keys are names"):
        hookfit.Loop(step, [1], plugins=[Saves(at_steps=(1,))]).fit()


def test_a_resumed_run_gives_the_stage_it_continues_the_carry_it_had() -> None:
    whole: list = []
    saves = Saves(at_steps=(2, 4))
    hookfit.Loop(counting(whole), [1, 2, 3], max_epochs=2, plugins=[saves]).fit()

    for step in (2, 4):  # inside epoch 1, and inside epoch 2
        resumed: list = []
        hookfit.Loop(counting(resumed), [1, 2, 3], max_epochs=2, resume="saved",
                     plugins=[ResumesFrom(saves.states[step])]).fit()
        assert len(resumed) == 6 - step
        for (stage, epoch, got), (_, want_epoch, want) in zip(resumed, whole[step:]):
            assert epoch == want_epoch and got.keys() == want.keys() and got.get("n") == want.get("n")
            assert ("h" not in want) or torch.equal(got["h"], want["h"])

    resumed = []  # from an epoch's end: the next stage starts empty, as it did
    hookfit.Loop(counting(resumed), [1, 2, 3], max_epochs=2, resume="saved",
                 plugins=[ResumesFrom(saves.states["epoch 0"])]).fit()
    assert resumed[0] == ("train", 1, {})


@pytest.mark.bad_input
@pytest.mark.parametrize("carry", [["hidden"], {1: 2}])
def test_a_saved_carry_that_is_not_a_mapping_of_names_is_refused(carry: Any) -> None:
    saves = Saves(at_steps=(1,))
    hookfit.Loop(counting([]), [1, 2], plugins=[saves]).fit()
    saved = {**saves.states[1], "carry": carry}
    with pytest.raises(ValueError, match=r"load_state_dict: 'carry' \(loop.carry\) is not a mapping of names"):
        hookfit.Loop(counting([]), [1, 2], resume="saved", plugins=[ResumesFrom(saved)]).fit()


@pytest.mark.slow
@pytest.mark.fault
def test_an_lstm_carrying_its_hidden_state_killed_at_a_checkpoint_resumes_bitwise_equal(tmp_path: Path) -> None:
    """A two-layer LSTM with dropout over a batchified corpus, its hidden state carried (and
    detached) across batches in ``loop.carry``, a checkpoint every step; SIGKILL once the
    checkpoint of step 13 (inside the second epoch) is whole, then a resume."""

    def run(run_dir: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
        return warm.run([sys.executable, str(CHILD), str(run_dir), str(out), *args],
                        capture_output=True, text=True, timeout=300)

    whole = run(tmp_path / "whole", tmp_path / "whole.pt")
    assert whole.returncode == 0, whole.stderr
    want = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert (want["status"], want["step"]) == ("completed", 24)

    killed = run(tmp_path / "run", tmp_path / "never.pt", "--kill-at", "13")
    assert killed.returncode == -9, killed.stderr
    resumed = run(tmp_path / "run", tmp_path / "resumed.pt", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    got = torch.load(tmp_path / "resumed.pt", weights_only=True)

    assert (got["status"], got["step"]) == ("completed", 24)
    done = 24 - len(got["losses"])  # the newest whole checkpoint: step 13 or, written meanwhile, 14
    assert done in (13, 14) and got["losses"] == want["losses"][done:]
    assert all(torch.equal(got["params"][k], want["params"][k]) for k in want["params"])
    assert all(torch.equal(g, w) for g, w in zip(got["hidden"], want["hidden"]))
