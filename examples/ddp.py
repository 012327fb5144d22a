"""The same script on one process or many: data-parallel training with torchrun.

    python examples/ddp.py                                   # one process
    torchrun --nproc-per-node 2 examples/ddp.py              # two processes on this machine

and on two machines (run the same command on both; the first one's address is the meeting
point, port 29500 open between them)::

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --master-addr 10.0.0.1 --master-port 29500 examples/ddp.py
    torchrun --nnodes 2 --node-rank 1 --nproc-per-node 1 --master-addr 10.0.0.1 --master-port 29500 examples/ddp.py

Nothing in the script is about processes: under torchrun the ``distributed`` plugin wraps the
model in DistributedDataParallel, gives each process its part of the data, sums the metrics
over the processes and lets only rank 0 print. The one rule: the step calls ``loop.model(x)``
(the wrapped model), not the ``model`` variable.

``--strategy fsdp`` shards the parameters, gradients and optimizer states over the processes
(FSDP2) instead of copying the model to each; checkpoints are then written by every process
with ``torch.distributed.checkpoint`` and can be resumed on another number of processes, with
the same global batch (``--batch-size`` times the number of processes)::

    torchrun --nproc-per-node 2 examples/ddp.py --strategy fsdp --epochs 2 --batch-size 32 --run-dir runs/fsdp
    python examples/ddp.py --strategy fsdp --epochs 3 --batch-size 64 --run-dir runs/fsdp --resume latest

The task is a small synthetic regression (a fixed random teacher network plus noise), so the
script needs nothing but torch. ``--batch-size`` is per process: ``n`` processes with batch
``b`` train exactly like one process with batch ``n * b``. The other options exist for the
tests (``tests/plugins/distributed/test_distributed.py``): injected stops, failures and hangs, a dump of every
rank's parameters and metrics per epoch, and a count of DDP's gradient all-reduces.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

import hookfit
from hookfit import hookimpl


def make_data(samples: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of the regression: ``y = teacher(x) + noise``."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 16, generator=generator)
    w1 = torch.randn(16, 32, generator=generator) / 4
    w2 = torch.randn(32, 1, generator=generator) / 4
    y = torch.tanh(x @ w1) @ w2 + 0.05 * torch.randn(samples, 1, generator=generator)
    return x, y


def batches_of(x: torch.Tensor, y: torch.Tensor, batch_size: int, kind: str, shuffle: bool) -> Any:
    """The data in the form ``kind`` asks for: hookfit Batches, a DataLoader or a list."""
    if kind == "batches":
        from hookfit.data import Batches

        return Batches(x, y, batch_size=batch_size, shuffle=shuffle, seed=0)
    if kind == "loader":
        from torch.utils.data import DataLoader, TensorDataset

        return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle)
    return [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, len(x), batch_size)]


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter, whole (a sharded one gathered from every rank), in one flat tensor."""
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return torch.cat([p.detach().flatten() for p in whole])


class Dump:
    """Records, per epoch, this rank's parameters and the published epoch metrics, and the
    end of the run; :meth:`write` puts it in ``<path>.rank<N>.json``."""

    name = "dump"

    def __init__(self, path: str, model: torch.nn.Module, count_allreduce: bool) -> None:
        self.path = path
        self.model = model
        self.count_allreduce = count_allreduce
        self.record: dict[str, Any] = {"epochs": [], "metrics": [], "allreduces": 0}

    @hookimpl
    def fit_start(self, loop: Any) -> None:
        self.record["world_size"] = loop.state.world_size
        self.record["model_type"] = type(loop.model).__name__
        if self.count_allreduce and hasattr(loop.model, "register_comm_hook"):
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
                allreduce_hook,
            )

            def counting(state, bucket):  # no annotations: DDP checks them against its own types
                self.record["allreduces"] += 1
                return allreduce_hook(state, bucket)

            loop.model.register_comm_hook(None, counting)

    @hookimpl
    def epoch_metrics(self, loop: Any, stage: str, metrics: Any) -> None:
        self.record["metrics"].append({"epoch": loop.state.epoch, "stage": stage, "samples": metrics.samples,
                                       **{k: v.epoch for k, v in metrics.values.items()}})

    @hookimpl
    def resumed(self) -> None:
        self.record["resumed_params"] = flat_params(self.model).tolist()

    @hookimpl
    def epoch_end(self, epoch: int) -> None:
        self.record["epochs"].append({"epoch": epoch, "params": flat_params(self.model).tolist()})

    @hookimpl
    def fit_end(self, loop: Any) -> None:
        state = loop.state
        self.record.update(rank=state.rank, status=state.status, reason=state.stop_reason,
                           step=state.step, epoch=state.epoch, params=flat_params(self.model).tolist())

    def write(self, loop: Any) -> None:
        """Write the record, with what ``loop.model`` is once the run is over."""
        self.record["model_after_fit"] = type(loop.model).__name__
        with open(f"{self.path}.rank{loop.state.rank}.json", "w") as file:
            json.dump(self.record, file)


def _record(function: Any) -> Any:
    """torchrun's ``record``: every failing rank's error and traceback (with hookfit's notes
    on where it came from) go to torchrun's end-of-run summary."""
    try:
        from torch.distributed.elastic.multiprocessing.errors import record
    except ImportError:  # pragma: no cover - a torch without torch.distributed
        return function
    return record(function)


@_record
def main(argv: list[str] | None = None) -> hookfit.State:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2048, help="training samples (validation: a quarter)")
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--data", choices=("batches", "loader", "list"), default="batches")
    parser.add_argument("--shuffle", action="store_true")
    parser.add_argument("--accumulate", type=int, default=1, help="gradient accumulation (optim)")
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp",
                        help="under torchrun: DDP, or FSDP2 (parameters and optimizer states sharded)")
    parser.add_argument("--stop-on-rank", type=int, help="this rank asks for a stop ...")
    parser.add_argument("--stop-at-batch", type=int, default=3, help="... in this training batch")
    parser.add_argument("--fail-on-rank", type=int, help="this rank raises ...")
    parser.add_argument("--fail-at-batch", type=int, default=3, help="... in this training batch")
    parser.add_argument("--hang-on-rank", type=int, help="this rank sleeps --hang-seconds ...")
    parser.add_argument("--hang-at-batch", type=int, default=3, help="... in this training batch")
    parser.add_argument("--hang-seconds", type=float, default=600.0)
    parser.add_argument("--dump", help="write <DUMP>.rank<N>.json: params and metrics per epoch")
    parser.add_argument("--count-allreduce", action="store_true", help="count DDP's all-reduces (in --dump)")
    parser.add_argument("--no-val", action="store_true")
    parser.add_argument("--run-dir", help="the run's folder (default: a new runs/ddp/<date>-<time>)")
    parser.add_argument("--resume", help="'latest' (the newest checkpoint of --run-dir) or a checkpoint")
    args = parser.parse_args(argv)

    torch.manual_seed(0)  # the same initial model everywhere (DDP copies rank 0's anyway)
    x, y = make_data(args.samples + args.samples // 4)
    train = batches_of(x[:args.samples], y[:args.samples], args.batch_size, args.data, args.shuffle)
    valid = batches_of(x[args.samples:], y[args.samples:], args.batch_size, args.data, False)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    rank = int(os.environ.get("RANK", "0"))  # for the injected faults only

    def train_step(loop: hookfit.Loop, batch: Any) -> dict[str, Any]:
        inputs, targets = batch
        if args.fail_on_rank == rank and loop.state.batch_idx == args.fail_at_batch:
            raise RuntimeError(f"injected failure on rank {rank}")
        if args.hang_on_rank == rank and loop.state.batch_idx == args.hang_at_batch:
            time.sleep(args.hang_seconds)
        if args.stop_on_rank == rank and loop.state.batch_idx == args.stop_at_batch:
            loop.request_stop(f"injected stop at batch {loop.state.batch_idx}")
        outputs = loop.model(inputs)  # loop.model: under torchrun, the DDP-wrapped model
        loss = torch.nn.functional.mse_loss(outputs, targets)
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss, "mae": (outputs.detach() - targets).abs().mean()}

    def val_step(loop: hookfit.Loop, batch: Any) -> dict[str, Any]:
        inputs, targets = batch
        return {"loss": torch.nn.functional.mse_loss(loop.model(inputs), targets)}

    from hookfit.plugins.optim import Optim

    plugins: list[Any] = [Optim(accumulate=args.accumulate)]
    if args.strategy != "ddp":
        from hookfit.plugins.distributed import Distributed

        plugins.append(Distributed(strategy=args.strategy))
    dump = Dump(args.dump, model, args.count_allreduce) if args.dump else None
    if dump is not None:
        plugins.append(dump)
    loop = hookfit.Loop(
        train_step, train, val_step=None if args.no_val else val_step, val_data=None if args.no_val else valid,
        model=model, optimizers=torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        max_epochs=args.epochs, run_dir=args.run_dir, resume=args.resume, plugins=plugins,
    )
    try:
        state = loop.fit()
    finally:
        if dump is not None:
            dump.write(loop)
    if state.rank == 0:
        print(f"ddp example: {state.status} after {state.step} steps on {state.world_size} process(es)")
    return state


if __name__ == "__main__":
    final = main()
    raise SystemExit(0 if final.status in ("completed", "interrupted") else 1)
