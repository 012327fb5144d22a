"""A training run over a stream (a ``DataLoader`` over an ``IterableDataset``: no length), for
the dashboard's end-to-end test of progress without a total (tmux).

``python streaming_dashboard.py OUT [--delay SECONDS] [--batches N]``: 2 epochs of N batches
(default: many more than the test waits for), ``--delay`` seconds a step. Writes ``OUT.pid`` at
the start and ``OUT`` (JSON: status, step) after ``fit()`` returned; the run folder is ``OUT``'s
folder's ``run``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch.utils.data import DataLoader, IterableDataset

import hookfit

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--delay", type=float, default=0.05)
parser.add_argument("--batches", type=int, default=100_000)
args = parser.parse_args()
with open(args.out + ".pid", "w") as f:
    f.write(str(os.getpid()))


class Stream(IterableDataset):
    def __iter__(self):
        generator = torch.Generator().manual_seed(0)
        for _ in range(args.batches * 4):
            yield torch.randn(4, generator=generator), torch.randn(1, generator=generator)


torch.manual_seed(0)
model = torch.nn.Linear(4, 1)


def step(loop, batch):
    time.sleep(args.delay)
    loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    return {"loss": loss}


loop = hookfit.Loop(step, DataLoader(Stream(), batch_size=4), model=model, max_epochs=2,
                    optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
                    run_dir=os.path.join(os.path.dirname(args.out), "run"))
state = loop.fit()
with open(args.out, "w") as f:
    json.dump({"status": state.status, "step": state.step, "reason": state.stop_reason}, f)
