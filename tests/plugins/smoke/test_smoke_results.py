"""What a smoke run returns points at nothing it removed: the checkpoint paths into its
temporary folder are None, and the report says so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim

from conftest import mse_step


@pytest.fixture(autouse=True)
def _smoke_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOKFIT_PLUGINS", "smoke")


def fit(smoke: bool) -> hookfit.State:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(4)]
    return hookfit.Loop(mse_step, data, val_step=lambda loop, batch: {"loss": torch.tensor(0.5)}, val_data=data,
                        model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1), max_epochs=2,
                        smoke=smoke, plugins=[Optim(), Metrics(), Checkpoint(background=False, monitor="valid/loss")],
                        run_dir="run").fit()


def test_a_smoke_run_returns_no_path_into_its_removed_folder(capsys: pytest.CaptureFixture[str]) -> None:
    real = fit(smoke=False)
    assert Path(real.results["best_checkpoint"]).is_file()  # the same run for real keeps them
    state = fit(smoke=True)
    assert state.status == "completed"
    assert state.results["best_checkpoint"] is None and state.results["last_checkpoint"] is None
    assert state.results.keys() == real.results.keys()  # the other results are there
    err = capsys.readouterr().err
    assert ("hookfit smoke: results that pointed into the temporary folder are None: best_checkpoint, "
            "last_checkpoint") in err
