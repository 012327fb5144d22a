"""A training run over a shuffled ``DataLoader`` in its own process, for the resume tests of
the loaders users bring.

``python stateful_child.py RUN_DIR OUT [--loader stateful|plain] [--workers N] [--no-shuffle]
[--kill-at STEP] [--resume] [--raw]``: trains a small model with dropout for 3 epochs over a
shuffled (or, with ``--no-shuffle``, unshuffled) torchdata
``StatefulDataLoader`` (which restores its own position) or a plain torch ``DataLoader``
(which the core skips); both draw their seeds from the global generator. A checkpoint is
written every step; the final parameters and the samples each step saw go to OUT. With
``--kill-at STEP`` the process kills itself with SIGKILL as soon as the checkpoint of that
step is announced whole (``checkpoint_saved``), so no exit path of hookfit runs. With ``--raw``
the same training runs as a plain PyTorch loop, without hookfit: what a script ported to
hookfit must still equal.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.optim import Optim

parser = argparse.ArgumentParser()
parser.add_argument("run_dir")
parser.add_argument("out")
parser.add_argument("--loader", choices=("stateful", "plain"), default="stateful")
parser.add_argument("--workers", type=int, default=0)
parser.add_argument("--kill-at", type=int, default=None)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--no-shuffle", action="store_true")
parser.add_argument("--raw", action="store_true")
args = parser.parse_args()

torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(32, 1))
g = torch.Generator().manual_seed(1)
x, y = torch.randn(100, 8, generator=g), torch.randn(100, 1, generator=g)
ids = torch.arange(100)
Loader = StatefulDataLoader if args.loader == "stateful" else torch.utils.data.DataLoader
data = Loader(torch.utils.data.TensorDataset(x, y, ids), batch_size=5, shuffle=not args.no_shuffle,
              num_workers=args.workers)
seen: list[list[int]] = []


def step(loop, batch):
    xb, yb, ib = batch
    seen.append(ib.tolist())
    loss = torch.nn.functional.mse_loss(loop.model(xb), yb)
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    return {"loss": loss}


class KillAt:
    name = "kill_at"

    @hookfit.hookimpl
    def checkpoint_saved(self, step):
        if step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


if args.raw:  # the original script, as it was before it was ported
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(3):
        for xb, yb, ib in data:
            seen.append(ib.tolist())
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    torch.save({"params": model.state_dict(), "status": "completed", "step": len(seen), "seen": seen}, args.out)
else:
    plugins = [Optim(), Checkpoint(every_n_steps=1, keep_last=2)]
    if args.kill_at is not None:
        plugins.append(KillAt())
    state = hookfit.Loop(step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
                         max_epochs=3, run_dir=args.run_dir, resume="latest" if args.resume else None,
                         plugins=plugins).fit()
    torch.save({"params": model.state_dict(), "status": state.status, "step": state.step, "seen": seen}, args.out)
