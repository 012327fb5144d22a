"""The checkpoint plugin's results on every process, for tests/plugins/checkpoint.

``torchrun --nproc-per-node 2 results_ddp.py OUT``: trains a small regression for 3 epochs
with ``Checkpoint(monitor="valid/loss", mode="max", keep_last=1)`` (the loss falls, so the best
by this monitor is the first epoch's checkpoint, kept beside the last one), in a new run folder
of the run's name (``runs/results/<date>-<time>``, which only rank 0 makes). Each process
writes ``OUT.rank<N>.json``: its ``state.results``, the plugin's ``best`` and ``last``, the
validation losses it saw and whether the files exist.

``torchrun --nproc-per-node 2 results_ddp.py --failing OUT``: one epoch of 8 steps with
one-file checkpoints every 2 steps into ``run/``, the main process's writes of steps 2 and 8
failing as on a full disk; each process writes ``OUT.rank<N>.json``: its status, step, checkpoint
results and the files its plugin lists as kept. ``--failing-monitored OUT``: checkpoints by
``valid/loss`` at validations every 4 steps and the epoch's end (step 8 twice), the main
process's write of step 4 failing, the processes' timeout 30 s. ``--raising OUT``: as ``--failing``
with ``on_save_error="raise"``, max_steps=7, only the main process's write at the end (step 7) failing: each process
writes its status and the error it raised, if any; ``--raising-foreground OUT``: the same, written in the
foreground (``background=False``: the end's own save raises it). ``--repeat OUT``: two epochs of 8
steps with checkpoints every 4 steps and at each epoch's end (steps 8 and 16 are both); each process
writes the files its writer wrote, one entry per write, and the checkpoints announced to it.
``--failing-best OUT``: three epochs, checkpoints of the best by ``valid/loss`` only (``mode="max"`` over a
falling loss: epoch 1's), the main process's write of it failing; each process writes its status.
``--seconds OUT``: one epoch with ``every_seconds=3600``, the other process's clock jumping an hour (the
main process's clock read after the first step, then a second of training later: after the epoch); each process writes its status and the
checkpoints its plugin lists. ``--one-rank OUT`` and ``--one-rank-alone OUT``: a ``Checkpoint(every_n_steps=2,
on_failure=True)`` given to the main process alone, the other process having the discovered one (or, ``-alone``,
none: ``HOOKFIT_PLUGINS`` without it there); each process writes the error it raised, if any. ``--apart OUT``: two
epochs with ``Checkpoint(dir="ck")``, the other process working in ``apart/``, where the relative path ``ck`` the main
process tells it is a folder of its own (as on a node that does not share the main process's filesystem); each
process writes its status, the last checkpoint its plugin knew as the second epoch began, and its results'.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time

import torch

import hookfit
from hookfit.data import Batches
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.checkpoint import plugin as checkpoint_plugin
from hookfit.plugins.checkpoint import ranks
from hookfit.plugins.checkpoint.writer import write_file
from hookfit.plugins.distributed import Distributed
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim


class Losses:
    name = "losses"

    def __init__(self) -> None:
        self.valid: list[float] = []

    @hookfit.hookimpl
    def epoch_metrics(self, stage, metrics) -> None:
        if stage == "valid":
            self.valid.append(metrics.values["loss"].epoch)


def regression():
    """The seeded model and data both runs train, and their step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)

    def step(loop, batch):
        loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    return model, x, y, step


FAILING = {2, 8}  # the main process's writes of these steps fail: its disk is full then


def failing(out: str, monitored: bool, raising: bool = False, background: bool = True) -> None:
    def save(state, path, between):
        if state["loop"]["step"] in ({4} if monitored else {7} if raising else FAILING):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        write_file(state, path, between)

    checkpoint_plugin.write_file = save  # the writer of every Checkpoint made from now
    model, x, y, step = regression()
    if monitored:
        checkpoint = Checkpoint(monitor="valid/loss", mode="max", background=False)
        options = dict(val_step=lambda loop, batch: {"loss": torch.nn.functional.mse_loss(loop.model(batch[0]),
                                                                                           batch[1])},
                       val_data=Batches(x, y, batch_size=8), val_every_n_steps=4)
    else:
        checkpoint, options = Checkpoint(every_n_epochs=None, every_n_steps=2, keep_last=10,
                                         on_save_error="raise" if raising else "warn", background=background), {}
    if raising:
        ended(hookfit.Loop(step, Batches(x, y, batch_size=4), model=model, max_steps=7, run_dir="run",
                           optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
                           plugins=[Distributed(timeout=30), Optim(), Metrics(), checkpoint]), out)
        return
    state = hookfit.Loop(step, Batches(x, y, batch_size=4), model=model, max_epochs=1, run_dir="run",
                         optimizers=torch.optim.SGD(model.parameters(), lr=0.05), **options,
                         plugins=[Distributed(timeout=30), Optim(), Metrics(), checkpoint]).fit()
    results = {k: v if v is None or isinstance(v, int) else str(v) for k, v in state.results.items()
               if k.endswith(("_checkpoint", "_saves"))}
    with open(f"{out}.rank{state.rank}.json", "w") as file:
        json.dump({"status": state.status, "step": state.step, "results": results,
                   "saved": [str(p) for p in checkpoint.saved]}, file)


def failing_best(out: str) -> None:
    def save(state, path, between):
        if state["loop"]["step"] == 8:  # epoch 1's best: the main process's disk is full then
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        write_file(state, path, between)

    checkpoint_plugin.write_file = save
    model, x, y, step = regression()

    def valid(loop, batch):
        return {"loss": torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])}

    state = hookfit.Loop(step, Batches(x, y, batch_size=4), val_step=valid, val_data=Batches(x, y, batch_size=8),
                         model=model, max_epochs=3, run_dir="run", optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
                         plugins=[Distributed(timeout=30), Optim(), Metrics(),
                                  Checkpoint(monitor="valid/loss", mode="max", every_n_epochs=None, background=False)]
                         ).fit()
    with open(f"{out}.rank{state.rank}.json", "w") as file:
        json.dump({"status": state.status, "step": state.step}, file)


def seconds(out: str) -> None:
    class Ahead:  # this process's clock: from its second reading (the run's start is its first) an hour ahead
        calls = 0

        @classmethod
        def monotonic(cls) -> float:
            cls.calls += 1
            return time.monotonic() + (3600.0 if cls.calls > 1 else 0.0)

    if os.environ.get("RANK") != "0":
        ranks.time = Ahead
    model, x, y, step = regression()
    checkpoint = Checkpoint(every_n_epochs=None, every_seconds=3600, keep_last=10, background=False)
    state = hookfit.Loop(step, Batches(x, y, batch_size=4), model=model, max_epochs=1, run_dir="run",
                         optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
                         plugins=[Distributed(timeout=30), Optim(), Metrics(), checkpoint]).fit()
    with open(f"{out}.rank{state.rank}.json", "w") as file:
        json.dump({"status": state.status, "step": state.step, "saved": [os.path.basename(p) for p in checkpoint.saved]},
                  file)


def repeat(out: str) -> None:
    writes, announced = [], []

    def save(state, path, between):
        writes.append(path.name)
        write_file(state, path, between)

    class Announced:
        name = "announced"

        @hookfit.hookimpl
        def checkpoint_saved(self, path, reason, step) -> None:
            announced.append([os.path.basename(path), reason, step])

    checkpoint_plugin.write_file = save
    model, x, y, step = regression()
    state = hookfit.Loop(step, Batches(x, y, batch_size=4), model=model, max_epochs=2, run_dir="run",
                         optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
                         plugins=[Distributed(timeout=30), Optim(), Metrics(), Announced(),
                                  Checkpoint(every_n_steps=4, keep_last=10)]).fit()
    with open(f"{out}.rank{state.rank}.json", "w") as file:
        json.dump({"status": state.status, "writes": writes, "announced": announced}, file)


def one_rank(out: str, alone: bool) -> None:
    model, x, y, step = regression()
    main = os.environ["RANK"] == "0"
    os.environ["HOOKFIT_PLUGINS"] = "distributed,optim,metrics" + ("" if alone else ",checkpoint")
    given = [Checkpoint(every_n_steps=2, on_failure=True, background=False)] if main else []
    ended(hookfit.Loop(step, Batches(x, y, batch_size=4), model=model, max_epochs=1, run_dir="run",
                       optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
                       plugins=[Distributed(timeout=30), *given]), out)


def apart(out: str) -> None:
    out = os.path.abspath(out)
    if os.environ["RANK"] != "0":
        os.chdir("apart")
    model, x, y, step = regression()
    checkpoint, seen = Checkpoint(dir="ck", background=False), []

    class Last:  # the run's last checkpoint as this process knows it during the run (the end agrees on the main one's)
        name = "last"

        @hookfit.hookimpl
        def epoch_start(self, epoch) -> None:
            if epoch:
                seen.append(str(checkpoint.last))

    state = hookfit.Loop(step, Batches(x, y, batch_size=4), model=model, max_epochs=2, run_dir="run",
                         optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
                         plugins=[Distributed(timeout=30), Optim(), Metrics(), checkpoint, Last()]).fit()
    with open(f"{out}.rank{state.rank}.json", "w") as file:
        json.dump({"status": state.status, "seen": seen, "last": str(state.results["last_checkpoint"])}, file)


def ended(loop: hookfit.Loop, out: str) -> None:
    """``loop.fit()``, then this process's status and the error it raised, if any, to ``OUT.rank<N>.json``."""
    try:
        loop.fit()
        error = None
    except Exception as raised:  # noqa: BLE001 - the error each process ends with is the result
        error = f"{type(raised).__name__}: {raised}"
    with open(f"{out}.rank{os.environ['RANK']}.json", "w") as file:
        json.dump({"status": loop.state.status, "error": error}, file)


def main(out: str) -> None:
    model, x, y, step = regression()

    def valid(loop, batch):
        return {"loss": torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])}

    checkpoint, losses = Checkpoint(monitor="valid/loss", mode="max", keep_last=1, background=False), Losses()
    state = hookfit.Loop(step, Batches(x, y, batch_size=8), val_step=valid, val_data=Batches(x, y, batch_size=8),
                         model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.05), max_epochs=3,
                         name="results", plugins=[Distributed(), Optim(), Metrics(), checkpoint, losses]).fit()
    assert state.status == "completed", state
    results = {key: str(value) for key, value in state.results.items() if key.endswith("_checkpoint")}
    best = checkpoint.best
    with open(f"{out}.rank{state.rank}.json", "w") as file:
        json.dump({"rank": state.rank, "world_size": state.world_size, "results": results,
                   "best": None if best is None else [best[0], str(best[1])], "last": str(checkpoint.last),
                   "valid": losses.valid, "exist": {k: os.path.exists(v) for k, v in results.items()}}, file)


if __name__ == "__main__":
    if sys.argv[1] == "--repeat":
        repeat(sys.argv[2])
    elif sys.argv[1] == "--seconds":
        seconds(sys.argv[2])
    elif sys.argv[1].startswith("--one-rank"):
        one_rank(sys.argv[2], alone=sys.argv[1] == "--one-rank-alone")
    elif sys.argv[1] == "--apart":
        apart(sys.argv[2])
    elif sys.argv[1] == "--failing-best":
        failing_best(sys.argv[2])
    elif sys.argv[1].startswith(("--failing", "--raising")):
        failing(sys.argv[2], monitored=sys.argv[1] == "--failing-monitored", raising=sys.argv[1].startswith("--raising"),
                background=sys.argv[1] != "--raising-foreground")
    else:
        main(sys.argv[1])
