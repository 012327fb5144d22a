"""Both trackers under torchrun, for tests/plugins/wandb/test_wandb.py.

``torchrun --nproc-per-node 2 tracker_dist.py``, in a folder: every process trains 2 epochs of
4 batches (its part of 8), given ``MLflow`` (a SQLite store, ``mlflow.db`` in the folder) and
``WandB`` (W&B's mode and folders from the environment; its files in the run folder ``run``),
the distributed plugin discovered. Each process writes ``rank<N>.json``: the world size, the
trackers still registered at ``fit_start``, the published training epoch means
(``[step, value]``), the run's name and the tracker runs' ids. ``tracker_dist.py resume``: a third
epoch, resumed from the run's latest checkpoint with ``Checkpoint(strict=True)``, the trackers given
on rank 0 only, as scripts do (``resumed<N>.json``).
"""

from __future__ import annotations

import json
import os
import sys

import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.mlflow import MLflow
from hookfit.plugins.optim import Optim
from hookfit.plugins.wandb import WandB


class Seen:
    """Not an observer: it stays on every rank, and sees what each rank has."""

    name = "seen"

    def __init__(self) -> None:
        self.trackers: list[str] = []
        self.train_loss: list[list[float]] = []

    @hookfit.hookimpl
    def fit_start(self, loop) -> None:
        self.trackers = [name for name in ("mlflow", "wandb") if loop.pm.get_plugin(name) is not None]

    @hookfit.hookimpl
    def epoch_metrics(self, stage, metrics) -> None:
        if stage == "train":
            self.train_loss.append([metrics.step, metrics.values["loss"].epoch])


def main() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 2, generator=g), torch.randn(4, 1, generator=g)) for _ in range(8)]
    model = torch.nn.Linear(2, 1)

    def step(loop, batch):
        loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    resume = sys.argv[1:] == ["resume"]
    seen, mlflow, wandb = Seen(), MLflow(tracking_uri="sqlite:///mlflow.db"), WandB()
    trackers = [mlflow, wandb] if not resume or os.environ["RANK"] == "0" else []  # resumed: given on rank 0 only
    plugins = [Optim(), Metrics(interval=0.0), *trackers, seen, Checkpoint(strict=True, background=False)]
    loop = hookfit.Loop(step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                        max_epochs=3 if resume else 2, run_dir="run", plugins=plugins,
                        resume="latest" if resume else None)
    state = loop.fit()
    rank = state.rank
    out = {"world_size": state.world_size, "name": loop.run.name, "trackers": seen.trackers, "train_loss": seen.train_loss,
           "mlflow": mlflow.run_id, "wandb": wandb.run_id, "status": state.status, "step": state.step}
    with open(f"{'resumed' if resume else 'rank'}{rank}.json", "w") as file:
        json.dump(out, file)
    assert os.environ.get("WORLD_SIZE") == "2"


if __name__ == "__main__":
    main()
