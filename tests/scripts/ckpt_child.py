"""A training run for the checkpoint tests, in its own process.

``python ckpt_child.py RUN_DIR OUT [--resume] [--sleep S] [--every N] [--tell]``: trains a small
model for 3 epochs on shuffled in-memory data with a checkpoint every N steps, printing
``started`` once training runs (with ``--tell``, ``batch`` as each training batch's step function
ends), and writes the final parameters to OUT. Environment:
``KILL_AT_FSYNC=n`` kills this process with SIGKILL at the n-th ``os.fsync`` (in the middle of
a checkpoint write, after the temporary file is written and before it is renamed).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch

import hookfit
from hookfit.data import Batches
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.interrupter import Interrupter
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim

parser = argparse.ArgumentParser()
parser.add_argument("run_dir")
parser.add_argument("out")
parser.add_argument("--resume", action="store_true")
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--every", type=int, default=1)
parser.add_argument("--tell", action="store_true")
args = parser.parse_args()

if os.environ.get("KILL_AT_FSYNC"):
    left = [int(os.environ["KILL_AT_FSYNC"])]
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        left[0] -= 1
        if left[0] == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        real_fsync(fd)

    os.fsync = fsync

torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.Dropout(0.1), torch.nn.ReLU(), torch.nn.Linear(128, 1))
g = torch.Generator().manual_seed(1)
x, y = torch.randn(200, 16, generator=g), torch.randn(200, 1, generator=g)
started = []


def step(loop, batch):
    if not started:
        started.append(True)
        print("started", flush=True)
    time.sleep(args.sleep)
    loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    if args.tell:
        print("batch", flush=True)
    return {"loss": loss}


loop = hookfit.Loop(
    step, Batches(x, y, batch_size=10, shuffle=True, seed=5),
    val_step=lambda l, b: {"vloss": torch.nn.functional.mse_loss(l.model(b[0]), b[1])},
    val_data=Batches(x[:40], y[:40], batch_size=10),
    model=model, optimizers=torch.optim.Adam(model.parameters(), lr=1e-3), max_epochs=3,
    run_dir=args.run_dir, resume="latest" if args.resume else None,
    plugins=[Optim(accumulate=3), Metrics(), Interrupter(exit=False), Checkpoint(every_n_steps=args.every, keep_last=2)],
)
state = loop.fit()
metrics = loop.run.pm.get_plugin("metrics")
history = metrics.history if metrics else {}
torch.save({"params": model.state_dict(), "status": state.status, "step": state.step,
            "history": {k: [dict(e) for e in v] for k, v in history.items()}}, args.out)
print("status", state.status, state.step, flush=True)
sys.exit(0)
