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

``--sharded``: the same model sharded with FSDP2 (``Distributed(strategy="fsdp")``) over 2
processes that this script starts with ``torchrun`` (gloo on the CPU), each size a job of its
own. Each rank times, inside a training run that saves every ``--gap`` steps:

* ``dcp.save``: DCP's synchronous save of the model's sharded state dict
  (``torch.distributed.checkpoint.save``, every rank its shard, no digest, no rename);
* ``sync``: the checkpoint plugin's sharded save with ``background=False``: the ranks write
  the folder in the foreground (DCP's save, digests, ``state.pt``, rename);
* ``background``: the plugin's sharded save with ``background=True`` (the default): the time
  the call blocks the loop (the state staged into host memory, DCP's ``async_save`` started on
  the checkpoint's own gloo group). ``first`` is the save that makes the buffers and the
  group; ``median`` and ``worst`` are over the saves after it. A save's time is the slowest
  rank's (the next collective waits for it);
* ``peak RSS``: each kind's job's peak resident memory (the larger of its ranks), and its rise
  over that job's training alone (for ``background``: the staging copy of the rank's shard,
  reused from save to save, and the transient buffers of writes that run while training
  allocates). Every rank builds the whole model before it is sharded: with ``--large`` a rank
  peaks near 9-11 GB (about 20 GB free needed).

The target: every background sharded save after the first at most 0.25x the synchronous
(``sync``) one.

    python benchmarks/checkpoint.py                     # 25 M and 100 M, about a minute on 2 cores
    python benchmarks/checkpoint.py --large --json runs/checkpoint.json
    python benchmarks/checkpoint.py --sharded [--large]  # 2 processes, FSDP2, DCP
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
SHARDED_TARGET = 0.25  # background sharded save after the first / synchronous sharded save


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


KINDS = ("background", "sync", "dcp")
"""The sharded saves timed, each in a torchrun job of its own (its peak memory its own)."""


def sharded_rank(millions: float, kind: str, saves: int, gap: int, where: str) -> None:
    """One rank of a ``--sharded`` job (under torchrun): a training run of ``gap`` steps alone,
    then ``saves`` saves of ``kind``, one every ``gap`` steps; its times and memory into
    ``where/<kind>.rank<N>.json``."""
    from hookfit.plugins.distributed import Distributed

    os.environ["HOOKFIT_PLUGINS"] = ""
    torch.set_num_threads(1)
    x = torch.randn(4, WIDTH)
    model = make_model(millions)
    params_m = sum(p.numel() for p in model.parameters()) / 1e6
    ckpt = None
    if kind != "dcp":
        ckpt = Checkpoint(dir=Path(where, kind), every_n_epochs=None, keep_last=2, background=kind == "background")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    blocked: list[float] = []
    steps: list[float] = []
    busy: list[bool] = []  # each save: whether this rank's previous background write was still in flight
    alone: list[float] = []  # the peak memory of training alone

    def step(loop: Any, batch: Any) -> None:
        start = time.perf_counter()
        loop.model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        steps.append(time.perf_counter() - start)
        if loop.state.step + 1 == gap:
            alone.append(peak_mb())
        if (loop.state.step + 1) % gap or loop.state.step + 1 == gap:
            return
        if ckpt is not None:
            busy.append(ckpt.shards.in_flight())
        start = time.perf_counter()
        if ckpt is not None:
            ckpt.save(loop, "step")
        else:  # DCP's own synchronous save of the sharded model's state dict
            from torch.distributed.checkpoint import state_dict_saver

            state_dict_saver.save(loop.model.state_dict(), checkpoint_id=Path(where, f"dcp{loop.state.step}"))
        blocked.append(time.perf_counter() - start)

    plugins: list[Any] = [Distributed(strategy="fsdp", shard_data=False)] + ([ckpt] if ckpt is not None else [])
    hookfit.Loop(step, list(range((saves + 1) * gap)), model=model, run_dir=Path(where, f"run-{kind}"),
                 plugins=plugins).fit()  # fit_end waits for the write in flight
    if ckpt is not None:
        assert ckpt.failed_saves == 0 and ckpt.skipped_saves == 0
    state_mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
    Path(where, f"{kind}.rank{os.environ['RANK']}.json").write_text(json.dumps({
        "params_m": params_m, "state_mb": state_mb, "blocked_s": blocked, "busy": busy,
        "step_s": statistics.median(steps[:gap]), "peak_rss_mb": peak_mb(), "rss_rise_mb": peak_mb() - alone[0]}))


def sharded(sizes: list[float], saves: int, gap: int, where: str | None, as_json: str | None) -> int:
    """``--sharded``: for each size and each kind of save, a torchrun job of 2 processes; the table."""
    torchrun = Path(sys.executable).with_name("torchrun")
    launch = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    rows = []
    for millions in sizes:
        row: dict[str, Any] = {}
        for kind in KINDS:
            count = saves if kind == "background" else max(2, saves // 2)
            with tempfile.TemporaryDirectory(dir=where) as tmp:
                command = [*launch, "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                           "localhost:0", __file__, "--sharded-rank", str(millions), "--kind", kind,
                           "--saves", str(count), "--gap", str(gap), "--dir", tmp]
                done = subprocess.run(command, capture_output=True, text=True,
                                      env={**os.environ, "OMP_NUM_THREADS": "1", "HOOKFIT_PLUGINS": ""})
                if done.returncode:
                    sys.stderr.write(done.stdout + done.stderr)
                    return done.returncode
                ranks = [json.loads(Path(tmp, f"{kind}.rank{r}.json").read_text()) for r in (0, 1)]
            row.update(params_m=ranks[0]["params_m"], state_mb=ranks[0]["state_mb"])
            row[f"{kind}_ms"] = [max(times) * 1e3 for times in zip(*(r["blocked_s"] for r in ranks))]  # the slowest rank
            row[f"{kind}_peak_rss_mb"] = max(r["peak_rss_mb"] for r in ranks)
            row[f"{kind}_rss_rise_mb"] = max(r["rss_rise_mb"] for r in ranks)
            row[f"{kind}_step_ms"] = max(r["step_s"] for r in ranks) * 1e3
            if kind == "background":
                row["found_busy"] = sum(any(b) for b in zip(*(r["busy"] for r in ranks)))
        rows.append(row)
    med = statistics.median
    print(f"Sharded checkpoint saves blocking the loop, 2 processes, FSDP2, gloo (ms, the slowest rank; medians; "
          f"background over {saves - 1} saves after the first, a save every {gap} steps; 1-minute load average "
          f"{os.getloadavg()[0]:.2f}; torch {torch.__version__})")
    print(f"  {'params':>7} {'state MB':>8} {'step':>6} {'dcp.save':>8} {'sync':>8} {'1st':>7} {'median':>7} "
          f"{'worst':>7} {'worst/sync':>10} {'busy':>4} {'peak RSS MB bg/sync/dcp':>23} {'RSS rise MB bg/sync/dcp':>23}")
    for row in rows:
        sync, background = med(row["sync_ms"]), row["background_ms"]
        worst = max(background[1:])
        row["worst_over_sync"] = worst / sync
        peaks = "/".join(f"{row[f'{k}_peak_rss_mb']:.0f}" for k in KINDS)
        rises = "/".join(f"{row[f'{k}_rss_rise_mb']:.0f}" for k in KINDS)
        print(f"  {row['params_m']:>6.0f}M {row['state_mb']:>8.0f} {row['background_step_ms']:>6.0f} "
              f"{med(row['dcp_ms']):>8.1f} {sync:>8.1f} {background[0]:>7.1f} {med(background[1:]):>7.1f} "
              f"{worst:>7.1f} {worst / sync:>10.3f} {row['found_busy']:>4} {peaks:>23} {rises:>23}")
    within = all(row["worst_over_sync"] <= SHARDED_TARGET for row in rows)
    print(f"  target: every background sharded save after the first <= {SHARDED_TARGET}x the synchronous one: "
          f"{'met' if within else 'NOT met'}")
    if as_json:
        Path(as_json).parent.mkdir(parents=True, exist_ok=True)
        Path(as_json).write_text(json.dumps({"machine": platform.platform(), "torch": torch.__version__, "gap": gap,
                                             "sharded": True, "rows": rows}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="25,100", help="millions of parameters, comma-separated")
    parser.add_argument("--large", action="store_true", help="add 400 M parameters (about 1.6 GB of state)")
    parser.add_argument("--rounds", type=int, default=5, help="torch.save and floor repetitions")
    parser.add_argument("--saves", type=int, default=None,
                        help="saves per size (the first allocates; default 6, with --sharded 4)")
    parser.add_argument("--gap", type=int, default=None, help="training steps between saves (default 8, with --sharded 3)")
    parser.add_argument("--dir", default=None, help="folder to write in (default: a temporary one)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--sharded", action="store_true", help="FSDP2 over 2 processes (torchrun): the sharded save")
    parser.add_argument("--one", type=float, default=None, help=argparse.SUPPRESS)  # a size, in its own process
    parser.add_argument("--sharded-rank", type=float, default=None, help=argparse.SUPPRESS)  # a rank of --sharded
    parser.add_argument("--kind", default="background", help=argparse.SUPPRESS)  # its kind of save
    args = parser.parse_args(argv)
    sharded_run = args.sharded or args.sharded_rank is not None
    args.saves = args.saves if args.saves is not None else 4 if sharded_run else 6
    args.gap = args.gap if args.gap is not None else 3 if sharded_run else 8
    if args.one is not None:
        print(json.dumps(measure(args.one, args.rounds, args.saves, args.gap, args.dir)))
        return 0
    if args.sharded_rank is not None:
        sharded_rank(args.sharded_rank, args.kind, args.saves, args.gap, args.dir)
        return 0
    sizes = [float(s) for s in args.sizes.split(",")] + ([400.0] if args.large else [])
    if args.sharded:
        return sharded(sizes, args.saves, args.gap, args.dir, args.json)
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
