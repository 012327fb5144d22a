"""hookfit.cadence: a validation interval that validates nothing is warned of, at the start where it is known
then, else as the completed run ends; a run that validated, or did not end by its bounds, says nothing."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest

import hookfit
from hookfit.errors import HookfitWarning
from conftest import StopAt, saved_run


class _Unsized:
    """Training data of no length: a generator factory of three batches."""

    def __iter__(self) -> Iterator[int]:
        yield from (1, 2, 3)


def _fit(data: Any = None, plugins: tuple[Any, ...] = (), step: Any = None, **bounds: Any) -> tuple[Any, list[str]]:
    """A fit validated on one batch, and the HookfitWarnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = hookfit.Loop(step or (lambda loop, b: None), _Unsized() if data is None else data,
                             val_step=lambda loop, b: None, val_data=[1], plugins=list(plugins), **bounds).fit()
    return state, [str(w.message) for w in caught if issubclass(w.category, HookfitWarning)]


@pytest.mark.bad_input
@pytest.mark.parametrize("data, bounds, said", [
    (None, {"max_epochs": 2, "val_every_n_steps": 50},
     "val_every_n_steps=50: the run completed (max_epochs=2 reached) after 6 training steps in 2 epochs"),
    (None, {"max_steps": 4, "val_every_n_epochs": 2},
     "val_every_n_epochs=2: the run completed (max_steps=4 reached) after 4 training steps in 2 epochs"),
])
def test_a_completed_fit_that_never_validated_is_warned_of_once_as_it_ends(data: Any, bounds: dict, said: str) -> None:
    """Training data of no length (the interval cannot be checked at the start), or an epoch interval over the run's
    epochs: the run validates nothing, and one warning says so as it ends, naming the interval and how far the run
    went."""
    state, warned = _fit(data, **bounds)
    assert state.status == "completed" and "valid" not in state.time_split
    assert warned == [f"{said} without a single validation: the interval is longer than the run; give a shorter "
                      f"one, or no val_data"]


@pytest.mark.parametrize("data, bounds", [
    (None, {"max_epochs": 2, "val_every_n_steps": 6}), (None, {"max_epochs": 2, "val_every_n_steps": 4}),
    (None, {"max_epochs": 2}), ([1, 2, 3], {"max_epochs": 4, "val_every_n_epochs": 4}),
    (None, {"max_steps": 3}), ([1, 2, 3], {"max_steps": 4, "val_every_n_epochs": 1}),
])
def test_a_fit_that_validated_at_least_once_says_nothing(data: Any, bounds: dict) -> None:
    state, warned = _fit(data, **bounds)
    assert state.status == "completed" and "valid" in state.time_split and warned == []


@pytest.mark.bad_input
@pytest.mark.parametrize("data, bounds, said", [
    ([1, 2, 3], {"max_epochs": 2, "val_every_n_steps": 50}, "val_every_n_steps=50 is more than the run's 6 training steps"),
    (None, {"max_epochs": 2, "val_every_n_epochs": 5}, "val_every_n_epochs=5 is more than the run's 2 epochs"),
    ([1, 2, 3], {"max_steps": 6, "val_every_n_epochs": 3}, "val_every_n_epochs=3 is more than the run's 2 epochs"),
])
def test_a_cadence_known_to_be_too_long_at_the_start_is_warned_of_there_only(data: Any, bounds: dict, said: str) -> None:
    """An epoch interval over the run's epochs validated nothing and said nothing, as a step interval over its steps
    is warned of as training starts (and not a second time as it ends)."""
    state, warned = _fit(data, **bounds)
    assert state.status == "completed" and "valid" not in state.time_split
    assert warned == [f"{said}: no validation will run"]


class _Done:
    """Ends the run as complete after its first step, as early stopping or a target reached does."""

    @hookfit.hookimpl
    def should_stop(self, loop: Any) -> Any:
        if loop.training and loop.state.step == 1:
            return hookfit.StopRequest("target reached", by="done", complete=True)
        return None


def _fails(loop: Any, batch: Any) -> None:
    if loop.state.step == 1:
        raise RuntimeError("injected failure")


def test_a_run_stopped_or_failed_before_its_validation_says_nothing_of_it() -> None:
    stopped, warned = _fit(plugins=(StopAt(1),), max_epochs=2, val_every_n_steps=50)
    assert stopped.status == "interrupted" and warned == []
    done, warned = _fit(plugins=(_Done(),), max_epochs=2, val_every_n_steps=50)
    assert (done.status, done.step) == ("completed", 1) and warned == []
    with warnings.catch_warnings():
        warnings.simplefilter("error", HookfitWarning)
        with pytest.raises(RuntimeError, match="injected failure"):
            hookfit.Loop(_fails, _Unsized(), val_step=lambda loop, b: None, val_data=[1], max_epochs=2,
                         val_every_n_steps=50).fit()


class _Resumer:
    """Puts the run at the start of epoch ``epoch``, step ``step``, as a checkpoint plugin does."""

    name = "resumer"

    def __init__(self, epoch: int, step: int) -> None:
        self.epoch, self.step = epoch, step

    @hookfit.hookimpl
    def resume(self, loop: Any, source: Any) -> str:
        loop.load_state_dict(saved_run(self.epoch, self.step, 0))
        return "ckpt.pt"


@pytest.mark.parametrize("at, bounds, warns", [
    ((2, 6), {"max_epochs": 3, "val_every_n_steps": 5}, False),  # validated at step 5, before the resume
    ((2, 6), {"max_epochs": 3, "val_every_n_epochs": 2}, False),  # validated after epoch 2
    ((1, 3), {"max_epochs": 2, "val_every_n_steps": 7}, True),   # never: the run has 6 steps
])
def test_a_resumed_run_counts_the_validations_of_the_run_it_continues(at: tuple[int, int], bounds: dict,
                                                                       warns: bool) -> None:
    state, warned = _fit(plugins=(_Resumer(*at),), resume="latest", **bounds)
    assert state.status == "completed" and "valid" not in state.time_split
    assert [w.startswith("val_every_n_steps=7: the run completed (max_epochs=2 reached) after 6 training steps")
            for w in warned] == ([True] if warns else [])


@pytest.mark.bad_input
@pytest.mark.parametrize("data, bounds, steps", [
    (None, {"max_epochs": 3, "max_steps": 2}, "2 training steps"), (None, {"max_steps": 2}, "2 training steps"),
    ([1, 2, 3], {"max_steps": 1, "val_every_n_epochs": 1}, "1 training step"),
])
def test_max_steps_inside_the_first_epoch_with_validation_at_epoch_ends_says_so(
        data: Any, bounds: dict, steps: str) -> None:
    """The default cadence (validation at epoch ends) on a run max_steps ends inside its first epoch: the warning
    named 'val_every_n_epochs=1', which the user never set, and asked for a shorter one, which there is not."""
    state, warned = _fit(data, **bounds)
    assert state.status == "completed" and "valid" not in state.time_split
    most = bounds["max_steps"]
    assert warned == [f"no validation ran: it comes at epoch ends (val_every_n_epochs=1), and max_steps={most} ended "
                      f"the run after {steps}, inside its first epoch: give val_every_n_steps={most} or less, a "
                      f"max_steps that reaches an epoch's end, or no val_data"]
