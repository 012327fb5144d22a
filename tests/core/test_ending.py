"""hookfit.ending: how a run ends when something fails: exception then fit_end, every fit_end
implementation run, errors named after the plugin or step that raised, KeyboardInterrupt."""

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
