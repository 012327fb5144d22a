"""checkpoint: a ``monitor`` the run never publishes is said once, in a ``CheckpointWarning`` naming
it and why: as training starts when the run can never publish it (a ``valid/`` monitor without
validation, or with every validation past the run's end: early stopping's error, in the same words),
else as a completed run ends when no publication carried it (not an interrupted one: the run resumed
from it may yet publish it). Its checkpoints are still written, without a
best among them."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint, CheckpointWarning
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim

from conftest import mse_step


def fit(tmp_path: Path, *plugins: Any, validate: bool = True, category: type[Warning] = CheckpointWarning,
        **options: Any) -> tuple[hookfit.State, list[str], Checkpoint]:
    """Fit two epochs of three batches, a monitored checkpoint among ``plugins``; returns the state,
    what the warnings of ``category`` said (each CheckpointWarning from this file, the caller's line)
    and the checkpoint."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    checkpoint = Checkpoint(dir=tmp_path, monitor="valid/loss", background=False)
    val = {"val_step": lambda loop, batch: {"loss": torch.tensor(1.0)}, "val_data": [0]} if validate else {}
    loop = hookfit.Loop(mse_step, [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(3)], model=model,
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                        plugins=[Optim(), *plugins, checkpoint], **{"max_epochs": 2, **val, **options})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = loop.fit()
    said = [str(w.message) for w in caught if issubclass(w.category, category)]
    assert all(w.filename == __file__ for w in caught if issubclass(w.category, CheckpointWarning))
    return state, said, checkpoint


NEVER = "checkpoint: monitor='valid/loss' needs validation, and this run "
UNSCORED = "; its checkpoints are still written, but none carries a score, so no best checkpoint is kept"


@pytest.mark.bad_input
@pytest.mark.parametrize("options, why", [
    ({"validate": False}, "has none: give Loop(val_step=..., val_data=...), or monitor a 'train/' metric"),
    ({"val_every_n_epochs": 3}, "never validates: val_every_n_epochs=3, and it trains 2 epoch(s) at most "
                                "(max_epochs); give val_every_n_epochs=2 or less, or monitor a 'train/' metric"),
    ({"max_epochs": None, "max_steps": 5, "val_every_n_epochs": 3},
     "never validates: val_every_n_epochs=3, and it trains 2 epoch(s) at most (max_steps=5); give "
     "val_every_n_epochs=2 or less, or monitor a 'train/' metric"),
    ({"max_steps": 6, "val_every_n_steps": 7},
     "never validates: val_every_n_steps=7, and it trains 6 step(s) at most (max_steps); give "
     "val_every_n_steps=6 or less, or monitor a 'train/' metric"),
    ({"val_every_n_steps": 7}, "never validates: val_every_n_steps=7, and it trains 6 step(s) at most "
                               "(max_epochs=2 of 3 batches); give val_every_n_steps=6 or less, or monitor a 'train/' "
                               "metric"),
])
def test_a_run_that_never_validates_says_so_once_as_training_starts_and_still_writes_its_checkpoints(
        tmp_path: Path, options: dict[str, Any], why: str) -> None:
    state, said, checkpoint = fit(tmp_path, Metrics(), **options)
    assert said == [NEVER + why + UNSCORED]
    assert state.status == "completed" and state.results["best_checkpoint"] is None and len(checkpoint.saved) >= 1


@pytest.mark.bad_input
@pytest.mark.parametrize("bound", [{"max_steps": 6}, {"max_epochs": 2, "max_steps": 9}])
def test_a_step_cadence_past_the_run_is_said_by_the_checkpoint_alone(tmp_path: Path, bound: dict[str, int]) -> None:
    """The checkpoint's warning names itself and its option: the core's warning of the same cause is not
    shown as well."""
    state, said, checkpoint = fit(tmp_path, Metrics(), category=Warning, val_every_n_steps=7, **bound)
    assert [message[:len(NEVER)] for message in said if "val_every_n_steps=7" in message] == [NEVER]


@pytest.mark.bad_input
@pytest.mark.parametrize("plugins, options", [
    ((), {}),                     # validation, but nothing publishes its metrics
    ((Metrics(),), {"max_steps": 2}),  # ended in the first epoch, before its validation
])
def test_a_run_that_never_published_the_monitor_says_so_once_as_it_ends(
        tmp_path: Path, plugins: tuple[Any, ...], options: dict[str, Any]) -> None:
    state, said, checkpoint = fit(tmp_path, *plugins, **options)
    assert said == ["checkpoint: monitor='valid/loss' was never published in this run: it ended before its valid "
                    "stage published metrics, or no plugin publishes epoch_metrics (the metrics plugin does); its "
                    "checkpoints are written, but none carries a score, so no best checkpoint is kept"]
    assert state.status == "completed" and state.results["best_checkpoint"] is None and checkpoint.saved


@pytest.mark.bad_input
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_monitor_never_finite_says_that_no_best_checkpoint_is_kept(tmp_path: Path, value: float) -> None:
    """One NaN sample in the validation data made valid/loss NaN every epoch: results['best_checkpoint'] was
    None without a word, and a script's validate(resume=None) then tested the last weights instead."""
    state, said, checkpoint = fit(tmp_path, Metrics(), val_step=lambda loop, batch: {"loss": torch.tensor(value)})
    assert said == [f"checkpoint: monitor='valid/loss' was never a finite number in this run (last: {value}): a "
                    f"non-finite score is never the best, so no best checkpoint is kept (results['best_checkpoint'] "
                    f"is None); its checkpoints are written"]
    assert state.status == "completed" and state.results["best_checkpoint"] is None and checkpoint.saved


def test_a_monitor_finite_once_keeps_that_checkpoint_as_the_best_without_a_word(tmp_path: Path) -> None:
    values = iter([1.0, float("nan")])
    state, said, checkpoint = fit(tmp_path, Metrics(), val_step=lambda loop, batch: {"loss": torch.tensor(next(values))})
    assert said == [] and state.results["best_checkpoint"] == checkpoint.best[1]


def test_a_run_that_published_the_monitor_and_validate_say_nothing_of_it(tmp_path: Path) -> None:
    """The control: a published monitor is no warning; nor is ``validate()`` with a Loop whose
    training would never validate (it validates)."""
    state, said, checkpoint = fit(tmp_path, Metrics())
    assert said == [] and state.results["best_checkpoint"] == checkpoint.best[1]
    model = torch.nn.Linear(2, 1)
    loop = hookfit.Loop(mse_step, [0], val_step=lambda loop, batch: {"loss": torch.tensor(1.0)}, val_data=[0],
                        model=model, max_epochs=2, val_every_n_epochs=3,
                        plugins=[Metrics(), Checkpoint(dir=tmp_path, monitor="valid/loss")])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert loop.validate(resume=checkpoint.best[1]).status == "completed"
    assert [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)] == []


class _StopAt:
    """Asks the run to stop after training step ``step``."""

    name = "stop_at"

    def __init__(self, step: int) -> None:
        self.step = step

    @hookfit.hookimpl
    def batch_end(self, loop: Any) -> None:
        if loop.training and loop.state.step == self.step:
            loop.request_stop("enough")


def test_a_run_a_stop_interrupted_before_the_monitor_was_published_says_nothing_of_it(tmp_path: Path) -> None:
    """Its monitor is published by the validations the resumed run will run: not a cause to name."""
    state, said, checkpoint = fit(tmp_path, Metrics(), _StopAt(2))
    assert state.status == "interrupted" and state.step == 2 and state.results["best_checkpoint"] is None
    assert said == [] and checkpoint.saved


@pytest.mark.bad_input
def test_a_one_set_monitor_with_several_sets_is_said_once_before_any_batch_naming_each_set_s_name(
        tmp_path: Path) -> None:
    """``valid/loss`` where the sets publish ``valid/a/loss`` and ``valid/b/loss``: said as the run starts
    (an error filter for the warning fails the run before its first batch), not again after the first
    validation, and the checkpoints are still written."""
    sets = {"a": [0], "b": [0]}
    state, said, checkpoint = fit(tmp_path / "warned", Metrics(), val_data=sets)
    assert said == ["checkpoint: monitor='valid/loss' names no validation set, and this run validates 2 sets ('a', "
                    "'b'), whose metrics are named per set ('valid/<set>/<metric>'): give monitor='valid/a/loss' or "
                    "'valid/b/loss'; no best checkpoint is kept by it"]
    assert state.status == "completed" and state.results["best_checkpoint"] is None and checkpoint.saved
    batches: list[Any] = []

    def step(loop: Any, batch: Any) -> Any:
        batches.append(batch)
        return mse_step(loop, batch)

    model = torch.nn.Linear(2, 1)
    loop = hookfit.Loop(step, [(torch.randn(4, 2), torch.randn(4, 1))], model=model, val_data=sets,
                        val_step=lambda loop, batch: {"loss": torch.tensor(1.0)},
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                        plugins=[Optim(), Metrics(), Checkpoint(dir=tmp_path / "failed", monitor="valid/loss")])
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        with pytest.raises(CheckpointWarning, match=r"^checkpoint: monitor='valid/loss' names no validation set"):
            loop.fit()
    assert batches == []
