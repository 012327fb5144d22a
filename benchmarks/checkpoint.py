"""How long a checkpoint save blocks the training loop, against a plain ``torch.save``.

A measurement, never an assertion. The model is a stack of ``Linear(2048, 2048)`` layers,
about 100 MB of float32 parameters (``--mb`` changes it). Each round, interleaved in one
process with the order rotating:

* ``torch.save``: ``torch.save(model.state_dict(), path)`` into the same folder: what a user
  would write by hand (no fsync, no rename, so not crash-safe);
* ``checkpoint-bg``: the checkpoint plugin's save with ``background=True`` (the default), timed
  from the call to its return inside a running loop: the time the loop is blocked (the state
  is copied, the file is written by a thread while training goes on); the write is then
  waited for, untimed, before the next variant runs;
* ``checkpoint-sync``: the same with ``background=False``: the whole atomic write (temporary
  file, fsync, rename, fsync of the folder) blocks the loop.

The checkpoint holds more than the model (position, RNG states, plugin states), as a real one
does. The target is ``checkpoint-bg`` blocking at most 1.2x ``torch.save``.

    python benchmarks/checkpoint.py               # 15 rounds, ~1 min on 2 cores
    python benchmarks/checkpoint.py --rounds 31 --json runs/checkpoint.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import median_ci  # noqa: E402  (same folder)

import hookfit  # noqa: E402
from hookfit.plugins.checkpoint import Checkpoint  # noqa: E402


def make_model(mb: float) -> torch.nn.Module:
    layers = max(1, round(mb * 2**20 / (4 * (2048 * 2048 + 2048))))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(layers)])


def checkpoint_runner(model: torch.nn.Module, folder: Path, background: bool) -> Callable[[], float]:
    """One save inside a running loop; returns the seconds the call blocked."""
    ckpt = Checkpoint(dir=folder, every_n_epochs=None, keep_last=1, background=background)
    blocked: list[float] = []

    def step(loop: Any, batch: Any) -> None:
        start = time.perf_counter()
        ckpt.save(loop, "benchmark")
        blocked.append(time.perf_counter() - start)

    def run() -> float:
        blocked.clear()
        hookfit.Loop(step, [0], model=model, run_dir=folder, plugins=[ckpt]).fit()  # fit_end waits
        return blocked[0]

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--dir", default=None, help="folder to write in (default: a temporary one)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    os.environ["HOOKFIT_PLUGINS"] = ""  # only the checkpoint plugin given here
    torch.set_num_threads(1)
    model = make_model(args.mb)
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)

        def plain() -> float:
            start = time.perf_counter()
            torch.save(model.state_dict(), folder / "plain.pt")
            return time.perf_counter() - start

        variants = {"torch.save": plain,
                    "checkpoint-bg": checkpoint_runner(model, folder / "bg", True),
                    "checkpoint-sync": checkpoint_runner(model, folder / "sync", False)}
        names = list(variants)
        times: dict[str, list[float]] = {n: [] for n in names}
        for n in names:  # warm-up: page cache, allocator
            variants[n]()
        for r in range(args.rounds):
            for n in names[r % len(names):] + names[: r % len(names)]:
                times[n].append(variants[n]())
    load = os.getloadavg()[0]
    print(f"Checkpoint save blocking the loop: model {size:.0f} MB of parameters, {args.rounds} rounds "
          f"interleaved (1-minute load average {load:.2f})")
    print(f"  {'variant':<16} {'ms median':>10} {'ratio':>8} {'ratio 95% CI':>15}")
    result: dict[str, Any] = {"model_mb": size, "rounds": args.rounds, "machine": platform.platform(),
                              "torch": torch.__version__, "variants": {}}
    for n in names:
        ratios = [t / b for t, b in zip(times[n], times["torch.save"])]
        ratio, low, high = median_ci(ratios)
        ms = statistics.median(times[n]) * 1e3
        result["variants"][n] = {"ms": ms, "ratio": ratio, "ci": [low, high], "raw_s": times[n]}
        print(f"  {n:<16} {ms:>10.1f} {ratio:>8.3f} {low:>7.3f}-{high:<7.3f}")
    bg = result["variants"]["checkpoint-bg"]
    verdict = "within" if bg["ci"][1] <= 1.2 else "OVER" if bg["ci"][0] > 1.2 else "undecided against"
    print(f"  measured: checkpoint-bg / torch.save = {bg['ratio']:.3f} (target <= 1.2): {verdict} the target")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
