"""hookfit.dispatch: every way an event is called, checked against pluggy's own call
(``pm.hook.<event>(**kwargs)``) as the oracle: results, order, first result, both kinds of
wrapper, tracing, implementations registered mid-run; and the guarantees pluggy does not give
(every ``fit_end`` implementation runs, observers are contained) without changing pluggy's
objects."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

import hookfit
from hookfit import manager
from hookfit.dispatch import Dispatch

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
    pm = manager.PluginManager()
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


def test_events_nobody_implements_are_none_and_unknown_names_are_errors() -> None:
    dispatch = Dispatch(pm_of())
    assert dispatch.batch_end is None and dispatch.before_backward is None
    assert dispatch.call_all("fit_end", LOOP) == [] and dispatch.call_each("save_state", LOOP) == []
    with pytest.raises(AttributeError, match="no hookfit event named 'batch_ned'"):
        dispatch.batch_ned


# -- every implementation runs -------------------------------------------------------------

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
            result = yield
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


def test_call_plugin_calls_one_implementation_inside_the_wrappers() -> None:
    log: list = []
    pm = pm_of(*CONFIGS["both wrappers"](log))
    assert Dispatch(pm).call_plugin("before_optimizer_step", "b", LOOP, "sgd", None) == 4
    assert [entry for entry in log if entry[1] == "sgd"] == [("b", "sgd")]
    assert ("new-wrapper", "before") in log and ("old-wrapper", "after") in log
    assert Dispatch(pm).call_plugin("before_optimizer_step", "nobody", LOOP, "sgd", None) is None


# -- observers, and pluggy's objects left alone --------------------------------------------

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
