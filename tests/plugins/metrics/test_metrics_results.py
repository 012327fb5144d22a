"""What fit() returns of the metrics: state.results["metrics"], each
metric's last epoch value, and state.results["best"], the best value and its epoch (from 1)
of the metrics with a direction; a partial last epoch and a resumed run's earlier epochs
count (for best, not a stage a stop request cut short)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hookfit
from conftest import StopAt, resumable_run
from hookfit.plugins.metrics import Metrics


LOSSES = {0: [4.0, 2.0], 1: [1.0, 1.0], 2: [3.0, 5.0]}  # the training loss of each epoch's batches
ACC = {0: 0.5, 1: 0.9, 2: 0.7}


def step(loop, batch):
    epoch = loop.state.epoch
    return {"loss": torch.tensor(LOSSES[epoch][batch]), "acc": ACC[epoch], "ppl": 10.0 - epoch}


def test_the_last_value_and_the_best_with_its_epoch_for_metrics_with_a_direction() -> None:
    state = hookfit.Loop(step, [0, 1], val_step=step, val_data=[1], max_epochs=3,
                         plugins=[Metrics(best={"valid/acc": "max"})]).fit()
    assert state.results["metrics"] == {"train/loss": 4.0, "train/acc": 0.7, "train/ppl": 8.0,
                                        "valid/loss": 5.0, "valid/acc": 0.7, "valid/ppl": 8.0}
    # loss is "min" unless configured; acc only where configured; ppl has no direction
    assert state.results["best"] == {"train/loss": (1.0, 2), "valid/loss": (1.0, 2), "valid/acc": (0.9, 2)}


def test_a_partial_last_epoch_counts() -> None:
    class Stop:
        name = "stop"

        @hookfit.hookimpl
        def batch_end(self, loop):
            if loop.state.step == 5:  # epoch 3, after its first batch (loss 3.0)
                loop.request_stop("enough")

    state = hookfit.Loop(step, [0, 1], max_epochs=3, plugins=[Metrics(best={"acc": "max"}), Stop()]).fit()
    assert state.status == "interrupted"
    assert state.results["metrics"]["train/loss"] == 3.0
    assert state.results["best"] == {"train/loss": (1.0, 2), "train/acc": (0.9, 2)}


CUT = {0: [4.0, 2.0], 1: [2.0, 2.0], 2: [0.5, 9.0]}  # epoch 3's first batch alone would be the lowest mean


@pytest.mark.parametrize("end", ["stop", "max_steps"])
def test_a_stage_a_stop_cut_short_is_the_last_value_never_the_best(end: str) -> None:
    """A stop request after epoch 3's first batch: its mean of one batch (0.5) is the run's last
    value, not its best, which stays epoch 2's whole mean (a sweep reading ``results["best"]``
    after a Ctrl-C would take one batch for an epoch). ``max_steps`` ends the run as planned:
    its partial epoch counts."""
    def cut_step(loop, batch):
        return {"loss": torch.tensor(CUT[loop.state.epoch][batch])}

    plugins = [Metrics(), StopAt(5)] if end == "stop" else [Metrics()]
    state = hookfit.Loop(cut_step, [0, 1], max_epochs=3, max_steps=5 if end == "max_steps" else None,
                         plugins=plugins).fit()
    assert state.status == ("interrupted" if end == "stop" else "completed")
    assert state.results["metrics"]["train/loss"] == 0.5
    assert state.results["best"] == {"train/loss": (2.0, 2) if end == "stop" else (0.5, 3)}


def test_nothing_published_reports_empty_mappings() -> None:
    state = hookfit.Loop(lambda l, b: None, [0, 1], plugins=[Metrics()]).fit()
    assert state.results["metrics"] == {} and state.results["best"] == {}


def test_a_resumed_run_reports_the_whole_run(tmp_path: Path) -> None:
    whole, _, _ = resumable_run(tmp_path / "whole")
    resumable_run(tmp_path / "cut", stop=10)
    resumed, _, _ = resumable_run(tmp_path / "cut", resume="latest")
    got, expected = resumed.run.state.results, whole.run.state.results
    assert set(expected["best"]) == {"train/loss"}  # vloss, noise, vnoise: no direction
    assert got["best"] == expected["best"] and got["metrics"] == expected["metrics"]
    assert expected["best"]["train/loss"][1] in (1, 2, 3)


@pytest.mark.filterwarnings("ignore:plugin states do not match this run")  # the checkpoint has optim's
def test_validate_reports_its_validation_alone(tmp_path: Path) -> None:
    """The checkpoint's metrics state holds the training run's report; a validation of it
    reports what it measured."""
    from hookfit.plugins.checkpoint import Checkpoint

    resumable_run(tmp_path / "train")
    checkpoint = sorted((tmp_path / "train" / "checkpoints").glob("epoch0003*"))[-1]
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    state = hookfit.Loop(lambda l, b: None, [0], val_step=lambda l, b: {"vloss": 0.5 * b}, val_data=[1, 2],
                         model=model, run_dir=tmp_path / "eval",
                         plugins=[Metrics(), Checkpoint(background=False)]).validate(resume=str(checkpoint))
    assert state.status == "completed"
    assert state.results["metrics"] == {"valid/vloss": 0.75} and state.results["best"] == {}
