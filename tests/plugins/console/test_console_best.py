"""The console's ``hookfit result`` lines agree with ``results["best"]``: a metric never finite
has no best (nor extremes), and ``Loop.validate(resume=...)`` reports its own validation alone,
not the restored history of the training run's."""

from __future__ import annotations

import io
import math
from pathlib import Path

import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.console import Console
from hookfit.plugins.metrics import Metrics
from conftest import StopAfter

QUIET = ["tui", "metrics_log", "csv"]


def result_lines(stream: io.StringIO) -> list[str]:
    return [line for line in stream.getvalue().splitlines() if line.startswith("hookfit result ")]


def test_a_metric_never_finite_has_no_best_on_the_console_as_in_the_results(tmp_path: Path) -> None:
    """``loss`` (best low) is NaN in every epoch, ``ppl`` (no direction) infinite: the result
    lines give their last value only; a finite one among them is taken, the others skipped."""
    losses = [math.nan, math.nan]
    stream = io.StringIO()

    def step(loop, batch):
        return {"loss": torch.tensor(losses[loop.state.epoch]), "ppl": torch.tensor(math.inf),
                "acc": torch.tensor([math.nan, 0.5][loop.state.epoch])}

    state = hookfit.Loop(step, [0, 1], max_epochs=2, run_dir=tmp_path, disable=QUIET,
                         plugins=[Metrics(best={"acc": "max"}), Console(stream=stream)]).fit()
    assert state.results["best"] == {"train/acc": (0.5, 2)}
    assert result_lines(stream) == [
        "hookfit result stage=train metric=loss last=nan",
        "hookfit result stage=train metric=ppl last=inf",
        "hookfit result stage=train metric=acc last=0.5 best=0.5 best_epoch=2",
    ]


def test_validate_reports_its_own_validation_not_the_training_runs_history(tmp_path: Path) -> None:
    """Trained 3 epochs on one validation set (loss 3, 2, 1), then the last checkpoint validated
    on another (loss 21): the console's best is the one value this validation produced, as
    ``results["best"]`` says, not the best of the training run's restored history."""
    model = torch.nn.Linear(1, 1)

    def train(loop, batch):
        return {"loss": torch.tensor(1.0)}

    def valid(loop, batch):
        return {"loss": torch.tensor(3.0 - loop.state.epoch)}

    def test(loop, batch):
        return {"loss": torch.tensor(21.0)}

    fitted = hookfit.Loop(train, [0, 1], val_step=valid, val_data=[0], model=model, max_epochs=3,
                          run_dir=tmp_path / "fit", disable=QUIET, plugins=[Metrics(), Checkpoint()]).fit()
    stream = io.StringIO()
    tested = hookfit.Loop(train, [0, 1], val_step=test, val_data=[0], model=model, run_dir=tmp_path / "test",
                          disable=QUIET, plugins=[Metrics(), Checkpoint(), Console(stream=stream)]
                          ).validate(resume=fitted.results["last_checkpoint"])
    assert tested.results["best"] == {"valid/loss": (21.0, 3)}
    assert result_lines(stream) == ["hookfit result stage=valid metric=loss last=21 best=21 best_epoch=3"]
    # labelled with the checkpoint's epoch, out of no total: this run trains none
    lines = stream.getvalue().splitlines()
    assert [line.split(" time=")[0] for line in lines if line.startswith("hookfit valid ")] == [
        "hookfit valid epoch=3 done batches=1"]
    assert lines[0].startswith("hookfit start plugins="), lines[0]


def test_a_validation_a_stop_cut_short_is_the_last_value_never_the_best(tmp_path: Path) -> None:
    """A stop after the first batch of epoch 2's validation (the easy batch: the lowest loss
    of the run): its partial mean is the last value, the best stays epoch 1's whole validation,
    as ``results["best"]`` says."""
    def train(loop, batch):
        return {"loss": torch.tensor(1.0)}

    def valid(loop, batch):
        return {"loss": torch.tensor(0.5 if batch == 0 else 4.0)}

    stream = io.StringIO()
    state = hookfit.Loop(train, [0, 1], val_step=valid, val_data=[0, 1], max_epochs=3, run_dir=tmp_path,
                         disable=QUIET, plugins=[Metrics(), Console(stream=stream), StopAfter(7)]).fit()  # epoch 2's first validation batch
    assert state.status == "interrupted" and state.results["best"]["valid/loss"] == (2.25, 1)
    assert result_lines(stream)[-1] == ("hookfit result stage=valid metric=loss last=0.5 last_partial=true best=2.25 "
                                          "best_epoch=1")
