"""hookfit.stopping: a stop asked by should_stop, request_stop (any thread) or a rule, honoured at the
next boundary; who asked; agree_stop across processes."""

from __future__ import annotations

import gc
import json
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


@pytest.mark.bad_input
def test_a_stop_asked_in_fit_end_says_the_run_has_ended_not_call_it_during_fit() -> None:
    """fit_end is during fit(): "call it during fit()" misled; the message says the run ended, and how."""

    class Late:
        name = "late"

        @hookfit.hookimpl
        def fit_end(self, loop):
            loop.request_stop("too late", complete=True)

    with pytest.raises(RuntimeError, match=r"this run has ended \(completed\): in fit_end or later a stop changes"):
        hookfit.Loop(lambda l, b: None, [1], plugins=[Late()]).fit()


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


def stopped_from_a_thread(reason: str, **how: object) -> tuple[object, object]:
    """A run whose step waits at its third batch while another thread asks ``Loop.request_stop(reason, **how)``:
    the run's state and the request the thread got."""
    started, release, asked = threading.Event(), threading.Event(), []

    def step(loop, b):
        if b == 2:
            started.set()
            assert release.wait(30)
        return None

    loop = hookfit.Loop(step, range(100))
    asker = threading.Thread(target=lambda: (started.wait(30), asked.append(loop.request_stop(reason, **how)),
                                             release.set()))
    asker.start()
    state = loop.fit()
    asker.join(30)
    (request,) = asked
    return state, request


def test_a_request_from_another_thread_is_honoured_after_the_current_batch() -> None:
    state, _ = stopped_from_a_thread("from a thread", by="a scheduler")
    assert (state.status, state.step, state.stop_reason, state.stopped_by) == (
        "interrupted", 3, "from a thread", "a scheduler")


class FailsToStop:
    """A participant whose ``stop_requested`` raises."""

    name = "listener"

    @hookfit.hookimpl
    def stop_requested(self, request):
        raise RuntimeError(f"cannot stop for {request.reason}")


@pytest.mark.fault
def test_a_participant_failing_at_a_stop_asked_from_another_thread_fails_the_run_naming_it() -> None:
    """Its stop_requested runs on the thread that asked (a watchdog's, a dashboard's): the asker gets
    its request; the run fails at the next boundary with the error, naming the plugin and the hook."""
    started, release, asked = threading.Event(), threading.Event(), []

    def step(loop, b):
        if b == 2:
            started.set()
            assert release.wait(30)

    def ask() -> None:
        started.wait(30)
        try:
            asked.append(loop.request_stop("watchdog"))
        except BaseException as error:  # (the test says so, not the thread's excepthook)
            asked.append(error)
        release.set()

    loop = hookfit.Loop(step, range(100), plugins=[FailsToStop()])
    asker = threading.Thread(target=ask)
    asker.start()
    with pytest.raises(RuntimeError, match="cannot stop for watchdog") as failed:
        loop.fit()
    asker.join(30)
    assert [type(a).__name__ for a in asked] == ["StopRequest"]
    assert (loop.state.status, loop.state.step) == ("failed", 3)
    assert "plugin 'listener'" in " ".join(failed.value.__notes__) and "'stop_requested'" in " ".join(
        failed.value.__notes__)


@pytest.mark.fault
def test_a_participant_failing_at_a_stop_asked_from_another_thread_is_said_when_the_run_fails_first() -> None:
    """The step fails before the boundary that would raise the kept error: the run fails with the step's
    error, and the participant's is one more warning naming its hook, never lost."""

    def step(loop, b):
        if b == 2:
            asker = threading.Thread(target=lambda: loop.request_stop("watchdog"))
            asker.start()
            asker.join(30)
            raise ValueError("step fails at batch 2")

    loop = hookfit.Loop(step, range(5), plugins=[FailsToStop()])
    with pytest.warns(hookfit.HookfitWarning, match="stop_requested failed on the thread that asked for a stop, "
                                                    "before the run failed: RuntimeError: cannot stop for watchdog "
                                                    r"\(.*plugin 'listener'"):
        with pytest.raises(ValueError, match="step fails at batch 2"):
            loop.fit()
    assert loop.state.status == "failed"


@pytest.mark.fault
def test_a_kept_stop_requested_error_no_boundary_raised_fails_the_run_as_any_failure_does() -> None:
    """A stop no boundary takes (``agree_stop`` answers False): the participant's error kept from the asking thread
    fails the run at its end, as a failure inside it would: the ``exception`` event told, the note naming the
    plugin and the hook."""
    told: list[str] = []

    class Refuses:
        name = "refuses"

        @hookfit.hookimpl
        def agree_stop(self):
            return False

        @hookfit.hookimpl
        def exception(self, error):
            told.append(str(error))

    def step(loop, b):
        if b == 3:
            asker = threading.Thread(target=lambda: loop.request_stop("watchdog"))
            asker.start()
            asker.join(30)

    loop = hookfit.Loop(step, range(5), plugins=[FailsToStop(), Refuses()])
    with pytest.raises(RuntimeError, match="cannot stop for watchdog") as failed:
        loop.fit()
    assert loop.state.status == "failed" and told == ["cannot stop for watchdog"]
    assert "plugin 'listener'" in " ".join(failed.value.__notes__)


@pytest.mark.fault
def test_a_second_ctrl_c_in_the_exception_hook_told_of_a_kept_error_still_ends_the_run(tmp_path) -> None:
    """The kept ``stop_requested`` error fails the run at its end; an ``exception`` implementation told of it is
    where a second Ctrl-C lands: fit() raises it, and still ``fit_end`` fires, run.jsonl gets its end line
    (failed, by the kept error) and the folder is unlocked (the next trial in the same run_dir starts)."""
    ended: list[str] = []

    class Impatient:
        name = "impatient"

        @hookfit.hookimpl
        def agree_stop(self):
            return False  # no boundary takes the stop: the error stays kept until the run's end

        @hookfit.hookimpl
        def fit_start(self, loop) -> None:
            assert loop.run_dir == tmp_path  # the run has its folder and its lock

        @hookfit.hookimpl
        def exception(self, error):
            raise KeyboardInterrupt("second SIGINT: aborting")

        @hookfit.hookimpl
        def fit_end(self, loop):
            ended.append(loop.state.status)

    def step(loop, b):
        if b == 3:
            asker = threading.Thread(target=lambda: loop.request_stop("watchdog"))
            asker.start()
            asker.join(30)

    loop = hookfit.Loop(step, range(5), run_dir=tmp_path, plugins=[FailsToStop(), Impatient()])
    with pytest.raises(KeyboardInterrupt, match="second SIGINT"):
        loop.fit()
    assert ended == ["failed"]
    lines = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    ends = [line for line in lines if line["event"] == "end"]
    assert [(end["status"], end["steps"]) for end in ends] == [("failed", 5)], ends
    assert "cannot stop for watchdog" in ends[0]["reason"], ends
    again = hookfit.Loop(lambda loop, b: None, [0], run_dir=tmp_path).fit()  # the folder is free
    assert again.status == "completed"


@pytest.mark.fault
def test_a_boundary_waits_for_the_asking_thread_s_listeners_before_it_stops() -> None:
    """The loop reaches its boundary while the participant's ``stop_requested`` still runs on the thread that
    asked: it waits for it, so the error it then raises fails the run (not lost with the run "interrupted")."""
    import sys
    import time

    asked = threading.Event()
    loop_thread = threading.get_ident()

    class Slow(FailsToStop):
        @hookfit.hookimpl
        def stop_requested(self, request):
            asked.set()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # until the loop's thread waits at the boundary for this listener
                frame = sys._current_frames().get(loop_thread)
                while frame is not None and frame.f_code.co_name != "kept":
                    frame = frame.f_back
                if frame is not None:
                    break
                time.sleep(0.001)
            raise RuntimeError(f"cannot stop for {request.reason}")

    def step(loop, b):
        if b == 2:
            threading.Thread(target=lambda: loop.request_stop("watchdog"), daemon=True).start()
            assert asked.wait(30)

    loop = hookfit.Loop(step, range(5), plugins=[Slow()])
    with pytest.raises(RuntimeError, match="cannot stop for watchdog"):
        loop.fit()
    assert loop.state.status == "failed"


@pytest.mark.parametrize("how", [{"ends_process": True}, {"complete": True}])
def test_a_request_from_another_thread_says_how_as_one_from_the_run_does(how: dict[str, bool]) -> None:
    """``Loop.request_stop`` takes ``Run.request_stop``'s ``complete`` and ``ends_process``: a scheduler's
    thread that ends the process afterwards must not leave a persistent dashboard holding it."""
    state, request = stopped_from_a_thread("preempted", **how)
    assert (request.ends_process, request.complete) == (how.get("ends_process", False), how.get("complete", False))
    assert (state.status, state.step) == ("completed" if how.get("complete") else "interrupted", 3)


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
                                             "stage_start", "batch", "batches_end", "stage_end", "epoch_end"]


@pytest.mark.bad_input
def test_agree_stop_with_a_wrong_answer_names_the_plugin() -> None:
    class Wrong:
        name = "wrong"

        @hookfit.hookimpl
        def agree_stop(self, loop, request, boundary):
            return "yes"

    with pytest.raises(TypeError, match=r"agree_stop must return a StopRequest, False or None.*wrong"):
        hookfit.Loop(lambda l, b: None, [1], plugins=[Wrong()]).fit()


def test_a_should_stop_answer_may_be_a_whole_stop_request_that_ends_the_run_completed() -> None:
    """A per-batch rule reached ends the run completed, as request_stop(complete=True) does; its
    reason is kept, the plugin named when the request names nobody; an interruption answered
    beside it keeps the run interrupted."""
    def rule(name: str, answer: object) -> object:
        class Rule:
            @hookfit.hookimpl
            def should_stop(self, loop):
                return answer if loop.state.step >= 2 else None
        plugin = Rule()
        plugin.name = name
        return plugin

    target = hookfit.payloads.StopRequest("loss under 0.01", complete=True)
    state = hookfit.Loop(lambda loop, b: None, range(5), plugins=[rule("target", target)]).fit()
    assert (state.status, state.step, state.stop_reason, state.stopped_by) == (
        "completed", 2, "loss under 0.01", "target")
    named = hookfit.payloads.StopRequest("budget", by="the budget", complete=True)
    state = hookfit.Loop(lambda loop, b: None, range(5), plugins=[rule("target", target), rule("budget", named)]).fit()
    assert (state.status, state.stopped_by) == ("completed", "the budget, target")
    assert sorted(state.stop_reason.split("; ")) == ["budget", "loss under 0.01"]
    state = hookfit.Loop(lambda loop, b: None, range(5), plugins=[rule("target", target), rule("cut", "enough")]).fit()
    assert (state.status, state.step) == ("interrupted", 2)
    assert sorted(state.stop_reason.split("; ")) == ["enough", "loss under 0.01"]


@pytest.mark.parametrize("at, max_steps, per_epoch, left", [
    (dict(epoch=1, step=8, batch=4), 8, 4, True),  # the last training batch: stage_end, validation, epoch_end
    (dict(epoch=1, step=8, batch=4, stage="valid"), 8, 4, True),  # inside the epoch's validation
    (dict(epoch=1, step=6, batch=2, val_due=True), 6, 4, True),  # a val_every_n_steps validation due
    (dict(epoch=1, step=8, batch=4), 8, None, True),  # no length: the loop draws a batch to know
    (dict(epoch=1, step=7, batch=3), 7, 4, False),  # inside the epoch: the rest of it is a longer run's
    (dict(epoch=2, step=8, batch=0), 8, 4, False),  # the epoch's end done
    (dict(epoch=1, step=8, batch=4, val_due=True), 6, 4, False),  # past max_steps: lowered bounds
    (dict(epoch=1, step=8, batch=4), None, 4, False),  # no step budget
])
def test_what_is_left_of_an_epoch_at_max_steps_is_not_nothing_left(at: dict, max_steps, per_epoch, left: bool) -> None:
    from hookfit.position import Position
    from hookfit.stopping import epoch_left, nothing_left

    position = Position(**at)
    assert epoch_left(position, max_steps, per_epoch) is left
    said = nothing_left("a.pt", position, max_steps, None, per_epoch)
    assert (said is None) is (left or max_steps is None)
    assert said is None or f"(it is at step {position.step}, and max_steps={max_steps})" in said
