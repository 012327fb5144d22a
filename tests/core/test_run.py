"""hookfit.run: one fit() of a Loop. Event order, step outputs, train and eval modes, stopping
at every boundary, failures and fit_end, flat memory, and the run's part in checkpoints and
several processes (plugin states keyed by name, resume, configure)."""

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


def test_event_sequence_two_epochs_with_validation(recorder: Recorder) -> None:
    state = hookfit.Loop(
        lambda loop, b: {"x": b},
        [1, 2],
        val_step=lambda loop, b: {"v": b},
        val_data=[10],
        max_epochs=2,
        plugins=[recorder],
    ).fit()
    assert state.status == "completed"
    batch = ["batch_start", "step_output", "batch_end", "should_stop"]
    train = ["batch_start", "step_output", "batch_end", "after_batch", "should_stop"]
    epoch = (
        ["epoch_start", "stage_start"] + train * 2 + ["stage_end", "stage_start"]
        + batch + ["stage_end", "epoch_end", "after_epoch"]
    )
    assert recorder.names() == ["configure", "fit_start"] + epoch * 2 + ["fit_end"]
    events = recorder.events
    assert events[2] == ("epoch_start", {"epoch": 0})
    assert events[3] == ("stage_start", {"stage": "train"})
    assert events[4] == ("batch_start", {"batch": 1, "batch_idx": 0})
    assert events[5] == ("step_output", {"output": {"x": 1}, "batch": 1})
    assert events[6] == ("batch_end", {"output": {"x": 1}, "batch": 1, "batch_idx": 0})
    assert ("stage_start", {"stage": "valid"}) in events
    assert ("step_output", {"output": {"v": 10}, "batch": 10}) in events
    assert ("epoch_end", {"epoch": 1}) in events
    assert state.step == 4 and state.epoch == 1
    assert state.stop_reason == "max_epochs=2 reached"


def test_loop_training_flag_and_stage_seen_by_steps_and_plugins(recorder: Recorder) -> None:
    seen = []

    def train(loop: hookfit.Loop, b: int) -> None:
        seen.append(("train", loop.training, loop.state.stage, torch.is_grad_enabled()))

    def valid(loop: hookfit.Loop, b: int) -> None:
        seen.append(("valid", loop.training, loop.state.stage, torch.is_grad_enabled()))

    hookfit.Loop(train, [1], val_step=valid, val_data=[1], plugins=[recorder]).fit()
    assert seen == [("train", True, "train", True), ("valid", False, "valid", False)]
    stage_flags = {(stage, training) for event, stage, training in recorder.seen if event == "batch_end"}
    assert stage_flags == {("train", True), ("valid", False)}


def test_every_step_output_kind_reaches_batch_end(recorder: Recorder) -> None:
    loss = torch.tensor(0.5)
    ordered = OrderedDict(acc=1.0)
    outputs = [None, {"accuracy": 0.9}, loss, ordered, {}]

    def step(loop: hookfit.Loop, i: int):
        return outputs[i]

    hookfit.Loop(step, range(len(outputs)), plugins=[recorder]).fit()
    ends = [args["output"] for event, args in recorder.events if event == "batch_end"]
    assert ends[0] is None
    assert ends[1] == {"accuracy": 0.9} and "loss" not in ends[1]
    assert ends[2] == {"loss": loss} and ends[2]["loss"] is loss
    assert ends[3] is ordered  # any mapping goes on unchanged
    assert ends[4] == {}
    step_outputs = [args["output"] for event, args in recorder.events if event == "step_output"]
    assert len(step_outputs) == 4  # None skips step_output, batch_end still fires


@pytest.mark.bad_input
def test_step_returning_a_string_names_the_step_and_type(recorder: Recorder) -> None:
    def my_train_step(loop: hookfit.Loop, b: int) -> str:
        return "oops"

    loop = hookfit.Loop(my_train_step, [1], plugins=[recorder])
    with pytest.raises(TypeError, match=r"my_train_step.*returned str"):
        loop.fit()
    assert loop.state.status == "failed"
    assert recorder.names()[-2:] == ["exception", "fit_end"]


class Frozen(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(2, 2)
        self.bn = torch.nn.BatchNorm1d(2)
        self.head = torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Linear(2, 1))


def test_validation_restores_each_modules_own_mode() -> None:
    model = Frozen()
    model.train()
    model.bn.eval()  # a frozen BatchNorm
    before = {name: m.training for name, m in model.named_modules()}
    during = []

    def valid(loop: hookfit.Loop, b: torch.Tensor) -> None:
        during.append({name: m.training for name, m in model.named_modules()})
        assert torch.is_inference_mode_enabled()

    hookfit.Loop(lambda loop, b: None, [1], val_step=valid, val_data=[1], model=model).fit()
    assert during and not any(any(flags.values()) for flags in during)
    assert {name: m.training for name, m in model.named_modules()} == before
    assert model.bn.training is False and model.body.training is True


def test_validation_no_grad_mode_and_several_models() -> None:
    g, d = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    d.eval()
    modes = []

    def valid(loop, b):
        modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled(), g.training, d.training))

    with pytest.warns(hookfit.HookfitWarning, match=r"^model\['d'\] \(Linear\) is in eval mode as training starts"):
        hookfit.Loop(
            lambda loop, b: None, [1], val_step=valid, val_data=[1],
            model={"g": g, "d": d}, val_grad_mode="no_grad",
        ).fit()
    assert modes == [(False, False, False, False)]
    assert g.training is True and d.training is False


@pytest.mark.fault
def test_validation_restores_modes_when_the_val_step_raises() -> None:
    model = Frozen()
    model.bn.eval()

    def valid(loop, b):
        raise RuntimeError("boom in validation")

    with pytest.raises(RuntimeError, match="boom in validation"):
        hookfit.Loop(lambda loop, b: None, [1], val_step=valid, val_data=[1], model=model).fit()
    assert model.training and model.body.training and not model.bn.training


def test_val_every_n_epochs(recorder: Recorder) -> None:
    hookfit.Loop(
        lambda loop, b: None, [1], val_step=lambda loop, b: None, val_data=[1],
        max_epochs=4, val_every_n_epochs=2, plugins=[recorder],
    ).fit()
    valid_epochs = [
        recorder.events[i - 1] for i, (e, a) in enumerate(recorder.events)
        if e == "stage_start" and a["stage"] == "valid"
    ]
    assert len(valid_epochs) == 2


def test_max_steps_completes_mid_epoch(recorder: Recorder) -> None:
    """The rest of epoch 1 belongs to a longer run: no stage_end, validation or epoch_end for
    it (resuming with a larger max_steps continues it exactly)."""
    state = hookfit.Loop(lambda loop, b: None, range(10), max_epochs=5, max_steps=13, plugins=[recorder],
                         val_step=lambda loop, b: None, val_data=[1]).fit()
    assert state.status == "completed" and state.step == 13 and state.epoch == 1
    assert state.stop_reason == "max_steps=13 reached"
    assert recorder.names().count("epoch_end") == 1
    assert recorder.names().count("stage_end") == 2  # epoch 0's training and validation only
    assert recorder.names()[-1] == "fit_end" and ("batch_end", {"output": None, "batch": 2, "batch_idx": 2}) in recorder.events[-4:]


def test_max_steps_at_the_end_of_an_epoch_completes_that_epoch(recorder: Recorder) -> None:
    state = hookfit.Loop(lambda loop, b: None, range(10), max_epochs=5, max_steps=10, plugins=[recorder]).fit()
    assert (state.status, state.step, state.stop_reason) == ("completed", 10, "max_steps=10 reached")
    assert recorder.names().count("epoch_end") == 1 and recorder.names()[-3:] == ["epoch_end", "after_epoch", "fit_end"]
    unsized = Recorder()  # without a length, the stage's end is found by asking for one more batch

    class Unsized:
        def __iter__(self):
            return iter(range(10))

    hookfit.Loop(lambda loop, b: None, Unsized(), max_epochs=5, max_steps=10, plugins=[unsized]).fit()
    assert unsized.names().count("epoch_end") == 1

@pytest.mark.bad_input
def test_empty_data_fails_the_run_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOKFIT_PLUGINS", "interrupter")
    before = signal.getsignal(signal.SIGINT)
    loop = hookfit.Loop(lambda l, b: None, [])
    with pytest.raises(ValueError, match="train data yielded no batches in epoch 0"):
        loop.fit()
    assert loop.state.status == "failed"
    assert signal.getsignal(signal.SIGINT) is before  # the interrupter's fit_end ran


@pytest.mark.bad_input
def test_exhausted_generator_is_explained() -> None:
    # several epochs of a generator: refused when the Loop is built...
    with pytest.raises(ValueError, match="train_data is a generator, an iterator that gives its batches once only"):
        hookfit.Loop(lambda l, b: None, (i for i in range(3)), max_epochs=2)
    # ... and where the epochs are not known then (max_steps alone), explained when it runs dry
    with pytest.raises(ValueError, match="epoch 1 .*generator iterator is used up after one pass"):
        hookfit.Loop(lambda l, b: None, (i for i in range(3)), max_steps=5).fit()

# -- stopping ---------------------------------------------------------------------------------

def test_should_stop_ends_run_after_that_batch_interrupted() -> None:
    recorder = Recorder(stop_after=3)
    state = hookfit.Loop(lambda loop, b: None, range(10), max_epochs=3, plugins=[recorder]).fit()
    assert state.status == "interrupted"
    assert state.step == 3
    assert state.stop_reason == "recorder stops at step 3" and state.stopped_by == "recorder"
    names = recorder.names()
    assert names[-3:] == ["should_stop", "stop_requested", "fit_end"]  # the answer became a request
    assert "stage_end" not in names and "epoch_end" not in names


def test_should_stop_asks_every_plugin_any_true_answer_stops() -> None:
    asked = []

    class No:
        name = "no"

        @hookfit.hookimpl
        def should_stop(self):
            asked.append("no")
            return False

    class Yes:
        name = "yes"

        @hookfit.hookimpl(tryfirst=True)
        def should_stop(self):
            asked.append("yes")
            return True

    state = hookfit.Loop(lambda loop, b: None, range(5), plugins=[No(), Yes()]).fit()
    assert asked == ["yes", "no"]
    assert state.status == "interrupted" and state.step == 1
    assert state.stop_reason == "a plugin answered should_stop"


@pytest.mark.parametrize("answers, stops", [([False], False), ([0, None], False), (["why"], True), ([None, "why"], True)])
def test_one_or_several_should_stop_answers(answers: list, stops: bool) -> None:
    """One implementation's answer is used as it is (no list around it), several are
    gathered: either way only a true answer stops, and a string is the reason."""
    def answering(value):
        class Answer:
            name = f"answer-{value!r}"

            @hookfit.hookimpl
            def should_stop(self, loop):
                return value
        return Answer()

    state = hookfit.Loop(lambda loop, b: None, range(3), plugins=[answering(a) for a in answers]).fit()
    assert (state.status, state.step) == (("interrupted", 1) if stops else ("completed", 3))
    assert state.stop_reason == ("why" if stops else "max_epochs=1 reached")


def test_request_stop_from_the_step_stops_after_that_batch(recorder: Recorder) -> None:
    def step(loop: hookfit.Loop, b: int) -> None:
        if b == 2:
            loop.request_stop("enough for today")

    state = hookfit.Loop(step, range(10), plugins=[recorder]).fit()
    assert state.status == "interrupted" and state.stop_reason == "enough for today"
    assert state.step == 3
    assert state.stopped_by == "step function 'test_request_stop_from_the_step_stops_after_that_batch.<locals>.step'"
    request = hookfit.StopRequest("enough for today", state.stopped_by)
    assert ("stop_requested", {"request": request}) in recorder.events


def test_request_stop_needs_no_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopping is the core's: with every discovered plugin switched off (the interrupter
    included), a request is honoured."""
    monkeypatch.delenv("HOOKFIT_PLUGINS")
    monkeypatch.setenv("HOOKFIT_DISABLE_PLUGINS", "interrupter")
    monkeypatch.setenv("HOOKFIT_PLUGINS", "")

    def step(loop: hookfit.Loop, b: int) -> None:
        loop.request_stop("please")

    loop = hookfit.Loop(step, range(2))
    state = loop.fit()
    assert state.status == "interrupted" and state.step == 1 and state.stop_reason == "please"
    assert "interrupter" not in [name for name, _ in loop.run.pm.list_name_plugin()]

def regression() -> tuple[torch.nn.Module, list]:
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(3, 1)
    with torch.no_grad():
        model.weight.copy_(torch.randn(1, 3, generator=g))
    return model, [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(5)]


def decider_for(event: str, stage: str | None, epoch: int):
    """A plugin implementing exactly ``event``, which asks for a stop there in ``epoch`` (and
    ``stage``) and keeps the parameters of that moment."""
    args = "loop" if event == "fit_start" else f"loop, {'stage' if event.startswith('stage') else 'epoch'}"
    ns: dict = {}
    exec(f"def {event}(self, {args}):\n    self.decide(loop)", ns)

    class Plugin:
        name = "decider"
        params: list | None = None

        def decide(self, loop):
            if loop.state.epoch == epoch and (stage is None or loop.state.stage == stage):
                self.params = [p.detach().clone() for p in loop.model.parameters()]
                loop.request_stop(f"decided in {event}")

    setattr(Plugin, event, hookfit.hookimpl(ns[event]))
    return Plugin()


def sgd_step(loop, batch):
    x, y = batch
    loss = torch.nn.functional.mse_loss(loop.model(x), y)
    loop.optimizers.zero_grad()
    loss.backward()
    loop.optimizers.step()
    return {"loss": loss}


@pytest.mark.parametrize("event, stage, epoch, batches_run", [
    ("fit_start", None, 0, 0),
    ("epoch_start", None, 1, 5),          # epoch 1 runs no batch
    ("stage_start", "train", 1, 5),       # ... nor does its training stage
    ("stage_end", "train", 1, 10),        # no validation, no epoch_end for epoch 1
    ("epoch_end", None, 1, 10),           # epoch 1 complete, epoch 2 never starts
])
def test_a_stop_asked_at_a_boundary_runs_no_further_batch(event: str, stage: str | None, epoch: int,
                                                           batches_run: int) -> None:
    """Early stopping decided in epoch_end, a budget checked in stage_end: the run ends right
    there, and the parameters are those of the decision."""
    model, data = regression()
    decider = decider_for(event, stage, epoch)
    recorder = Recorder()
    loop = hookfit.Loop(sgd_step, data, val_step=lambda l, b: None, val_data=data[:2], model=model,
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.1), max_epochs=4,
                        plugins=[decider, recorder])
    state = loop.fit()
    assert state.status == "interrupted" and state.stop_reason == f"decided in {event}"
    assert state.stopped_by == "decider"
    assert state.step == batches_run
    assert all(torch.equal(a, b) for a, b in zip(decider.params, model.parameters()))
    names = recorder.names()
    after = ["after_epoch"] if event == "epoch_end" else []  # the epoch is whole: it may be saved
    assert names[-3 - len(after):] == [event, "stop_requested", *after, "fit_end"]
    assert names.count("epoch_end") == (2 if event == "epoch_end" else epoch)
    assert names.count("batch_end") == batches_run + 2 * names.count("epoch_end")  # + validation batches


@pytest.mark.parametrize("complete, status", [(True, "completed"), (False, "interrupted")])
def test_a_stop_by_the_run_s_own_rule_completes_it(complete: bool, status: str) -> None:
    """request_stop(complete=True) (early stopping, a target reached) ends the run where it
    was asked, like any stop, with status completed instead of interrupted."""
    model, data = regression()

    class Rule:
        name = "rule"

        @hookfit.hookimpl
        def epoch_end(self, loop, epoch):
            if epoch == 1:
                loop.request_stop("target reached", complete=complete)

    recorder = Recorder()
    state = hookfit.Loop(sgd_step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                         max_epochs=4, plugins=[Rule(), recorder]).fit()
    assert (state.status, state.stop_reason, state.stopped_by) == (status, "target reached", "rule")
    assert state.step == 10 and recorder.names().count("epoch_end") == 2
    assert recorder.names()[-3:] == ["stop_requested", "after_epoch", "fit_end"]


def test_a_request_from_another_thread_is_honoured_after_the_current_batch() -> None:
    started, release = threading.Event(), threading.Event()

    def step(loop, b):
        if b == 2:
            started.set()
            assert release.wait(30)
        return None

    loop = hookfit.Loop(step, range(100))
    asker = threading.Thread(target=lambda: (started.wait(30), loop.request_stop("from a thread", by="a scheduler"),
                                             release.set()))
    asker.start()
    state = loop.fit()
    asker.join(30)
    assert (state.status, state.step, state.stop_reason, state.stopped_by) == (
        "interrupted", 3, "from a thread", "a scheduler")


def test_the_first_request_wins_and_the_event_fires_once(recorder: Recorder) -> None:
    def step(loop, b):
        first = loop.request_stop("first", by="me")
        again = loop.request_stop("second")
        assert again is first and loop.stop_requested is first

    state = hookfit.Loop(step, range(5), plugins=[recorder]).fit()
    assert (state.stop_reason, state.stopped_by, state.step) == ("first", "me", 1)
    assert recorder.names().count("stop_requested") == 1


def test_who_asked_is_the_plugin_whose_code_asked() -> None:
    class Budget:
        name = "budget"

        @hookfit.hookimpl
        def batch_end(self, loop, batch_idx):
            if batch_idx == 1:
                self.check(loop)

        def check(self, loop):  # not a hook itself: the plugin is still found on the stack
            loop.request_stop("time budget spent")

    state = hookfit.Loop(lambda l, b: None, range(5), plugins=[Budget()]).fit()
    assert (state.stop_reason, state.stopped_by, state.step) == ("time budget spent", "budget", 2)


def test_should_stop_answers_name_the_plugins_that_answered() -> None:
    def answering(name, value):
        class Answer:
            @hookfit.hookimpl
            def should_stop(self, loop):
                return value if loop.state.step == 2 else None
        plugin = Answer()
        plugin.name = name
        return plugin

    state = hookfit.Loop(lambda l, b: None, range(5),
                         plugins=[answering("a", "loss exploded"), answering("b", True), answering("c", False)]).fit()
    assert (state.step, state.stop_reason, state.stopped_by) == (2, "loss exploded", "b, a")


@pytest.mark.bad_input
def test_a_bad_reason_is_refused() -> None:
    def step(loop, b):
        loop.request_stop(3)

    with pytest.raises(TypeError, match="reason must be a string, got int"):
        hookfit.Loop(step, [1]).fit()


class Agreement:
    """Stands in for a distributed plugin: defers every request until ``at``, then stops."""

    name = "agreement"

    def __init__(self, at: int) -> None:
        self.at = at
        self.seen: list[tuple[str, str | None]] = []

    @hookfit.hookimpl
    def agree_stop(self, loop, request, boundary):
        self.seen.append((boundary, None if request is None else request.reason))
        if boundary == "batch" and loop.state.step == self.at:
            return hookfit.StopRequest("agreed", by="every rank")
        return False


def test_agree_stop_defers_a_request_until_the_processes_agree() -> None:
    agreement = Agreement(at=4)

    def step(loop, b):
        if b == 1:
            loop.request_stop("rank 1 wants to stop")

    state = hookfit.Loop(step, range(10), plugins=[agreement]).fit()
    assert (state.status, state.step, state.stop_reason, state.stopped_by) == ("interrupted", 4, "agreed", "every rank")
    assert agreement.seen[:3] == [("start", None), ("epoch_start", None), ("stage_start", None)]
    assert agreement.seen[3:] == [("batch", None)] + [("batch", "rank 1 wants to stop")] * 3


def test_agree_stop_asked_at_every_boundary_of_a_completed_run() -> None:
    agreement = Agreement(at=-1)
    hookfit.Loop(lambda l, b: None, [1, 2], val_step=lambda l, b: None, val_data=[1], plugins=[agreement]).fit()
    assert [b for b, _ in agreement.seen] == ["start", "epoch_start", "stage_start", "batch", "batch", "stage_end",
                                             "stage_start", "batch", "stage_end", "epoch_end"]


@pytest.mark.bad_input
def test_agree_stop_with_a_wrong_answer_names_the_plugin() -> None:
    class Wrong:
        name = "wrong"

        @hookfit.hookimpl
        def agree_stop(self, loop, request, boundary):
            return "yes"

    with pytest.raises(TypeError, match=r"agree_stop must return a StopRequest, False or None.*wrong"):
        hookfit.Loop(lambda l, b: None, [1], plugins=[Wrong()]).fit()

# -- failures -----------------------------------------------------------------------------------

class Boom(Exception):
    pass


@pytest.mark.fault
def test_failing_step_fires_exception_then_fit_end_and_reraises(recorder: Recorder) -> None:
    error = Boom("step exploded")
    statuses = []

    class Watch:
        name = "watch"

        @hookfit.hookimpl
        def fit_end(self, loop):
            statuses.append(loop.state.status)

    def exploding_step(loop, b):
        if b == 1:
            raise error

    loop = hookfit.Loop(exploding_step, range(3), plugins=[recorder, Watch()])
    with pytest.raises(Boom) as info:
        loop.fit()
    assert info.value is error  # propagated unchanged
    assert any("exploding_step" in note for note in info.value.__notes__)
    assert recorder.names()[-2:] == ["exception", "fit_end"]
    assert recorder.events[-2] == ("exception", {"error": "Boom"})
    assert statuses == ["failed"] and loop.state.status == "failed"
    assert loop.state.error is error


@pytest.mark.fault
def test_failing_plugin_is_named_in_the_note(recorder: Recorder) -> None:
    class Faulty:
        name = "faulty"

        @hookfit.hookimpl
        def batch_end(self, batch_idx):
            if batch_idx == 1:
                raise Boom("plugin exploded")

    loop = hookfit.Loop(lambda loop, b: None, range(3), plugins=[recorder, Faulty()])
    with pytest.raises(Boom) as info:
        loop.fit()
    note = " ".join(info.value.__notes__)
    assert "plugin 'faulty'" in note and "hook 'batch_end'" in note and "batch 1" in note
    assert recorder.names()[-2:] == ["exception", "fit_end"]
    assert loop.state.status == "failed"


@pytest.mark.fault
def test_fit_end_runs_for_every_plugin_even_if_one_raises() -> None:
    ran = []

    class A:
        name = "a"

        @hookfit.hookimpl
        def fit_end(self):
            ran.append("a")

    class B:
        name = "b"

        @hookfit.hookimpl
        def fit_end(self):
            ran.append("b")
            raise Boom("fit_end failed")

    loop = hookfit.Loop(lambda loop, b: None, [1], plugins=[A(), B()])
    with pytest.raises(Boom) as info:
        loop.fit()
    assert ran == ["b", "a"]
    assert "plugin 'b'" in " ".join(info.value.__notes__)
    assert loop.state.status == "failed"


@pytest.mark.fault
def test_fit_end_error_after_a_failure_is_a_warning_not_a_replacement() -> None:
    class B:
        name = "b"

        @hookfit.hookimpl
        def fit_end(self):
            raise ValueError("cleanup failed")

    def step(loop, b):
        raise Boom("original")

    with pytest.warns(hookfit.HookfitWarning, match="cleanup failed"):
        with pytest.raises(Boom, match="original"):
            hookfit.Loop(step, [1], plugins=[B()]).fit()


@pytest.mark.fault
def test_keyboard_interrupt_is_interrupted_and_fit_end_runs(recorder: Recorder) -> None:
    def step(loop, b):
        raise KeyboardInterrupt

    loop = hookfit.Loop(step, [1], plugins=[recorder])
    with pytest.raises(KeyboardInterrupt):
        loop.fit()
    assert loop.state.status == "interrupted"
    assert recorder.names()[-1] == "fit_end" and "exception" not in recorder.names()


def test_memory_is_flat_over_many_batches() -> None:
    """Outputs and batches are not kept: the traced memory after 20 000 batches is no larger
    than after 2 000 (a leak of even one small dict per batch would add over a megabyte)."""
    def step(loop, b):
        return {"loss": torch.ones(()) * b, "extra": [b] * 4}

    class Reader:
        @hookfit.hookimpl
        def batch_end(self, output):
            output["loss"].item()

    def run(n: int) -> int:
        gc.collect()
        tracemalloc.start()
        hookfit.Loop(step, range(n), plugins=[Reader()]).fit()
        gc.collect()
        current, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return current

    run(500)  # warm caches
    small, large = run(2_000), run(20_000)
    assert large - small < 50_000, (small, large)

# -- the run's part in checkpoints and several processes ---------------------------------------

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


@pytest.mark.bad_input
def test_mismatched_plugin_states_fail_in_strict_mode_and_warn_in_lenient_mode() -> None:
    states = {"a": {"seen": 5}, "gone": {"x": 1}}
    with pytest.raises(ValueError, match=r"no saved state for plugin 'b'.*'gone'.*strict") as raised:
        hookfit.Loop(lambda l, x: None, [1], plugins=[
            Counter("a"), Counter("b"), Probe(lambda l: l.load_plugin_states(states))]).fit()
    # a typed error, so a plugin that restores states (checkpoint) can say how to go on
    # without reading the message
    assert isinstance(raised.value, hookfit.StateMismatch)
    assert (raised.value.missing, raised.value.extra) == (["b"], ["gone"])
    assert "strict" not in raised.value.detail

    a = Counter("a")
    with pytest.warns(hookfit.HookfitWarning, match=r"no saved state for plugin 'b'.*'gone'.*restoring the rest"):
        hookfit.Loop(lambda l, x: None, [1], plugins=[
            a, Counter("b"), Probe(lambda l: l.load_plugin_states(states, strict=False))]).fit()
    assert a.seen == 6


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


@pytest.mark.fault
def test_with_wrappers_and_tracing_every_exception_and_fit_end_implementation_runs() -> None:
    """The failure the contracts issue reported: with a fit_end wrapper installed, one fit_end
    implementation that raised skipped every other one (a terminal restore among them)."""
    ran: list[str] = []

    def plugin(label: str, fails: bool):
        class P:
            name = label

            @hookfit.hookimpl
            def exception(self, error):
                ran.append(f"{label}.exception")
                if fails:
                    raise RuntimeError(f"{label} broke in exception")

            @hookfit.hookimpl
            def fit_end(self):
                ran.append(f"{label}.fit_end")
                if fails:
                    raise RuntimeError(f"{label} broke in fit_end")
        return P()

    class Wrap:
        name = "wrap"

        @hookfit.hookimpl(wrapper=True)
        def fit_end(self):
            ran.append("wrap.before")
            result = yield
            ran.append("wrap.after")
            return result

        @hookfit.hookimpl(hookwrapper=True)
        def exception(self):
            yield

    traced: list[str] = []

    class Tracer:
        name = "tracer"

        @hookfit.hookimpl
        def fit_start(self, loop):
            loop.pm.add_hookcall_monitoring(lambda name, impls, kwargs: traced.append(name), lambda *a: None)

    def step(loop, b):
        raise Boom("the step failed")

    plugins = [plugin("first", False), plugin("broken", True), plugin("last", False), Wrap(), Tracer()]
    with pytest.warns(hookfit.HookfitWarning) as warned:
        with pytest.raises(Boom, match="the step failed"):
            hookfit.Loop(step, [1], plugins=plugins).fit()
    assert {"first.exception", "broken.exception", "last.exception", "first.fit_end", "broken.fit_end",
            "last.fit_end", "wrap.before", "wrap.after"} == set(ran)
    assert traced.count("exception") == 1 and traced.count("fit_end") == 1  # one traced call each
    messages = " ".join(str(w.message) for w in warned)
    assert "broken broke in exception" in messages and "broken broke in fit_end" in messages
    assert "plugin 'broken'" in messages


# -- identity, resume reporting, first-batch checks ------------------------------------------

def test_a_run_is_named_and_gets_a_folder_of_its_name(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    folders = []

    def step(loop, b):
        folders.append((loop.name, loop.run_dir))

    hookfit.Loop(step, [1], name="exp").fit()
    hookfit.Loop(step, [1], name="exp").fit()
    hookfit.Loop(step, [1], run_dir=tmp_path / "given").fit()
    (name1, dir1), (name2, dir2), (name3, dir3) = folders
    assert name1 == name2 == "exp" and dir1 != dir2
    assert dir1.parent == dir2.parent == tmp_path / "runs" / "exp"  # runs/<name>/<date>-<time>
    assert (name3, dir3) == ("given", tmp_path / "given")


@pytest.mark.bad_input
@pytest.mark.parametrize("name", ["", " ", "a/b", "..", 3])
def test_a_bad_name_is_refused(name) -> None:
    with pytest.raises(ValueError, match="name must be a non-empty string usable as a folder name"):
        hookfit.Loop(lambda l, b: None, [1], name=name)


@pytest.mark.bad_input
def test_continue_in_is_refused_once_the_folder_is_used(tmp_path) -> None:
    class Late:
        name = "late"

        @hookfit.hookimpl
        def fit_start(self, loop):
            loop.run_dir  # a plugin already writes here
            loop.continue_in(tmp_path / "elsewhere")

    with pytest.raises(RuntimeError, match="already writes to .*call it at configure"):
        hookfit.Loop(lambda l, b: None, [1], name="x", plugins=[Late()]).fit()

    class Early:
        name = "early"

        @hookfit.hookimpl
        def configure(self, loop):
            loop.continue_in(tmp_path / "earlier-run")

    seen = []
    hookfit.Loop(lambda l, b: seen.append(l.run_dir), [1], plugins=[Early()]).fit()
    assert seen == [tmp_path / "earlier-run"]


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


def test_plugin_states_name_every_plugin_that_saves_even_without_state_now() -> None:
    """A plugin whose save_state answers None took part: its entry is None, and a resumed
    run restores nothing for it and complains about nothing."""
    class Empty:
        name = "empty"
        loaded = []

        @hookfit.hookimpl
        def save_state(self):
            return None

        @hookfit.hookimpl
        def load_state(self, state):
            Empty.loaded.append(state)

    saved = {}

    class Save:
        name = "save"

        @hookfit.hookimpl
        def fit_end(self, loop):
            saved.update(loop.plugin_states())

    hookfit.Loop(lambda l, b: None, [1], plugins=[Empty(), Counter("a"), Save()]).fit()
    assert saved == {"empty": None, "a": {"seen": 1}}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hookfit.Loop(lambda l, b: None, [1], plugins=[
            Empty(), Counter("a"), Probe(lambda l: l.load_plugin_states(saved))]).fit()
    assert Empty.loaded == []

    # new to the run and inert (nothing to save now, as a discovered plugin left unconfigured):
    # it misses nothing, so states saved before it was installed resume without a word
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hookfit.Loop(lambda l, b: None, [1], plugins=[
            Empty(), Counter("a"), Probe(lambda l: l.load_plugin_states({"a": {"seen": 1}}, strict=True))]).fit()


@pytest.mark.bad_input
def test_a_new_plugin_starts_fresh_with_one_warning_naming_it() -> None:
    fresh = Counter("new")
    with pytest.warns(hookfit.HookfitWarning, match=r"no saved state for plugin 'new' .*\(new to the run: it starts fresh\)") as caught:
        hookfit.Loop(lambda l, b: None, [1], plugins=[
            fresh, Probe(lambda l: l.load_plugin_states({}, strict=False))]).fit()
    assert fresh.seen == 1 and len([w for w in caught if "plugin states" in str(w.message)]) == 1


@pytest.mark.bad_input
def test_a_step_output_with_a_key_that_is_not_a_string_is_named_at_the_first_batch(recorder: Recorder) -> None:
    def my_step(loop, b):
        return {"loss": 1.0, 3: 2.0}

    with pytest.raises(TypeError, match=r"step function '.*my_step' returned a mapping with the key 3 \(int\)"):
        hookfit.Loop(my_step, range(5), plugins=[recorder]).fit()
    assert "step_output" not in recorder.names()  # no plugin saw it
    assert recorder.events[-3][0] == "batch_start"


@pytest.mark.bad_input
def test_a_model_left_in_eval_mode_is_warned_about_once() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    model.eval()
    with pytest.warns(hookfit.HookfitWarning, match=r"the model \(Sequential\) is in eval mode as training starts") as caught:
        hookfit.Loop(lambda l, b: None, [1], model=model, max_epochs=3,
                     val_step=lambda l, b: None, val_data=[1]).fit()
    assert len([w for w in caught if "eval mode" in str(w.message)]) == 1
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hookfit.Loop(lambda l, b: None, [1], model=model.train()).fit()


def test_wrap_step_surrounds_every_call_of_both_steps_and_keeps_their_names() -> None:
    calls = []

    def tagging(tag):
        def wrapper(step):
            def wrapped(loop, batch):
                calls.append(tag)
                return step(loop, batch)
            return wrapped
        return wrapper

    class Wrapping:
        name = "wrapping"

        @hookfit.hookimpl
        def configure(self, loop):
            loop.wrap_step(tagging("inner"))

        @hookfit.hookimpl
        def fit_start(self, loop):
            loop.wrap_step(tagging("outer"))

    def my_train(loop, batch):
        calls.append("train")

    def my_valid(loop, batch):
        calls.append("valid")

    loop = hookfit.Loop(my_train, [1], val_step=my_valid, val_data=[1], plugins=[Wrapping()])
    loop.fit()
    assert calls == ["outer", "inner", "train", "outer", "inner", "valid"]
    assert loop.run.train_step.__qualname__.endswith("my_train") and loop.train_step is my_train


@pytest.mark.bad_input
def test_wrap_step_after_the_first_batch_or_returning_no_function_is_an_error() -> None:
    class Late:
        name = "late"

        @hookfit.hookimpl
        def batch_end(self, loop):
            loop.wrap_step(lambda step: step)

    with pytest.raises(RuntimeError, match=r"wrap_step\(\) must be called at configure or fit_start"):
        hookfit.Loop(lambda l, b: None, [1], plugins=[Late()]).fit()

    class Bad:
        name = "bad"

        @hookfit.hookimpl
        def configure(self, loop):
            loop.wrap_step(lambda step: None)

    with pytest.raises(TypeError, match=r"wrap_step: the wrapper returned None for train_step '.*<lambda>'"):
        hookfit.Loop(lambda l, b: None, [1], plugins=[Bad()]).fit()



def test_plugin_code_a_step_calls_is_blamed_on_the_plugin_and_the_step_named() -> None:
    """An error raised inside plugin code that the step calls (``loop.backward``, a managed
    optimizer's ``step()``) names the plugin and its function, and the step that called it;
    an error of the step's own code still names the step alone."""
    from hookfit.plugins.optim import Optim

    model = torch.nn.Linear(2, 1)

    def step(loop, batch):
        loop.backward(torch.tensor(1.0))  # no graph: torch refuses, inside optim's backward

    with pytest.raises(RuntimeError) as caught:
        hookfit.Loop(step, [0], model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                     plugins=[Optim()]).fit()
    note = " ".join(caught.value.__notes__)
    assert re.search(r"hookfit: raised by plugin 'optim' \([^)]*\) in \S+, called from step function "
                     r"'test_plugin_code_a_step_calls_is_blamed.*\.<locals>\.step'", note), note

    def own(loop, batch):
        raise KeyError("the step's own")

    with pytest.raises(KeyError) as caught:
        hookfit.Loop(own, [0], model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                     plugins=[Optim()]).fit()
    assert "raised in step function" in " ".join(caught.value.__notes__)


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
