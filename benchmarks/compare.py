"""hookfit against a raw PyTorch loop, Lightning and Ignite, interleaved in one process.

    pip install -e ".[bench]"
    python benchmarks/compare.py                  # tiny and compute-bound models
    python benchmarks/compare.py --pty            # adds hookfit with the dashboard (needs a pty)

Every variant trains its own copy of one seeded model on the same in-memory batches, with one
torch thread. A round runs one epoch of each variant, in an order that rotates; per-step time
is the training epoch's duration (taken at each framework's own epoch-start and epoch-end
events, so set-up costs are excluded) divided by the batches. Reported: median us per step,
the median per-round ratio to raw, the Python heap peak of one extra epoch (tracemalloc: what
the framework allocates in Python, not torch's tensors), and the framework's overhead per
step compared with hookfit's default stack. Results also go to runs/compare-<time>.json.
"""

from __future__ import annotations

import argparse
import copy
import gc
import io
import json
import logging
import os
import statistics
import sys
import time
import tracemalloc
import warnings
from contextlib import redirect_stderr, redirect_stdout
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import StageClock, in_pty, median_ci, scratch  # noqa: E402  (same folder)

import hookfit  # noqa: E402
from hookfit.plugins.console import Console  # noqa: E402
from hookfit.plugins.optim import Optim  # noqa: E402

MODELS = {
    "tiny": dict(width=32, depth=1, batch=64, batches=64, rounds=31),
    "compute": dict(width=1024, depth=3, batch=256, batches=8, rounds=15),
}


def make_model(width: int, depth: int, inputs: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    size = inputs
    for _ in range(depth):
        layers += [torch.nn.Linear(size, width), torch.nn.ReLU()]
        size = width
    return torch.nn.Sequential(*layers, torch.nn.Linear(size, 1))


class Setup:
    def __init__(self, name: str, width: int, depth: int, batch: int, batches: int, rounds: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.name, self.rounds = name, rounds
        inputs = width
        self.data = [(torch.randn(batch, inputs, generator=gen), torch.randn(batch, 1, generator=gen))
                     for _ in range(batches)]
        torch.manual_seed(0)
        self.template = make_model(width, depth, inputs)

    def fresh(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = copy.deepcopy(self.template)
        return model, torch.optim.SGD(model.parameters(), lr=0.01)


mse = torch.nn.functional.mse_loss
Runner = Callable[[], float]  # one epoch; returns seconds of the training epoch


# -- raw and hookfit ---------------------------------------------------------------------------
def raw(setup: Setup) -> Runner:
    model, opt = setup.fresh()

    def run() -> float:
        start = time.perf_counter()
        for x, y in setup.data:
            opt.zero_grad()
            loss = mse(model(x), y)
            loss.backward()
            opt.step()
        return time.perf_counter() - start

    return run


def hookfit_variant(only: str, given: Callable[[], list[Any]], managed: bool = True) -> Callable[[Setup], Runner]:
    """``managed``: the step goes through the optim plugin; else it steps the optimizer itself
    and no optim plugin is loaded (the core alone)."""

    def build(setup: Setup) -> Runner:
        model, opt = setup.fresh()
        run_dir = scratch("hookfit-compare-")

        def step(loop: Any, batch: Any) -> Any:
            x, y = batch
            if not managed:
                opt.zero_grad()
                loss = mse(model(x), y)
                loss.backward()
                opt.step()
                return loss
            loop.optimizers.zero_grad()
            loss = mse(model(x), y)
            loop.backward(loss)
            loop.optimizers.step()
            return {"loss": loss}

        def run() -> float:
            clock = StageClock()
            os.environ["HOOKFIT_PLUGINS"] = only
            try:
                hookfit.Loop(step, setup.data, model=model, optimizers=opt, run_dir=run_dir,
                             plugins=[*([Optim()] if managed else []), *given(), clock]).fit()
            finally:
                del os.environ["HOOKFIT_PLUGINS"]
            return clock.end - clock.start

        return run

    return build


class Batches:
    """The in-memory batches as one iterable with a length, as every framework gets them."""

    def __init__(self, data: list[Any]) -> None:
        self.data = data

    def __iter__(self) -> Any:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)


def _sink() -> io.TextIOBase:
    return open(os.devnull, "w")


# -- Lightning ---------------------------------------------------------------------------------
def lightning_module(model: torch.nn.Module, log: bool) -> Any:
    """The LightningModule of these comparisons: SGD on ``model``'s MSE, the loss logged to
    the progress bar every step when ``log`` (Lightning's usual set-up)."""
    import pytorch_lightning as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = mse(self.net(x), y)
            if log:
                self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Module()


def lightning(default: bool) -> Callable[[Setup], Runner]:
    def build(setup: Setup) -> Runner:
        import lightning_fabric  # noqa: F401  (installed with pytorch-lightning)
        import pytorch_lightning as pl

        model, _ = setup.fresh()
        times: list[float] = []

        class Clock(pl.Callback):
            def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
                self.start = time.perf_counter()

            def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
                times.append(time.perf_counter() - self.start)

        module = lightning_module(model, log=default)
        root = scratch("lightning-compare-")
        loader = Batches(setup.data)  # Lightning would read a plain list as several loaders

        def run() -> float:
            options: dict[str, Any] = dict(max_epochs=1, accelerator="cpu", devices=1, default_root_dir=root,
                                           callbacks=[Clock()], num_sanity_val_steps=0)
            if not default:
                options.update(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                               enable_model_summary=False)
            with redirect_stdout(_sink()), redirect_stderr(_sink()), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                pl.Trainer(**options).fit(module, train_dataloaders=loader)
            return times[-1]

        return run

    return build


# -- Ignite ------------------------------------------------------------------------------------
def ignite(default: bool) -> Callable[[Setup], Runner]:
    def build(setup: Setup) -> Runner:
        from ignite.engine import Engine, Events

        model, opt = setup.fresh()
        times: list[float] = []

        def update(engine: Any, batch: Any) -> float:
            x, y = batch
            opt.zero_grad()
            loss = mse(model(x), y)
            loss.backward()
            opt.step()
            return loss.item()

        def run() -> float:
            engine = Engine(update)
            if default:
                from ignite.contrib.handlers import ProgressBar
                from ignite.metrics import RunningAverage

                RunningAverage(output_transform=lambda out: out).attach(engine, "loss")
                ProgressBar(file=_sink()).attach(engine, ["loss"])
            engine.add_event_handler(Events.EPOCH_STARTED, lambda e: setattr(e.state, "t0", time.perf_counter()))
            engine.add_event_handler(Events.EPOCH_COMPLETED, lambda e: times.append(time.perf_counter() - e.state.t0))
            engine.run(setup.data, max_epochs=1)
            return times[-1]

        return run

    return build


VARIANTS: dict[str, Callable[[Setup], Runner]] = {
    "raw": raw,
    "hookfit-core": hookfit_variant("", lambda: [], managed=False),
    "hookfit-default": hookfit_variant("metrics,interrupter", lambda: [Console(stream=_sink())]),
    "hookfit-dashboard": hookfit_variant("metrics,interrupter,tui,console", lambda: []),
    "lightning-bare": lightning(default=False),
    "lightning-default": lightning(default=True),
    "ignite-bare": ignite(default=False),
    "ignite-progress": ignite(default=True),
}


def heap_peak(runner: Runner) -> float:
    gc.collect()
    tracemalloc.start()
    runner()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak / 1024


def measure(setup: Setup, names: list[str]) -> dict[str, Any]:
    runners = {n: VARIANTS[n](setup) for n in names}
    for runner in runners.values():  # warm up, and settle every framework's first-run costs
        runner()
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(setup.rounds):
        order = names[i % len(names):] + names[: i % len(names)]
        for name in order:
            gc.collect()
            times[name].append(runners[name]())
    steps = len(setup.data)
    out: dict[str, Any] = {}
    for name in names:
        ratios = [t / r for t, r in zip(times[name], times["raw"])]
        ratio, low, high = median_ci(ratios)
        added = statistics.median((t - r) / steps * 1e6 for t, r in zip(times[name], times["raw"]))
        out[name] = {"us_per_step": statistics.median(times[name]) / steps * 1e6, "ratio": ratio,
                     "ratio_ci": [low, high], "added_us": added, "heap_peak_kib": heap_peak(runners[name])}
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,compute")
    parser.add_argument("--rounds", type=int, help="override the rounds of every model")
    parser.add_argument("--pty", action="store_true", help="run in a pseudo-terminal to include the dashboard")
    parser.add_argument("--json", help="where to write the results (default runs/compare-<time>.json)")
    parser.add_argument("--json-raw", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.pty:
        return in_pty(argv, script=os.path.abspath(__file__), renderer=render)
    torch.set_num_threads(1)
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    from hookfit.plugins.tui import interactive_terminal

    names = [n for n in VARIANTS if n != "hookfit-dashboard" or interactive_terminal() is None]
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(),
                              "torch": torch.__version__, "models": {}}
    for model in args.models.split(","):
        config = dict(MODELS[model])
        if args.rounds:
            config["rounds"] = args.rounds
        result["models"][model] = {"config": config, "variants": measure(Setup(model, **config), names)}
    path = args.json or os.path.join("runs", time.strftime("compare-%Y%m%d-%H%M%S.json"))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as handle:
        json.dump(result, handle, indent=2)
    if not args.quiet:
        print(render(result))
        print(f"wrote {path}")
    return 0


def render(result: dict[str, Any]) -> str:
    lines = [f"hookfit compare ({result['date']}, {result['cpus']} CPUs, torch {result['torch']}, 1 thread)"]
    for model, entry in result["models"].items():
        c = entry["config"]
        lines += ["", f"{model}: width {c['width']} depth {c['depth']} batch {c['batch']}, "
                      f"{c['batches']} steps an epoch, {c['rounds']} rounds interleaved"]
        lines.append(f"  {'variant':<18} {'us/step':>9} {'ratio':>7} {'95% CI':>13} {'added us':>9} {'heap KiB':>9}")
        variants = entry["variants"]
        base = variants.get("hookfit-default", {}).get("added_us")
        for name, v in variants.items():
            lines.append(f"  {name:<18} {v['us_per_step']:>9.1f} {v['ratio']:>7.3f} "
                         f"{v['ratio_ci'][0]:>6.3f}-{v['ratio_ci'][1]:<6.3f} {v['added_us']:>+9.1f} {v['heap_peak_kib']:>9.0f}")
        if base and base > 0:
            for peer in ("ignite-progress", "lightning-default"):
                if peer in variants:
                    lines.append(f"  {peer} overhead / hookfit-default overhead: {variants[peer]['added_us'] / base:.1f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
