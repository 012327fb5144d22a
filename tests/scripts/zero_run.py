"""A run whose optimizer shards its state over the processes (``ZeroRedundancyOptimizer``), for
tests/plugins/optim/test_zero.py.

``torchrun --nproc-per-node 2 zero_run.py OUT [--max-steps N] [--hand]``: two epochs of 6 batches a
process of a small regression, DDP (``Distributed()``), ``ZeroRedundancyOptimizer`` over Adam, and a
checkpoint every 4 steps; ``HOOKFIT_RESUME=latest`` continues the run's latest checkpoint. The script
initialises the process group itself: the optimizer needs it when it is built. ``--hand`` first
trains the same model the same way in a hand-written DDP and ZeRO loop. Each process writes
``OUT.rank<N>.json``: the run's status and step, its parameters as a flat list, and the hand loop's.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import hookfit
from hookfit.data import Batches
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.distributed import Distributed
from hookfit.plugins.optim import Optim

EPOCHS = 2


def built() -> tuple[torch.nn.Module, ZeroRedundancyOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)


def flat(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--hand", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(192, 8, generator=generator), torch.randn(192, 1, generator=generator)
    data = Batches(x, y, batch_size=16).shard(rank, dist.get_world_size())  # this process's 6 batches
    out: dict[str, Any] = {}
    if args.hand:
        model, optimizer = built()
        ddp = DistributedDataParallel(model)
        for _ in range(EPOCHS):
            for inputs, targets in data:
                loss = torch.nn.functional.mse_loss(ddp(inputs), targets)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        out["hand"] = flat(model)

    def step(loop: Any, batch: Any) -> None:
        inputs, targets = batch
        loop.backward(torch.nn.functional.mse_loss(loop.model(inputs), targets))
        loop.optimizers.step()
        loop.optimizers.zero_grad()

    model, optimizer = built()
    state = hookfit.Loop(step, data, model=model, optimizers=optimizer, max_epochs=EPOCHS, max_steps=args.max_steps,
                         run_dir="run", plugins=[Distributed(), Optim(),
                                                 Checkpoint(every_n_steps=4, background=False, keep_last=20)]).fit()
    out.update(status=state.status, step=state.step, params=flat(model))
    with open(f"{args.out}.rank{rank}.json", "w") as file:
        json.dump(out, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
