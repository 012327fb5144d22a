"""A short distributed job that ends as a scheduler sees it, for
tests/plugins/distributed/test_exit.py.

``torchrun --nproc-per-node 2 exit_job.py STRATEGY``: two epochs of a small regression with
``Distributed(strategy=STRATEGY)`` ("ddp" or "fsdp") and a checkpoint at every epoch's end
written in the background (a thread, and for FSDP ``torch.distributed.checkpoint``), then the
interpreter exits with nothing of hookfit's shut down by hand: the process group, its store and
the saving thread must all be gone by then. Each rank prints ``exit_job rank R completed`` when
its run has ended, and, from the last of the interpreter's exit handlers (registered before
anything else, so it runs after hookfit's), ``exit_job rank R at exit: ...``: ``clean``, or
the threads still alive there (Python threads other than the main one, and native threads of
gloo or of a store), any of which can abort the process as the interpreter finalizes.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading


def _native_threads() -> list[str]:
    """This process's native threads (Linux: /proc/self/task) of gloo or of a store."""
    names = []
    folder = "/proc/self/task"
    for task in os.listdir(folder) if os.path.isdir(folder) else []:
        try:
            with open(f"{folder}/{task}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(name for name in names if "gloo" in name.lower() or "store" in name.lower())


def _at_exit() -> None:
    python = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive())
    left = [f"python thread {name!r}" for name in python] + [f"native thread {name!r}" for name in _native_threads()]
    print(f"exit_job rank {os.environ.get('RANK')} at exit: {'; '.join(left) or 'clean'}", flush=True)


atexit.register(_at_exit)  # first registered, last run

import torch  # noqa: E402 - after the exit handler, whose place among the handlers is the point

import hookfit  # noqa: E402
from hookfit.data import Batches  # noqa: E402
from hookfit.plugins.checkpoint import Checkpoint  # noqa: E402
from hookfit.plugins.distributed import Distributed  # noqa: E402
from hookfit.plugins.optim import Optim  # noqa: E402


def main(strategy: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x, y = torch.randn(128, 8), torch.randn(128, 1)

    def step(loop, batch):
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(loop.model(inputs), targets)
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    loop = hookfit.Loop(step, Batches(x, y, batch_size=16, shuffle=True, seed=0), model=model,
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.05), max_epochs=2, run_dir="run",
                        plugins=[Distributed(strategy=strategy), Optim(), Checkpoint(background=True)])
    state = loop.fit()
    print(f"exit_job rank {os.environ['RANK']} {state.status}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
