"""A training run for tests/test_replaceable.py, with whichever metrics plugin the environment
enables (the tests: ``mean_metrics`` from the hookfit-mean-metrics package, ``metrics``
disabled).

``python replaced_metrics.py OUT [options]``: a small regression whose steps return a tensor
loss, a tensor ``mae``, an int ``const``, a float ``half``, and values that must be ignored (a
vector, a string). The last batch of each stage is smaller than the others, so weighting by the
batch size matters. ``--valid-losses a,b,...`` makes the validation ``loss`` of epoch ``e`` the
scripted ``a, b, ...`` (plus ``0.01 * batch_idx``). ``--checkpoint-dir`` adds the built-in
checkpoint plugin, ``Checkpoint(monitor="valid/loss", keep_last=1)``, with that run folder.
``--sleep`` seconds per training step (for the dashboard).

The script keeps its own batch-size-weighted sums of every scalar its steps return, and writes
OUT (JSON) after ``fit()``: every ``epoch_metrics`` snapshot as published, every
``metrics_update`` snapshot, each with the script's own means at that moment, and how the run
ended.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from typing import Any

import torch

import hookfit
from hookfit.data import Batches

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--train-samples", type=int, default=100)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--valid-losses", help="comma-separated validation losses, one per epoch")
parser.add_argument("--checkpoint-dir")
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--best", help="the console's best directions, as JSON (Console(best=...))")
args = parser.parse_args()
scripted = [float(v) for v in args.valid_losses.split(",")] if args.valid_losses else None

torch.manual_seed(0)
generator = torch.Generator().manual_seed(0)
x = torch.randn(args.train_samples + 40, 8, generator=generator)
y = x @ torch.randn(8, 1, generator=generator) + 0.1 * torch.randn(len(x), 1, generator=generator)
train = Batches(x[:args.train_samples], y[:args.train_samples], batch_size=args.batch_size)
valid = Batches(x[args.train_samples:], y[args.train_samples:], batch_size=args.batch_size)
model = torch.nn.Linear(8, 1)

# the script's own account: (stage, epoch) -> key -> [sum of value * batch size, sum of sizes]
sums: dict[tuple[str, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))


def account(loop: Any, batch: Any, output: dict[str, Any]) -> dict[str, Any]:
    n = len(batch[0])
    mine = sums[(loop.state.stage, loop.state.epoch)]
    for key in ("loss", "mae", "const", "half"):
        value = output[key]
        value = float(value.item()) if isinstance(value, torch.Tensor) else float(value)
        mine[key][0] += value * n
        mine[key][1] += n
    output.update(vector=torch.ones(3), name="not a number")  # not scalars: ignored
    return output


def means(stage: str, epoch: int) -> dict[str, float]:
    return {key: total / count for key, (total, count) in sums[(stage, epoch)].items()}


def train_step(loop: Any, batch: Any) -> dict[str, Any]:
    if args.sleep:
        time.sleep(args.sleep)
    inputs, targets = batch
    error = model(inputs) - targets
    loss = error.pow(2).mean()
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    return account(loop, batch, {"loss": loss, "mae": error.detach().abs().mean(), "const": 3, "half": 0.5})


def val_step(loop: Any, batch: Any) -> dict[str, Any]:
    inputs, targets = batch
    error = model(inputs) - targets
    loss = error.pow(2).mean()
    if scripted is not None:
        loss = torch.tensor(scripted[loop.state.epoch] + 0.01 * loop.state.batch_idx)
    return account(loop, batch, {"loss": loss, "mae": error.abs().mean(), "const": 3, "half": 0.5})


def published(stage: str, metrics: Any) -> dict[str, Any]:
    return {
        "stage": stage, "epoch": metrics.epoch, "max_epochs": metrics.max_epochs, "step": metrics.step,
        "batches": metrics.batches, "total": metrics.total, "samples": metrics.samples, "final": metrics.final,
        "values": {k: list(v) for k, v in metrics.values.items()}, "lr": dict(metrics.lr),
        "history": [dict(entry) for entry in metrics.history], "mine": means(stage, metrics.epoch),
    }


class Record:
    """What the metrics plugin published, as the other plugins received it."""

    name = "record"

    def __init__(self) -> None:
        self.epochs: list[dict[str, Any]] = []
        self.updates: list[dict[str, Any]] = []

    @hookfit.hookimpl
    def metrics_update(self, stage: str, metrics: Any) -> None:
        self.updates.append(published(stage, metrics))

    @hookfit.hookimpl
    def epoch_metrics(self, stage: str, metrics: Any) -> None:
        self.epochs.append(published(stage, metrics))


record = Record()
plugins: list[Any] = [record]
if args.best:
    from hookfit.plugins.console import Console

    plugins.append(Console(best=json.loads(args.best)))
if args.checkpoint_dir:
    from hookfit.plugins.checkpoint import Checkpoint

    plugins.append(Checkpoint(monitor="valid/loss", keep_last=1))
loop = hookfit.Loop(train_step, train, val_step=val_step, val_data=valid, model=model,
                    optimizers=torch.optim.SGD(model.parameters(), lr=0.05), max_epochs=args.epochs,
                    run_dir=args.checkpoint_dir, plugins=plugins)
outcome = "returned"
try:
    try:
        loop.fit()
    except KeyboardInterrupt:
        outcome = "KeyboardInterrupt"
finally:
    with open(args.out, "w") as file:
        json.dump({"outcome": outcome, "status": loop.state.status, "reason": loop.state.stop_reason,
                   "step": loop.state.step, "epochs": record.epochs, "updates": record.updates}, file)
