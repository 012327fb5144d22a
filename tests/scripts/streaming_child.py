"""A training run over data without a length, in its own process, for the streaming resume tests
(``tests/core/test_streaming.py``).

``python streaming_child.py RUN_DIR OUT --data KIND [--workers N] [--marker PATH --pause-at STEP]
[--resume]``, KIND one of:

* ``iterable``: a ``DataLoader`` over an ``IterableDataset`` (``num_workers=N``; with workers the
  stream is split by ``get_worker_info()``), told the epoch through ``set_epoch``; each sample
  gets noise from the global generator (the workers' own, seeded by the loader), so the resume
  must rebuild the loader's seeds as well as skip the batches done;
* ``factory``: an iterable whose ``__iter__`` is a generator function (a generator factory: a
  new pass each epoch), yielding whole batches;
* ``stateful``: torchdata's ``StatefulDataLoader`` over an ``IterableDataset`` that keeps its
  position in ``state_dict()`` (``num_workers=N``): resumed by its own state, nothing skipped;
* ``hf``: a Hugging Face streaming dataset (``IterableDataset.from_generator``) batched by
  ``.batch()``, given to the loop as it is: resumed by its own ``state_dict()``;
* ``hf-loader``: the same stream shuffled with a buffer (seeded, a pure function of the epoch)
  in a ``DataLoader`` (``num_workers=N``): resumed by skipping the batches done.

A model with dropout trains 3 epochs of 12 batches, with a checkpoint every step; the final
parameters, the sample ids of every step and hookfit's warnings go to OUT. With ``--pause-at
STEP`` the process writes ``--marker`` once the checkpoint of that step is announced whole
(``checkpoint_saved``) and then waits, before the next checkpoint, until a signal ends it: the
test kills it (``kill -9``) or stops it gracefully (SIGTERM) from outside.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.interrupter import Interrupter
from hookfit.plugins.optim import Optim

parser = argparse.ArgumentParser()
parser.add_argument("run_dir")
parser.add_argument("out")
parser.add_argument("--data", choices=("iterable", "factory", "stateful", "hf", "hf-loader"), required=True)
parser.add_argument("--workers", type=int, default=0)
parser.add_argument("--marker", default=None)
parser.add_argument("--pause-at", type=int, default=None)
parser.add_argument("--resume", action="store_true")
args = parser.parse_args()

N, BATCH, EPOCHS = 60, 5, 3
torch.manual_seed(0)
torch.set_num_threads(1)
g = torch.Generator().manual_seed(1)
X, Y = torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g)


def order(epoch: int) -> list[int]:
    """The epoch's order of the samples: a pure function of the epoch."""
    return torch.randperm(N, generator=torch.Generator().manual_seed(100 + epoch)).tolist()


class Stream(IterableDataset):
    """Samples in an order of the epoch, each with noise from the global generator."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        ids = order(self.epoch)
        info = get_worker_info()
        if info is not None:  # each worker its own part of the stream
            ids = ids[info.id::info.num_workers]
        for i in ids:
            yield X[i] + 0.01 * torch.randn(4), Y[i], i


class Positioned(IterableDataset):
    """Samples in an order of the epoch that keeps its position (``state_dict``)."""

    def __init__(self) -> None:
        self.epoch, self.done = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "done": self.done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.done = state["epoch"], state["done"]

    def __iter__(self):
        ids = order(self.epoch)
        info = get_worker_info()
        if info is not None:
            ids = ids[info.id::info.num_workers]
        self.done = start = self.done if self.done < len(ids) else 0  # a restored position, else the start
        for i in ids[start:]:
            self.done += 1
            yield X[i], Y[i], i
        self.done = 0  # the next pass starts afresh


class Factory:
    """A generator factory: each ``iter()`` starts a new pass, batches made as they go."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        ids = torch.tensor(order(self.epoch))
        for first in range(0, N, BATCH):
            chosen = ids[first:first + BATCH]
            yield X[chosen], Y[chosen], chosen


def hf_stream(shuffled: bool):
    import datasets

    def examples(n: int):
        for i in range(n):
            yield {"x": X[i].tolist(), "y": Y[i].tolist(), "i": i}

    stream = datasets.IterableDataset.from_generator(examples, gen_kwargs={"n": N})
    if shuffled:
        stream = stream.shuffle(seed=7, buffer_size=16)
    return stream.with_format("torch")


if args.data == "iterable":
    data = DataLoader(Stream(), batch_size=BATCH, num_workers=args.workers)
elif args.data == "factory":
    data = Factory()
elif args.data == "stateful":
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = StatefulDataLoader(Positioned(), batch_size=BATCH, num_workers=args.workers)
elif args.data == "hf":
    data = hf_stream(shuffled=False).batch(BATCH)
else:
    data = DataLoader(hf_stream(shuffled=True), batch_size=BATCH, num_workers=args.workers)

model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(16, 1))
seen: list[list[int]] = []


def step(loop, batch):
    if isinstance(batch, dict):  # Hugging Face's rows
        batch = batch["x"], batch["y"], batch["i"]
    x, y, ids = batch
    seen.append([int(i) for i in ids])
    loss = torch.nn.functional.mse_loss(loop.model(x.float()), y.float())
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    return {"loss": loss}


class PauseAt:
    """Writes the marker once the checkpoint of ``--pause-at`` is whole, then waits until a
    signal ends the process (SIGKILL), or a graceful stop (SIGTERM) is asked."""

    name = "pause_at"

    @hookfit.hookimpl
    def checkpoint_saved(self, loop, step):
        if step != args.pause_at:
            return
        with open(args.marker + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(args.marker + ".tmp", args.marker)
        while loop.stop_requested is None:  # the test's signal: SIGKILL ends it here, SIGTERM asks a stop
            time.sleep(0.01)


plugins = [Optim(), Interrupter(exit=False), Checkpoint(every_n_steps=1, keep_last=2)]  # fit() returns: OUT is written
if args.pause_at is not None:
    plugins.append(PauseAt())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", hookfit.HookfitWarning)
    state = hookfit.Loop(step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
                         max_epochs=EPOCHS, run_dir=args.run_dir, resume="latest" if args.resume else None,
                         plugins=plugins).fit()
mine = [str(w.message) for w in caught if issubclass(w.category, hookfit.HookfitWarning)]
torch.save({"params": model.state_dict(), "status": state.status, "step": state.step, "seen": seen,
            "warnings": mine, "resumed_from": str(state.resumed_from) if state.resumed_from else None}, args.out)
