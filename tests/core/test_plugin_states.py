"""hookfit.states: every plugin's state keyed by its name, restored to its owner; a changed plugin set
in strict and lenient mode."""

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
