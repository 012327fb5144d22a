"""A training run for tests/test_replaceable.py, with whichever optimizer plugin the environment
enables (the tests: ``plain_optim`` from the hookfit-plain-optim package, ``optim`` disabled).

``python replaced_optim.py OUT [options]``, or under ``torchrun``: a small regression (the
teacher network of examples/ddp.py) on ``hookfit.data.Batches``, SGD with momentum; the step
drives ``loop.backward`` and ``loop.optimizers.step()/zero_grad()``. It writes
``OUT.rank<N>.json``: the parameters after every epoch and at the end, what ``loop.optimizers``
was, for every training batch the ``should_sync_gradients`` answer and the optimizer steps that
followed it, the learning rate of every epoch, DDP's gradient all-reduces (``--count-allreduce``)
and how the run ended.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

import torch

import hookfit
from hookfit.data import Batches

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--samples", type=int, default=960, help="training samples (validation: 64 more)")
parser.add_argument("--batch-size", type=int, default=32, help="per process")
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--gamma", type=float, help="a StepLR(step_size=1) stepped by the script at every epoch's end")
parser.add_argument("--shuffle", action="store_true")
parser.add_argument("--run-dir")
parser.add_argument("--stop-at-step", type=int, help="request a stop in the step of this global step (0-based)")
parser.add_argument("--count-allreduce", action="store_true")
args = parser.parse_args()

torch.manual_seed(0)
generator = torch.Generator().manual_seed(0)
x = torch.randn(args.samples + 64, 16, generator=generator)
teacher = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
with torch.no_grad():
    y = teacher(x) + 0.05 * torch.randn(len(x), 1, generator=generator)
train = Batches(x[:args.samples], y[:args.samples], batch_size=args.batch_size, shuffle=args.shuffle, seed=0)
valid = Batches(x[args.samples:], y[args.samples:], batch_size=args.batch_size)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.gamma) if args.gamma else None


def params() -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


class Probe:
    """Records what the test checks; steps the scheduler at the end of every epoch."""

    name = "probe"

    def __init__(self) -> None:
        self.record: dict[str, Any] = {"epochs": [], "lr": [], "batches": [], "allreduces": 0}

    @hookfit.hookimpl
    def fit_start(self, loop: Any) -> None:
        # hooks.md: an optimizer plugin puts its objects in loop.optimizers at configure
        opts = loop.optimizers
        self.record.update(
            rank=loop.state.rank, world_size=loop.state.world_size, model=type(loop.model).__name__,
            optimizers_mapping=isinstance(opts, Mapping), optimizer_names=list(opts) if isinstance(opts, Mapping) else None,
            optimizers_type=f"{type(opts).__module__}.{type(opts).__qualname__}",
        )
        if args.count_allreduce and hasattr(loop.model, "register_comm_hook"):
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def counting(state, bucket):  # no annotations: DDP checks them against its own
                self.record["allreduces"] += 1
                return allreduce_hook(state, bucket)

            loop.model.register_comm_hook(None, counting)

    @hookfit.hookimpl
    def batch_start(self, loop: Any) -> None:
        if loop.training:
            ask = loop.hooks.should_sync_gradients
            self.record["batches"].append([loop.state.epoch, loop.state.batch_idx, ask(loop) if ask else None, 0])

    @hookfit.hookimpl
    def after_optimizer_step(self, loop: Any) -> None:
        self.record["batches"][-1][3] += 1  # the steps after a batch's start: its window's

    @hookfit.hookimpl
    def epoch_end(self, loop: Any, epoch: int) -> None:
        self.record["epochs"].append({"epoch": epoch, "params": params()})
        self.record["lr"].append(optimizer.param_groups[0]["lr"])
        if scheduler is not None:
            scheduler.step()

    @hookfit.hookimpl
    def fit_end(self, loop: Any) -> None:
        state = loop.state
        self.record.update(status=state.status, reason=state.stop_reason, step=state.step, params=params())


def train_step(loop: Any, batch: Any) -> dict[str, Any]:
    if loop.state.step == args.stop_at_step:
        loop.request_stop("stopped by the test")
    inputs, targets = batch
    loss = torch.nn.functional.mse_loss(loop.model(inputs), targets)  # loop.model: DDP under torchrun
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    return {"loss": loss}


def val_step(loop: Any, batch: Any) -> dict[str, Any]:
    inputs, targets = batch
    return {"loss": torch.nn.functional.mse_loss(loop.model(inputs), targets)}


probe = Probe()
loop = hookfit.Loop(train_step, train, val_step=val_step, val_data=valid, model=model, optimizers=optimizer,
                    max_epochs=args.epochs, run_dir=args.run_dir, plugins=[probe])
state = loop.fit()
with open(f"{args.out}.rank{state.rank}.json", "w") as file:
    json.dump(probe.record, file)
raise SystemExit(0 if state.status in ("completed", "interrupted") else 1)
