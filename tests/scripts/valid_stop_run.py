"""A distributed run stopped inside a validation, for tests/plugins/distributed/test_valid_stop.py.

``torchrun --nproc-per-node 2 valid_stop_run.py OUT [--resume latest] [--hold-signal | --ask-on-rank-1]``:
three epochs of a small regression with dropout, ``Distributed()``, the interrupter and a checkpoint
(none saved by the epoch: only the stop's). Each process seeds its own random stream. The validation data
is a ``DataLoader`` without a generator of its own: making its iterator draws a seed from torch's global
generator, so a resumed run whose random state is not the validation's start draws other dropout masks
from then on. 81 validation samples in batches of 4: the ranks' parts are 11 and 10 batches.

``--hold-signal``: the second epoch's validation, at its second batch, writes ``validating.rank<N>`` and
waits until this process has a stop request (the test sends SIGTERM to torchrun once both files exist).
``--ask-on-rank-1``: rank 1 asks for a stop at that batch itself and writes ``asked``; rank 0 waits at its
own second batch until that file exists. ``--ask-after-rank-1-ends``: rank 1 writes ``ended`` as that
validation's ``stage_end`` fires there; rank 0 waits at its last batch until that file exists, then asks for a
stop. Each process writes ``OUT.rank<N>.json``: the run's status and
stop reason, its validation batches of each epoch, and the parameters as a flat list.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.distributed import Distributed
from hookfit.plugins.interrupter import Interrupter
from hookfit.plugins.optim import Optim

WAIT = 120.0
"""The most seconds a validation batch waits for its condition: the test fails after it."""


def wait_for(done: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {WAIT:g} s for {what}")
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--resume")
    parser.add_argument("--hold-signal", action="store_true")
    parser.add_argument("--ask-on-rank-1", action="store_true")
    parser.add_argument("--ask-after-rank-1-ends", action="store_true")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(145, 4, generator=g), torch.randn(145, 1, generator=g)
    train = DataLoader(TensorDataset(x[:64], y[:64]), batch_size=8, shuffle=True,
                       generator=torch.Generator().manual_seed(2))
    valid = DataLoader(TensorDataset(x[64:], y[64:]), batch_size=4)
    torch.manual_seed(100 + rank)  # each process its own stream: its dropout masks
    validated: dict[int, int] = {}

    def step(loop: Any, batch: Any) -> dict[str, Any]:
        loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    def val_step(loop: Any, batch: Any) -> dict[str, Any]:
        epoch = loop.state.epoch
        validated[epoch] = validated.get(epoch, 0) + 1
        if epoch == 1 and loop.state.batch_idx == 10 and rank == 0 and args.ask_after_rank_1_ends:
            wait_for(Path("ended").exists, "the end of rank 1's validation")
            loop.request_stop("asked by rank 0's last validation batch")
        elif epoch == 1 and loop.state.batch_idx == 1 and args.resume is None:
            if args.hold_signal:
                Path(f"validating.rank{rank}").write_text("")
                wait_for(lambda: loop.stop_requested is not None, "the SIGTERM's stop request")
            elif args.ask_on_rank_1 and rank == 1:
                loop.request_stop("asked by rank 1's validation")
                Path("asked").write_text("")
            elif args.ask_on_rank_1:
                wait_for(Path("asked").exists, "rank 1's stop request")
        return {"vloss": torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1]), "noise": torch.rand(())}

    class Ends:
        name = "ends"

        @hookfit.hookimpl
        def stage_end(self, loop: Any, stage: str) -> None:
            if stage == "valid" and loop.state.epoch == 1 and rank == 1 and args.ask_after_rank_1_ends:
                Path("ended").write_text("")

    loop = hookfit.Loop(step, train, val_step=val_step, val_data=valid, model=model,
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.05), max_epochs=3, run_dir="run",
                        resume=args.resume, plugins=[Distributed(), Optim(), Interrupter(exit=False), Ends(),
                                                     Checkpoint(every_n_epochs=None, background=False)])
    state = loop.fit()
    with open(f"{args.out}.rank{rank}.json", "w") as out:
        json.dump({"status": state.status, "reason": state.stop_reason, "validated": validated,
                   "params": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()}, out)


if __name__ == "__main__":
    main()
