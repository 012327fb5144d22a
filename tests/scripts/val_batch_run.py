"""A run whose validation batch is its own option, for
tests/plugins/distributed/test_fsdp.py: a sharded checkpoint of two processes resumed as a plain
one-process run that keeps its validation batch.

``[torchrun --nproc-per-node N] val_batch_run.py OUT --batch-size B --val-batch-size V
--epochs E [--resume PATH]``: a small regression on ``hookfit.data.Batches`` (64 training
samples, 20 validation samples, neither shuffled nor cut), with ``Distributed(strategy="fsdp")``
under torchrun (a plain process: no group, the plugin leaves the run alone) and
``Checkpoint(dir="ckpt")``. ``--batch-size`` is per process. Each process writes
``OUT.rank<N>.json``: the run's status and step (or the error that ended it), every parameter
whole as a flat list as the run resumed and ended, and the validation loss (a mean over the
samples) of every epoch.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch

import hookfit
from hookfit import hookimpl
from hookfit.data import Batches
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.distributed import Distributed
from hookfit.plugins.optim import Optim


def flat(model: torch.nn.Module) -> list[float]:
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return torch.cat([p.detach().flatten() for p in whole]).tolist()


class Record:
    """The parameters as the run resumed and ended; the validation loss of every epoch, summed
    over every sample of every process."""

    name = "record"

    def __init__(self) -> None:
        self.sums = torch.zeros(2, dtype=torch.float64)  # loss * samples, samples
        self.result: dict[str, Any] = {"valid": []}

    def add(self, loss: torch.Tensor, samples: int) -> None:
        self.sums += torch.tensor([float(loss) * samples, samples], dtype=torch.float64)

    @hookimpl
    def resumed(self, loop: Any) -> None:
        self.result["resumed_params"] = flat(loop.model)

    @hookimpl
    def stage_end(self, loop: Any, stage: str) -> None:
        if stage == "valid":
            sums = self.sums.clone()
            if loop.state.world_size > 1:
                import torch.distributed as dist

                dist.all_reduce(sums)
            self.result["valid"].append(float(sums[0] / sums[1]))
        self.sums.zero_()

    @hookimpl(tryfirst=True)
    def fit_end(self, loop: Any) -> None:
        if loop.state.status != "failed":
            self.result["params"] = flat(loop.model)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--val-batch-size", type=int, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--resume")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(84, 4, generator=g), torch.randn(84, 2, generator=g)
    record = Record()

    def step(loop: Any, batch: Any) -> dict[str, Any]:
        loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    def val_step(loop: Any, batch: Any) -> dict[str, Any]:
        loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
        record.add(loss, len(batch[0]))
        return {"loss": loss}

    loop = hookfit.Loop(step, Batches(x[:64], y[:64], batch_size=args.batch_size), val_step=val_step,
                        val_data=Batches(x[64:], y[64:], batch_size=args.val_batch_size), model=model,
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.1), max_epochs=args.epochs,
                        resume=args.resume, name="val_batch",
                        plugins=[Distributed(strategy="fsdp"), Optim(), Checkpoint(dir="ckpt"), record])
    result = record.result
    try:
        state = loop.fit()
        result.update(status=state.status, step=state.step, world_size=state.world_size)
    except Exception as error:  # noqa: BLE001 - reported in the dump
        result["error"] = f"{type(error).__name__}: {error}"
    with open(f"{args.out}.rank{os.environ.get('RANK', '0')}.json", "w") as file:
        json.dump(result, file)
    if "error" in result:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
