"""A training run for tests/integration/test_role_packages.py, in a venv where hookfit-sam-optim
and hookfit-snapshot-metrics are installed; which plugins run, and their options, come from the
environment (``HOOKFIT_DISABLE_PLUGINS``/``HOOKFIT_PLUGINS``, ``HOOKFIT_CONFIG``).

``python role_train.py OUT [options]``, or under ``torchrun``: a small regression on a list of
``(x, y, ids)`` batches (under torchrun each process gets every n-th batch), SGD with momentum
given to the ``Loop``, a step doing Sharpness-Aware Minimization's two passes (``loop.backward``,
then ``loop.optimizers.step(closure)``). The validation step reports a scripted ``score`` per
epoch (for early stopping and the checkpoint's monitor) and the mean target. A probe plugin
records what the tests check (every pass, every ``should_sync_gradients`` answer, every
optimizer step, every snapshot, the weights validation saw, DDP's gradient all-reduces); the
record goes to ``OUT.rank<N>.json`` after ``fit()``. ``--reference`` adds the weights a
hand-written SAM (plain torch, no hookfit) reaches over the same batches and windows.
``--block-at-step K`` writes ``OUT.blocked`` in the step of global step K and waits there for
ever (the test kills the process).
"""

from __future__ import annotations

import argparse
import copy
import json
import threading
import time
from pathlib import Path
from typing import Any

import torch

import hookfit

SCORES = [0.5, 0.875, 0.75, 0.625, 0.9375, 0.96875]  # dyadic: exact means; best (max) at epoch 2 of 4

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--run-dir")
parser.add_argument("--resume")
parser.add_argument("--epochs", type=int, default=6)
parser.add_argument("--batches", type=int, default=10, help="training batches per epoch, over every process")
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--rho", type=float, default=0.05, help="for --reference: sam_optim's rho")
parser.add_argument("--accumulate", type=int, default=1, help="for --reference: sam_optim's accumulate")
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--reference", action="store_true")
parser.add_argument("--block-at-step", type=int)
parser.add_argument("--sleep", type=float, default=0.0, help="seconds per training step")
args = parser.parse_args()

torch.manual_seed(0)
samples = args.batches * args.batch_size
x = torch.randn(samples + 64, 8)
y = torch.sin(x @ torch.randn(8, 1)) + 0.1 * torch.randn(samples + 64, 1)
ids = torch.arange(samples + 64)
cut = [(i, i + args.batch_size) for i in range(0, samples, args.batch_size)]
train = [(x[a:b], y[a:b], ids[a:b]) for a, b in cut]
valid = [(x[i:i + 16], y[i:i + 16], ids[i:i + 16]) for i in range(samples, samples + 64, 16)]
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
initial = copy.deepcopy(model.state_dict())
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)


def vector(tensors: Any) -> list[float]:
    return torch.cat([t.detach().flatten() for t in tensors]).tolist()


def grads() -> list[float]:
    return vector(p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters())


def loss_and_mae(net: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets, _ = batch
    predicted = net(inputs)
    return torch.nn.functional.mse_loss(predicted, targets), (predicted - targets).abs().mean()


class Probe:
    """Records what the test checks; takes part in training (on every process)."""

    name = "probe"

    def __init__(self) -> None:
        self.record: dict[str, Any] = {"batches": [], "steps": [], "updates": [], "epochs": [], "valid": [],
                                       "saved": [], "resumed": None, "allreduces": 0, "per_epoch": []}
        self.current: dict[str, Any] = {}
        self.mine: dict[tuple[str, int], dict[str, list[float]]] = {}

    @hookfit.hookimpl
    def fit_start(self, loop: Any) -> None:
        opts = loop.optimizers
        self.record.update(rank=loop.state.rank, world_size=loop.state.world_size, model=type(loop.model).__name__,
                           optimizers_type=f"{type(opts).__module__}.{type(opts).__qualname__}")
        if hasattr(loop.model, "register_comm_hook"):
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def counting(state, bucket):  # no annotations: DDP checks them against its own
                self.record["allreduces"] += 1
                return allreduce_hook(state, bucket)

            loop.model.register_comm_hook(None, counting)

    @hookfit.hookimpl
    def resumed(self, info: Any) -> None:
        self.record["resumed"] = {"source": str(info.source), "epoch": info.epoch, "step": info.step,
                                  "batch": info.batch, "stage": info.stage}

    @hookfit.hookimpl
    def batch_start(self, loop: Any, batch: Any, batch_idx: int) -> None:
        if loop.training:
            self.current = {"epoch": loop.state.epoch, "batch": batch_idx, "step": loop.state.step,
                            "ids": batch[2].tolist(), "before": 0, "after": 0, "sync": [], "first_grads": None}
            self.record["batches"].append(self.current)

    @hookfit.hookimpl
    def before_backward(self, loop: Any) -> None:
        self.current["before"] += 1

    @hookfit.hookimpl
    def after_backward(self, loop: Any) -> None:
        self.current["after"] += 1
        if self.current["after"] == 1:  # SAM's first pass: this process's gradients alone
            self.current["first_grads"] = grads()

    @hookfit.hookimpl(wrapper=True)
    def should_sync_gradients(self, loop: Any) -> Any:
        answer = yield
        self.current["sync"].append(answer)
        return answer

    @hookfit.hookimpl
    def before_optimizer_step(self, loop: Any, name: str) -> None:
        self.record["steps"].append({"epoch": loop.state.epoch, "batch": loop.state.batch_idx, "name": name,
                                     "stage": loop.state.stage, "grads": grads()})

    @hookfit.hookimpl
    def after_optimizer_step(self, loop: Any) -> None:
        self.record["steps"][-1]["params"] = vector(model.parameters())

    @hookfit.hookimpl
    def batch_end(self, loop: Any, output: Any, batch: Any) -> None:
        if output is None:
            return
        mine = self.mine.setdefault((loop.state.stage, loop.state.epoch), {})
        size = len(batch[0])
        for key, value in output.items():
            value = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
            total = mine.setdefault(key, [0.0, 0.0])
            total[0] += value * size
            total[1] += size

    @hookfit.hookimpl
    def metrics_update(self, stage: str, metrics: Any) -> None:
        self.record["updates"].append({"stage": stage, "epoch": metrics.epoch, "batches": metrics.batches,
                                       "final": metrics.final, "history": len(metrics.history),
                                       "values": {k: [v.last, v.running, v.epoch] for k, v in metrics.values.items()}})

    @hookfit.hookimpl
    def epoch_metrics(self, loop: Any, stage: str, metrics: Any) -> None:
        mine = self.mine.get((stage, metrics.epoch), {})
        self.record["epochs"].append({
            "stage": stage, "epoch": metrics.epoch, "step": metrics.step, "batches": metrics.batches,
            "total": metrics.total, "samples": metrics.samples, "final": metrics.final,
            "max_epochs": metrics.max_epochs,
            "values": {k: [v.last, v.running, v.epoch] for k, v in metrics.values.items()},
            "best": dict(metrics.best), "lr": dict(metrics.lr), "history": [dict(h) for h in metrics.history],
            "mine": {k: total / count for k, (total, count) in mine.items()}, "state_stage": loop.state.stage})

    @hookfit.hookimpl
    def epoch_end(self, epoch: int) -> None:
        self.record["per_epoch"].append({"epoch": epoch, "params": vector(model.parameters())})

    @hookfit.hookimpl(optionalhook=True)
    def checkpoint_saved(self, path: str, reason: str, step: int) -> None:
        self.record["saved"].append({"path": path, "reason": reason, "step": step})


probe = Probe()


def train_step(loop: Any, batch: Any) -> dict[str, Any]:
    if loop.state.step == args.block_at_step:
        Path(f"{args.out}.blocked").write_text(str(loop.state.step))
        threading.Event().wait()  # until the test kills the process
    if args.sleep:
        time.sleep(args.sleep)
    loss, mae = loss_and_mae(loop.model, batch)  # loop.model: DDP under torchrun
    loop.backward(loss)

    def closure() -> torch.Tensor:
        again, _ = loss_and_mae(loop.model, batch)
        loop.backward(again)
        return again

    loop.optimizers.step(closure)
    loop.optimizers.zero_grad()
    return {"loss": loss, "mae": mae, "const": 0.25}


def val_step(loop: Any, batch: Any) -> dict[str, Any]:
    if loop.state.batch_idx == 0:
        probe.record["valid"].append({"epoch": loop.state.epoch, "step": loop.state.step,
                                      "params": vector(model.parameters())})
    loss, mae = loss_and_mae(loop.model, batch)
    return {"loss": loss, "mae": mae, "score": SCORES[loop.state.epoch % len(SCORES)], "target": batch[1].mean()}


def reference(batches: list[dict[str, Any]], world_size: int) -> list[float]:
    """Hand-written SAM over the batches the run trained on (each process's n-th batch of
    ``train``), in plain torch: per batch the gradient g, the gradient at w + rho g/||g|| of the
    loss divided by the window's size, summed over the window and averaged over the processes,
    then one SGD step per window (a partial window at the epoch's end)."""
    net = copy.deepcopy(model)
    net.load_state_dict(initial)
    params = list(net.parameters())
    sgd = torch.optim.SGD(params, lr=args.lr, momentum=0.9)
    per_rank = len(train) // world_size
    epochs: dict[int, list[int]] = {}
    for entry in batches:
        epochs.setdefault(entry["epoch"], []).append(entry["batch"])
    for epoch, indices in sorted(epochs.items()):
        assert indices == list(range(per_rank)), (epoch, indices)
        total = [torch.zeros_like(p) for p in params]
        for k in indices:
            start = k - k % args.accumulate
            size = min(args.accumulate, per_rank - start)
            for rank in range(world_size):
                batch = train[k * world_size + rank]
                g = torch.autograd.grad(loss_and_mae(net, batch)[0], params)
                norm = torch.sqrt(sum((gi ** 2).sum() for gi in g))
                saved = [p.detach().clone() for p in params]
                with torch.no_grad():
                    for p, gi in zip(params, g):
                        p.add_(gi * (args.rho / (norm + 1e-12)))
                sharp = torch.autograd.grad(loss_and_mae(net, batch)[0] / size, params)
                with torch.no_grad():
                    for p, w in zip(params, saved):
                        p.copy_(w)
                for t, gi in zip(total, sharp):
                    t += gi / world_size
            if (k + 1) % args.accumulate == 0 or k == per_rank - 1:
                for p, t in zip(params, total):
                    p.grad = t
                sgd.step()
                total = [torch.zeros_like(p) for p in params]
    return vector(params)


kwargs: dict[str, Any] = {"resume": args.resume} if args.resume else {}
loop = hookfit.Loop(train_step, train, val_step=val_step, val_data=valid, model=model, optimizers=optimizer,
                    max_epochs=args.epochs, run_dir=args.run_dir, plugins=[probe], **kwargs)
state = loop.fit()
record = probe.record
ema = loop.run.pm.get_plugin("ema")
record.update(valid_target=float(y[samples:].mean()), status=state.status, reason=state.stop_reason,
              by=state.stopped_by, step=state.step, epoch=state.epoch, params=vector(model.parameters()),
              results=json.loads(json.dumps(dict(state.results), default=str)),
              ema=vector(ema.module.parameters()) if getattr(ema, "module", None) is not None else None)
if args.reference and state.rank == 0:
    record["reference"] = reference(record["batches"], state.world_size)
with open(f"{args.out}.rank{state.rank}.json", "w") as file:
    json.dump(record, file)
raise SystemExit(0 if state.status in ("completed", "interrupted") else 1)
