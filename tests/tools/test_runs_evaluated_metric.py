"""An evaluation (``Loop.validate(resume=checkpoint)``) in a folder of its own is judged by the
metric the training run whose checkpoint it read was judged by: ``hookfit runs`` lists both by
``valid/acc`` when the run gave ``Metrics(best={"valid/acc": "max"})``, though the evaluating
``Loop``'s metrics plugin was given no direction."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.metrics_log import MetricsLog
from hookfit.plugins.optim import Optim
from hookfit.tools import cli, runs


def _valid(loop: Any, batch: Any) -> dict[str, Any]:
    out = loop.model(batch[0])
    return {"loss": torch.nn.functional.cross_entropy(out, batch[1]), "acc": (out.argmax(1) == batch[1]).float().mean()}


def test_an_evaluation_is_judged_by_the_metric_of_the_run_it_evaluated(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    data = [(torch.randn(4, 2), torch.randint(0, 2, (4,))) for _ in range(3)]

    def train(loop: Any, batch: Any) -> dict[str, Any]:
        loss = torch.nn.functional.cross_entropy(loop.model(batch[0]), batch[1])
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    trained = tmp_path / "runs" / "train"
    state = hookfit.Loop(train, data, val_step=_valid, val_data=data, model=model, max_epochs=2, run_dir=trained,
                         optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                         plugins=[Optim(), Metrics(best={"valid/acc": "max"}), MetricsLog(),
                                  Checkpoint(monitor="valid/acc")]).fit()
    evaluated = tmp_path / "runs" / "eval"
    checkpoint = str(state.results["best_checkpoint"])
    with pytest.warns(hookfit.HookfitWarning, match="'optim' that no enabled plugin of this run restores"):
        hookfit.Loop(val_step=_valid, val_data=data, model=model, run_dir=evaluated,
                     plugins=[Metrics(), MetricsLog(), Checkpoint()]).validate(resume=checkpoint)

    info = runs.load(evaluated)
    assert info.evaluation and info.evaluated == checkpoint
    assert (info.metric, info.mode) == ("valid/acc", "max") == (runs.load(trained).metric, runs.load(trained).mode)
    assert info.best is not None and info.best[:2] == ("valid/acc", runs.epoch_rows(evaluated)[-1]["acc"])

    assert cli.main(["runs", str(tmp_path / "runs")]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "/runs/" in line]
    assert len(rows) == 2 and all(" valid/acc " in row for row in rows), rows

    assert runs.evaluated_directions({"valid/loss": "min"}, None) == {"valid/loss": "min"}  # no run read: its own
    assert runs.evaluated_directions({"valid/acc": "min"}, checkpoint)["valid/acc"] == "min"
