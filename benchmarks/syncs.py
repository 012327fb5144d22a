"""Host reads per training step of hookfit, Lightning and Ignite in their default set-ups.

    pip install -e ".[bench]"
    python benchmarks/syncs.py                 # ~20 s; --json PATH writes the numbers

A host read is a call that needs a tensor's value on the CPU: ``item()``, ``bool()``,
``float()``, ``int()``, ``tolist()``, ``numpy()``, formatting, ``.cpu()``/``.to("cpu")``, and
the operations whose result size or truth depends on the data (``nonzero``, ``equal``...). On
an accelerator each one waits for the device: a host-device synchronisation. They are counted
here on the CPU, with a ``torch.overrides.TorchFunctionMode`` that sees every torch call made
from Python (the framework's, torch's optimizer code, the step's), through the code path each
framework takes on an accelerator: Lightning's and Ignite's do not depend on the device;
hookfit's optim and metrics plugins take it with ``defer=True``. Per step is the count between
the starts of consecutive training batches (the last batch, which runs into the epoch's end,
is left out), as its median and its mean over the epoch; ``epoch`` is every read from the
epoch's start to its end (publications, the epoch summary). Calls torch makes in C++ are not
seen (none of these loops makes a syncing one: no boolean-mask indexing, no ``nonzero``).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import statistics
import sys
import warnings
from contextlib import redirect_stderr, redirect_stdout
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import Batches, Setup, _sink, lightning_module, mse  # noqa: E402  (same folder)
from overhead import scratch  # noqa: E402

import hookfit  # noqa: E402
from hookfit.plugins.console import Console  # noqa: E402
from hookfit.plugins.metrics import Metrics  # noqa: E402
from hookfit.plugins.optim import Optim  # noqa: E402

T = torch.Tensor
READS = {
    T.item, T.__bool__, T.__float__, T.__int__, T.__index__, T.tolist, T.numpy, T.cpu,
    T.__format__, T.__repr__, T.__array__, T.nonzero, T.masked_select, T.is_nonzero,
    torch.nonzero, torch.masked_select, torch.equal, torch.is_nonzero, torch.unique, torch.allclose,
}
"""Tensor calls that read a value on the host (``.to`` and ``.copy_`` are decided by their
arguments, in :meth:`HostReads.__torch_function__`)."""


def _to_cpu(args: tuple, kwargs: dict) -> bool:
    """Whether ``tensor.to(...)`` names the CPU as a string (``.to("cpu")``). A
    ``torch.device`` or a tensor argument is not counted: on a CPU run ``.to(device)`` cannot
    tell a copy to the host from a no-op on the tensor's own device (torch's fused optimizers
    move ``found_inf`` to the parameters' device that way, Lightning moves each batch to the
    accelerator)."""
    return any(isinstance(value, str) and value.startswith("cpu") for value in (*args[1:], kwargs.get("device")))


class HostReads(TorchFunctionMode):
    """Counts host reads (see the module docstring) while it is active: ``with HostReads() as
    reads: ...``; ``reads.count`` is the number so far, ``reads.calls`` their names (and
    ``where`` the caller's file and line, when ``trace=True``)."""

    def __init__(self, trace: bool = False) -> None:
        super().__init__()
        self.count = 0
        self.calls: list[str] = []
        self.trace = trace

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in READS or (func is T.to and _to_cpu(args, kwargs)):
            self.count += 1
            name = getattr(func, "__name__", repr(func))
            if self.trace:
                frame = sys._getframe(1)
                name = f"{name} at {frame.f_code.co_filename}:{frame.f_lineno}"
            self.calls.append(name)
        return func(*args, **kwargs)


class Counts:
    """The counter's value at each training batch's start and at the epoch's start and end."""

    def __init__(self, reads: HostReads) -> None:
        self.reads = reads
        self.starts: list[int] = []
        self.epoch = [0, 0]

    def summary(self) -> dict[str, Any]:
        per_step = [b - a for a, b in zip(self.starts, self.starts[1:])]
        calls = collections.Counter(self.reads.calls[self.starts[0]:self.starts[-1]])
        return {"per_step_median": statistics.median(per_step), "per_step_mean": statistics.mean(per_step),
                "per_step_max": max(per_step), "epoch": self.epoch[1] - self.epoch[0],
                "steps": len(self.starts), "per_step": per_step, "per_step_calls": dict(calls.most_common())}


# -- the frameworks ----------------------------------------------------------------------------
def hookfit_default(setup: Setup, counts: Counts, *, device_path: bool = True, adam: bool = False,
                    **optim: Any) -> None:
    """hookfit's default stack (optim, metrics, interrupter, console), as compare.py runs it,
    with torch's SGD (or Adam) built as users build it, the kernel left to torch;
    ``device_path``: optim and metrics take the path they take on an accelerator."""
    model, _ = setup.fresh()
    opt = (torch.optim.Adam(model.parameters(), lr=0.001) if adam
           else torch.optim.SGD(model.parameters(), lr=0.01))

    def step(loop: Any, batch: Any) -> Any:
        x, y = batch
        loop.optimizers.zero_grad()
        loss = mse(model(x), y)
        loop.backward(loss)
        loop.optimizers.step()
        return {"loss": loss}

    class Count:
        @hookfit.hookimpl
        def epoch_start(self) -> None:
            counts.epoch[0] = counts.reads.count

        @hookfit.hookimpl
        def batch_start(self, loop: Any) -> None:
            if loop.training:
                counts.starts.append(counts.reads.count)

        @hookfit.hookimpl(trylast=True)
        def epoch_end(self) -> None:
            counts.epoch[1] = counts.reads.count

    defer = True if device_path else None
    os.environ["HOOKFIT_PLUGINS"] = "interrupter"
    try:
        with counts.reads:
            hookfit.Loop(step, setup.data, model=model, optimizers=opt, run_dir=scratch("syncs-"),
                         plugins=[Optim(defer=defer, **optim), Metrics(defer=defer), Console(stream=_sink()),
                                  Count()]).fit()
    finally:
        del os.environ["HOOKFIT_PLUGINS"]


def lightning_default(setup: Setup, counts: Counts) -> None:
    """Lightning's defaults (logger, checkpointing, progress bar, model summary) with
    ``self.log("loss", loss, prog_bar=True)`` every step, as compare.py runs it."""
    import pytorch_lightning as pl

    model, _ = setup.fresh()

    class Count(pl.Callback):
        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            counts.epoch[0] = counts.reads.count

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            counts.starts.append(counts.reads.count)

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            counts.epoch[1] = counts.reads.count

    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, callbacks=[Count()],
                         default_root_dir=scratch("syncs-"), num_sanity_val_steps=0)
    with counts.reads:
        trainer.fit(lightning_module(model, log=True), train_dataloaders=Batches(setup.data))


def ignite_default(setup: Setup, counts: Counts) -> None:
    """Ignite's supervised-trainer shape (the update returns ``loss.item()``, as
    ``create_supervised_trainer`` does) with ``RunningAverage`` and ``ProgressBar``."""
    from ignite.contrib.handlers import ProgressBar
    from ignite.engine import Engine, Events
    from ignite.metrics import RunningAverage

    model, opt = setup.fresh()

    def update(engine: Any, batch: Any) -> float:
        x, y = batch
        opt.zero_grad()
        loss = mse(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    engine = Engine(update)
    RunningAverage(output_transform=lambda out: out).attach(engine, "loss")
    ProgressBar(file=_sink()).attach(engine, ["loss"])
    engine.add_event_handler(Events.EPOCH_STARTED, lambda e: counts.epoch.__setitem__(0, counts.reads.count))
    engine.add_event_handler(Events.ITERATION_STARTED, lambda e: counts.starts.append(counts.reads.count))
    engine.add_event_handler(Events.EPOCH_COMPLETED, lambda e: counts.epoch.__setitem__(1, counts.reads.count))
    with counts.reads:
        engine.run(setup.data, max_epochs=1)


VARIANTS: dict[str, Callable[[Setup, Counts], None]] = {
    "hookfit-default": hookfit_default,
    "hookfit-default-adam": lambda s, c: hookfit_default(s, c, adam=True),
    "hookfit-fuse-false": lambda s, c: hookfit_default(s, c, fuse=False),
    "hookfit-nonfinite-none": lambda s, c: hookfit_default(s, c, nonfinite=None),
    "hookfit-cpu-path": lambda s, c: hookfit_default(s, c, device_path=False),
    "lightning-default": lightning_default,
    "ignite-default": ignite_default,
}
NOTES = {
    "hookfit-default": "SGD: optim runs torch's fused kernel, the flag is its found_inf",
    "hookfit-default-adam": "Adam: the same",
    "hookfit-fuse-false": "Optim(fuse=False): torch's for-loop SGD, optim reads the flag at the step",
    "hookfit-nonfinite-none": "Optim(nonfinite=None): no check",
    "hookfit-cpu-path": "as on the CPU: loss.item() in optim and metrics (no sync there)",
}


def measure(names: list[str], batches: int, trace: bool = False) -> dict[str, Any]:
    setup = Setup("tiny", width=32, depth=1, batch=64, batches=batches, rounds=1)
    out: dict[str, Any] = {}
    for name in names:
        counts = Counts(HostReads(trace=trace))
        try:
            with redirect_stdout(_sink()), redirect_stderr(_sink()), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                VARIANTS[name](setup, counts)
        except ImportError as error:  # a peer not installed: pip install -e ".[bench]"
            out[name] = {"missing": str(error)}
            continue
        out[name] = counts.summary()
    return out


def render(result: dict[str, Any]) -> str:
    lines = [f"host reads per training step (torch {torch.__version__}, {result['batches']} batches, "
             f"tiny model)", f"  {'variant':<24} {'median':>6} {'mean':>6} {'max':>4} {'epoch':>6}"]
    for name, row in result["variants"].items():
        if "missing" in row:
            lines.append(f"  {name:<24} not installed ({row['missing']})")
            continue
        lines.append(f"  {name:<24} {row['per_step_median']:>6g} {row['per_step_mean']:>6.2f} "
                     f"{row['per_step_max']:>4} {row['epoch']:>6}   {NOTES.get(name, '')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--batches", type=int, default=64)
    parser.add_argument("--trace", action="store_true", help="list where the reads come from")
    parser.add_argument("--json", help="write the numbers there")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    result = {"torch": torch.__version__, "batches": args.batches,
              "variants": measure(args.variants.split(","), args.batches, args.trace)}
    print(render(result))
    if args.trace:
        for name, row in result["variants"].items():
            steps = max(row.get("steps", 1) - 1, 1)
            print(f"\n{name}: per step")
            for call, n in row.get("per_step_calls", {}).items():
                print(f"  {n / steps:6.2f}  {call}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
