"""A small run for the identity, concurrency and smoke tests (tests/core/test_identity.py).

``python identity_train.py OUT [--epochs N] [--run-dir DIR] [--hold DIR]``: trains a small
model with a checkpoint at every epoch (``HOOKFIT_RESUME``, ``HOOKFIT_SMOKE`` as the
environment says) and writes to OUT (JSON) the run's name, identity, folder, what it resumed
from, its status and step, and its first parameter's sum. ``--hold DIR``: after the first batch,
writes ``DIR/ready`` and waits until ``DIR/go`` exists (or the process is killed).
A failure is written to stderr and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import hookfit
from hookfit.data import Batches
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--run-dir")
parser.add_argument("--hold")
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(40, 4, generator=g), torch.randn(40, 1, generator=g)
held = False


def step(loop, batch):
    global held
    loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    if args.hold and not held:
        held = True
        hold = Path(args.hold)
        (hold / "ready").write_text(str(loop.run_dir))
        while not (hold / "go").exists():
            time.sleep(0.05)  # polls for the test's go-ahead (or its kill -9)
    return {"loss": loss}


loop = hookfit.Loop(step, Batches(x, y, batch_size=10, shuffle=True, seed=2), model=model,
                    optimizers=torch.optim.SGD(model.parameters(), lr=0.1), max_epochs=args.epochs,
                    run_dir=args.run_dir, plugins=[Optim(), Metrics(), Checkpoint(background=False)])
state = loop.fit()
with open(args.out, "w") as f:
    json.dump({"name": loop.run.name, "identity": loop.run.identity.key, "run_dir": str(loop.run.run_dir),
               "status": state.status, "step": state.step,
               "resumed_from": None if state.resumed_from is None else str(state.resumed_from.source),
               "weight": float(model.weight.detach().sum())}, f)
