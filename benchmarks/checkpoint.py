"""How long a checkpoint save blocks the training loop, against ``torch.save`` and the copy floor.

A measurement, never an assertion. The model is a stack of ``Linear(2048, 2048)`` layers
trained with plain SGD (no optimizer state); each size runs in a process of its own (so its
peak resident memory is its own), 25 M and 100 M parameters by default, 400 M with
``--large``. For each size, side by side:

* ``torch.save``: ``torch.save(model.state_dict(), path)``: what a user writes by hand (no
  fsync, no rename: not crash-safe), the median of ``--rounds``;
* ``floor``: one copy of the model's state into buffers allocated once: what a save that
  writes in the background cannot go below, the median of ``--rounds`` (after a first copy
  that pays the page faults);
* ``one-file``: the checkpoint plugin's save with ``background=True`` (the default) inside a
  training run, a save every ``--gap`` training steps: the time the call blocks the loop (the
  state is built and copied into the staging buffers; the digest, the file, its fsyncs and
  rename are the writer thread's, while training goes on). ``first`` is the save that
  allocates the buffers; ``median`` and ``worst`` are over the saves after it;
* ``sync``: the same save with ``background=False``: the whole atomic write blocks the loop;
* ``peak RSS``: the process's peak resident memory, and how far it rose above the peak of
  training alone (model, gradients, activations) while the one-file saves ran: one staging copy of the
  state when writes end before the next save, two at most. ``busy``: how many of the saves
  after the first found the previous write still in flight (they copy into a second set of
  buffers, made at the first such save, while the writer steps aside).

The target: every one-file save after the first at most 1.5x the floor.

    python benchmarks/checkpoint.py                     # 25 M and 100 M, about a minute on 2 cores
    python benchmarks/checkpoint.py --large --json runs/checkpoint.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint

WIDTH = 2048
TARGET = 1.5  # one-file save after the first / floor


def make_model(millions: float) -> torch.nn.Module:
    layers = max(1, round(millions * 1e6 / (WIDTH * WIDTH + WIDTH)))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def peak_mb() -> float:
    """The process's peak resident memory so far, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # (KiB on Linux)


def saves_in_a_run(model: torch.nn.Module, folder: Path, *, background: bool, saves: int, gap: int,
                   busy: list[int] | None = None) -> list[float]:
    """Seconds each ``Checkpoint.save`` blocked a training run that saves every ``gap`` steps
    (``busy`` gets, for each, how many snapshots the writer held when it was asked)."""
    ckpt = Checkpoint(dir=folder, every_n_epochs=None, keep_last=2, background=background)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = torch.randn(4, WIDTH)
    blocked: list[float] = []

    def step(loop: Any, batch: Any) -> None:
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if (loop.state.step + 1) % gap == 0:
            if busy is not None:
                busy.append(ckpt.writer.pending)
            start = time.perf_counter()
            ckpt.save(loop, "step")
            blocked.append(time.perf_counter() - start)

    hookfit.Loop(step, range(saves * gap), model=model, run_dir=folder, plugins=[ckpt]).fit()  # fit_end waits
    assert ckpt.skipped_saves == 0 and ckpt.failed_saves == 0
    return blocked


def measure(millions: float, rounds: int, saves: int, gap: int, where: str | None) -> dict[str, Any]:
    os.environ["HOOKFIT_PLUGINS"] = ""  # only the checkpoint plugin given here
    torch.set_num_threads(1)  # training on one core, the writer thread on the other
    model = make_model(millions)
    state = model.state_dict()
    size = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    out: dict[str, Any] = {"params_m": sum(p.numel() for p in model.parameters()) / 1e6, "state_mb": size}
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        folder = Path(tmp)
        saves_in_a_run(model, folder / "warm", background=False, saves=1, gap=2)  # gradients, page cache
        before = peak_mb()  # training alone: model, gradients, activations (a save in place writes no copy)
        busy: list[int] = []
        bg = saves_in_a_run(model, folder / "bg", background=True, saves=saves, gap=gap, busy=busy)
        out["found_busy"] = sum(1 for b in busy[1:] if b)
        out["rss_rise_mb"] = peak_mb() - before
        out["one_file_first_ms"] = bg[0] * 1e3
        out["one_file_ms"] = [t * 1e3 for t in bg[1:]]
        out["sync_ms"] = [t * 1e3 for t in saves_in_a_run(model, folder / "sync", background=False,
                                                           saves=max(2, rounds // 2), gap=1)]
        plain = []
        for _ in range(rounds):
            start = time.perf_counter()
            torch.save(model.state_dict(), folder / "plain.pt")
            plain.append(time.perf_counter() - start)
        out["torch_save_ms"] = [t * 1e3 for t in plain]
    buffers = [torch.empty_like(t) for t in state.values()]
    floor = []
    for i in range(rounds + 1):
        start = time.perf_counter()
        for buffer, tensor in zip(buffers, state.values()):
            buffer.copy_(tensor)
        if i:  # the first pays the page faults
            floor.append(time.perf_counter() - start)
    out["floor_ms"] = [t * 1e3 for t in floor]
    out["peak_rss_mb"] = peak_mb()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="25,100", help="millions of parameters, comma-separated")
    parser.add_argument("--large", action="store_true", help="add 400 M parameters (about 1.6 GB of state)")
    parser.add_argument("--rounds", type=int, default=5, help="torch.save and floor repetitions")
    parser.add_argument("--saves", type=int, default=6, help="one-file saves per size (the first allocates)")
    parser.add_argument("--gap", type=int, default=8, help="training steps between saves")
    parser.add_argument("--dir", default=None, help="folder to write in (default: a temporary one)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", type=float, default=None, help=argparse.SUPPRESS)  # a size, in its own process
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure(args.one, args.rounds, args.saves, args.gap, args.dir)))
        return 0
    sizes = [float(s) for s in args.sizes.split(",")] + ([400.0] if args.large else [])
    rows = []
    for millions in sizes:
        command = [sys.executable, __file__, "--one", str(millions), "--rounds", str(args.rounds),
                   "--saves", str(args.saves), "--gap", str(args.gap)] + (["--dir", args.dir] if args.dir else [])
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    med = statistics.median
    print(f"Checkpoint saves blocking the loop (ms; medians; one-file over {args.saves - 1} saves after the first, "
          f"a save every {args.gap} steps; 1-minute load average {os.getloadavg()[0]:.2f}; torch {torch.__version__})")
    print(f"  {'params':>7} {'state MB':>8} {'torch.save':>10} {'floor':>7} {'1st':>7} {'median':>7} {'worst':>7} "
          f"{'worst/floor':>11} {'busy':>4} {'sync':>7} {'peak RSS MB':>11} {'RSS rise MB':>11}")
    for row in rows:
        floor = med(row["floor_ms"])
        worst = max(row["one_file_ms"])
        row["worst_over_floor"] = worst / floor
        print(f"  {row['params_m']:>6.0f}M {row['state_mb']:>8.0f} {med(row['torch_save_ms']):>10.1f} {floor:>7.1f} "
              f"{row['one_file_first_ms']:>7.1f} {med(row['one_file_ms']):>7.1f} {worst:>7.1f} "
              f"{worst / floor:>11.2f} {row['found_busy']:>4} {med(row['sync_ms']):>7.1f} "
              f"{row['peak_rss_mb']:>11.0f} {row['rss_rise_mb']:>11.0f}")
    within = all(row["worst_over_floor"] <= TARGET for row in rows)
    print(f"  target: every one-file save after the first <= {TARGET}x the floor: {'met' if within else 'NOT met'}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"machine": platform.platform(), "torch": torch.__version__,
                                               "gap": args.gap, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
