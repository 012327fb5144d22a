"""A short distributed job that ends as a scheduler sees it, for
tests/plugins/distributed/test_exit.py.

``torchrun --nproc-per-node 2 exit_job.py STRATEGY``: two epochs of a small regression with
``Distributed(strategy=STRATEGY)`` ("ddp" or "fsdp") and a checkpoint at every epoch's end
written in the background (a thread, and for FSDP ``torch.distributed.checkpoint``), then the
interpreter exits with nothing of hookfit's shut down by hand: the process group, its store and
the saving thread must all be gone by then. Each rank prints ``exit_job rank R completed`` last.
"""

from __future__ import annotations

import os
import sys

import torch

import hookfit
from hookfit.data import Batches
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.distributed import Distributed
from hookfit.plugins.optim import Optim


def main(strategy: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x, y = torch.randn(256, 8), torch.randn(256, 1)

    def step(loop, batch):
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(loop.model(inputs), targets)
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    loop = hookfit.Loop(step, Batches(x, y, batch_size=32, shuffle=True, seed=0), model=model,
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.05), max_epochs=2, run_dir="run",
                        plugins=[Distributed(strategy=strategy), Optim(), Checkpoint(background=True)])
    state = loop.fit()
    print(f"exit_job rank {os.environ['RANK']} {state.status}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
