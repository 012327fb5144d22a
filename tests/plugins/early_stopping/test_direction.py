"""early_stopping: which way its monitor improves comes from the metrics snapshots (the directions
``Metrics(best=...)`` publishes) unless ``mode`` is given; a given one that contradicts them
warns once and is kept; a publisher that gives no direction leaves it ``"min"``."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit.errors import HookfitWarning
from hookfit.payloads import MetricsSnapshot, Value
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.early_stopping import EarlyStopping
from hookfit.plugins.metrics import Metrics

RISING = [0.5, 0.6, 0.7, 0.8, 0.9]  # an accuracy that improves every epoch
PEAK = [0.5, 0.9, 0.6, 0.55, 0.5]  # best in the second epoch


def fit(accs: list[float], *plugins: Any, **loop: Any) -> hookfit.State:
    """A run of ``len(accs)`` epochs; checkpoints only when ``plugins`` has a ``Checkpoint``."""
    quiet = ["tui", "metrics_log", "csv"] + ([] if any(isinstance(p, Checkpoint) for p in plugins) else ["checkpoint"])

    def step(loop, batch):
        return {"loss": torch.tensor(1.0)}

    def valid(loop, batch):
        return {"acc": torch.tensor(accs[loop.state.epoch])}

    return hookfit.Loop(step, [0, 1], val_step=valid, val_data=[0], max_epochs=len(accs), model=torch.nn.Linear(1, 1),
                        plugins=list(plugins), disable=quiet, **loop).fit()


def test_without_a_mode_it_follows_the_direction_the_metrics_plugin_publishes() -> None:
    """``valid/acc`` is best high (``Metrics(best=...)``): a rising accuracy never stops the
    run; one that peaks stops it, the reason naming the highest value and its epoch."""
    plugin = EarlyStopping(monitor="valid/acc", patience=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HookfitWarning)  # nothing contradicts: no warning
        state = fit(RISING, Metrics(best={"valid/acc": "max"}), plugin)
    assert (state.status, state.epoch + 1, state.stop_reason) == ("completed", 5, "max_epochs=5 reached")
    assert plugin.mode is None and plugin.best == pytest.approx(0.9) and plugin.best_epoch == 4
    state = fit(PEAK, Metrics(best={"acc": "max"}), EarlyStopping(monitor="valid/acc", patience=2))
    assert state.epoch + 1 == 4 and state.stopped_by == "early_stopping", state.stop_reason
    assert state.stop_reason.endswith("best (max) 0.9 at epoch 2"), state.stop_reason


def test_without_a_published_direction_it_is_min() -> None:
    """The built-in metrics plugin with no direction for ``acc``, and a third-party publisher
    whose snapshots carry none: lower is better, as before."""
    said = r"early_stopping: valid/acc is compared as lower is better \('min', the default"  # (support.Monitor)
    with pytest.warns(HookfitWarning, match=said):
        state = fit(RISING, Metrics(), EarlyStopping(monitor="valid/acc", patience=1))
    assert state.epoch + 1 == 2 and state.stop_reason.endswith("best (min) 0.5 at epoch 1"), state.stop_reason

    class Publisher:
        """A metrics plugin of its own: the mean of ``acc`` at each validation's end, no ``best``."""

        name = "publisher"

        @hookfit.hookimpl
        def stage_end(self, loop, stage):
            if stage == "valid":
                acc = RISING[loop.state.epoch]
                loop.hooks.epoch_metrics(loop, stage, MetricsSnapshot(
                    stage=stage, epoch=loop.state.epoch, max_epochs=loop.max_epochs, step=loop.state.step,
                    batches=1, total=1, samples=1, elapsed=0.1, values={"acc": Value(acc, acc, acc)}, final=True))

    with pytest.warns(HookfitWarning, match=said):
        state = fit(RISING, Publisher(), EarlyStopping(monitor="valid/acc", patience=1))
    assert state.epoch + 1 == 2 and state.stop_reason.endswith("best (min) 0.5 at epoch 1"), state.stop_reason


@pytest.mark.bad_input
def test_a_mode_that_contradicts_the_published_direction_warns_once_and_is_kept() -> None:
    with pytest.warns(HookfitWarning) as caught:
        state = fit(RISING, Metrics(best={"valid/acc": "max"}), EarlyStopping(monitor="valid/acc", mode="min",
                                                                              patience=1))
    mine = [str(w.message) for w in caught if "early_stopping" in str(w.message)]
    assert len(mine) == 1, mine  # once, though every epoch's snapshot says so again
    assert all(word in mine[0] for word in ("valid/acc", "mode='min'", "'max'")), mine[0]
    assert state.epoch + 1 == 2 and state.stop_reason.endswith("best (min) 0.5 at epoch 1"), state.stop_reason


def test_a_mode_that_agrees_with_the_published_direction_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", HookfitWarning)
        state = fit(PEAK, Metrics(best={"valid/acc": "max"}), EarlyStopping(monitor="valid/acc", mode="max",
                                                                            patience=2))
    assert state.stop_reason.endswith("best (max) 0.9 at epoch 2"), state.stop_reason


@pytest.mark.fault
def test_a_run_resumed_after_it_stopped_says_the_direction_it_stopped_by(tmp_path: Path) -> None:
    """Resumed after it stopped, it stops again before any snapshot of this run: the direction
    comes from its saved state, so the reason is the one the stopped run gave."""
    def plugins() -> list[Any]:
        return [Metrics(best={"valid/acc": "max"}), EarlyStopping(monitor="valid/acc", patience=2),
                Checkpoint(background=False)]

    first = fit(PEAK, *plugins(), run_dir=tmp_path)
    assert first.epoch + 1 == 4 and first.stop_reason.endswith("best (max) 0.9 at epoch 2"), first.stop_reason
    again = fit(PEAK, *plugins(), run_dir=tmp_path, resume="latest")
    assert (again.status, again.step, again.stop_reason) == ("completed", first.step, first.stop_reason)
