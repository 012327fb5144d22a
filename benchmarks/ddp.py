"""Data-parallel throughput: one process against two (gloo), and hookfit + DDP against a raw
DDP loop. A measurement, never an assertion.

The model is compute-bound: ``--layers`` x ``Linear(width, width)`` with ReLU between them
(default 4 x 1024, 4.2 M parameters), MSE against random targets, SGD. The *global* batch is
the same in every configuration (``--batch``, default 1024): one process trains on all of it,
each of two processes on half (strong scaling, the same optimisation as one process). At
batch 256 the same model is communication-bound on two cores (the 17 MB gradient all-reduce
costs more than half a step saves); ``--batch 256`` shows it.

Configurations, each in its own process(es) so thread settings do not leak:

* ``1 process x 1 thread`` and ``1 process x 2 threads``: ``python benchmarks/ddp.py --worker``;
* ``2 processes x 1 thread`` (gloo): ``torchrun --nproc-per-node 2 benchmarks/ddp.py --worker``.

In each, two variants run in interleaved rounds (the order alternates), over the same
batches (``--batches`` per round): ``raw`` is ``for x, y in shard: zero_grad, ddp(x), loss,
backward, step`` with a ``DistributedDataParallel`` built before each round, as ``fit()``
builds one (a plain loop on one process);
``hookfit`` is ``hookfit.Loop(...).fit()`` with the distributed, optim, metrics and interrupter
plugins (the distributed plugin wraps the model, shards the data and agrees on stopping after
every batch). Two times per hookfit round: ``stage``, the training stage's batches (per-step
cost), and ``fit``, the whole call (plus discovery, wrapping in DDP, the per-run events). The
ratio reported is the median over rounds of hookfit's time over raw's in the same round.

    python benchmarks/ddp.py                      # the table (~1 min on 2 cores)
    python benchmarks/ddp.py --rounds 11 --batches 12 --json runs/ddp.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TARGET = 1.05  # hookfit + DDP at most 5 % slower than raw DDP


def _model(width: int, layers: int) -> Any:
    import torch

    parts: list[Any] = []
    for i in range(layers):
        parts.append(torch.nn.Linear(width, width))
        if i < layers - 1:
            parts.append(torch.nn.ReLU())
    return torch.nn.Sequential(*parts)


def worker(args: argparse.Namespace) -> None:
    """One configuration: interleaved rounds of raw and hookfit; rank 0 prints a JSON line."""
    import torch
    import torch.distributed as dist

    import hookfit
    from hookfit import hookimpl
    from hookfit.data import Batches

    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    per_rank = args.batch // world
    generator = torch.Generator().manual_seed(0)
    samples = args.batches * args.batch
    x = torch.randn(samples, args.width, generator=generator)
    y = torch.randn(samples, args.width, generator=generator)
    data = Batches(x, y, batch_size=per_rank)  # hookfit shards it; raw iterates a shard
    shard = data.shard(rank, world) if world > 1 else data
    loss_fn = torch.nn.functional.mse_loss

    torch.manual_seed(0)
    raw_model = _model(args.width, args.layers)
    raw_opt = torch.optim.SGD(raw_model.parameters(), lr=1e-3)
    torch.manual_seed(0)
    hf_model = _model(args.width, args.layers)
    hf_opt = torch.optim.SGD(hf_model.parameters(), lr=1e-3)

    def raw() -> dict[str, float]:
        # a fresh wrapper per round, as hookfit's fit() makes one: both pay DDP's first steps
        raw_net = torch.nn.parallel.DistributedDataParallel(raw_model) if world > 1 else raw_model
        start = time.perf_counter()
        for xb, yb in shard:
            raw_opt.zero_grad(set_to_none=True)
            loss = loss_fn(raw_net(xb), yb)
            loss.backward()
            raw_opt.step()
        return {"stage": time.perf_counter() - start}

    class Clock:
        name = "clock"

        def __init__(self) -> None:
            self.start = self.stage = 0.0

        @hookimpl
        def stage_start(self) -> None:
            self.start = time.perf_counter()

        @hookimpl
        def stage_end(self) -> None:
            self.stage = time.perf_counter() - self.start

    def step(loop: Any, batch: Any) -> Any:
        xb, yb = batch
        loss = loss_fn(loop.model(xb), yb)
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    from overhead import scratch  # (same folder)

    run_dir = scratch("hookfit-ddp-bench-")

    def fit() -> dict[str, float]:
        clock = Clock()
        start = time.perf_counter()
        state = hookfit.Loop(step, data, model=hf_model, optimizers=hf_opt, max_epochs=1,
                             run_dir=run_dir, plugins=[clock]).fit()
        total = time.perf_counter() - start
        assert state.status == "completed" and state.world_size == world, state
        return {"stage": clock.stage, "fit": total}

    for variant in (raw, fit):  # warm-up: allocator, DDP buckets, imports
        variant()
    rounds: list[dict[str, Any]] = []
    for i in range(args.rounds):
        order = (raw, fit) if i % 2 == 0 else (fit, raw)
        timed = {f.__name__: f() for f in order}
        rounds.append({"raw": timed["raw"]["stage"], "stage": timed["fit"]["stage"], "fit": timed["fit"]["fit"]})
    if world > 1:
        group = dist.group.WORLD  # freed last, from Python (see plugins/distributed/plugin.py, _release)
        gc.collect()
        dist.destroy_process_group()
        del group
    if rank == 0:
        print("RESULT " + json.dumps({"world": world, "threads": args.threads, "per_rank": per_rank,
                                      "rounds": rounds}), flush=True)


def run_config(args: argparse.Namespace, processes: int, threads: int) -> dict[str, Any]:
    here = Path(__file__).resolve()
    common = ["--worker", "--threads", str(threads), "--rounds", str(args.rounds), "--batches", str(args.batches),
              "--batch", str(args.batch), "--width", str(args.width), "--layers", str(args.layers)]
    if processes == 1:
        command = [sys.executable, str(here), *common]
    else:
        torchrun = Path(sys.executable).with_name("torchrun")
        launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
        command = [*launcher, "--nproc-per-node", str(processes), "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", "localhost:0", str(here), *common]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS=str(threads), HOOKFIT_PLUGINS="distributed,interrupter,metrics,optim")
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    for line in result.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise SystemExit(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batches", type=int, default=6, help="training batches per round")
    parser.add_argument("--batch", type=int, default=1024, help="global batch (split across processes)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    import torch

    started = time.perf_counter()
    configs = [("1 process x 1 thread", 1, 1), ("1 process x 2 threads", 1, 2), ("2 processes x 1 thread (gloo)", 2, 1)]
    results = []
    for label, processes, threads in configs:
        result = run_config(args, processes, threads)
        rounds = result["rounds"]
        samples = args.batches * args.batch
        med = {k: statistics.median(r[k] for r in rounds) for k in ("raw", "stage", "fit")}
        results.append({
            "config": label, "processes": processes, "threads": threads, "per_rank_batch": result["per_rank"],
            "raw_samples_per_s": samples / med["raw"], "hookfit_samples_per_s": samples / med["stage"],
            "hookfit_fit_samples_per_s": samples / med["fit"],
            "stage_ratio": statistics.median(r["stage"] / r["raw"] for r in rounds),
            "fit_ratio": statistics.median(r["fit"] / r["raw"] for r in rounds),
            "rounds": rounds,
        })
    params = args.layers * (args.width * args.width + args.width)
    print(f"hookfit + DDP throughput: {args.layers} x Linear({args.width}, {args.width}) + ReLU "
          f"({params / 1e6:.1f} M parameters), MSE, SGD; global batch {args.batch}; {args.batches} batches "
          f"per round, {args.rounds} interleaved rounds (medians)")
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"{platform.machine()}")
    print()
    header = (f"{'configuration':<31} {'batch/rank':>10} {'raw samples/s':>14} {'hookfit samples/s':>18} "
              f"{'hookfit/raw (stage)':>20} {'hookfit/raw (fit)':>18}")
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r['config']:<31} {r['per_rank_batch']:>10} {r['raw_samples_per_s']:>14.0f} "
              f"{r['hookfit_samples_per_s']:>18.0f} {r['stage_ratio']:>20.3f} {r['fit_ratio']:>18.3f}")
    one, two = results[0], results[2]
    print()
    print(f"2 processes vs 1 process x 1 thread: raw x{two['raw_samples_per_s'] / one['raw_samples_per_s']:.2f}, "
          f"hookfit x{two['hookfit_samples_per_s'] / one['hookfit_samples_per_s']:.2f}; "
          f"vs 1 process x 2 threads: raw x{two['raw_samples_per_s'] / results[1]['raw_samples_per_s']:.2f}")
    ratio = two["stage_ratio"]
    verdict = "met" if ratio <= TARGET else "missed"
    print(f"target: hookfit + DDP at most {100 * (TARGET - 1):.0f} % slower than raw DDP per step: {verdict} "
          f"({100 * (ratio - 1):+.1f} %; whole fit() call: {100 * (two['fit_ratio'] - 1):+.1f} %)")
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
