"""hookfit.ending: how a run ends when something fails: exception then fit_end, every fit_end
implementation run, errors named after the plugin or step that raised, KeyboardInterrupt."""

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
            assert loop.state.error is error  # while the run ends: the exception itself

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
    kept = loop.state.error  # once the run is over: a copy without its traceback
    assert type(kept) is Boom and kept is not error and kept.args == ("step exploded",)
    assert kept.__notes__ == error.__notes__ and kept.__traceback__ is None
    assert error.__traceback__ is not None  # what fit() raised keeps its frames, for a debugger


def test_a_note_an_exception_hook_adds_is_part_of_the_stop_reason() -> None:
    """What a plugin knows of the cause (a distributed run's rank that failed first, while this rank saw
    its connection closed) reaches loop.state.stop_reason, which run.jsonl and hookfit runs show."""
    class Cause:
        name = "cause"

        @hookfit.hookimpl
        def exception(self, error):
            error.add_note("hookfit distributed: rank 1 of 2 failed first: ValueError: bad")

    def step(loop, batch):
        raise RuntimeError("Connection closed by peer")

    loop = hookfit.Loop(step, [1], plugins=[Cause()])
    with pytest.raises(RuntimeError):
        loop.fit()
    assert loop.state.stop_reason == ("RuntimeError: Connection closed by peer (hookfit distributed: rank 1 of 2 "
                                      "failed first: ValueError: bad)")


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
    assert "plugin 'faulty'" in note and "hook 'batch_end'" in note and "(epoch 1, stage train, batch 2)" in note  # batch_idx 1: the second batch
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
def test_a_fit_end_error_is_the_status_the_renderers_and_loggers_after_it_write(tmp_path) -> None:
    """A plugin's fit_end raises in a run that completed: the console's end line, metrics.jsonl's and
    run.jsonl's all say failed (before, the trylast console and log had written completed)."""
    import io
    import json

    from hookfit.plugins.console import Console
    from hookfit.plugins.metrics import Metrics
    from hookfit.plugins.metrics_log import MetricsLog

    class Broken:
        name = "broken"

        @hookfit.hookimpl
        def fit_end(self):
            raise OSError("cannot close")

    out = io.StringIO()
    with pytest.raises(OSError, match="cannot close"):
        hookfit.Loop(lambda l, b: {"loss": torch.tensor(1.0)}, [1, 2], run_dir=tmp_path,
                     plugins=[Broken(), Metrics(), MetricsLog(), Console(stream=out)]).fit()
    ends = [json.loads(line) for name in ("metrics.jsonl", "run.jsonl")
            for line in (tmp_path / name).read_text().splitlines() if json.loads(line)["event"] == "end"]
    assert [end["status"] for end in ends] == ["failed", "failed"]
    assert "hookfit end status=failed" in out.getvalue(), out.getvalue()


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
@pytest.mark.parametrize("hook", ["fit_end", "results"])
def test_a_second_ctrl_c_while_the_run_ends_still_records_its_end_and_unlocks_its_folder(tmp_path, hook) -> None:
    """A notebook user's second Ctrl-C lands in a plugin's fit_end (a checkpoint waiting for its write) or
    results: fit() raises it, and the run's folder stayed locked by this very process (the next trial in the
    same run_dir refused: "in use by another live process"), its run.jsonl without an end (``running``)."""
    class Impatient:
        @hookfit.hookimpl
        def fit_start(self, loop) -> None:
            assert loop.run_dir == tmp_path  # a plugin that writes there: the run has its folder and its lock

        @hookfit.hookimpl(specname=hook)
        def ending(self) -> None:
            raise KeyboardInterrupt("second SIGINT: aborting")

    def step(loop, b):
        if b == 1:
            loop.request_stop("SIGINT")

    with pytest.raises(KeyboardInterrupt, match="second SIGINT"):
        hookfit.Loop(step, [0, 1, 2], run_dir=tmp_path, plugins=[Impatient()]).fit()
    lines = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    ends = [line for line in lines if line["event"] == "end"]
    assert [(end["status"], end["steps"]) for end in ends] == [("interrupted", 2)], ends
    again = hookfit.Loop(lambda loop, b: None, [0], run_dir=tmp_path).fit()  # the folder is free
    assert again.status == "completed"


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


@pytest.mark.fault
def test_a_failed_run_s_kept_state_keeps_what_failed_but_not_the_run() -> None:
    """A sweep that catches each failure and keeps the state (its table of outcomes): the
    state's error says what failed (class, message, notes, cause) without the traceback whose
    frames held the run, so the model, its optimizer and the step's loss are freed."""
    import weakref

    model = torch.nn.Linear(4, 4)
    alive = weakref.ref(model)

    def step(loop, batch):
        loss = loop.model(batch).square().mean()  # a local with its autograd graph
        try:
            raise ValueError("the inner cause")
        except ValueError as cause:
            raise Boom(f"diverged at loss {loss.item() > -1}") from cause

    loop = hookfit.Loop(step, [torch.ones(2, 4)], model=model, optimizers=torch.optim.Adam(model.parameters()),
                        disable=["console", "checkpoint"])
    with pytest.raises(Boom) as caught:
        loop.fit()
    assert caught.value.__traceback__ is not None and caught.value.__cause__.__traceback__ is not None
    raised_notes = list(caught.value.__notes__)
    state = loop.state
    del loop, model, caught
    gc.collect()
    assert alive() is None, "the failed run's state keeps its model alive"
    error = state.error
    assert state.status == "failed" and type(error) is Boom and str(error) == "diverged at loss True"
    assert error.__notes__ == raised_notes and any("step function" in note for note in error.__notes__)
    assert error.__traceback__ is None and error.__suppress_context__
    assert type(error.__cause__) is ValueError and error.__cause__.args == ("the inner cause",)
    assert error.__cause__.__traceback__ is None and error.__cause__ is error.__context__
    assert state.stop_reason == "Boom: diverged at loss True"


@pytest.mark.slow
@pytest.mark.fault
def test_a_kept_state_s_silenced_observers_keep_their_error_but_not_the_run() -> None:
    import weakref

    class Flaky:
        name = "flaky"
        observer = True

        @hookfit.hookimpl
        def batch_end(self, loop):
            raise RuntimeError(f"cannot draw batch {loop.state.batch_idx}")

    model = torch.nn.Linear(2, 2)
    alive = weakref.ref(model)
    loop = hookfit.Loop(lambda loop, b: None, [1], model=model, plugins=[Flaky()], disable=["console", "checkpoint"])
    with pytest.warns(hookfit.errors.ObserverWarning):
        state = loop.fit()
    del loop, model
    gc.collect()
    assert alive() is None, "a silenced observer's error keeps the run alive"
    [silenced] = state.silenced
    assert silenced.plugin == "flaky" and type(silenced.error) is RuntimeError
    assert str(silenced.error) == "cannot draw batch 0" and silenced.error.__traceback__ is None


def test_detached_copies_exceptions_that_cannot_be_built_again_from_their_args() -> None:
    from hookfit.ending import detached
    from hookfit.errors import ErrorCopy, StateMismatch

    def raised(error: BaseException) -> BaseException:
        try:
            raise error
        except BaseException as caught:
            return caught

    mismatch = raised(StateMismatch("2 plugins differ", ["a"], ["b"]))  # its __init__ takes three
    copy = detached(mismatch)
    assert type(copy) is StateMismatch and copy.args == mismatch.args and copy.__traceback__ is None
    assert (copy.detail, copy.missing, copy.extra) == ("2 plugins differ", ["a"], ["b"])

    class Fussy(Exception):
        def __new__(cls, code: int) -> "Fussy":  # cannot be made from its args
            if not isinstance(code, int):
                raise TypeError("code")
            return super().__new__(cls, code)

        def __init__(self, code: int) -> None:
            super().__init__(f"code {code}")

    fussy = raised(Fussy(3))
    fussy.add_note("a note")
    copy = detached(fussy)
    assert type(copy) is ErrorCopy and "Fussy: code 3" in str(copy) and copy.__notes__ == ["a note"]
    assert copy.__traceback__ is None

    group = raised(ExceptionGroup("two failed", [raised(ValueError("one")), raised(KeyError("two"))]))
    copy = detached(group)
    assert type(copy) is ExceptionGroup and copy.message == "two failed" and copy.__traceback__ is None
    assert [(type(e), e.args) for e in copy.exceptions] == [(ValueError, ("one",)), (KeyError, ("two",))]
    assert all(e.__traceback__ is None for e in copy.exceptions) and all(e.__traceback__ for e in group.exceptions)

    first, second = raised(ValueError("a")), raised(ValueError("b"))
    first.__context__, second.__context__ = second, first  # a chain that loops back
    copy = detached(first)
    assert copy.__context__.__context__ is copy and copy.__context__.args == ("b",)
    assert first.__traceback__ is not None  # the original is left as it was
