"""The console's ``hookfit result`` lines agree with ``results["best"]``: a metric never finite
has no best (nor extremes)."""

from __future__ import annotations

import io
import math
from pathlib import Path

import torch

import hookfit
from hookfit.plugins.console import Console
from hookfit.plugins.metrics import Metrics

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

