"""hookfit.dispatch: every way an event is called, checked against pluggy's own call
(``pm.hook.<event>(**kwargs)``) as the oracle: results, order, first result, both kinds of
wrapper, tracing, implementations registered mid-run; and the guarantees pluggy does not give
(every ``fit_end`` implementation runs, observers are contained) without changing pluggy's
objects."""

from __future__ import annotations

import io
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit import manager
from hookfit.dispatch import Dispatch
from hookfit.plugins.console import Console
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim

from conftest import saved_run

LOOP = object()  # the events' loop argument; the implementations here never look at it


def make(label: str, log: list, answer: Any = None, raises: BaseException | None = None,
         observer: bool = False, **opts: Any) -> Any:
    """A plugin implementing before_optimizer_step (taking a subset of its arguments, in
    another order), resume (first result) and fit_end."""

    class Plugin:
        name = label

        @hookfit.hookimpl(**opts)
        def before_optimizer_step(self, name, loop):
            log.append((label, name))
            if raises is not None:
                raise raises
            return answer

        @hookfit.hookimpl(**opts)
        def resume(self, source):
            log.append((label, source))
            return answer

        @hookfit.hookimpl(**opts)
        def fit_end(self, loop):
            log.append((label, "fit_end"))
            if raises is not None:
                raise raises

    Plugin.observer = observer
    return Plugin()


class NewWrapper:
    name = "new-wrapper"

    def __init__(self, log: list) -> None:
        self.log = log

    @hookfit.hookimpl(wrapper=True)
    def before_optimizer_step(self, name):
        self.log.append(("new-wrapper", "before"))
        result = yield
        self.log.append(("new-wrapper", "after"))
        return [*result, "wrapped"]

    @hookfit.hookimpl(wrapper=True)
    def fit_end(self):
        self.log.append(("new-wrapper", "before"))
        try:
            return (yield)
        finally:
            self.log.append(("new-wrapper", "after"))


class OldWrapper:
    name = "old-wrapper"

    def __init__(self, log: list) -> None:
        self.log = log

    @hookfit.hookimpl(hookwrapper=True)
    def before_optimizer_step(self):
        self.log.append(("old-wrapper", "before"))
        outcome = yield
        self.log.append(("old-wrapper", "after"))
        outcome.force_result(outcome.get_result() + ["forced"])

    @hookfit.hookimpl(hookwrapper=True)
    def fit_end(self):
        self.log.append(("old-wrapper", "before"))
        yield
        self.log.append(("old-wrapper", "after"))


def pm_of(*plugins: Any) -> manager.PluginManager:
    """A bare manager with these plugins, which also knows the events the optim plugin declares
    (``before_optimizer_step``, used below as an ordinary event with results)."""
    from hookfit.plugins.optim import hookspecs as optim_events

    pm = manager.PluginManager()
    pm.add_hookspecs(optim_events)
    for plugin in plugins:
        pm.register(plugin, name=plugin.name)
    return pm


def plain(log: list) -> list:
    return [make("a", log, answer=1), make("last", log, answer=2, trylast=True),
            make("none", log), make("first", log, answer=3, tryfirst=True), make("b", log, answer=4)]


CONFIGS = {
    "plain": lambda log: plain(log),
    "new-style wrapper": lambda log: plain(log) + [NewWrapper(log)],
    "old-style wrapper": lambda log: plain(log) + [OldWrapper(log)],
    "both wrappers": lambda log: [NewWrapper(log)] + plain(log) + [OldWrapper(log)],
    "one implementation": lambda log: [make("only", log, answer=7)],
}


def traced(pm: manager.PluginManager) -> tuple[list, Any]:
    calls: list = []
    undo = pm.add_hookcall_monitoring(
        lambda name, impls, kwargs: calls.append((name, [i.plugin_name for i in impls], dict(kwargs))),
        lambda outcome, name, impls, kwargs: calls.append(("after", name)),
    )
    return calls, undo


@pytest.mark.parametrize("tracing", [False, True], ids=["untraced", "traced"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_results_order_and_wrappers_equal_pluggys(config: str, tracing: bool) -> None:
    log: list = []
    pm = pm_of(*CONFIGS[config](log))
    trace, undo = traced(pm) if tracing else ([], None)
    expected = pm.hook.before_optimizer_step(loop=LOOP, name="sgd", optimizer=None)
    expected_log, expected_trace = log[:], trace[:]
    log.clear()
    trace.clear()
    dispatch = Dispatch(pm)
    assert dispatch.before_optimizer_step(LOOP, "sgd", None) == expected
    assert log == expected_log
    assert trace == expected_trace  # tracing sees the same call, with the same implementations
    if undo is not None:
        undo()


@pytest.mark.parametrize("config", list(CONFIGS))
def test_first_result_equals_pluggys(config: str) -> None:
    log: list = []
    pm = pm_of(*CONFIGS[config](log))
    expected = pm.hook.resume(loop=LOOP, source="x")
    expected_log = log[:]
    log.clear()
    assert Dispatch(pm).resume(LOOP, "x") == expected
    assert log == expected_log


def test_keyword_parameters_with_defaults_are_passed_as_pluggy_passes_them() -> None:
    seen: list = []

    class Defaults:
        name = "defaults"

        @hookfit.hookimpl
        def before_optimizer_step(self, loop, name="unset", optimizer="unset"):
            seen.append((name, optimizer))

    pm = pm_of(Defaults())
    pm.hook.before_optimizer_step(loop=LOOP, name="sgd", optimizer="opt")
    Dispatch(pm).before_optimizer_step(LOOP, "sgd", "opt")
    assert seen == [("sgd", "opt"), ("sgd", "opt")]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_an_event_fired_with_pluggys_keywords_gets_the_same_call(config: str) -> None:
    """``loop.hooks.<event>(loop=..., name=..., optimizer=...)``, as ``pm.hook.<event>`` is called, or
    mixed: the same answer and calls as in order, whatever implements it (one implementation was called
    as it is, and took the keywords, where several raised a TypeError naming an inner function)."""
    log: list = []
    pm = pm_of(*CONFIGS[config](log))
    expected = pm.hook.before_optimizer_step(loop=LOOP, name="sgd", optimizer=None)
    expected_log = log[:]
    for call in (lambda d: d.before_optimizer_step(loop=LOOP, name="sgd", optimizer=None),
                 lambda d: d.before_optimizer_step(LOOP, optimizer=None, name="sgd")):
        log.clear()
        assert call(Dispatch(pm)) == expected and log == expected_log
    log.clear()
    assert Dispatch(pm).resume(source="x", loop=LOOP) == pm.hook.resume(loop=LOOP, source="x")


@pytest.mark.bad_input
def test_an_event_fired_with_wrong_arguments_names_the_event_and_its_arguments() -> None:
    dispatch = Dispatch(pm_of(make("only", [])))
    with pytest.raises(TypeError, match=r"^loop.hooks.resume\(loop, source\) has no argument 'path'$"):
        dispatch.resume(loop=LOOP, path="x")
    with pytest.raises(TypeError, match=r"^loop.hooks.resume\(loop, source\) was not given 'source'$"):
        dispatch.resume(LOOP)
    with pytest.raises(TypeError, match=r"^loop.hooks.resume\(loop, source\) was given 'loop' twice"):
        dispatch.resume(LOOP, loop=LOOP, source="x")
    with pytest.raises(TypeError, match=r"^loop.hooks.resume\(loop, source\) takes 2 argument\(s\), 3 were"):
        dispatch.resume(LOOP, "x", "y")


def test_a_plugin_registered_or_removed_mid_run_is_followed() -> None:
    log: list = []
    pm = pm_of(make("a", log, answer=1))
    dispatch = Dispatch(pm)
    assert dispatch.before_optimizer_step(LOOP, "x", None) == [1]
    late = make("late", log, answer=2)
    pm.register(late, name="late")
    assert dispatch.before_optimizer_step(LOOP, "x", None) == pm.hook.before_optimizer_step(
        loop=LOOP, name="x", optimizer=None) == [2, 1]
    pm.unregister(late)
    assert dispatch.before_optimizer_step(LOOP, "x", None) == [1]
    trace, undo = traced(pm)  # monitoring switched on mid-run: pluggy's path from then on
    dispatch.before_optimizer_step(LOOP, "x", None)
    assert [c[0] for c in trace] == ["before_optimizer_step", "after"]
    undo()
    trace.clear()
    dispatch.before_optimizer_step(LOOP, "x", None)
    assert trace == []
    dispatch.close()


@pytest.mark.bad_input
def test_events_nobody_implements_are_none_and_unknown_names_are_errors() -> None:
    dispatch = Dispatch(pm_of())
    assert dispatch.batch_end is None and dispatch.before_backward is None
    assert dispatch.call_all("fit_end", LOOP) == [] and dispatch.call_each("save_state", LOOP) == []
    with pytest.raises(AttributeError, match="no hookfit event named 'batch_ned'"):
        dispatch.batch_ned


# -- every implementation runs -------------------------------------------------------------

@pytest.mark.fault
@pytest.mark.parametrize("tracing", [False, True], ids=["untraced", "traced"])
@pytest.mark.parametrize("wrappers", ["none", "new", "old", "both"])
def test_call_all_runs_every_implementation_when_one_raises(wrappers: str, tracing: bool) -> None:
    """The bug this module exists for: with a fit_end wrapper installed, pluggy's call stops
    at the first implementation that raises, and the others (a terminal restore) never run."""
    log: list = []
    plugins = [make("a", log), make("bad", log, raises=ValueError("bad one")), make("b", log),
               make("worse", log, raises=OSError("worse one"))]
    if wrappers in ("new", "both"):
        plugins.append(NewWrapper(log))
    if wrappers in ("old", "both"):
        plugins.append(OldWrapper(log))
    pm = pm_of(*plugins)
    trace, undo = traced(pm) if tracing else ([], None)
    errors = Dispatch(pm).call_all("fit_end", LOOP)
    assert {label for label, what in log if what == "fit_end"} == {"a", "bad", "b", "worse"}
    assert [(name, type(error)) for name, error in errors] == [("worse", OSError), ("bad", ValueError)]
    assert "hookfit: raised by plugin 'worse' in hook 'fit_end'" in errors[0][1].__notes__
    for wrapper in {"new": ["new-wrapper"], "old": ["old-wrapper"], "both": ["new-wrapper", "old-wrapper"]}.get(wrappers, []):
        assert (wrapper, "before") in log and (wrapper, "after") in log  # the wrappers saw one whole call
    if tracing:
        assert [c[0] for c in trace] == ["fit_end", "after"]
        undo()
    # pluggy's own call, for comparison, stops at the first error
    log.clear()
    with pytest.raises(OSError):
        pm.hook.fit_end(loop=LOOP)
    assert ("a", "fit_end") not in log


@pytest.mark.fault
@pytest.mark.parametrize("when", ["before its yield", "after its yield", "no yield"])
def test_call_all_runs_the_implementations_inside_a_wrapper_that_raises(when: str) -> None:
    log: list = []

    class Broken:
        name = "broken-wrapper"

        @hookfit.hookimpl(wrapper=True)
        def fit_end(self):
            if when == "before its yield":
                raise RuntimeError("wrapper broke")
            if when == "no yield":
                return None
            yield
            raise RuntimeError("wrapper broke late")

    if when == "no yield":  # a generator function that returns at once
        def fit_end(self):
            return
            yield  # noqa: unreachable - makes it a generator
        Broken.fit_end = hookfit.hookimpl(wrapper=True)(fit_end)

    pm = pm_of(make("a", log), make("b", log), Broken())
    errors = Dispatch(pm).call_all("fit_end", LOOP)
    assert {label for label, _ in log} == {"a", "b"}
    assert [name for name, _ in errors] == ["broken-wrapper"]


@pytest.mark.fault
def test_call_all_passes_keyboard_interrupt_through() -> None:
    log: list = []
    pm = pm_of(make("a", log), make("ctrl-c", log, raises=KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        Dispatch(pm).call_all("fit_end", LOOP)


# -- answers keyed by plugin ---------------------------------------------------------------

@pytest.mark.parametrize("config", ["plain", "new-style wrapper", "old-style wrapper"])
def test_call_each_names_each_answer_in_pluggys_order(config: str) -> None:
    log: list = []
    pm = pm_of(*CONFIGS[config](log))
    each = Dispatch(pm).call_each("before_optimizer_step", LOOP, "sgd", None)
    assert each == [("first", 3), ("b", 4), ("a", 1), ("last", 2)]  # "none" answered None
    assert [label for label, _ in log if label not in ("new-wrapper", "old-wrapper")] == [
        "first", "b", "none", "a", "last"]


@pytest.mark.fault
@pytest.mark.parametrize("tracing", [False, True], ids=["untraced", "traced"])
@pytest.mark.parametrize("config", ["plain", "new-style wrapper", "old-style wrapper", "both wrappers"])
def test_gather_names_every_answer_in_pluggys_order_and_runs_past_errors(config: str, tracing: bool) -> None:
    log: list = []
    plugins = CONFIGS[config](log)
    pm = pm_of(*plugins)
    trace, undo = traced(pm) if tracing else ([], None)
    answers, errors = Dispatch(pm).gather("before_optimizer_step", LOOP, "sgd", None)
    assert answers == [("first", 3), ("b", 4), ("a", 1), ("last", 2)] and errors == []
    if tracing:
        assert [c[0] for c in trace] == ["before_optimizer_step", "after"]
        undo()
    # the oracle: pluggy's own call, in the same order, without the names
    assert [a for _, a in answers] == [r for r in pm.hook.before_optimizer_step(loop=LOOP, name="sgd", optimizer=None)
                                       if r not in ("wrapped", "forced")]
    # an implementation that raises: the others still answer, its error comes back named
    pm.register(make("bad", log, raises=ValueError("no answer"), tryfirst=True), name="bad")
    log.clear()
    answers, errors = Dispatch(pm).gather("before_optimizer_step", LOOP, "sgd", None)
    assert answers == [("first", 3), ("b", 4), ("a", 1), ("last", 2)]
    assert [(name, type(error)) for name, error in errors] == [("bad", ValueError)]
    assert "hookfit: raised by plugin 'bad' in hook 'before_optimizer_step'" in errors[0][1].__notes__


def test_call_plugin_calls_one_implementation_inside_the_wrappers() -> None:
    log: list = []
    pm = pm_of(*CONFIGS["both wrappers"](log))
    assert Dispatch(pm).call_plugin("before_optimizer_step", "b", LOOP, "sgd", None) == 4
    assert [entry for entry in log if entry[1] == "sgd"] == [("b", "sgd")]
    assert ("new-wrapper", "before") in log and ("old-wrapper", "after") in log
    assert Dispatch(pm).call_plugin("before_optimizer_step", "nobody", LOOP, "sgd", None) is None


# -- observers, and pluggy's objects left alone --------------------------------------------

@pytest.mark.fault
@pytest.mark.parametrize("path", ["direct", "pluggy"])
def test_an_observer_that_raises_is_switched_off_and_the_call_goes_on(path: str) -> None:
    log: list = []
    plugins = [make("a", log, answer=1), make("watcher", log, raises=ValueError("cannot draw"), observer=True),
               make("b", log, answer=2)]
    if path == "pluggy":
        plugins.append(NewWrapper(log))
    pm = pm_of(*plugins)
    dispatch = Dispatch(pm)
    with pytest.warns(hookfit.ObserverWarning, match=r"'watcher'.*'before_optimizer_step'.*cannot draw"):
        result = dispatch.before_optimizer_step(LOOP, "sgd", None)
    assert result[:2] == [2, 1]
    assert pm.get_plugin("watcher") is None and [s.plugin for s in pm.silenced] == ["watcher"]
    log.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dispatch.before_optimizer_step(LOOP, "sgd", None)  # switched off: no second warning
    assert "watcher" not in {label for label, _ in log}


@pytest.mark.filterwarnings("ignore::pluggy.PluggyTeardownRaisedWarning")  # the old-style wrapper sees the error, as meant
def test_no_hook_implementation_is_changed_by_a_run() -> None:
    """Guards are calls in place of the registered functions, not changes to them: after a run
    with an observer, wrappers, tracing and a failing fit_end, every registered HookImpl still
    holds its plugin's own function."""
    log: list = []
    watcher = make("watcher", log, observer=True)
    plugins = [watcher, make("bad", log, raises=ValueError("x")), NewWrapper(log), OldWrapper(log)]
    pm = pm_of(*plugins)
    before = {(caller.name, i.plugin_name): i.function for caller in vars(pm.hook).values()
              for i in caller.get_hookimpls()}
    trace, undo = traced(pm)
    dispatch = Dispatch(pm)
    dispatch.call_all("fit_end", LOOP)
    with pytest.raises(ValueError):
        dispatch.before_optimizer_step(LOOP, "sgd", None)
    undo()
    after = {(caller.name, i.plugin_name): i.function for caller in vars(pm.hook).values()
             for i in caller.get_hookimpls()}
    assert after == before and all(after[key] is before[key] for key in after)
    assert all(not hasattr(f, "__wrapped__") for f in after.values())


# -- through a real run ---------------------------------------------------------------------


def ordered_plugins(log: list) -> list:
    def plugin(label: str, **opts):
        class P:
            name = label

            @hookfit.hookimpl(**opts)
            def batch_end(self, output, loop):  # argument order differs from the spec
                log.append((label, output))

        return P()

    return [plugin("last", trylast=True), plugin("a"), plugin("first", tryfirst=True), plugin("b")]


def test_direct_dispatch_order_equals_pluggys() -> None:
    log: list = []
    loop = hookfit.Loop(lambda loop, b: {"b": b}, [7], plugins=ordered_plugins(log))
    loop.fit()
    direct = [label for label, _ in log]
    log.clear()
    loop.run.pm.hook.batch_end(loop=loop, output={"b": 7}, batch=7, batch_idx=0)
    assert direct == [label for label, _ in log] == ["first", "b", "a", "last"]


def test_wrappers_go_through_pluggy() -> None:
    log: list = []

    class Wrapper:
        @hookfit.hookimpl(wrapper=True)
        def batch_end(self, batch_idx):
            log.append(("before", batch_idx))
            result = yield
            log.append(("after", batch_idx))
            return result

    loop = hookfit.Loop(lambda loop, b: None, [0], plugins=ordered_plugins(log) + [Wrapper()])
    loop.fit()
    assert log[0] == ("before", 0) and log[-1] == ("after", 0) and len(log) == 6


def test_tracing_switches_to_pluggys_call_path_and_back() -> None:
    traced: list = []
    log: list = []

    class Tracer:
        @hookfit.hookimpl
        def epoch_start(self, loop):
            self.undo = loop.pm.add_hookcall_monitoring(
                lambda name, impls, kwargs: traced.append(name), lambda *a: None
            )

        @hookfit.hookimpl
        def epoch_end(self, loop):
            self.undo()

    tracer = Tracer()
    loop = hookfit.Loop(lambda loop, b: None, [0, 1], plugins=ordered_plugins(log) + [tracer])
    loop.fit()
    assert traced.count("batch_end") == 2 and traced.count("batch_start") == 0
    assert loop.run.pm.monitors == 0


def test_plugin_registered_mid_run_is_called_from_then_on() -> None:
    late: list = []

    class Late:
        @hookfit.hookimpl
        def batch_end(self, batch_idx):
            late.append(batch_idx)

    class Registrar:
        @hookfit.hookimpl
        def batch_start(self, loop, batch_idx):
            if batch_idx == 2:
                loop.pm.register(Late(), name="late")

    hookfit.Loop(lambda loop, b: None, range(5), plugins=[Registrar()]).fit()
    assert late == [2, 3, 4]


def test_events_without_implementations_resolve_to_nothing() -> None:
    loop = hookfit.Loop(lambda loop, b: None, [1])
    loop.fit()
    dispatch = Dispatch(loop.run.pm)
    assert (dispatch.batch_start, dispatch.step_output, dispatch.batch_end, dispatch.should_stop) == (None,) * 4
    assert dispatch.call_each("should_stop", loop.run) == []


def test_loop_hooks_resolve_any_event_once_and_again_after_changes() -> None:
    seen = []

    class Listener:
        @hookfit.hookimpl
        def before_backward(self, loss):
            seen.append(loss)
            return "heard"

    class Probe:
        @hookfit.hookimpl
        def fit_start(self, loop):
            assert loop.hooks.before_backward is None  # nothing implements it: costs nothing
            with pytest.raises(AttributeError, match="no hookfit event named 'before_backwards'"):
                loop.hooks.before_backwards
            loop.pm.register(Listener(), name="listener")
            assert loop.hooks.before_backward(loop, 1.5) == ["heard"]  # pluggy's result semantics

    hookfit.Loop(lambda loop, b: None, [1], plugins=[Probe()]).fit()
    assert seen == [1.5]



# -- observers in a real run: faults stay inside them; participants still fail the run ------


def make_observer(fail_in: str):
    class Flaky:
        name = "flaky"
        observer = True

        def __init__(self) -> None:
            self.calls = 0

        @hookfit.hookimpl
        def batch_end(self, batch_idx):
            self.calls += 1
            if fail_in == "batch_end":
                raise ValueError(f"cannot draw batch {batch_idx}")

        @hookfit.hookimpl
        def fit_end(self):
            if fail_in == "fit_end":
                raise OSError("disk full while writing the summary")

    return Flaky()


@pytest.mark.fault
def test_an_observer_failing_every_batch_warns_once_and_the_run_completes() -> None:
    observer = make_observer("batch_end")
    out = io.StringIO()
    with pytest.warns(hookfit.ObserverWarning) as caught:
        loop = hookfit.Loop(lambda l, b: {"loss": torch.tensor(1.0)}, range(1000),
                            plugins=[observer, Metrics(), Console(stream=out)])
        state = loop.fit()
    assert state.status == "completed" and state.step == 1000
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "observer plugin 'flaky'" in message and "hook 'batch_end'" in message
    assert "ValueError: cannot draw batch 0" in message
    assert observer.calls == 1  # switched off after the first failure
    assert [(s.plugin, s.hook) for s in state.silenced] == [("flaky", "batch_end")]
    assert 'hookfit silenced plugin=flaky hook=batch_end error="ValueError: cannot draw batch 0"' in out.getvalue()


@pytest.mark.fault
@pytest.mark.parametrize("event", ["batch_start", "step_output", "batch_end", "after_batch", "after_backward"])
def test_an_observer_switched_off_mid_call_leaves_the_others_their_call(event: str) -> None:
    """An observer that raises in a handler-list event is switched off during that call: the plugin after
    it still gets the call (the list a call iterates is never changed under it; each of the 18 calls
    reached the counter, where before the batch of the failure missed it, and the console said the
    metrics' epoch was partial)."""
    calls: list[int] = []

    def count(self, loop):
        calls.append(loop.state.step)

    def fail(self, loop):
        if loop.state.step >= 2:
            raise OSError("cannot log")

    first = type("Failing", (), {"name": "failing", "observer": True, event: hookfit.hookimpl(fail)})()
    then = type("Counter", (), {"name": "counter", event: hookfit.hookimpl(count)})()
    model = torch.nn.Linear(1, 1)

    def step(loop, batch):
        loss = model(torch.ones(1, 1)).sum()
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return loss

    with pytest.warns(hookfit.ObserverWarning, match="'failing'"):
        state = hookfit.Loop(step, range(6), model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                             max_epochs=3, plugins=[then, first, Optim()]).fit()  # (the last given is called first)
    assert state.status == "completed" and [s.plugin for s in state.silenced] == ["failing"]
    assert len(calls) == 18


def test_batch_events_leaves_out_the_per_batch_events_a_plugin_does_not_name() -> None:
    calls: list[str] = []

    class Sometimes:
        name = "sometimes"

        def batch_events(self, loop):
            return ["batch_end"]

        @hookfit.hookimpl
        def batch_start(self):
            calls.append("batch_start")

        @hookfit.hookimpl
        def batch_end(self):
            calls.append("batch_end")

    hookfit.Loop(lambda l, b: None, [1, 2], plugins=[Sometimes()]).fit()
    assert calls == ["batch_end", "batch_end"]


class Done:
    """Takes part in batch_end until its state says it is done; that state comes back on resume."""

    name = "done"

    def __init__(self) -> None:
        self.done, self.calls = False, 0

    def batch_events(self, loop):
        return () if self.done else ("batch_end",)

    @hookfit.hookimpl
    def batch_end(self):
        self.calls += 1

    @hookfit.hookimpl
    def load_state(self, state):
        self.done = state["done"]

    @hookfit.hookimpl
    def resume(self, loop, source):
        loop.load_plugin_states({"done": {"done": True}})
        loop.load_state_dict(saved_run(1, 2, 0))
        return "ckpt.pt"


def test_batch_events_is_asked_again_after_the_resume_so_restored_state_counts() -> None:
    """The answer was asked at configure only, before load_state: a plugin whose restored state left it out
    of batch_end still got every batch of the resumed run (2 here)."""
    fresh = Done()
    hookfit.Loop(lambda l, b: None, [1, 2], plugins=[fresh], max_epochs=2).fit()
    resumed = Done()
    state = hookfit.Loop(lambda l, b: None, [1, 2], plugins=[resumed], max_epochs=2, resume="x").fit()
    assert fresh.calls == 4 and state.step == 4 and state.resumed_from is not None
    assert resumed.done and resumed.calls == 0


@pytest.mark.bad_input
def test_a_run_refused_before_fit_start_still_gives_every_plugin_its_fit_end() -> None:
    """As hookspecs.fit_end says: every run that fired configure ends with fit_end, one refused before
    fit_start (a misspelt batch_events answer) too, so what configure set up is released."""
    seen: list[str] = []

    class Opener:
        name = "opener"

        @hookfit.hookimpl
        def configure(self):
            seen.append("configure")

        @hookfit.hookimpl
        def fit_start(self):
            seen.append("fit_start")

        @hookfit.hookimpl
        def fit_end(self, loop):
            seen.append(f"fit_end {loop.state.status}")

    class Misspelt:
        name = "misspelt"

        def batch_events(self, loop):
            return ("batch_ends",)

        @hookfit.hookimpl
        def batch_end(self):
            pass

    with pytest.raises(hookfit.PluginError, match="plugin 'misspelt'"):
        hookfit.Loop(lambda l, b: None, [1], plugins=[Opener(), Misspelt()]).fit()
    assert seen == ["configure", "fit_end failed"]


@pytest.mark.bad_input
@pytest.mark.parametrize("answer, match", [
    (("batch_ends",), r"plugin 'asks' .*batch_events\(\) answered 'batch_ends', not a per-batch event.*"
                      r"batch_start, step_output, batch_end, after_batch.*Did you mean 'batch_end'\?"),
    (("should_stop",), r"answered 'should_stop', not a per-batch event.*should_stop and the other events"),
    ("batch_end", r"batch_events\(\) answered a str, not a collection of event names"),
    (KeyError("every_n"), r"every_n"),
])
def test_a_batch_events_answer_that_names_no_per_batch_event_is_an_error_naming_the_plugin(
        answer: Any, match: str) -> None:
    """A misspelt answer left batch_end out of the run without a word, an answer naming should_stop
    changed nothing, and an error in batch_events named no plugin."""

    class Asks:
        name = "asks"

        def batch_events(self, loop):
            if isinstance(answer, Exception):
                raise answer
            return answer

        @hookfit.hookimpl
        def batch_end(self):
            pass

    with pytest.raises(Exception, match=match) as caught:
        hookfit.Loop(lambda l, b: None, [1], plugins=[Asks()]).fit()
    assert "plugin 'asks'" in str(caught.value) + " ".join(getattr(caught.value, "__notes__", []))


@pytest.mark.fault
def test_an_observer_failing_in_fit_end_does_not_fail_the_run() -> None:
    with pytest.warns(hookfit.ObserverWarning, match=r"'flaky'.*'fit_end'.*disk full"):
        state = hookfit.Loop(lambda l, b: None, [1, 2], plugins=[make_observer("fit_end")]).fit()
    assert state.status == "completed" and state.silenced[0].hook == "fit_end"


@pytest.mark.fault
@pytest.mark.parametrize("fails", [False, True])
def test_an_observer_switched_off_still_gets_fit_end_once_to_release_what_it_holds(fails: bool) -> None:
    """A thread an observer starts at fit_start and stops at fit_end is stopped though the observer
    was switched off mid-run, whether the run completed or failed; fit_end's own error is one more
    warning naming it, and the run's outcome is the run's."""
    import threading

    class Uploader:
        name = "uploader"
        observer = True

        def __init__(self) -> None:
            self.ends: list[str] = []
            self.done = threading.Event()

        @hookfit.hookimpl
        def fit_start(self):
            self.thread = threading.Thread(target=self.done.wait, daemon=True)
            self.thread.start()

        @hookfit.hookimpl
        def batch_end(self):
            raise OSError("upload failed")

        @hookfit.hookimpl
        def fit_end(self, loop):
            self.ends.append(loop.state.status)
            self.done.set()
            self.thread.join()
            raise RuntimeError("cannot flush")

    def step(loop, batch):
        if fails and batch == 2:
            raise ValueError("bad batch")

    uploader = Uploader()
    with pytest.warns(hookfit.ObserverWarning) as caught:
        loop = hookfit.Loop(step, [1, 2, 3], plugins=[uploader])
        if fails:
            with pytest.raises(ValueError, match="bad batch"):
                loop.fit()
        else:
            loop.fit()
    assert uploader.ends == ["failed" if fails else "completed"] and not uploader.thread.is_alive()
    assert loop.state.status == uploader.ends[0]
    assert [(s.plugin, s.hook) for s in loop.state.silenced] == [("uploader", "batch_end")]
    assert len(caught) == 2 and re.fullmatch(r"observer plugin 'uploader' \(.*Uploader, given to Loop\), switched off "
                                             r"earlier, failed in hook 'fit_end' too: RuntimeError: cannot flush",
                                             str(caught[1].message))


@pytest.mark.fault
def test_an_observer_switched_off_in_fit_end_gets_it_once() -> None:
    observer = make_observer("fit_end")
    ends: list[int] = []
    observer.fit_end = hookfit.hookimpl(lambda: (ends.append(1), 1 / 0))  # type: ignore[method-assign]
    with pytest.warns(hookfit.ObserverWarning, match="'fit_end'"):
        state = hookfit.Loop(lambda l, b: None, [1], plugins=[observer]).fit()
    assert ends == [1] and state.silenced[0].hook == "fit_end"


@pytest.mark.fault
def test_an_observer_switched_off_gets_fit_end_by_its_specname_and_one_switched_off_inside_fit_end_once(
        tmp_path: Path) -> None:
    """An observer whose fit_end is registered under another name (``specname``) gets it; one switched
    off inside fit_end (its checkpoint state refused by the checkpoint's final save there) gets it once."""
    from hookfit.plugins.checkpoint import Checkpoint

    class Named:
        name, observer = "named", True

        def __init__(self) -> None:
            self.released = 0

        @hookfit.hookimpl
        def batch_end(self):
            raise OSError("off")

        @hookfit.hookimpl(specname="fit_end")
        def release(self):
            self.released += 1

    class Refused:
        name, observer = "refused", True

        def __init__(self) -> None:
            self.ends = 0

        @hookfit.hookimpl
        def save_state(self):
            return {"x": object()}

        @hookfit.hookimpl
        def fit_end(self):
            self.ends += 1

    model = torch.nn.Linear(3, 1)
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(5)]
    named, refused = Named(), Refused()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = hookfit.Loop(lambda l, b: {"loss": torch.nn.functional.mse_loss(l.model(b[0]), b[1])}, data,
                             model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1), max_steps=2,
                             run_dir=tmp_path, plugins=[Optim(), Checkpoint(), named, refused]).fit()
    assert [s.plugin for s in state.silenced] == ["named", "refused"]
    assert (named.released, refused.ends) == (1, 1)


@pytest.mark.fault
def test_a_plugin_that_takes_part_still_fails_the_run() -> None:
    class Participant:
        name = "participant"

        @hookfit.hookimpl
        def batch_end(self):
            raise ValueError("participant broke")

    with warnings.catch_warnings():
        warnings.simplefilter("error", hookfit.ObserverWarning)
        with pytest.raises(ValueError, match="participant broke") as info:
            hookfit.Loop(lambda l, b: None, [1], plugins=[Participant()]).fit()
    assert "plugin 'participant'" in " ".join(info.value.__notes__)


def test_builtin_renderers_are_observers() -> None:
    from hookfit.plugins.tui import TuiRenderer

    assert Console.observer is True and TuiRenderer.observer is True
    from hookfit.plugins.optim import Optim

    assert getattr(Optim, "observer", False) is False and getattr(Metrics, "observer", False) is False


@pytest.mark.fault
def test_isolation_also_holds_on_pluggys_call_path() -> None:
    class Logger:
        name = "logger"
        observer = True
        epochs = 0

        @hookfit.hookimpl
        def epoch_end(self, epoch):
            Logger.epochs += 1
            raise RuntimeError("log server unreachable")

    with pytest.warns(hookfit.ObserverWarning, match="'logger'.*'epoch_end'.*log server unreachable"):
        state = hookfit.Loop(lambda l, b: None, [1], max_epochs=3, plugins=[Logger()]).fit()
    assert state.status == "completed" and Logger.epochs == 1



def test_a_fit_end_error_raised_in_an_event_another_plugin_fires_there_is_blamed_on_its_implementation() -> None:
    """fit_end's guard calls each implementation on its own: an error raised by plugin B's
    implementation of an event that plugin A fires from its fit_end names B, called from A."""

    class Specs:
        @hookfit.hookspec
        def tidy(self, loop: Any) -> None:
            """Fired by 'fires' from its fit_end."""

    class Fires:
        name = "fires"
        hookspecs = Specs

        @hookfit.hookimpl
        def fit_end(self, loop: Any) -> None:
            loop.hooks.tidy(loop)

    class Raises:
        name = "raises"

        @hookfit.hookimpl
        def tidy(self, loop: Any) -> None:
            raise LookupError("tidy failed")

    with pytest.raises(LookupError, match="tidy failed") as caught:
        hookfit.Loop(lambda loop, b: None, [1], plugins=[Fires(), Raises()]).fit()
    notes = " ".join(getattr(caught.value, "__notes__", []))
    assert re.search(r"raised by plugin 'raises' .* in hook 'tidy', called from plugin 'fires' .* in its hook "
                     r"'fit_end'", notes), notes
