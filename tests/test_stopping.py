"""Stopping is core state: honoured at the next boundary, whoever asks, from any thread, with
no plugin needed; several processes agree through ``agree_stop``."""

from __future__ import annotations

import threading

import pytest
import torch

import hookfit
from conftest import Recorder


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
    assert names[-3:] == [event, "stop_requested", "fit_end"]
    assert names.count("epoch_end") == (2 if event == "epoch_end" else epoch)
    assert names.count("batch_end") == batches_run + 2 * names.count("epoch_end")  # + validation batches


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


def test_a_bad_reason_is_refused() -> None:
    def step(loop, b):
        loop.request_stop(3)

    with pytest.raises(TypeError, match="reason must be a string, got int"):
        hookfit.Loop(step, [1]).fit()


def test_loop_request_stop_outside_a_run_is_an_error() -> None:
    loop = hookfit.Loop(lambda l, b: None, [1])
    with pytest.raises(RuntimeError, match="needs a running loop"):
        loop.request_stop("too early")
    loop.fit()
    with pytest.raises(RuntimeError, match="needs a running loop"):
        loop.request_stop("too late")


# -- agreement between processes -----------------------------------------------------------

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


def test_agree_stop_with_a_wrong_answer_names_the_plugin() -> None:
    class Wrong:
        name = "wrong"

        @hookfit.hookimpl
        def agree_stop(self, loop, request, boundary):
            return "yes"

    with pytest.raises(TypeError, match=r"agree_stop must return a StopRequest, False or None.*wrong"):
        hookfit.Loop(lambda l, b: None, [1], plugins=[Wrong()]).fit()
