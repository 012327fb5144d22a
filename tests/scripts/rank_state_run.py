"""A distributed run whose processes each keep a state of their own, for
tests/plugins/distributed/test_rank_state.py.

``torchrun --nproc-per-node 2 rank_state_run.py OUT STRATEGY [--kill-at STEP]``: two epochs of
a small regression with dropout, ``Distributed(strategy=STRATEGY)``, the metrics plugin, and a
checkpoint every 3 steps. Each process seeds its own random stream (``torch.manual_seed(100 +
rank)``), as scripts do for per-process augmentation and dropout, and each sees other samples,
so each process's partial sums of the epoch's loss differ. ``--kill-at STEP`` kills rank 0
with SIGKILL at the end of training step STEP, before that step's checkpoint (torchrun then
ends the job); run again
with ``HOOKFIT_RESUME=latest`` it continues from that checkpoint. Each process writes
``OUT.rank<N>.json``: the run's status, every epoch's published training loss and the
parameters, whole, as a flat list.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any

import torch

import hookfit
from hookfit import hookimpl
from hookfit.data import Batches
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.distributed import Distributed
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim


class Record:
    """The published training loss of every epoch; SIGKILL at the end of a step."""

    name = "record"

    def __init__(self, kill_at: int | None) -> None:
        self.kill_at = kill_at
        self.losses: list[float] = []

    @hookimpl
    def epoch_metrics(self, loop: Any, stage: str, metrics: Any) -> None:
        if stage == "train":
            self.losses.append(metrics.values["loss"].epoch)

    @hookimpl
    def batch_end(self, loop: Any) -> None:
        if loop.training and loop.state.step == self.kill_at and loop.is_main:
            os.kill(os.getpid(), signal.SIGKILL)  # torchrun then ends the other process


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("strategy")
    parser.add_argument("--kill-at", type=int)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.3), torch.nn.Tanh(),
                                torch.nn.Linear(32, 1))
    x, y = torch.randn(192, 8), torch.randn(192, 1)
    torch.manual_seed(100 + rank)  # each process its own stream: its dropout masks

    def step(loop: Any, batch: Any) -> dict[str, Any]:
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(loop.model(inputs), targets)
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    record = Record(args.kill_at)
    loop = hookfit.Loop(step, Batches(x, y, batch_size=16, shuffle=True, seed=1), model=model,
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.05), max_epochs=2, run_dir="run",
                        plugins=[Distributed(strategy=args.strategy), Optim(), Metrics(),
                                 Checkpoint(every_n_steps=3, background=False, keep_last=20), record])
    state = loop.fit()
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    with open(f"{args.out}.rank{rank}.json", "w") as out:
        json.dump({"status": state.status, "step": state.step, "losses": record.losses,
                   "params": torch.cat([p.detach().flatten() for p in params]).tolist()}, out)


if __name__ == "__main__":
    main()
