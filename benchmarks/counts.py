"""Per-batch instruction, cache-miss and branch-miss counts of the tiny model's loops, under
Valgrind's callgrind: a measure that does not move with the machine's load.

On a shared 2-core VM the wall-clock readings of ``overhead.py`` move by several microseconds a
step from run to run, more than the effects looked for. Callgrind runs the same code on a
simulated CPU and counts what it executed: instructions (``Ir``), first-level instruction and
data cache misses (``I1mr``, ``D1mr`` + ``D1mw``) and mispredicted conditional and indirect
branches (``Bcm``, ``Bim``). The counts are the same in every run on the same build, so a
change of a few hundred instructions a batch is visible. They are not time: a miss in the first
level that hits the second costs a dozen cycles, callgrind does not model the second level (its
"last level" is the host's L3), and a real CPU runs several instructions a cycle.

How a pass is counted: each valgrind process warms a variant up with two passes, then runs one
more inside libc's ``qsort``, called on two elements with a Python comparison function that
makes the pass; collection is off except inside ``qsort`` and what it calls
(``--toggle-collect=*qsort*``: glibc's ``qsort`` jumps to ``qsort_r``, which calls the
comparison; a pattern naming ``qsort`` alone loses the pass). The count is checked to hold at
least :data:`LEAST_PER_BATCH` instructions a batch. Work driven by the clock is off in the
counted processes (:data:`UNTIMED`): callgrind runs the code some 50 times slower, so a
publication of the metrics every 0.5 s, which comes once in ~2,000 batches at full speed, would
come every ~40 batches and be counted as per-batch work (13,000 of the default stack's 41,000
instructions a batch, before this was done). Every variant runs a short and a long pass
(``--batches 20,220``), each in its own process; their difference divided by the difference in
batches is the per-batch count, free of what a pass costs once (the ``Loop``, its plugins, the
stage's events).

    python benchmarks/counts.py                  # raw, call, core, optim, metrics, default; ~35 min on 2 cores
    python benchmarks/counts.py --variants raw,core --json runs/counts.json

Variants are :data:`overhead.VARIANTS` and two parts of the default stack on the tiny model:
``optim`` (the core and optim, the managed step) and ``metrics`` (the core and metrics), the
rows of ``overhead.py --budget-model``. Without ``valgrind`` on the ``PATH`` it says so and exits.
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import ctypes
import gc
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Callable, Sequence

import torch

import budget
import overhead

PARTS: dict[str, Callable[[overhead.Workload], Any]] = {
    "optim": budget.ROWS["optim (managed step)"][0],
    "metrics": budget.ROWS["metrics"][0],
}
UNTIMED = "[plugins.metrics]\ninterval = 1e9\n"
"""The ``hookfit.toml`` of a counted process: no publication of the metrics by time, so no
console line either (it writes on publications). The core's live time split is put off in
:func:`child`. A publication's own cost is not a batch's: at full speed one comes a stage's
end or every 0.5 s."""
LEAST_PER_BATCH = 100_000
"""Fewer instructions a batch than a pass of the tiny model can run (a raw step runs ~800,000)."""
DEFAULT_VARIANTS = ("raw", "call", "core", "optim", "metrics", "default")
SHOWN = (("Ir", ("Ir",)), ("I1 misses", ("I1mr",)), ("D1 misses", ("D1mr", "D1mw")),
         ("branch misses", ("Bcm", "Bim")))


def builder(name: str) -> Callable[[overhead.Workload], Any]:
    return PARTS[name] if name in PARTS else overhead.VARIANTS[name]


# -- the child: passes under valgrind ----------------------------------------------------------
def child(name: str, size: int) -> None:
    """Warm the variant up with two passes of ``size`` batches, then run one more inside
    ``qsort``'s comparison function."""
    torch.set_num_threads(1)
    import hookfit.run

    config = tempfile.NamedTemporaryFile("w", prefix="hookfit-counts-", suffix=".toml", delete=False)
    with config:
        config.write(UNTIMED)
    atexit.register(os.unlink, config.name)
    os.environ["HOOKFIT_CONFIG"] = config.name
    hookfit.run.Run.TIME_SPLIT_INTERVAL = math.inf  # the stage's split once, at its end
    libc = ctypes.CDLL(None)
    compare_type = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    two = (ctypes.c_int * 2)(0, 1)
    run = builder(name)(overhead.model_workload(size))
    run()  # the first pass imports and discovers
    run()
    passes = []

    def compare(_a: Any, _b: Any) -> int:
        run()
        passes.append(1)
        return 0

    gc.collect()
    libc.qsort(two, 2, ctypes.sizeof(ctypes.c_int), compare_type(compare))
    if len(passes) != 1:
        raise RuntimeError(f"qsort called the pass {len(passes)} times, not once")
    loop = getattr(run, "last_loop", None)  # (the raw loop has none)
    metrics = loop.run.pm.get_plugin("metrics") if loop is not None else None
    untimed = f" (metrics by time every {metrics.interval:g} s)" if metrics is not None else ""
    print(f"counted {name} {size}{untimed}", flush=True)


# -- the parent --------------------------------------------------------------------------------
def parse(path: str) -> dict[str, int]:
    """The event totals of one callgrind output."""
    events: list[str] = []
    for line in open(path, encoding="utf-8", errors="replace"):
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith(("totals:", "summary:")):
            values = [int(v) for v in line.split()[1:]]
            return dict(zip(events, values + [0] * (len(events) - len(values))))
    raise ValueError(f"{path}: no totals in this callgrind output")


def count(name: str, size: int, folder: str, python: str = sys.executable) -> dict[str, int]:
    """One valgrind process: the counts of one pass of ``size`` batches of ``name``."""
    out = os.path.join(folder, f"callgrind.{name}.{size}")
    here = os.path.dirname(os.path.abspath(__file__))
    argv = ["valgrind", "--tool=callgrind", "--cache-sim=yes", "--branch-sim=yes", "--collect-atstart=no",
            "--toggle-collect=*qsort*", f"--callgrind-out-file={out}",
            python, os.path.join(here, "counts.py"), "--child", name, "--batches", str(size)]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=here)
    if done.returncode != 0 or f"counted {name} {size}" not in done.stdout:
        raise RuntimeError(f"valgrind for {name} ({size} batches) exited {done.returncode}:\n"
                           f"{done.stdout[-2000:]}{done.stderr[-4000:]}")
    total = parse(out)
    if total.get("Ir", 0) < LEAST_PER_BATCH * size:
        raise RuntimeError(f"valgrind for {name} ({size} batches) counted {total.get('Ir', 0)} instructions, "
                           f"too few for the pass: collection did not cover it")
    return total


def per_batch(counts: list[dict[str, int]], sizes: Sequence[int]) -> dict[str, float]:
    """The long pass minus the short one, per batch of difference."""
    short, long = counts[0], counts[-1]
    return {event: (long[event] - short[event]) / (sizes[-1] - sizes[0]) for event in long}


def shown(values: dict[str, float]) -> list[float]:
    return [sum(values.get(event, 0.0) for event in events) for _, events in SHOWN]


def table(results: dict[str, dict[str, float]]) -> str:
    lines = [f"  {'variant':10s}" + "".join(f"{title:>15s}" for title, _ in SHOWN)]
    raw = shown(results["raw"]) if "raw" in results else None
    for name, values in results.items():
        row = shown(values)
        lines.append(f"  {name:10s}" + "".join(f"{v:15.0f}" for v in row))
        if raw is not None and name != "raw":
            lines.append(f"  {'  - raw':10s}" + "".join(f"{v - r:+15.0f}" for v, r in zip(row, raw)))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--variants", default=",".join(DEFAULT_VARIANTS),
        help=f"comma-separated (registered: {', '.join([*overhead.VARIANTS, *PARTS])}); raw is always counted")
    add("--batches", default="20,220", help="the short and the long pass, in batches (default 20,220)")
    add("--jobs", type=int, default=2, help="valgrind processes at once (default 2)")
    add("--json", help="write the per-batch counts here")
    add("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.batches.split(",")]
    if args.child is not None:
        child(args.child, sizes[0])
        return 0
    if len(sizes) != 2 or not 0 < sizes[0] < sizes[1]:
        parser.error("--batches takes two sizes, the short pass first: e.g. 20,220")
    names = list(dict.fromkeys(["raw", *(n for n in args.variants.split(",") if n)]))
    unknown = [n for n in names if n not in overhead.VARIANTS and n not in PARTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}")
    if shutil.which("valgrind") is None:
        print("counts.py: valgrind is not installed (apt install valgrind); nothing counted")
        return 0
    runs = [(name, size) for name in names for size in sizes]
    with tempfile.TemporaryDirectory(prefix="hookfit-counts-") as folder:
        with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
            totals = list(pool.map(lambda run: count(*run, folder), runs))
    raw_counts = {name: [t for (n, _), t in zip(runs, totals) if n == name] for name in names}
    results = {name: per_batch(raw_counts[name], sizes) for name in names}
    print(f"per batch, tiny model, {sizes[1]} - {sizes[0]} batches, under callgrind "
          f"(torch {torch.__version__}, Python {sys.version.split()[0]}):")
    print(table(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump({"batches": sizes, "per_batch": results, "passes": raw_counts}, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
