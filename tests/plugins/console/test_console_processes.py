"""The console's lines on rank 0 of several processes, in this process: a plugin sets
``loop.state.rank`` and ``world_size`` as the distributed plugin does under ``torchrun`` (the
metrics are then this process's, nothing reducing them). Batches count the whole job's, every
process running as many training batches; ``every_n_batches`` counts them so. A real
``torchrun`` job: ``tests/plugins/distributed/test_console_ranks.py``."""

from __future__ import annotations

import io
import re
from typing import Any

import hookfit
from hookfit.plugins.console import Console
from hookfit.plugins.metrics import Metrics


class Ranks:
    """What the distributed plugin does at ``configure`` under ``torchrun``, for the run's state."""

    name = "ranks"

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    @hookfit.hookimpl
    def configure(self, loop: Any) -> None:
        loop.state.rank, loop.state.world_size = 0, self.world_size


def lines(world_size: int, every: int) -> list[str]:
    console = Console(stream=io.StringIO(), interval=None, every_n_batches=every)
    plugins = [Ranks(world_size), console, Metrics(interval=0)]
    hookfit.Loop(lambda loop, batch: {"loss": float(batch)}, list(range(10)), val_step=lambda loop, batch: {"loss": batch},
                 val_data=[1.0, 2.0, 3.0], max_epochs=1, plugins=plugins).fit()
    assert isinstance(console.stream, io.StringIO)
    return console.stream.getvalue().splitlines()


def test_batches_are_the_jobs_and_every_n_batches_counts_them() -> None:
    # 3 processes, 10 batches each: the job's count goes 3, 6, ... 30; a line where it reaches
    # or passes a multiple of 4 (at 6, 9, 12 ...: 4, 8, 12 ...), with the values of that batch
    printed = lines(world_size=3, every=4)
    assert re.match(r"hookfit start epochs=1 batches_per_epoch=30 processes=3 plugins=", printed[0]), printed[0]
    progress = [line for line in printed if line.startswith("hookfit train epoch=1/1 batch=")]
    assert [line.split()[3] for line in progress] == [f"batch={n}/30" for n in (6, 9, 12, 18, 21, 24, 30)], progress
    assert all("metrics_at_batch" not in line and " loss=" in line for line in progress), progress
    assert [line.split()[3:5] for line in printed if " done " in line] == [["done", "batches=30"],
                                                                            ["done", "samples=3"]], printed
    assert [line.split()[2:4] for line in printed if line.startswith("hookfit time ")] == [
        ["stage=train", "rank=0"], ["stage=valid", "rank=0"]], printed


def test_one_process_prints_as_it_always_did() -> None:
    printed = lines(world_size=1, every=4)
    assert re.match(r"hookfit start epochs=1 batches_per_epoch=10 plugins=", printed[0]), printed[0]
    progress = [line.split()[3] for line in printed if line.startswith("hookfit train epoch=1/1 batch=")]
    assert progress == ["batch=4/10", "batch=8/10"]
    assert [line.split()[4] for line in printed if " done " in line] == ["batches=10", "batches=3"], printed
    assert not [line for line in printed if "rank=" in line or "processes=" in line], printed
