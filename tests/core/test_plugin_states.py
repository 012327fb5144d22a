"""hookfit.states: every plugin's state keyed by its name, restored to its owner; a changed plugin set
in strict and lenient mode, and in an evaluation; a state a checkpoint could not be read back with,
refused as it is gathered."""

from __future__ import annotations

import collections
import gc
import io
import pickle
import re
import signal
import threading
import tracemalloc
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np
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


class Holds:
    """A participant (or, with ``observer``, an observer) whose ``save_state`` answers ``state``."""

    def __init__(self, state: object, name: str = "holds", observer: bool = False) -> None:
        self.name, self.state, self.observer = name, state, observer

    @hookfit.hookimpl
    def save_state(self) -> object:
        return self.state

    @hookfit.hookimpl
    def load_state(self, state: object) -> None:
        self.state = state


def _gathered(*plugins: object) -> dict:
    """``loop.plugin_states()`` as a checkpoint takes it, after the run's one batch."""
    saved: dict = {}

    class Save:
        name = "save"

        @hookfit.hookimpl
        def epoch_end(self, loop):
            saved.update(loop.plugin_states())

    hookfit.Loop(lambda l, b: None, [1], plugins=[*plugins, Save()]).fit()
    return saved


def _safe_load_refuses(state: object) -> bool:
    buffer = io.BytesIO()
    torch.save({"state": state}, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError:
        return True
    return False


class Opaque:
    pass


@pytest.mark.bad_input
@pytest.mark.parametrize("state, where, kind", [
    ({"best": np.float64(1.5)}, r"state\['best'\]", "numpy.float64"),
    (object(), "state", "object"),
    ({"runs": [1, {"dir": Path("x")}]}, r"state\['runs'\]\[1\]\['dir'\]", r"pathlib\.\w*Path"),
    ({"seen": {np.int64(3): 1}}, r"a key of state\['seen'\] \(np\.int64\(3\)\)", "numpy.int64"),
    ({"tags": frozenset({"a"})}, r"state\['tags'\]", "frozenset"),
    ((1, Opaque()), r"state\[1\]", "test_plugin_states.Opaque"),
], ids=["numpy-scalar", "object", "path-deep-inside", "numpy-key", "frozenset", "own-class-in-a-tuple"])
def test_a_state_a_checkpoint_could_not_be_read_back_with_fails_when_gathered_naming_plugin_place_and_type(
        state: object, where: str, kind: str) -> None:
    """A participant's state that torch.load(weights_only=True), which reads checkpoints, refuses fails the run
    where the state is gathered, naming the plugin, the place inside the state and the type, and what to return:
    no checkpoint is written that cannot be read."""
    assert _safe_load_refuses(state)  # what the check stands for
    with pytest.raises(TypeError, match=rf"plugin 'holds' .*returned from save_state a state that no checkpoint "
                                        rf"could be read back with: {where} is an? {kind}, which "
                                        rf"torch\.load\(weights_only=True\).* refuses\. Return plain data instead: "
                                        rf"Python numbers"):
        _gathered(Holds(state))


@pytest.mark.bad_input
def test_an_observer_whose_state_could_not_be_read_back_is_switched_off_with_one_warning_naming_it() -> None:
    with pytest.warns(hookfit.ObserverWarning, match=r"observer plugin 'look'.* in hook 'save_state'.*"
                                                     r"state\['best'\] is a numpy\.float64") as caught:
        saved = _gathered(Holds({"best": np.float64(1.5)}, "look", observer=True), Counter("a"))
    assert saved == {"look": None, "a": {"seen": 1}}
    assert len([w for w in caught if issubclass(w.category, hookfit.ObserverWarning)]) == 1


@pytest.mark.parametrize("state", [
    {"ints": 1, "float": 1.5, "complex": 1j, "bool": True, "none": None, "str": "s", "bytes": b"b",
     "bytearray": bytearray(b"b"), "dtype": torch.float16, "device": torch.device("cpu"), "layout": torch.strided,
     "size": torch.Size([2, 3]), "set": {1, 2}, "tuple": (1, (2, "x")), 3: "an int key", (1, 2): "a tuple key"},
    OrderedDict(a=torch.ones(2), b=torch.nn.Parameter(torch.zeros(1))),
    torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1, momentum=0.9).state_dict(),
    [collections.Counter("abca"), torch.arange(3)],
])
def test_states_a_checkpoint_reads_back_pass_unchanged(state: object) -> None:
    assert not _safe_load_refuses(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _gathered(Holds(state))["holds"] is state


def test_a_state_that_holds_itself_is_walked_once() -> None:
    """The check follows containers, not references it has met on its way in: it ends."""
    looped: list = [1]
    looped.append(looped)
    assert _gathered(Holds(looped))["holds"] is looped


class TrainingOnly(Counter):
    """A plugin with a state that takes no part in an evaluation: it leaves the run at its configure there, as
    early stopping without a monitor does."""

    @hookfit.hookimpl
    def configure(self, loop):
        if loop.mode != "fit":
            loop.pm.unregister(self)


def test_an_evaluation_leaves_the_state_of_a_plugin_that_sits_it_out_unused_without_a_word() -> None:
    """Strict or not, an evaluation (Loop.validate) says nothing of a saved state whose plugin it has but which
    takes no part in it; the state of a plugin it lacks altogether is still reported (it may have mattered: an
    average of the weights), as is a plugin of the evaluation with no saved state, and a fit reports both."""
    states = {"a": {"seen": 5}, "trainer": {"seen": 2}}

    def evaluate(*plugins: object) -> hookfit.State:
        return hookfit.Loop(val_step=lambda l, b: None, val_data=[1], plugins=[
            *plugins, Probe(lambda l: l.load_plugin_states(states, strict=True))]).validate()

    a, trainer = Counter("a"), TrainingOnly("trainer")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert evaluate(a, trainer).status == "completed"
    assert a.seen == 6 and trainer.seen == 0  # restored, then the validation batch counted; the other untouched
    with pytest.raises(hookfit.StateMismatch, match=r"'trainer' that no enabled plugin") as raised:
        evaluate(Counter("a"))
    assert (raised.value.missing, raised.value.extra) == ([], ["trainer"])
    with pytest.raises(hookfit.StateMismatch, match=r"no saved state for plugin 'b'") as raised:
        evaluate(Counter("a"), TrainingOnly("trainer"), Counter("b"))
    assert (raised.value.missing, raised.value.extra) == (["b"], [])
    with pytest.raises(hookfit.StateMismatch, match=r"'gone' that no enabled plugin"):
        hookfit.Loop(lambda l, b: None, [1], plugins=[Counter("a"), TrainingOnly("trainer"), Probe(
            lambda l: l.load_plugin_states({**states, "gone": {"x": 1}}))]).fit()


INSTALLED = """
    import hookfit

    class Kept:
        def __init__(self):
            self.seen = None

        def inert(self, chosen):
            return None if chosen else "given to Loop(plugins=[...]), or named by a [plugins.NAME] table"

        @hookfit.hookimpl
        def save_state(self):
            return {"seen": 1}

        @hookfit.hookimpl
        def load_state(self, state):
            self.seen = state["seen"]

    class Averager(Kept):
        \"\"\"Validates with other weights it keeps: swaps them in at the stage's start.\"\"\"

        @hookfit.hookimpl(wrapper=True)
        def stage_start(self, loop, stage):
            return (yield)

    class Shaper(Kept):
        \"\"\"Changes the model or the batch for each step.\"\"\"

        @hookfit.hookimpl
        def batch_start(self, loop, batch, batch_idx):
            pass

    class Scorer(Kept):
        \"\"\"Aggregates the step's outputs into a metric of its own.\"\"\"

        @hookfit.hookimpl
        def step_output(self, loop, output, batch):
            pass

    class Stopper(Kept):
        \"\"\"Reads the epoch's metrics alone, as early stopping does.\"\"\"

        @hookfit.hookimpl
        def epoch_end(self, loop, epoch):
            pass

    class Tracker(Kept):
        \"\"\"Logs each finished batch and stage to a run of its own (its state: the run's id).\"\"\"

        @hookfit.hookimpl
        def batch_end(self, loop, output, batch, batch_idx):
            pass

        @hookfit.hookimpl
        def after_batch(self, loop, batch_idx):
            pass

        @hookfit.hookimpl
        def stage_end(self, loop, stage):
            pass
    """

KEEPERS = ("averager", "shaper", "scorer", "stopper", "tracker")


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A distribution of plugins inert until chosen, discovered (``averager``, ``shaper`` and ``scorer`` shape what
    a validation measures, ``stopper`` and ``tracker`` do not), the module's classes yielded."""
    import sys

    from conftest import make_dist

    site = make_dist(tmp_path / "site", "keepers", {name: f"keepers_mod:{name.capitalize()}" for name in KEEPERS},
                     {"keepers_mod": INSTALLED})
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("HOOKFIT_PLUGINS", ",".join(KEEPERS))
    hookfit.discovery.refresh()
    try:
        import keepers_mod

        yield keepers_mod
    finally:
        sys.modules.pop("keepers_mod", None)
        hookfit.discovery.refresh()


@pytest.mark.bad_input
@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("name", ["averager", "shaper", "scorer"])
def test_an_evaluation_reports_the_unused_state_of_an_inert_plugin_that_shapes_what_it_measures(
        installed, name, strict) -> None:
    """Installed, inert merely discovered and left out of the evaluation: the state of a plugin acting on the
    model, batches or outputs of a validation (what the run's validations may have measured, as SWA's average) is
    reported as unused, naming the plugin and how to turn it on, strict or not; early stopping's and a tracker's
    sit out without a word. Given to the evaluation, the plugin restores its state and nothing is said."""
    states = {name: {"seen": 5}, "stopper": {"seen": 2}, "tracker": {"seen": 3}}

    def evaluate(*plugins: object) -> hookfit.State:
        return hookfit.Loop(val_step=lambda l, b: None, val_data=[1], plugins=[
            *plugins, Probe(lambda l: l.load_plugin_states(states, strict=strict))]).validate()

    said = (rf"plugin states do not match this run: saved state of plugin '{name}' \(keepers 1\.2\.3, entry point "
            rf"keepers_mod:{name.capitalize()}\), which is inert in this evaluation \(left unused\), although the validations of "
            r"the run it comes from may have measured it .*; it takes part when given to Loop\(plugins=\[\.\.\.\]\), "
            r"or named by a \[plugins\.NAME\] table")
    if strict:
        with pytest.raises(hookfit.StateMismatch, match=said) as raised:
            evaluate()
        assert (raised.value.missing, raised.value.extra) == ([], [name])
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            evaluate()
        assert [(w.category, re.match(said + "; restoring the rest$", str(w.message)) is not None) for w in caught] == [
            (hookfit.HookfitWarning, True)], [str(w.message) for w in caught]
    chosen = getattr(installed, name.capitalize())()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert evaluate(chosen).status == "completed"
    assert chosen.seen == 5


@pytest.mark.parametrize("strict", [False, True])
def test_an_evaluation_says_nothing_of_the_state_of_an_inert_tracker_logging_each_batch(installed, strict) -> None:
    """A tracker inert until chosen, with a state (its remote run's id) and acting in batch_end, after_batch and
    stage_end only, measured nothing of the run's validations: an evaluation leaves it out and its state unused
    without a word, strict or not; chosen, it restores the state."""
    states = {"tracker": {"seen": 3}, "stopper": {"seen": 2}}

    def evaluate(*plugins: object) -> hookfit.State:
        return hookfit.Loop(val_step=lambda l, b: None, val_data=[1], plugins=[
            *plugins, Probe(lambda l: l.load_plugin_states(states, strict=strict))]).validate()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert evaluate().status == "completed"
        tracker = installed.Tracker()
        assert evaluate(tracker).status == "completed"
    assert tracker.seen == 3


def test_a_type_allowlisted_for_safe_loads_passes_as_torch_reads_it_back() -> None:
    """numpy scalars allowlisted as torch's own error advises (add_safe_globals of numpy's scalar and
    dtypes): the walk refused np.float64 that torch.load(weights_only=True) then reads back."""
    allowed = [np._core.multiarray.scalar, np.dtype, type(np.dtype(np.float64))]
    state = {"best": np.float64(1.5)}
    with torch.serialization.safe_globals(allowed):
        assert not _safe_load_refuses(state)
        assert _gathered(Holds(state)) == {"holds": state}
