"""A run stopped inside an epoch: its last value of a metric is the mean over the batches that
epoch ran. ``hookfit runs``, ``hookfit compare``, ``hookfit show`` and the console's ``hookfit
result`` line show it as the final value marked partial, never as a whole epoch's (it is not
comparable with BEST, which is over whole epochs, and may look better than it)."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.console import Console
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.metrics_log import MetricsLog
from hookfit.plugins.optim import Optim
from hookfit.plugins.tui import TuiRenderer
from hookfit.tools import cli, runs


def _train(folder: Path, stop_at: int | None, out: io.StringIO, resume: str | None = None) -> Any:
    """Four batches an epoch, three epochs, no validation (the run is judged by ``train/loss``);
    a stop asked at step ``stop_at``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 3, generator=generator), torch.randn(8, 1, generator=generator)) for _ in range(4)]

    def step(loop: Any, batch: Any) -> dict[str, Any]:
        x, y = batch
        # the second epoch's first batches give a loss far below every whole epoch's mean
        loss = torch.nn.functional.mse_loss(loop.model(x), y) * (0.01 if loop.state.epoch == 1 else 1.0)
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        if loop.state.step == stop_at:
            loop.request_stop("enough")
        return {"loss": loss}

    loop = hookfit.Loop(step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
                        max_epochs=3, run_dir=folder, resume=resume,
                        plugins=[Optim(), Metrics(), MetricsLog(), Checkpoint(), Console(stream=out, interval=None)])
    return loop.fit()


def _cell(out: str, folder: Path) -> str:
    """The FINAL cell of ``folder``'s row in a table whose columns are two spaces apart or more."""
    header = next(line for line in out.splitlines() if "FINAL" in line)
    row = next(line for line in out.splitlines() if str(folder) in line)
    start = header.index("FINAL")
    return row[start:].split("  ")[0].strip()


def test_a_final_value_of_an_epoch_a_stop_cut_short_is_marked_partial_everywhere(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "runs" / "stopped"
    console = io.StringIO()
    assert _train(folder, 6, console).status == "interrupted"  # after 3 of epoch 2's 4 batches
    rows = runs.epoch_rows(folder)
    cut = rows[-1]
    assert cut["stopped"] and cut["epoch"] == 2 and cut["batches"] == 3
    info = runs.load(folder)
    assert info.metric == "train/loss" and info.partial
    assert info.final == (cut["loss"], 2) and info.best == ("train/loss", rows[0]["loss"], 1)
    assert info.final[0] < info.best[1]  # a partial mean that looks better than the best whole epoch

    assert cli.main(["runs", str(folder)]) == 0
    out = capsys.readouterr().out
    assert _cell(out, folder) == f"{cut['loss']:.4g} (partial)"
    assert runs.PARTIAL in out
    assert cli.main(["runs", str(folder), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)[0]
    assert listed["final"] == {"metric": "train/loss", "value": cut["loss"], "epoch": 2, "partial": True}
    assert "partial" not in listed  # (said once, in "final")

    assert cli.main(["compare", str(folder)], plugins=[TuiRenderer()]) == 0
    out = capsys.readouterr().out
    assert _cell(out, folder) == f"{cut['loss']:.4g} (partial)"
    assert runs.PARTIAL in out

    assert cli.main(["show", str(folder), "--text"], plugins=[TuiRenderer()]) == 0
    out = capsys.readouterr().out
    shown = re.escape(f"{cut['loss']:.4g}")
    assert re.search(rf"^  loss +{shown} \(partial\) +- *$", out, re.M), out
    assert "(partial: the mean over the batches of an epoch a stop cut short" in out

    result = next(line for line in console.getvalue().splitlines() if line.startswith("hookfit result"))
    assert re.search(r" last=\S+ last_partial=true best=\S+ best_epoch=1$", result), result


def test_a_run_resumed_past_the_cut_epoch_has_a_whole_final_value(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "runs" / "resumed"
    assert _train(folder, 6, io.StringIO()).status == "interrupted"
    console = io.StringIO()
    assert _train(folder, None, console, resume="latest").status == "completed"
    info = runs.load(folder)
    assert info.final is not None and info.final[1] == 3 and not info.partial
    assert cli.main(["runs", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "(partial" not in out and runs.PARTIAL not in out
    assert "partial" not in next(line for line in console.getvalue().splitlines() if line.startswith("hookfit result"))


def test_a_stop_right_after_an_epochs_last_batch_leaves_that_epoch_whole(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The stage got every batch of its epoch: the mean is the whole epoch's, so it is the run's
    best as well as its last, in the metrics role's results, the console, the metric log and the
    tools alike, though the stop interrupted the run."""
    folder = tmp_path / "runs" / "whole"
    console = io.StringIO()
    state = _train(folder, 3, console)  # asked in epoch 1's fourth and last batch
    assert state.status == "interrupted"
    row = runs.epoch_rows(folder)[-1]
    assert row["epoch"] == 1 and row["batches"] == 4 and "stopped" not in row
    assert state.results["best"]["train/loss"] == (row["loss"], 1)
    info = runs.load(folder)
    assert not info.partial and info.final == (row["loss"], 1) and info.best == ("train/loss", row["loss"], 1)
    assert cli.main(["runs", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "(partial" not in out and runs.PARTIAL not in out
    epoch = next(line for line in console.getvalue().splitlines() if line.startswith("hookfit train epoch=1/3"))
    assert " done batches=4 " in epoch, epoch
    result = next(line for line in console.getvalue().splitlines() if line.startswith("hookfit result"))
    assert re.search(r" last=(\S+) best=\1 best_epoch=1$", result), result
