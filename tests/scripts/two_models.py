"""Two models stepped by hand under ``torchrun`` with ``Distributed(wrap_model=False)``, for
tests/plugins/distributed/test_replicas.py.

``torchrun ... two_models.py MODE``: a generator and a discriminator (``Loop(model={"gen": ..., "disc": ...})``),
each with its optimizer, stepped in the step function as a GAN's are, on each rank's own part of the data.
MODE ``unwrapped``: the modules as they are, nothing synchronises their gradients; ``ddp``: each wrapped in
``DistributedDataParallel`` by the script; ``allreduce``: as they are, the step averaging the gradients itself
before each optimizer step; ``unchecked``: as ``unwrapped``, with ``Distributed(check_replicas=False)``.
Rank 0 writes ``trained.json``: the run's status and whether every rank ended with the same parameters.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import hookfit
from hookfit.plugins.distributed import Distributed
from hookfit.plugins.optim import Optim

MODE = sys.argv[1]
torch.manual_seed(0)  # the same initial weights on every rank
gen, disc = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
optimizers = {"gen": torch.optim.SGD(gen.parameters(), lr=0.1), "disc": torch.optim.SGD(disc.parameters(), lr=0.1)}
data = [torch.randn(8, 4) for _ in range(8)]
dist.init_process_group("gloo")
model: dict[str, torch.nn.Module] = {"gen": gen, "disc": disc}
if MODE == "ddp":
    model = {name: DistributedDataParallel(module) for name, module in model.items()}


def averaged(module: torch.nn.Module) -> None:
    for parameter in module.parameters():
        if parameter.grad is not None:
            dist.all_reduce(parameter.grad)
            parameter.grad /= dist.get_world_size()


def step(loop: Any, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    g, d, opts = loop.model["gen"], loop.model["disc"], loop.optimizers
    fake = g(batch)
    with opts.toggle("disc"):
        opts["disc"].zero_grad()
        d_loss = d(fake.detach()).pow(2).mean() + (d(batch) - 1).pow(2).mean()
        loop.backward(d_loss)
        if MODE == "allreduce":
            averaged(d)
        opts["disc"].step()
    with opts.toggle("gen"):
        opts["gen"].zero_grad()
        g_loss = (d(fake) - 1).pow(2).mean()
        loop.backward(g_loss)
        if MODE == "allreduce":
            averaged(g)
        opts["gen"].step()
    return {"d_loss": d_loss.detach(), "g_loss": g_loss.detach()}


loop = hookfit.Loop(step, data, model=model, optimizers=optimizers, max_epochs=2,
                    plugins=[Distributed(wrap_model=False, check_replicas=MODE != "unchecked"), Optim()])
state = loop.fit()
flat = torch.cat([p.detach().reshape(-1) for m in (gen, disc) for p in m.parameters()])
everyone = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
dist.all_gather(everyone, flat)
if dist.get_rank() == 0:
    with open("trained.json", "w") as file:
        json.dump({"status": state.status, "steps": state.step,
                   "same": all(torch.equal(t, everyone[0]) for t in everyone)}, file)
dist.destroy_process_group()
