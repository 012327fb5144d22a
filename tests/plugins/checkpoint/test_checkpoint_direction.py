"""checkpoint: the best checkpoint by ``monitor`` is the best epoch in the direction the metrics
snapshots publish (``Metrics(best=...)``) unless ``mode`` is given, so ``results["best_checkpoint"]``
and the metrics plugin's ``results["best"]`` name the same epoch; a given ``mode`` that
contradicts them warns once and is kept; no published direction is ``"min"``."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint, CheckpointWarning
from hookfit.plugins.metrics import Metrics

ACCS = [0.5, 0.9, 0.6, 0.55]  # validation accuracy: highest in the second epoch, lowest in the first


def fit(folder: Path, *plugins: Any) -> hookfit.State:
    model = torch.nn.Linear(1, 1)

    def step(loop, batch):
        return {"loss": torch.tensor(1.0)}

    def valid(loop, batch):
        return {"acc": torch.tensor(ACCS[loop.state.epoch])}

    return hookfit.Loop(step, [0, 1], val_step=valid, val_data=[0], model=model, max_epochs=len(ACCS),
                        run_dir=folder, plugins=list(plugins), disable=["tui", "metrics_log", "csv"]).fit()


def test_without_a_mode_the_best_checkpoint_is_the_metrics_plugins_best_epoch(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)  # nothing contradicts: no warning
        state = fit(tmp_path, Metrics(best={"valid/acc": "max"}),
                    Checkpoint(monitor="valid/acc", keep_last=1, background=False))
    assert state.results["best"]["valid/acc"] == (pytest.approx(0.9), 2)
    assert state.results["best_checkpoint"] == tmp_path / "checkpoints" / "epoch0002-step000000004.pt"
    assert state.results["best_checkpoint"].exists()  # kept besides the last one


def test_without_a_published_direction_the_best_checkpoint_is_the_lowest(tmp_path: Path) -> None:
    with pytest.warns(CheckpointWarning, match=r"checkpoint: valid/acc is compared as lower is better \('min'"):
        state = fit(tmp_path, Metrics(), Checkpoint(monitor="valid/acc", keep_last=1, background=False))
    assert "valid/acc" not in state.results["best"]  # no direction: the metrics plugin has no best either
    assert state.results["best_checkpoint"] == tmp_path / "checkpoints" / "epoch0001-step000000002.pt"


@pytest.mark.bad_input
def test_a_mode_that_contradicts_the_published_direction_warns_once_and_is_kept(tmp_path: Path) -> None:
    checkpoint = Checkpoint(monitor="valid/acc", mode="min", keep_last=1, background=False)
    with pytest.warns(CheckpointWarning) as caught:
        state = fit(tmp_path, Metrics(best={"valid/acc": "max"}), checkpoint)
    mine = [str(w.message) for w in caught if str(w.message).startswith("checkpoint:")]
    assert len(mine) == 1, mine  # once, though every epoch's snapshot says so again
    assert all(word in mine[0] for word in ("valid/acc", "mode='min'", "'max'")), mine[0]
    assert state.results["best_checkpoint"] == tmp_path / "checkpoints" / "epoch0001-step000000002.pt"
