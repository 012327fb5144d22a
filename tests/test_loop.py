"""The core loop: event order, step outputs, modes, stopping and failure."""

from __future__ import annotations

import gc
import tracemalloc
from collections import OrderedDict

import pytest
import torch

import hookfit
from conftest import Recorder, spec_names


def per_batch(events: list[str]) -> list[str]:
    return events


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
    epoch = (
        ["epoch_start", "stage_start"] + batch * 2 + ["stage_end", "stage_start"]
        + batch + ["stage_end", "epoch_end"]
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

    hookfit.Loop(
        lambda loop, b: None, [1], val_step=valid, val_data=[1],
        model={"g": g, "d": d}, val_grad_mode="no_grad",
    ).fit()
    assert modes == [(False, False, False, False)]
    assert g.training is True and d.training is False


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
    state = hookfit.Loop(lambda loop, b: None, range(10), max_epochs=5, max_steps=13, plugins=[recorder]).fit()
    assert state.status == "completed" and state.step == 13 and state.epoch == 1
    assert state.stop_reason == "max_steps=13 reached"
    assert recorder.names().count("epoch_end") == 2


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


class Boom(Exception):
    pass


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


def test_keyboard_interrupt_is_interrupted_and_fit_end_runs(recorder: Recorder) -> None:
    def step(loop, b):
        raise KeyboardInterrupt

    loop = hookfit.Loop(step, [1], plugins=[recorder])
    with pytest.raises(KeyboardInterrupt):
        loop.fit()
    assert loop.state.status == "interrupted"
    assert recorder.names()[-1] == "fit_end" and "exception" not in recorder.names()


def test_a_loop_runs_once() -> None:
    loop = hookfit.Loop(lambda loop, b: None, [1])
    loop.fit()
    with pytest.raises(RuntimeError, match="already run"):
        loop.fit()


def test_every_hookspec_is_documented_and_fired() -> None:
    """A new event cannot land undocumented, or without the loop firing it somewhere that
    these runs cover (normal run with validation, a stop request, a failure)."""
    import ast
    from pathlib import Path

    source = Path(hookfit.hookspecs.__file__).read_text()
    declared = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and any(
            getattr(d, "id", None) == "hookspec" or getattr(getattr(d, "func", None), "id", None) == "hookspec"
            for d in node.decorator_list
        ):
            declared[node.name] = ast.get_docstring(node) or ""
    assert set(declared) == set(spec_names())
    for name, doc in declared.items():
        assert len(doc.split()) >= 15, f"hook {name!r} needs a docstring saying when it fires"

    fired: set[str] = set()
    rec = Recorder()
    hookfit.Loop(lambda l, b: {"x": 1}, [1], val_step=lambda l, b: None, val_data=[1], plugins=[rec]).fit()
    fired |= set(rec.names())

    rec = Recorder()

    class Stopper:
        @hookfit.hookimpl
        def batch_end(self, loop):
            loop.request_stop("test")

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hookfit.HookfitWarning)
        hookfit.Loop(lambda l, b: None, [1], plugins=[rec, Stopper()]).fit()
    fired |= set(rec.names())

    rec = Recorder()
    with pytest.raises(Boom):
        hookfit.Loop(lambda l, b: (_ for _ in ()).throw(Boom()), [1], plugins=[rec]).fit()
    fired |= set(rec.names())

    from hookfit.plugins.console import Console
    from hookfit.plugins.metrics import Metrics
    from hookfit.plugins.optim import Optim

    rec = Recorder(agree=True)
    model = torch.nn.Linear(1, 1)

    def optim_step(loop, x):
        loop.backward(model(x).sum())
        loop.optimizers.step()

    class TwoProcessesResumed:
        name = "two"

        @hookfit.hookimpl
        def configure(self, loop):
            loop.state.world_size = 2  # so that metrics asks for its sums to be reduced

        @hookfit.hookimpl
        def batch_start(self, loop):
            if (ask := loop.hooks.should_sync_gradients) is not None:  # as a distributed plugin does
                ask(loop)

        @hookfit.hookimpl
        def resume(self, loop):
            states = loop.plugin_states()
            states["recorder"] = {"anything": 1}
            loop.load_plugin_states(states, strict=False)
            return True

    hookfit.Loop(optim_step, [torch.ones(1)], optimizers=torch.optim.SGD(model.parameters()), resume="x",
                 plugins=[Optim(), Metrics(sync_every=1, log=False), Console(), TwoProcessesResumed(), rec]).fit()
    fired |= set(rec.names())
    assert fired == set(declared), f"never fired: {set(declared) - fired}"


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


def test_interrupter_leaves_signal_handlers_alone_off_the_main_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    import signal
    import threading

    monkeypatch.setenv("HOOKFIT_PLUGINS", "interrupter")
    before = signal.getsignal(signal.SIGINT)
    seen, states = [], []

    class Look:
        @hookfit.hookimpl
        def batch_end(self, loop):
            seen.append(signal.getsignal(signal.SIGINT))
            if loop.state.step == 2:
                loop.request_stop("from the worker thread's step")

    worker = threading.Thread(target=lambda: states.append(hookfit.Loop(lambda l, b: None, range(5), plugins=[Look()]).fit()))
    worker.start()
    worker.join(30)
    assert states[0].status == "interrupted" and states[0].stop_reason == "from the worker thread's step"
    assert seen and all(handler is before for handler in seen)


def test_a_run_never_changes_the_loops_configuration() -> None:
    """What plugins replace for a run (the model wrapped, the data sharded, managed
    optimizers) is the run's own: the Loop keeps what the user gave it."""
    model, data = torch.nn.Linear(1, 1), [torch.ones(1)] * 4
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []

    class Replacer:
        name = "replacer"

        @hookfit.hookimpl(tryfirst=True)
        def configure(self, loop):
            loop.model = torch.nn.Sequential(loop.model)
            loop.train_data = loop.train_data[:2]

        @hookfit.hookimpl
        def fit_start(self, loop):
            loop.optimizers = {"wrapped": loop.optimizers}

    def step(loop, batch):
        seen.append((type(loop.model).__name__, type(loop.optimizers).__name__, loop is loop_.run))

    loop_ = hookfit.Loop(step, data, model=model, optimizers=opt, plugins=[Replacer()])
    state = loop_.fit()
    assert seen == [("Sequential", "dict", True)] * 2 and state.step == 2
    assert loop_.model is model and loop_.train_data is data and loop_.optimizers is opt
    run = loop_.run
    assert isinstance(run, hookfit.Run) and run.state is state is loop_.state
    assert run.pm is not None and [n for n, _ in run.pm.list_name_plugin()] == ["replacer"]
    assert "backward" not in vars(run)  # the bound backward went with the run's end
