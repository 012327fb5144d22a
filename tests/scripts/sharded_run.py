"""A small FSDP2 run with sharded checkpoints, for tests/plugins/checkpoint/test_sharded_trust.py.

``torchrun --nproc-per-node 2 sharded_run.py OUT --dir CKPT [--epochs N] [--resume latest|PATH]
[--fallback] [--squeeze-at EPOCH]``: trains a small regression (``Distributed(strategy="fsdp")``,
``Checkpoint(dir=CKPT, keep_last=10)``, a checkpoint at every epoch's end). ``--squeeze-at``
limits the size of any file this process writes to 600 bytes from that epoch's start on
(``RLIMIT_FSIZE``: the kernel refuses the write with ``EFBIG``, as a full disk refuses with
``ENOSPC``), so that epoch's checkpoint cannot be written. Each process writes
``OUT.rank<N>.json``: the run's status and step (or the error that ended it), the checkpoint
plugin's failed saves, the checkpoint it resumed from, the warnings it caught (category and
message) and every parameter, whole, as a flat list.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import warnings
from typing import Any

import torch

import hookfit
from hookfit.data import Batches
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.distributed import Distributed
from hookfit.plugins.optim import Optim


class Squeeze:
    """From the start of epoch ``at`` (counted from 1), no file of this process may grow past
    600 bytes; lifted at the run's end."""

    name = "squeeze"

    def __init__(self, at: int) -> None:
        self.at = at
        self.limits: tuple[int, int] | None = None

    @hookfit.hookimpl
    def epoch_start(self, epoch: int) -> None:
        if epoch + 1 == self.at:
            self.limits = resource.getrlimit(resource.RLIMIT_FSIZE)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
            resource.setrlimit(resource.RLIMIT_FSIZE, (600, self.limits[1]))

    @hookfit.hookimpl
    def fit_end(self) -> None:
        if self.limits is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, self.limits)


class Params:
    """Every parameter, whole (gathered from every rank), as a flat list, at the run's end."""

    name = "params"

    def __init__(self) -> None:
        self.flat: list[float] | None = None

    @hookfit.hookimpl(tryfirst=True)
    def fit_end(self, loop: Any) -> None:
        if loop.state.status != "failed":
            whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in loop.model.parameters()]
            self.flat = torch.cat([p.detach().flatten() for p in whole]).tolist()


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, Batches, Any]:
    """The run's model, optimizer, data and step function (a test resumes its checkpoints in
    its own process with them)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, 2, generator=g)

    def step(loop: Any, batch: Any) -> dict[str, Any]:
        loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    return model, torch.optim.Adam(model.parameters(), lr=0.01), Batches(x, y, batch_size=4), step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--resume")
    parser.add_argument("--fallback", action="store_true")
    parser.add_argument("--squeeze-at", type=int)
    args = parser.parse_args()

    model, optimizer, data, step = build()
    checkpoint = Checkpoint(dir=args.dir, keep_last=10, fallback=args.fallback)
    params = Params()
    plugins: list[Any] = [Distributed(strategy="fsdp"), Optim(), checkpoint, params]
    if args.squeeze_at is not None:
        plugins.append(Squeeze(args.squeeze_at))
    loop = hookfit.Loop(step, data, model=model, max_epochs=args.epochs, optimizers=optimizer, resume=args.resume,
                        name="sharded", plugins=plugins)
    result: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            state = loop.fit()
            result.update(status=state.status, step=state.step)
        except Exception as error:  # noqa: BLE001 - reported in the dump
            result["error"] = f"{type(error).__name__}: {error}"
    rank = int(os.environ.get("RANK", "0"))
    result.update(
        failed_saves=checkpoint.failed_saves,
        resumed_from=None if checkpoint.resumed_from is None else str(checkpoint.resumed_from),
        warnings=[[w.category.__name__, str(w.message)] for w in caught],
        params=params.flat,
    )
    with open(f"{args.out}.rank{rank}.json", "w") as file:
        json.dump(result, file)
    if "error" in result:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
