"""The core's part in checkpoints and several processes: plugin states keyed by name, the
``resume`` event and the position it sets, data protocols, and the ``configure`` event."""

from __future__ import annotations


import pytest

import hookfit
from conftest import Recorder


class Counter:
    """A plugin with state: how many batches it saw."""

    def __init__(self, name: str = "counter") -> None:
        self.name = name
        self.seen = 0

    @hookfit.hookimpl
    def batch_end(self) -> None:
        self.seen += 1

    @hookfit.hookimpl
    def save_state(self) -> dict:
        return {"seen": self.seen}

    @hookfit.hookimpl
    def load_state(self, state: dict) -> None:
        self.seen = state["seen"]


class Probe:
    """Runs ``action(loop)`` at fit_start."""

    name = "probe"

    def __init__(self, action):
        self.action = action

    @hookfit.hookimpl
    def fit_start(self, loop):
        self.action(loop)


def test_plugin_states_are_keyed_by_plugin_name_and_restored_to_their_owner() -> None:
    saved = {}
    a, b = Counter("a"), Counter("b")
    hookfit.Loop(lambda l, x: None, [1, 2, 3], plugins=[a, b, Probe(lambda l: None)]).fit()

    class Save:
        name = "save"

        @hookfit.hookimpl
        def fit_end(self, loop):
            saved.update(loop.plugin_states())

    hookfit.Loop(lambda l, x: None, [1, 2], plugins=[Counter("a"), Save()]).fit()
    assert saved == {"a": {"seen": 2}}

    fresh = Counter("a")
    hookfit.Loop(lambda l, x: None, [1], plugins=[fresh, Probe(lambda l: l.load_plugin_states({"a": {"seen": 40}}))]).fit()
    assert fresh.seen == 41


def test_mismatched_plugin_states_fail_in_strict_mode_and_warn_in_lenient_mode() -> None:
    states = {"a": {"seen": 5}, "gone": {"x": 1}}
    with pytest.raises(ValueError, match=r"no saved state for plugin 'b'.*'gone'.*strict"):
        hookfit.Loop(lambda l, x: None, [1], plugins=[
            Counter("a"), Counter("b"), Probe(lambda l: l.load_plugin_states(states))]).fit()

    a = Counter("a")
    with pytest.warns(hookfit.HookfitWarning, match=r"no saved state for plugin 'b'.*'gone'.*restoring the rest"):
        hookfit.Loop(lambda l, x: None, [1], plugins=[
            a, Counter("b"), Probe(lambda l: l.load_plugin_states(states, strict=False))]).fit()
    assert a.seen == 6


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
    """A resume plugin that puts the run at (epoch, step, resume_batch)."""

    name = "position"

    def __init__(self, epoch: int, step: int, batch: int) -> None:
        self.at = (epoch, step, batch)

    @hookfit.hookimpl
    def resume(self, loop, source):
        loop.state.epoch, loop.state.step, loop.state.resume_batch = self.at
        return source


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

    state = hookfit.Loop(step, data, max_epochs=3, resume="ckpt", plugins=[Position(1, 6, 3)]).fit()
    assert seen == [(1, 3, 3)] + [(2, i, i) for i in range(4)]
    assert state.step == 6 + 1 + 4 and state.status == "completed" and state.resume_batch == 0
    if protocol:
        assert data.epochs == [1, 2] and data.starts == [3] and data.produced == [3]


@pytest.mark.parametrize("stage", ["train", "valid"])
def test_a_run_resumed_after_its_last_training_batch(stage: str) -> None:
    """Stopped after the last training batch, the stage still has to end (``stage_end`` steps
    a partial accumulation window, publishes the epoch); stopped in validation, it is over."""
    seen = []
    rec = Recorder()

    class At(Position):
        @hookfit.hookimpl
        def resume(self, loop, source):
            super().resume(loop, source)
            loop.state.resume_stage = stage

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


def test_configure_fires_first_and_a_plugin_switched_off_there_sees_nothing() -> None:
    victim = Recorder()
    victim.name = "victim"

    class Gate:
        name = "gate"

        @hookfit.hookimpl
        def configure(self, loop):
            loop.state.rank, loop.state.world_size = 1, 2
            loop.pm.unregister(victim)

    order = Recorder()
    state = hookfit.Loop(lambda l, x: None, [1], plugins=[victim, Gate(), order]).fit()
    assert victim.names() in ([], ["configure"]) and order.names()[:2] == ["configure", "fit_start"]
    assert state.rank == 1 and state.world_size == 2


def test_is_main_follows_the_rank() -> None:
    seen = []
    hookfit.Loop(lambda l, x: seen.append(l.is_main), [1]).fit()
    assert seen == [True]
