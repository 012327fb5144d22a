"""The console's end-of-run summary after a resume covers the whole run, the epochs of the run
it continues included, as an uninterrupted run's does."""

from __future__ import annotations

import io
from pathlib import Path

import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.console import Console
from hookfit.plugins.metrics import Metrics

LOSS = [1.0, 5.0, 3.0, 7.0]  # the epochs' training loss: the best is the first epoch's
ACC = [0.5, 0.9, 0.7, 0.6]  # validation accuracy: highest in the second epoch


def results(epochs: int, folder: Path, resume: bool) -> list[str]:
    """The ``hookfit result`` lines of a run of ``epochs`` epochs in ``folder``."""
    def train(loop, batch):
        return {"loss": torch.tensor(LOSS[loop.state.epoch])}

    def valid(loop, batch):
        return {"acc": torch.tensor(ACC[loop.state.epoch])}

    stream = io.StringIO()
    hookfit.Loop(train, list(range(3)), val_step=valid, val_data=[0], model=torch.nn.Linear(1, 1),
                 max_epochs=epochs, run_dir=folder, resume="latest" if resume else None,
                 plugins=[Metrics(best={"valid/acc": "max"}), Console(stream=stream), Checkpoint()],
                 disable=["tui", "metrics_log", "csv"]).fit()
    return [line for line in stream.getvalue().splitlines() if line.startswith("hookfit result ")]


def test_a_resumed_runs_summary_covers_the_epochs_before_the_resume(tmp_path: Path) -> None:
    whole = results(4, tmp_path / "whole", resume=False)
    assert "hookfit result stage=train metric=loss last=7 best=1 best_epoch=1" in whole, whole
    assert "hookfit result stage=valid metric=acc last=0.6 best=0.9 best_epoch=2" in whole, whole
    results(2, tmp_path / "run", resume=False)
    resumed = results(4, tmp_path / "run", resume=True)
    assert resumed == whole
