"""hookfit.position: where a resumed run continues (the saved batch, after the last training batch, at
max_steps), resume through the environment, what a resumed run reports and what its events see."""

from __future__ import annotations

import gc
import re
import signal
import threading
import tracemalloc
from collections import OrderedDict

import pytest
import torch

import hookfit
import hookfit.payloads
from conftest import saved_run
from conftest import Recorder


@pytest.mark.bad_input
def test_resume_without_a_plugin_that_implements_it_fails_clearly(recorder: Recorder) -> None:
    with pytest.raises(RuntimeError, match=r"resume='latest' needs a plugin that implements the 'resume' event"):
        hookfit.Loop(lambda l, x: None, [1], resume="latest").fit()


def test_resume_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOKFIT_RESUME", "some/path")
    asked = []

    class Resumer:
        name = "resumer"

        @hookfit.hookimpl
        def resume(self, source):
            asked.append(source)
            return False

    hookfit.Loop(lambda l, x: None, [1], plugins=[Resumer()]).fit()
    assert asked == ["some/path"]


class Position:
    """A resume plugin that puts the run at (epoch, step, resume_batch), through the run's own
    ``load_state_dict`` as a checkpoint plugin does."""

    name = "position"
    stage = "train"

    def __init__(self, epoch: int, step: int, batch: int) -> None:
        self.at = (epoch, step, batch)
        self.ended_at = None

    @hookfit.hookimpl
    def resume(self, loop, source):
        loop.load_state_dict(saved_run(*self.at, self.stage))
        return source

    @hookfit.hookimpl
    def fit_end(self, loop):
        self.ended_at = loop.position


class Stateful(list):
    """Data with the optional protocols: set_epoch and iter_from."""

    def __init__(self, items):
        super().__init__(items)
        self.epochs: list[int] = []
        self.starts: list[int] = []
        self.produced: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def iter_from(self, start: int):
        self.starts.append(start)
        for item in self[start:]:
            self.produced.append(item)
            yield item


@pytest.mark.parametrize("protocol", [False, True])
def test_a_resumed_run_continues_at_the_saved_batch_without_the_earlier_ones(protocol: bool) -> None:
    data = Stateful([0, 1, 2, 3]) if protocol else [0, 1, 2, 3]
    seen: list[tuple[int, int, int]] = []

    def step(loop, x):
        seen.append((loop.state.epoch, loop.state.batch_idx, x))

    at = Position(1, 6, 3)
    state = hookfit.Loop(step, data, max_epochs=3, resume="ckpt", plugins=[at]).fit()
    assert seen == [(1, 3, 3)] + [(2, i, i) for i in range(4)]
    assert state.step == 6 + 1 + 4 and state.status == "completed" and at.ended_at.batch == 0
    if protocol:
        assert data.epochs == [1, 2] and data.starts == [3] and data.produced == [3]


@pytest.mark.parametrize("stage", ["train", "valid"])
def test_a_run_resumed_after_its_last_training_batch(stage: str) -> None:
    """Stopped after the last training batch, the stage still has to end (``stage_end`` steps
    a partial accumulation window, publishes the epoch); stopped in validation, it is over."""
    seen = []
    rec = Recorder()

    class At(Position):
        pass

    At.stage = stage

    hookfit.Loop(lambda l, x: seen.append(("t", x)), [0, 1], val_step=lambda l, x: seen.append(("v", x)),
                 val_data=[9], max_epochs=1, resume="x", plugins=[At(0, 2, 2), rec]).fit()
    assert seen == [("v", 9)]
    stages = [a["stage"] for e, a in rec.events if e in ("stage_start", "stage_end")]
    assert stages == (["train"] * 2 if stage == "train" else []) + ["valid"] * 2


def test_a_run_resumed_at_max_steps_does_no_more_work() -> None:
    seen = []
    state = hookfit.Loop(lambda l, x: seen.append(x), [0, 1], max_epochs=5, max_steps=4,
                         resume="x", plugins=[Position(2, 4, 0)]).fit()
    assert seen == [] and state.status == "completed" and "max_steps" in state.stop_reason


def test_a_resume_is_reported_with_where_it_continues(recorder: Recorder) -> None:
    class Resumer:
        name = "resumer"

        @hookfit.hookimpl
        def configure(self, loop):
            assert loop.resume == "latest"  # known before any plugin starts

        @hookfit.hookimpl
        def resume(self, loop, source):
            loop.load_state_dict(saved_run(1, 7, 2))
            return "runs/x/ckpt.pt"

    state = hookfit.Loop(lambda l, b: None, range(5), max_epochs=2, resume="latest",
                         plugins=[Resumer(), recorder]).fit()
    info = hookfit.payloads.ResumeInfo("runs/x/ckpt.pt", epoch=1, step=7, batch=2, stage="train")
    assert state.resumed_from == info and ("resumed", {"info": info}) in recorder.events
    assert recorder.names().index("resumed") < recorder.names().index("epoch_start")
    assert str(info) == "runs/x/ckpt.pt (epoch 2, after 2 training batches, step 7)"
    assert state.step == 10


def test_what_a_resumed_epoch_s_stage_start_and_a_stopped_run_s_fit_end_see() -> None:
    """As hooks.md says: at the resumed epoch's stage_start the batch index is the first batch
    to run and the position counts the ones done; at fit_end after a stop, the stage is None
    and the position is after the last whole batch."""
    seen = []

    class Watch(Position):
        @hookfit.hookimpl
        def stage_start(self, loop, stage):
            seen.append(("start", stage, loop.state.batch_idx, loop.state.step, loop.position.batch))

        @hookfit.hookimpl
        def batch_end(self, loop, batch_idx):
            if loop.state.step == 8:
                loop.request_stop("enough")

        @hookfit.hookimpl
        def fit_end(self, loop):
            seen.append(("end", loop.state.stage, loop.state.step, loop.position.epoch, loop.position.batch))

    hookfit.Loop(lambda l, b: None, [0, 1, 2, 3, 4], max_epochs=3, resume="x", plugins=[Watch(1, 3, 3)]).fit()
    # epoch 1 from batch 3 (steps 4, 5), epoch 2 from its start; stopped after step 8
    assert seen == [("start", "train", 3, 3, 3), ("start", "train", 0, 5, 0), ("end", None, 8, 2, 3)]
