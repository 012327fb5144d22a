"""A small FSDP2 run with sharded checkpoints, for tests/plugins/checkpoint/test_sharded_trust.py.

``torchrun --nproc-per-node 2 sharded_run.py OUT --dir CKPT [--epochs N] [--resume latest|PATH]
[--fallback] [--squeeze-at EPOCH] [--sync] [--every-n-steps N] [--when-busy wait|skip]
[--on-save-error warn|raise] [--on-failure] [--pace SECONDS] [--hold] [--keep-last K]
[--fail-staging WHAT:STEP]``: trains a small
regression (``Distributed(strategy="fsdp")``, ``Checkpoint(dir=CKPT, keep_last=10)`` or K, a
checkpoint at every epoch's end, or every N steps). ``--sync`` writes them in the foreground (``background=False``).
``--squeeze-at`` limits the size of any file this process writes to 600 bytes from that epoch's
start on (``RLIMIT_FSIZE``: the kernel refuses the write with ``EFBIG``, as a full disk refuses
with ``ENOSPC``; the write in flight, if any, ends first), so that epoch's checkpoint cannot be
written.

Background writes, told and paced: with ``--pace``, every piece of a sharded checkpoint's
write (each tensor DCP writes, ``state.pt``, the rename) prints ``ckpt-io <rank>`` first and
waits that many seconds, so a kill at a random one of those lines falls inside a write while
training goes on. With ``--hold``, DCP's write of each checkpoint waits before its first tensor
until the next save is asked or the run's end waits for it: the write is in flight for certain
when the next save is asked, and a save that blocked training until its write ended would never
end.

With ``--fail-staging shards:STEP`` (or ``rest:STEP``), rank 1's copy of its state into host
memory at the save of step STEP raises, once: DCP's stager of the sharded tensors (a
``MemoryError``), or the staging of the rest of the checkpoint (an ``OSError``, ``ENOMEM``).
With ``interrupt:STEP``, DCP's stager of rank 1 raises ``KeyboardInterrupt`` there (a second
Ctrl-C on that rank alone), once, after the rest of its checkpoint was staged.

Each process writes ``OUT.rank<N>.json``: the run's status and step (or the error that ended it
(``KeyboardInterrupt`` and ``SystemExit`` too), the run's status and stop reason then, and the
step), the checkpoint plugin's failed and skipped saves, the checkpoint it resumed
from, the warnings it caught (category and message), for each save whether a write was in flight
on this rank when it was asked and the step the training had reached when its write ended, and
every parameter, whole, as a flat list. Each prints ``pid <rank> <pid>`` at its start.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import resource
import signal
import threading
import time
import warnings
from typing import Any

import torch

import hookfit
from hookfit.data import Batches
from hookfit.plugins.checkpoint import Checkpoint, sharded
from hookfit.plugins.checkpoint.shardwriter import ShardWriter
from hookfit.plugins.distributed import Distributed
from hookfit.plugins.optim import Optim


class Squeeze:
    """From the start of epoch ``at`` (counted from 1), no file of this process may grow past
    600 bytes; lifted at the run's end."""

    name = "squeeze"

    def __init__(self, at: int, checkpoint: Checkpoint) -> None:
        self.at = at
        self.checkpoint = checkpoint
        self.limits: tuple[int, int] | None = None

    @hookfit.hookimpl
    def epoch_start(self, epoch: int) -> None:
        if epoch + 1 == self.at:
            self.checkpoint.shards.wait()  # the previous epoch's write is not this epoch's to fail
            self.limits = resource.getrlimit(resource.RLIMIT_FSIZE)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
            resource.setrlimit(resource.RLIMIT_FSIZE, (600, self.limits[1]))

    @hookfit.hookimpl
    def fit_end(self) -> None:
        if self.limits is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, self.limits)


class FailStaging:
    """On rank 1, the copy into host memory at the save of step ``step`` raises, once (see the
    module): ``what`` is ``"shards"`` (DCP's stager) or ``"rest"`` (the checkpoint's staging), or
    ``"interrupt"`` (DCP's stager raises ``KeyboardInterrupt``)."""

    def __init__(self, what: str, step: int, watch: Watch) -> None:
        self.what, self.step, self.watch = what, step, watch

    def install(self) -> None:
        if int(os.environ.get("RANK", "0")) != 1:
            return
        from torch.distributed.checkpoint.staging import DefaultStager

        from hookfit.plugins.checkpoint.staging import Staging

        owner, stage = (Staging, Staging.stage) if self.what == "rest" else (DefaultStager, DefaultStager.stage)
        failing = self

        def failing_stage(stager: Any, *args: Any, **kwargs: Any) -> Any:
            if failing.watch.step == failing.step:
                failing.step = -1  # once
                if failing.what == "interrupt":
                    raise KeyboardInterrupt("raised by rank 1's stager")
                if failing.what == "shards":
                    raise MemoryError("the host copy of the shards was refused")
                raise OSError(errno.ENOMEM, "Cannot allocate memory for the host copy")
            return stage(stager, *args, **kwargs)

        owner.stage = failing_stage  # type: ignore[method-assign]


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


class Watch:
    """What the background writes did (see the module): ``--pace`` and ``--hold``."""

    name = "watch"

    def __init__(self, pace: float | None, hold: bool) -> None:
        self.pace, self.hold = pace, hold
        self.rank = int(os.environ.get("RANK", "0"))
        self.step = 0  # the training's step, as the writing threads read it
        self.saves: list[dict[str, Any]] = []
        self.go = threading.Condition()
        self.released = True  # the write in flight may go on (--hold)

    @hookfit.hookimpl
    def after_batch(self, loop: Any) -> None:
        with self.go:
            self.step = loop.state.step
            self.go.notify_all()

    def piece(self) -> None:
        """Before each piece of a write, on a writing thread."""
        if self.pace is not None:
            os.write(1, f"ckpt-io {self.rank}\n".encode())
            time.sleep(self.pace)

    def first(self) -> None:
        """Before DCP writes a checkpoint's first tensor (--hold)."""
        with self.go:
            while not self.released:
                self.go.wait()

    def install(self) -> None:
        from torch.distributed.checkpoint import filesystem

        watch, write_item, rename, save = self, filesystem._write_item, sharded._rename, torch.save
        ready, submit, wait = ShardWriter.ready, ShardWriter.submit, ShardWriter.wait

        def paced_item(*args: Any, **kwargs: Any) -> Any:
            if watch.hold:
                watch.first()
            watch.piece()
            return write_item(*args, **kwargs)

        def paced_rename(*args: Any) -> None:
            watch.piece()
            rename(*args)

        def paced_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            if threading.current_thread().name == "hookfit-checkpoint-shards":  # state.pt
                watch.piece()
            save(obj, f, *args, **kwargs)

        def told_ready(writer: ShardWriter, must: bool) -> bool:
            watch.saves.append({"step": watch.step, "in_flight": writer.in_flight()})
            answer = ready(writer, must)
            watch.saves[-1]["skipped"] = not answer
            watch.release()
            return answer

        def told_submit(writer: ShardWriter, *args: Any) -> Any:
            with watch.go:
                watch.released = False
            answer = submit(writer, *args)
            thread = writer._thread
            record = watch.saves[-1] if watch.saves else {}
            if thread is None:  # nothing written: the copy into host memory failed on some rank
                record["failed"] = True
                return answer

            def ended() -> None:
                thread.join()
                record["ended_at"] = watch.step

            threading.Thread(target=ended, daemon=True).start()
            return answer

        def told_wait(writer: ShardWriter) -> None:
            watch.release()
            wait(writer)

        filesystem._write_item = paced_item
        sharded._rename = paced_rename
        torch.save = paced_save
        ShardWriter.ready, ShardWriter.submit, ShardWriter.wait = told_ready, told_submit, told_wait

    def release(self) -> None:
        with self.go:
            self.released = True
            self.go.notify_all()


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
    parser.add_argument("--sync", action="store_true")
    parser.add_argument("--every-n-steps", type=int)
    parser.add_argument("--when-busy", default="wait")
    parser.add_argument("--on-save-error", default="warn")
    parser.add_argument("--pace", type=float)
    parser.add_argument("--hold", action="store_true")
    parser.add_argument("--keep-last", type=int, default=10)
    parser.add_argument("--fail-staging")
    parser.add_argument("--on-failure", action="store_true")
    args = parser.parse_args()
    os.write(1, f"pid {os.environ.get('RANK', '0')} {os.getpid()}\n".encode())

    model, optimizer, data, step = build()
    every = {"every_n_steps": args.every_n_steps, "every_n_epochs": None} if args.every_n_steps else {}
    checkpoint = Checkpoint(dir=args.dir, keep_last=args.keep_last, fallback=args.fallback, background=not args.sync,
                            when_busy=args.when_busy, on_save_error=args.on_save_error, on_failure=args.on_failure,
                            **every)
    params = Params()
    watch = Watch(args.pace, args.hold)
    watch.install()
    if args.fail_staging is not None:
        what, at = args.fail_staging.split(":")
        FailStaging(what, int(at), watch).install()
    plugins: list[Any] = [Distributed(strategy="fsdp"), Optim(), checkpoint, params, watch]
    if args.squeeze_at is not None:
        plugins.append(Squeeze(args.squeeze_at, checkpoint))
    loop = hookfit.Loop(step, data, model=model, max_epochs=args.epochs, optimizers=optimizer, resume=args.resume,
                        name="sharded", plugins=plugins)
    result: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            state = loop.fit()
            result.update(status=state.status, step=state.step)
        except BaseException as error:  # noqa: BLE001 - reported in the dump (an interrupt or an exit too)
            result.update(error=f"{type(error).__name__}: {error}", status=loop.state.status,
                          stop_reason=loop.state.stop_reason, step=loop.state.step)
    rank = int(os.environ.get("RANK", "0"))
    result.update(
        failed_saves=checkpoint.failed_saves,
        skipped_saves=checkpoint.skipped_saves,
        saves=watch.saves,
        resumed_from=None if checkpoint.resumed_from is None else str(checkpoint.resumed_from),
        warnings=[[w.category.__name__, str(w.message)] for w in caught],
        params=params.flat,
    )
    with open(f"{args.out}.rank{rank}.json", "w") as file:
        json.dump(result, file)
    # a run that failed ends with 0 too: the dump says how it ended, and torchrun stops the other
    # ranks as soon as one exits with an error, before they write theirs


if __name__ == "__main__":
    main()
