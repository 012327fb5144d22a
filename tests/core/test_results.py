"""The ``results`` event: what plugins report when a run is over, merged by the core into
``loop.state.results`` (read-only), which ``fit()`` and ``validate()`` return; asked after
``fit_end`` in every outcome; keys have one owner."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

import hookfit
from conftest import StopAfter
from hookfit.testing import Recorder


class Reports:
    """Answers ``results`` with ``answer`` (a callable of the run, or a value), recording the
    status it saw and whether ``fit_end`` had run."""

    def __init__(self, name: str, answer: Any) -> None:
        self.name = name
        self.answer = answer
        self.ended = False
        self.saw: list[tuple[str, bool]] = []

    @hookfit.hookimpl
    def fit_end(self) -> None:
        self.ended = True

    @hookfit.hookimpl
    def results(self, loop: Any) -> Any:
        self.saw.append((loop.state.status, self.ended))
        return self.answer(loop) if callable(self.answer) else self.answer


def step(loop: Any, batch: Any) -> Any:
    return {"loss": float(batch)}


def test_the_answers_are_merged_into_what_fit_returns_read_only() -> None:
    a = Reports("a", lambda loop: {"steps": loop.state.step})
    b = Reports("b", {"path": "somewhere", "nothing": None})
    quiet = Reports("quiet", None)
    state = hookfit.Loop(step, [1, 2, 3], plugins=[a, b, quiet]).fit()
    assert dict(state.results) == {"steps": 3, "path": "somewhere", "nothing": None}
    assert a.saw == b.saw == quiet.saw == [("completed", True)]  # once, after fit_end
    with pytest.raises(TypeError):
        state.results["steps"] = 4  # type: ignore[index]
    assert hookfit.Loop(step, [1]).fit().results == {}  # nobody answered


def test_validate_returns_the_results_too() -> None:
    a = Reports("a", lambda loop: {"mode": loop.mode})
    state = hookfit.Loop(step, [1], val_step=step, val_data=[1, 2], plugins=[a]).validate()
    assert dict(state.results) == {"mode": "validate"}


def test_a_stopped_run_reports_what_it_knows() -> None:
    a = Reports("a", lambda loop: {"steps": loop.state.step})
    state = hookfit.Loop(step, [1, 2, 3, 4], max_epochs=2, plugins=[a, StopAfter(5)]).fit()
    assert state.status == "interrupted" and dict(state.results) == {"steps": 5}
    assert a.saw == [("interrupted", True)]


@pytest.mark.fault
def test_a_failed_run_still_asks_and_its_error_propagates() -> None:
    a = Reports("a", lambda loop: {"steps": loop.state.step})

    def failing(loop: Any, batch: Any) -> Any:
        if batch == 2:
            raise RuntimeError("boom")

    loop = hookfit.Loop(failing, [1, 2, 3], plugins=[a])
    with pytest.raises(RuntimeError, match="boom"):
        loop.fit()
    assert a.saw == [("failed", True)] and dict(loop.state.results) == {"steps": 1}


@pytest.mark.bad_input
def test_two_plugins_answering_one_key_fail_the_run_naming_both() -> None:
    loop = hookfit.Loop(step, [1], plugins=[Reports("first", {"best": 1, "a": 1}), Reports("second", {"best": 2})])
    with pytest.raises(ValueError, match=r"plugin '(first|second)' .* and plugin '(first|second)' .* both answer "
                                         r"the key 'best'") as caught:
        loop.fit()
    assert "first" in str(caught.value) and "second" in str(caught.value)
    assert loop.state.status == "failed" and type(loop.state.error) is ValueError
    assert loop.state.error.args == caught.value.args  # a copy of what fit() raised, without its traceback
    assert loop.state.results["a"] == 1 and loop.state.results["best"] in (1, 2)  # the first answer kept


@pytest.mark.bad_input
@pytest.mark.parametrize("answer, match", [
    (["best", 1], r"results: plugin 'odd' .* answered a list; 'results' returns a mapping"),
    ({1: "one"}, r"results: plugin 'odd' .* answered the key 1 \(int\); keys of results are strings"),
])
def test_an_answer_that_is_not_a_mapping_of_names_is_an_error_naming_the_plugin(answer: Any, match: str) -> None:
    loop = hookfit.Loop(step, [1], plugins=[Reports("odd", answer), Reports("fine", {"x": 1})])
    with pytest.raises(TypeError, match=match):
        loop.fit()
    assert dict(loop.state.results) == {"x": 1}


@pytest.mark.fault
def test_every_plugin_answers_even_if_one_raises_and_the_first_error_fails_the_run() -> None:
    def broken(loop: Any) -> Any:
        raise OSError("cannot say")

    fine = Reports("fine", {"x": 1})
    loop = hookfit.Loop(step, [1], plugins=[fine, Reports("broken", broken)])
    with pytest.raises(OSError, match="cannot say") as caught:
        loop.fit()
    assert "hookfit: raised by plugin 'broken' (" in " ".join(caught.value.__notes__)
    assert fine.saw == [("completed", True)] and dict(loop.state.results) == {"x": 1}
    assert (loop.state.status, loop.state.stop_reason) == ("failed", "OSError: cannot say")


@pytest.mark.fault
def test_after_a_failure_a_results_error_is_a_warning_and_the_run_s_error_propagates() -> None:
    def failing(loop: Any, batch: Any) -> Any:
        raise RuntimeError("boom")

    loop = hookfit.Loop(failing, [1], plugins=[Reports("one", {"k": 1}), Reports("two", {"k": 2})])
    with warnings.catch_warnings(record=True) as caught, pytest.raises(RuntimeError, match="boom"):
        warnings.simplefilter("always")
        loop.fit()
    assert [str(w.message) for w in caught if "both answer the key 'k'" in str(w.message)], caught
    assert all(issubclass(w.category, hookfit.HookfitWarning) for w in caught)
    assert str(caught[0].message).startswith("results failed while the run was already ending: ValueError")


@pytest.mark.fault
def test_an_error_in_fit_end_is_the_status_results_sees() -> None:
    class Broken:
        @hookfit.hookimpl
        def fit_end(self) -> None:
            raise OSError("disk gone")

    a = Reports("a", {"x": 1})
    with pytest.raises(OSError, match="disk gone"):
        hookfit.Loop(step, [1], plugins=[a, Broken()]).fit()
    assert a.saw == [("failed", True)]


def test_an_observer_that_raises_in_results_is_switched_off_not_fatal() -> None:
    class Watcher:
        observer = True

        @hookfit.hookimpl
        def results(self) -> Any:
            raise RuntimeError("observer broke")

    with pytest.warns(hookfit.ObserverWarning, match="observer broke"):
        state = hookfit.Loop(step, [1], plugins=[Watcher(), Reports("a", {"x": 1})]).fit()
    assert state.status == "completed" and dict(state.results) == {"x": 1}


def test_the_recorder_asks_for_results_only_when_told() -> None:
    plain, told = Recorder(), Recorder(results=True)
    hookfit.Loop(step, [1], plugins=[plain]).fit()
    hookfit.Loop(step, [1], plugins=[told]).fit()
    assert plain.names()[-1] == "fit_end" and told.names()[-2:] == ["fit_end", "results"]
