"""A run named after its script, for the checkpoint tests: copies of this file under other
names (``a.py``, ``b.py``) in one folder are runs of different names sharing ``runs/``.

``python a.py OUT [--epochs N]``: trains a small model without ``run_dir`` (so in
``runs/<name>/<date>-<time>``), with a checkpoint at every epoch, ``HOOKFIT_RESUME`` as the
environment says, and writes to OUT (JSON) the run's name, folder, what it resumed from, its
status and step, and its first parameter's sum.
"""

from __future__ import annotations

import argparse
import json

import torch

import hookfit
from hookfit.data import Batches
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--epochs", type=int, default=1)
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(40, 4, generator=g), torch.randn(40, 1, generator=g)


def step(loop, batch):
    loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    return {"loss": loss}


loop = hookfit.Loop(step, Batches(x, y, batch_size=10, shuffle=True, seed=2), model=model,
                    optimizers=torch.optim.SGD(model.parameters(), lr=0.1), max_epochs=args.epochs,
                    plugins=[Optim(), Metrics(), Checkpoint(background=False)])
state = loop.fit()
with open(args.out, "w") as f:
    json.dump({"name": loop.run.name, "run_dir": str(loop.run.run_dir), "status": state.status, "step": state.step,
               "resumed_from": None if state.resumed_from is None else state.resumed_from.source,
               "weight": float(model.weight.sum())}, f)
