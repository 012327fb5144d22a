"""Several runs in one torchrun job, for tests/plugins/distributed/test_job.py.

``torchrun --nproc-per-node 2 dist_runs.py OUT``: three runs, a ``Loop`` after a ``Loop``, in
each process, as a script that trains, then evaluates, does:

1. ``fit()`` with a two-pass optimizer plugin (Sharpness-Aware Minimization, written here)
   given to the ``Loop`` under the name ``optim``, so it replaces the built-in: the step's
   pass, then a second pass in the closure given to ``loop.optimizers.step(closure)``. It
   answers ``should_sync_gradients`` ``False`` for the first pass and ``True`` for the
   closure's. Recorded per batch: the answers asked, DDP's all-reduces (a comm hook) during
   each pass, and the gradients each pass left. Two observers watch: one with ``every_rank =
   True``, one without.
2. ``fit()`` with the built-in optim and a ``time_budget`` plugin that asks for a stop on
   every rank at the same batch (``should_stop``); console and metrics log enabled through
   ``HOOKFIT_PLUGINS``, the run folder ``OUT.run2``.
3. ``validate()`` of a test set on a new ``Loop``.
4. ``validate()`` with data each process shards itself (``Distributed(shard_data=False)``), a
   training batch more on rank 1.

Then :func:`hookfit.plugins.distributed.shutdown`. It writes ``OUT.rank<N>.json``.

``python dist_runs.py OUT exit`` (one process, ``RANK``/``WORLD_SIZE``/``MASTER_*`` set by
the test, no torchrun): one run, then, at exit, whether the group hookfit made was destroyed
before the interpreter finalizes (an ``atexit`` handler registered before it, so run after
it) in ``OUT.exit.json``.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

import hookfit
from hookfit import hookimpl
from hookfit.plugins.distributed import Distributed, shutdown

RHO = 0.05


def flat_grads(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.grad.detach().flatten() for p in model.parameters()]).tolist()


class TwoPass:
    """``loop.optimizers`` of :class:`SAM`: ``step(closure)`` perturbs the weights along the
    first pass's gradient, runs ``closure`` (the second pass) there, and steps the base
    optimizer from the original weights with the second pass's gradients."""

    def __init__(self, plugin: SAM, base: torch.optim.Optimizer) -> None:
        self.plugin, self.base = plugin, base

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.base.param_groups

    def step(self, closure: Any) -> None:
        plugin, params = self.plugin, [p for g in self.base.param_groups for p in g["params"]]
        plugin.passed("first")
        kept = [p.detach().clone() for p in params]
        with torch.no_grad():
            norm = torch.norm(torch.stack([p.grad.norm() for p in params]))
            for p in params:
                p.add_(p.grad * (RHO / (norm + 1e-12)))
        self.base.zero_grad()
        plugin.in_closure = True
        try:
            closure()
        finally:
            plugin.in_closure = False
        plugin.passed("second")
        with torch.no_grad():
            for p, weights in zip(params, kept):
                p.copy_(weights)  # back to the weights of the first pass, exactly
        if (call := plugin.loop.hooks.before_optimizer_step) is not None:
            call(plugin.loop, "default", self.base)
        self.base.step()
        if (call := plugin.loop.hooks.after_optimizer_step) is not None:
            call(plugin.loop, "default", self.base)

    def zero_grad(self) -> None:
        self.base.zero_grad()


class SAM:
    """An optimizer plugin that runs two passes per batch (the optimizer role of core/hooks.md)."""

    name = "optim"  # replaces the built-in optim for this Loop

    def __init__(self) -> None:
        self.in_closure = False
        self.loop: Any = None
        self.model: Any = None
        self.record: dict[str, Any] = {"asked": [], "batches": []}
        self.allreduces = 0
        self._counted = 0

    @hookimpl
    def configure(self, loop: Any) -> None:
        self.loop = loop
        loop.optimizers = TwoPass(self, loop.optimizers)

    @hookimpl
    def fit_start(self, loop: Any) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def counting(state, bucket):  # no annotations: DDP checks them against its own types
            self.allreduces += 1
            return allreduce_hook(state, bucket)

        loop.model.register_comm_hook(None, counting)  # loop.model: the DDP wrapper here
        self.model = loop.model.module

    @hookimpl
    def backward(self, loop: Any, loss: torch.Tensor) -> bool:
        loss.backward()
        return True

    @hookimpl
    def should_sync_gradients(self, loop: Any) -> bool:
        self.record["asked"].append([loop.state.step, self.in_closure])
        return self.in_closure  # the closure's pass is the one the step uses

    def passed(self, which: str) -> None:
        """After a pass's backward: the all-reduces it made and the gradients it left."""
        if which == "first":
            self.record["batches"].append({})
        self.record["batches"][-1][which] = {"allreduces": self.allreduces - self._counted,
                                             "grads": flat_grads(self.model)}
        self._counted = self.allreduces


class Watcher:
    """An observer recording the events it receives."""

    observer = True

    def __init__(self, name: str) -> None:
        self.name = name
        self.events: list[Any] = []

    @hookimpl
    def fit_start(self, loop: Any) -> None:
        self.events.append(["fit_start", loop.state.rank])

    @hookimpl
    def epoch_metrics(self, loop: Any, stage: str, metrics: Any) -> None:
        self.events.append(["epoch_metrics", stage, metrics.epoch, {k: v.epoch for k, v in metrics.values.items()}])

    @hookimpl
    def fit_end(self, loop: Any) -> None:
        self.events.append(["fit_end", loop.state.status])


class EveryRank(Watcher):
    every_rank = True  # stays registered on every rank under torchrun


class TimeBudget:
    name = "time_budget"

    @hookimpl
    def should_stop(self, loop: Any) -> str | None:
        return "time budget spent" if loop.training and loop.state.step >= 3 else None


def data(seed: int, batches: int) -> list[Any]:
    """``batches`` batches of 8 per process (the distributed plugin takes every other one)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8 * batches * world, 4, generator=g)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(len(x), 1, generator=g)
    return [(x[i:i + 8], y[i:i + 8]) for i in range(0, len(x), 8)]


def train_step(loop: Any, batch: Any) -> Any:
    x, y = batch
    loss = torch.nn.functional.mse_loss(loop.model(x), y)
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    return {"loss": loss}


def sam_step(loop: Any, batch: Any) -> Any:
    x, y = batch
    loss = torch.nn.functional.mse_loss(loop.model(x), y)
    loop.backward(loss)

    def closure() -> torch.Tensor:
        again = torch.nn.functional.mse_loss(loop.model(x), y)
        loop.backward(again)
        return again

    loop.optimizers.step(closure)
    loop.optimizers.zero_grad()
    return {"loss": loss}


def val_step(loop: Any, batch: Any) -> Any:
    x, y = batch
    return {"loss": torch.nn.functional.mse_loss(loop.model(x), y)}


def params(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def native_threads() -> list[str]:
    """The names of this process's threads (Linux): gloo's workers are ``pt_gloo_runloop``."""
    names = []
    for task in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(names)


def job(out: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    record: dict[str, Any] = {}

    # 1. a two-pass optimizer; observers with and without every_rank
    sam, every, plain = SAM(), EveryRank("every_rank_watcher"), Watcher("rank0_watcher")
    first = hookfit.Loop(sam_step, data(1, 3), val_step=val_step, val_data=data(2, 1), model=model,
                         optimizers=torch.optim.SGD(model.parameters(), lr=0.05), max_epochs=2,
                         plugins=[sam, every, plain])
    state = first.fit()
    record["first"] = {"status": state.status, "rank": state.rank, "params": params(model), **sam.record,
                       "every_rank": every.events, "plain": plain.events,
                       "group_kept": dist.is_initialized()}

    # 2. the built-in optim; a stop every rank asks for at the same batch
    second = hookfit.Loop(train_step, data(3, 6), model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
                          max_epochs=2, run_dir=f"{out}.run2", plugins=[TimeBudget()])
    state = second.fit()
    request = second.run.stop_requested
    record["second"] = {"status": state.status, "step": state.step, "reason": state.stop_reason,
                        "by": state.stopped_by, "ranks": None if request is None else list(request.ranks or ()),
                        "request_by": None if request is None else request.by}

    # 3. a test set on a new Loop
    test = EveryRank("every_rank_watcher")
    third = hookfit.Loop(train_step, data(3, 1), val_step=val_step, val_data=data(4, 2), model=model, plugins=[test])
    state = third.validate()
    record["third"] = {"status": state.status, "events": test.events}

    # 4. data each process shards itself, a training batch more on rank 1: an evaluation reads no
    # training data, so the lengths differ harmlessly (a fit of it is refused: test_job.py)
    rank = dist.get_rank()
    fourth = hookfit.Loop(train_step, data(5, 2)[:2 + rank], val_step=val_step, val_data=data(6, 1)[rank::2],
                          model=model, plugins=[Distributed(shard_data=False)])
    record["uneven_validate"] = fourth.validate().status

    record["shutdown"] = shutdown()
    record["after_shutdown"] = {"initialized": dist.is_initialized(),
                                "gloo_threads": [t for t in native_threads() if "gloo" in t]}
    with open(f"{out}.rank{record['first']['rank']}.json", "w") as file:
        json.dump(record, file)


def at_exit(out: str) -> None:
    """One run, nothing destroyed by the script: hookfit's atexit handler must do it."""
    seen: dict[str, Any] = {}

    def last() -> None:  # registered before hookfit's handler, so called after it
        seen["initialized_at_exit"] = dist.is_initialized()
        with open(f"{out}.exit.json", "w") as file:
            json.dump(seen, file)

    atexit.register(last)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    state = hookfit.Loop(train_step, data(1, 2), model=model,
                         optimizers=torch.optim.SGD(model.parameters(), lr=0.05)).fit()
    seen.update(status=state.status, world_size=state.world_size, initialized_after_fit=dist.is_initialized())


def uneven(out: str) -> None:
    """Streams each process reads itself (``shard_data=False``, no length): first as many training batches on
    every rank (two epochs, validation streams of 2 and 5 batches), then rank 1's two training batches short. Each
    run's status, or the error it ends with and its notes, to ``OUT.uneven<rank>.json`` (a process gloo aborts
    writes nothing)."""
    rank = int(os.environ["RANK"])

    class Stream:  # no length: its batches are known by reading them
        def __init__(self, batches: int) -> None:
            self.batches = batches

        def __iter__(self):
            for i in range(self.batches):
                yield torch.full((2, 4), float(i)), torch.zeros(2, 1)

    seen: dict[str, Any] = {}
    for name, batches, epochs in (("even", 3, 2), ("uneven", 6 - 2 * rank, 1)):
        model = torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.BatchNorm1d(1))  # (buffers DDP broadcasts)
        loop = hookfit.Loop(train_step, Stream(batches), model=model, max_epochs=epochs,
                            optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
                            val_step=val_step, val_data=Stream(2 + 3 * rank),  # validation streams may differ
                            plugins=[Distributed(shard_data=False, timeout=10)])
        try:
            state = loop.fit()
            seen[name] = {"error": None, "status": state.status, "step": state.step}
        except Exception as error:  # noqa: BLE001 - what each process ends with is the result
            seen[name] = {"error": f"{type(error).__name__}: {error}", "notes": getattr(error, "__notes__", [])}
    with open(f"{out}.uneven{rank}.json", "w") as file:
        json.dump(seen, file)

def raising(out: str) -> None:
    """Streams each process reads itself (``shard_data=False``, no length), 3 training batches on each; rank 1's
    raises ``OSError`` as it runs out, after the epoch's last collective operation, while rank 0 waits in the store
    for rank 1's stream to end. The error each run ends with, and its notes, to ``OUT.raising<rank>.json``."""
    rank = int(os.environ["RANK"])

    class Stream:  # no length; rank 1's fails where it ends
        def __iter__(self):
            for i in range(3):
                yield torch.full((2, 4), float(i)), torch.zeros(2, 1)
            if rank == 1:
                raise OSError("shard file truncated")

    model = torch.nn.Linear(4, 1)
    loop = hookfit.Loop(train_step, Stream(), model=model, max_epochs=1,
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
                        plugins=[Distributed(shard_data=False, timeout=60)])
    try:
        state = loop.fit()
        seen: dict[str, Any] = {"error": None, "status": state.status}
    except Exception as error:  # noqa: BLE001 - what each process ends with is the result
        seen = {"error": f"{type(error).__name__}: {error}", "notes": getattr(error, "__notes__", [])}
    with open(f"{out}.raising{rank}.json", "w") as file:
        json.dump(seen, file)


if __name__ == "__main__":
    if sys.argv[2:] == ["exit"]:
        at_exit(sys.argv[1])
    elif sys.argv[2:] == ["uneven"]:
        uneven(sys.argv[1])
    elif sys.argv[2:] == ["raising"]:
        raising(sys.argv[1])
    else:
        job(sys.argv[1])
