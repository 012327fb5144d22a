"""Validation on several processes against one, for tests/test_distributed.py.

``python exact_validation.py OUT MODE``, or under ``torchrun``: three validation sets of 41
samples, one of each kind the distributed plugin shards (``hookfit.data.Batches``, a shuffled
``DataLoader``, a list of batches of 4: 11 batches), sizes that divide by no number of
processes. MODE ``validate``: ``loop.validate()`` alone (the same weights everywhere);
``fit``: a training run validating inside the training stage every 3 steps
(``val_every_n_steps``). The metrics are published at every batch (``Metrics(interval=0)``: a
collective per validation batch would hang on parts of different lengths). One run a
process: a second run in the same torchrun process re-creates the process group, which is not
what this checks. MODE ``sampler``: ``loop.validate()`` of one set, a shuffled ``DataLoader``
given a ``DistributedSampler`` of its own (torch's: it pads 41 samples to 42 on 2 processes).
It writes ``OUT.rank<N>.json``: every validation's published epoch metrics and samples, the
batches this process validated, and the warnings it saw.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hookfit
from hookfit.data import Batches
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim


class Published:
    name = "published"

    def __init__(self) -> None:
        self.rows: list[dict] = []

    @hookfit.hookimpl
    def epoch_metrics(self, stage, metrics) -> None:
        if stage == "valid":
            self.rows.append({"step": metrics.step, "samples": metrics.samples,
                              **{k: v.epoch for k, v in metrics.values.items()}})


def loop(model: torch.nn.Module, published: Published, counted: list, **kwargs) -> hookfit.Loop:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)
    vx, vy = torch.randn(41, 4, generator=g), torch.randn(41, 1, generator=g)
    sets = {"batches": Batches(vx, vy, batch_size=4),
            "loader": DataLoader(TensorDataset(vx, vy), batch_size=4, shuffle=True),
            "list": [(vx[i:i + 4], vy[i:i + 4]) for i in range(0, 41, 4)]}
    if kwargs.pop("own_sampler", False):
        dataset = TensorDataset(vx, vy)
        own = DistributedSampler(dataset, num_replicas=world, rank=int(os.environ.get("RANK", "0")), shuffle=True)
        sets = {"own": DataLoader(dataset, batch_size=4, sampler=own)}

    def train(run, batch):
        loss = torch.nn.functional.mse_loss(run.model(batch[0]), batch[1])
        run.backward(loss)
        run.optimizers.step()
        run.optimizers.zero_grad()
        return loss

    def valid(run, batch):
        counted.append(len(batch[0]))
        error = run.model(batch[0]) - batch[1]
        return {"mse": (error ** 2).mean(), "mae": error.abs().mean()}

    # world processes with batch 8 // world train like one process with batch 8
    return hookfit.Loop(train, Batches(x, y, batch_size=8 // world), val_step=valid, val_data=sets, model=model,
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.1), max_epochs=2,
                        plugins=[Optim(), Metrics(interval=0), published], **kwargs)


def main(out: str, mode: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    published, counted = Published(), []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if mode in ("validate", "sampler"):
            state = loop(model, published, counted, own_sampler=mode == "sampler").validate()
        else:
            state = loop(model, published, counted, val_every_n_steps=3).fit()
    assert state.status == "completed", state
    with open(f"{out}.rank{state.rank}.json", "w") as file:
        json.dump({"rows": published.rows, "batches": counted, "world_size": state.world_size,
                   "threads": native_threads(), "warned": [str(w.message) for w in caught]}, file)


def native_threads() -> list[str]:
    """The names of this process's threads (Linux): gloo's workers are ``pt_gloo_runloop``."""
    folder = "/proc/self/task"
    if not os.path.isdir(folder):
        return []
    names = []
    for task in os.listdir(folder):
        try:
            with open(f"{folder}/{task}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(names)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
