"""What a data source costs per batch: hookfit.data.Batches against DataLoader(TensorDataset).

A measurement, never an assertion. One in-memory dataset (4096 rows of 32 float features and
one float target, seeded) is read in batches of 64 (64 batches an epoch) by each source:

* ``list``: a pre-made list of 64 batches, the baseline (what ``overhead.py`` trains on);
* ``dataloader``: ``DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)``;
* ``batches-shuffle``: ``Batches(x, y, batch_size=64, shuffle=True)``, with ``set_epoch`` moved
  on every pass so each pass draws a new permutation, as the DataLoader does;
* ``batches``: ``Batches(x, y, batch_size=64)``, no shuffle (slices, views);
* ``slices``: a bare generator of ``(x[i:i + 64], y[i:i + 64])``, the floor for any source
  that makes new batch tensors (fresh tensor objects cost a few us a step in a training step);
* ``permute-epoch`` (iteration table only): the alternative ``Batches`` did not take, permuting
  the whole tensors once an epoch and slicing them.

Three workloads, each timed as rounds with every variant interleaved in one process (the
order rotates each round, ``gc`` frozen and collected before every pass) and one torch thread,
like ``overhead.py``:

* ``iterate``: one epoch of ``for batch in source: pass``; us per batch.
* ``train``: one epoch of the tiny model of ``overhead.py`` (Linear 32-32, ReLU, Linear 32-1,
  MSE, SGD lr 0.01), each variant its own copy of one seeded model; us per step, and what
  each source adds per step over the pre-made list, paired round by round.
* ``resume``: the time to reach batch 32 of 64 (the middle of an epoch) and get it:
  ``next(batches.iter_from(32))`` (a fresh epoch, so the permutation is drawn too) against
  skipping 32 batches of the DataLoader, and against ``islice`` over ``Batches`` (what the
  loop does for data without ``iter_from``); us per start.

Ratios and added times are medians of per-round paired values with a distribution-free ~95%
confidence interval (order statistics, ``overhead.median_ci``).

    python benchmarks/data.py                      # 201 rounds, ~40 s on 2 cores
    python benchmarks/data.py --rounds 1201 --json runs/data.json
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import interleave, median_ci  # noqa: E402  (same folder)

import hookfit  # noqa: E402
from hookfit.data import Batches  # noqa: E402

Source = Callable[[], Iterable[Any]]
"""Called once a pass: the iterable of that pass's batches."""
Runner = Callable[[], float]
"""One timed pass: returns its seconds."""


# -- sources ---------------------------------------------------------------------------------
def make_sources(x: torch.Tensor, y: torch.Tensor, batch: int) -> dict[str, Source]:
    """name -> source, every one over the same rows."""
    premade = [(xb.clone(), yb.clone()) for xb, yb in zip(x.split(batch), y.split(batch))]
    loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True)
    shuffled = Batches(x, y, batch_size=batch, shuffle=True, seed=0)
    plain = Batches(x, y, batch_size=batch)
    generator = torch.Generator().manual_seed(0)

    def next_epoch() -> Batches:
        shuffled.set_epoch(shuffled.epoch + 1)  # a new permutation every pass, as DataLoader draws
        return shuffled

    def slices() -> Iterator[Any]:
        for begin in range(0, len(x), batch):
            yield x[begin:begin + batch], y[begin:begin + batch]

    def permute_epoch() -> Iterable[Any]:
        order = torch.randperm(len(x), generator=generator)
        return zip(x.index_select(0, order).split(batch), y.index_select(0, order).split(batch))

    return {
        "list": lambda: premade,
        "dataloader": lambda: loader,
        "batches-shuffle": next_epoch,
        "batches": lambda: plain,
        "slices": slices,
        "permute-epoch": permute_epoch,
    }


# -- workloads: name -> runner -------------------------------------------------------------------
def iterate_runners(sources: dict[str, Source], names: Sequence[str]) -> dict[str, Runner]:
    def runner(source: Source) -> Runner:
        def run() -> float:
            start = time.perf_counter()
            for _ in source():
                pass
            return time.perf_counter() - start

        return run

    return {name: runner(sources[name]) for name in names}


def train_runners(sources: dict[str, Source], names: Sequence[str], seed: int) -> dict[str, Runner]:
    nn = torch.nn
    torch.manual_seed(seed)
    template = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    mse = nn.functional.mse_loss

    def runner(source: Source) -> Runner:
        model = copy.deepcopy(template)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def run() -> float:
            start = time.perf_counter()
            for xb, yb in source():
                opt.zero_grad()
                loss = mse(model(xb), yb)
                loss.backward()
                opt.step()
            return time.perf_counter() - start

        return run

    return {name: runner(sources[name]) for name in names}


def resume_runners(x: torch.Tensor, y: torch.Tensor, batch: int) -> dict[str, Runner]:
    loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True)
    batches = Batches(x, y, batch_size=batch, shuffle=True)
    half = len(batches) // 2

    def dataloader_skip() -> float:
        start = time.perf_counter()
        next(itertools.islice(loader, half, None))
        return time.perf_counter() - start

    def batches_iter_from() -> float:
        batches.set_epoch(batches.epoch + 1)  # not cached: the permutation is drawn in the time
        start = time.perf_counter()
        next(batches.iter_from(half))
        return time.perf_counter() - start

    def batches_islice() -> float:
        batches.set_epoch(batches.epoch + 1)
        start = time.perf_counter()
        next(itertools.islice(batches, half, None))
        return time.perf_counter() - start

    return {"dataloader-skip": dataloader_skip, "batches-iter_from": batches_iter_from,
            "batches-islice": batches_islice}


# -- measuring ---------------------------------------------------------------------------------
@dataclass
class Result:
    """One variant of one workload; times in us per unit (batch, step or start), medians over
    rounds with ~95% CIs. ``ratio``: median of this variant's time / the ``ratio_to`` variant's
    of the same round; ``added``: median of (this - the ``added_to`` variant) of the round."""

    variant: str
    us: float
    us_ci: tuple[float, float]
    ratio: float | None = None
    ratio_ci: tuple[float, float] | None = None
    added_us: float | None = None
    added_ci: tuple[float, float] | None = None
    rounds_us: list[float] = field(default_factory=list)


def measure(runners: dict[str, Runner], units: int, rounds: int, warmup: int,
            ratio_to: str | None, added_to: str | None) -> list[Result]:
    names = list(runners)
    times = {name: [t / units * 1e6 for t in ts] for name, ts in interleave(runners, rounds, warmup).items()}
    results = []
    for name in names:
        us, *ci = median_ci(times[name])
        res = Result(name, us, (ci[0], ci[1]), rounds_us=times[name])
        if ratio_to is not None and name != ratio_to:
            res.ratio, *ci = median_ci([a / b for a, b in zip(times[name], times[ratio_to])])
            res.ratio_ci = (ci[0], ci[1])
        if added_to is not None and name != added_to:
            res.added_us, *ci = median_ci([a - b for a, b in zip(times[name], times[added_to])])
            res.added_ci = (ci[0], ci[1])
        results.append(res)
    return results


# -- output ------------------------------------------------------------------------------------
def _ratio(value: float) -> str:
    return f"{value:.3f}" if value >= 0.1 else f"{value:.2g}"


def table(workload: dict[str, Any]) -> str:
    """The readable table of one workload."""
    unit, digits = workload["unit"], workload["digits"]
    lines = [f"{workload['title']}, {workload['rounds']} rounds interleaved, medians over rounds"]
    row = "  {:<18} {:>9} {:>17} {:>8} {:>14} {:>11} {:>18}"
    lines.append(row.format("variant", unit, "95% CI", "ratio", "ratio 95% CI", "added", "added 95% CI"))
    for r in workload["results"]:
        lines.append(row.format(
            r["variant"],
            f"{r['us']:.{digits}f}",
            f"{r['us_ci'][0]:.{digits}f}..{r['us_ci'][1]:.{digits}f}",
            "" if r["ratio"] is None else _ratio(r["ratio"]),
            "" if r["ratio"] is None else f"{_ratio(r['ratio_ci'][0])}-{_ratio(r['ratio_ci'][1])}",
            "" if r["added_us"] is None else f"{r['added_us']:+.{digits}f}",
            "" if r["added_us"] is None else f"{r['added_ci'][0]:+.{digits}f}..{r['added_ci'][1]:+.{digits}f}",
        ).rstrip())
    lines.append(f"  {workload['note']}")
    return "\n".join(lines)


def render(out: dict[str, Any]) -> str:
    lines = [out["header"]]
    for workload in out["workloads"].values():
        lines += ["", table(workload)]
    lines.append(f"\n({out['seconds']:.1f} s; 1-minute load average {out['load_average'][0]:.2f} before, "
                 f"{out['load_average'][1]:.2f} after: anything else running on the machine distorts these numbers)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--rounds", type=int, default=201, help="timed rounds per workload, at least 15 (default 201)")
    add("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    add("--rows", type=int, default=4096, help="rows in the dataset (default 4096)")
    add("--batch", type=int, default=64, help="batch size (default 64)")
    add("--seed", type=int, default=0, help="seed of the data and the model (default 0)")
    add("--json", metavar="PATH", help="also write every number, round by round, as JSON")
    args = parser.parse_args(argv)
    if args.rounds < 15:
        parser.error("--rounds must be at least 15: fewer says nothing on a noisy machine")
    if args.rows < 2 * args.batch or args.batch < 1 or args.warmup < 0:
        parser.error("need --batch >= 1, --rows >= 2 * --batch, --warmup >= 0")

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)  # the DataLoader's shuffle draws from the global RNG
    gen = torch.Generator().manual_seed(args.seed)
    x, y = torch.randn(args.rows, 32, generator=gen), torch.randn(args.rows, 1, generator=gen)
    sources = make_sources(x, y, args.batch)
    epoch = -(-args.rows // args.batch)
    half = epoch // 2
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    header = (f"hookfit.data: Python {platform.python_version()}, torch {torch.__version__}, "
              f"hookfit {hookfit.__version__}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}; "
              f"{args.rows} rows x 32 features + 1 target, batch {args.batch}, {epoch} batches an epoch")
    plan = [
        ("iterate", iterate_runners(sources, ["list", "dataloader", "batches-shuffle", "batches", "slices",
                                    "permute-epoch"]),
         epoch, "dataloader", "list", "us/batch", 2,
         "Iteration only (for batch in source: pass)",
         "ratio: to dataloader; added: over iterating the pre-made list"),
        ("train", train_runners(sources, ["list", "dataloader", "batches-shuffle", "batches", "slices"], args.seed),
         epoch, "list", "list", "us/step", 1,
         "Tiny model step (Linear 32-32, ReLU, Linear 32-1; MSE; SGD) fed by each source",
         "ratio and added: to the same step fed by the pre-made list"),
        ("resume", resume_runners(x, y, args.batch), 1, "dataloader-skip", None, "us/start", 1,
         f"Start mid-epoch: time to get batch {half} of {epoch}",
         "ratio: to skipping through the DataLoader"),
    ]
    out: dict[str, Any] = {"header": header, "config": vars(args), "workloads": {}}
    for key, runners, units, ratio_to, added_to, unit, digits, title, note in plan:
        results = measure(runners, units, args.rounds, args.warmup, ratio_to, added_to)
        out["workloads"][key] = {"title": title, "note": note, "unit": unit, "digits": digits,
                                 "rounds": args.rounds, "results": [asdict(r) for r in results]}
    out["seconds"] = time.perf_counter() - started
    out["load_average"] = [load_before, os.getloadavg()[0]]
    print(render(out))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump(out, handle, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
