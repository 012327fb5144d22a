"""A loss that is not finite on one process only, for tests/plugins/distributed/test_nonfinite_ranks.py.

``torchrun --nproc-per-node 2 nonfinite_ranks.py POLICY [defer]``: two epochs of 4 batches a process of a small
regression, DDP (``Distributed()``) and ``Optim(nonfinite=POLICY)`` (``skip`` or ``raise``; ``defer``:
``defer=True``, the device path) on the CPU, rank 0's loss made NaN at the run's step 2 (the first epoch's third
batch, which messages call batch 3).
Each process writes ``out.rank<N>.json``: the run's status and step, the error it raised (type and message) if any,
the steps its optimizer took and those ``step_skipped`` announced, the skips it counted, optim's warnings, and (a
run that ended) whether every rank holds the same parameters.
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist

import hookfit
from hookfit.plugins.distributed import Distributed
from hookfit.plugins.optim import Optim, OptimWarning

BAD_STEP = 2


class Steps:
    """The steps taken and skipped, as optim announces them."""

    name = "steps"

    def __init__(self) -> None:
        self.taken: list[int] = []
        self.skipped: list[list[Any]] = []

    @hookfit.hookimpl
    def after_optimizer_step(self, loop: Any) -> None:
        self.taken.append(loop.state.step)

    @hookfit.hookimpl
    def step_skipped(self, reason: str, step: int) -> None:
        self.skipped.append([reason, step])


def step(loop: Any, batch: Any) -> dict[str, torch.Tensor]:
    x, y = batch
    loss = torch.nn.functional.mse_loss(loop.model(x), y)
    if loop.state.rank == 0 and loop.state.step == BAD_STEP:
        loss = loss * float("nan")
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    return {"loss": loss.detach()}


torch.manual_seed(0)  # the same model on every rank; the data sharded by the plugin
model = torch.nn.Linear(4, 1)
data = [(torch.randn(4, 4), torch.randn(4, 1)) for _ in range(8)]
steps = Steps()
loop = hookfit.Loop(step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                    max_epochs=2, plugins=[Distributed(), Optim(nonfinite=sys.argv[1], defer=sys.argv[2:] == ["defer"] or None),
                                           steps])
error: BaseException | None = None
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        loop.fit()
    except Exception as exc:  # under "raise": written below
        error = exc
rank, same = loop.state.rank, None
if error is None:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    same = all(torch.equal(t, everyone[0]) for t in everyone) and bool(torch.isfinite(flat).all())
with open(f"out.rank{rank}.json", "w") as file:
    json.dump({"status": loop.state.status, "step": loop.state.step, "taken": steps.taken, "skipped": steps.skipped,
               "counted": loop.state.results.get("skipped_steps"),
               "error": None if error is None else [type(error).__name__, str(error)], "same": same,
               "warnings": [str(w.message) for w in caught if issubclass(w.category, OptimWarning)]}, file)
