"""The training stage in progress, in a checkpoint of a run of several processes.

Each process aggregates its own batches (its partial sums, counts and running window); a
publication adds them up over the processes. A checkpoint written by the main process would
hold its partial sums alone, and every process of the resumed run would start from them: the
interrupted epoch's mean would count the main process's batches twice and the others' never.

So :func:`gather` gives every process every process's stage state (one all-reduce of a table
with a row per process, through the ``all_reduce`` event), the checkpoint keeps them all, and
:func:`own` gives each process of the resumed run its own row: the resumed epoch's mean is then
the uninterrupted run's, bit for bit. Resumed on another number of processes, the main process
takes the sum of every row and the others start from nothing (the same keys, zero counts), so
the sums over the processes are still those of the whole epoch so far.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from hookfit.plugins.metrics.aggregate import Reduce

__all__ = ["gather", "own"]

_HEAD = ("batches", "samples", "elapsed")
_SERIES = ("weighted", "count", "last")


def _row(state: Mapping[str, Any], keys: list[str]) -> list[float]:
    row = [float(state[name]) for name in _HEAD]
    for key in keys:
        series = state["series"][key]
        row += [float(series[name]) for name in _SERIES] + [float(len(series["window"]))]
        row += [float(value) for pair in series["window"] for value in pair]
    return row


def _state(row: list[float], keys: list[str]) -> dict[str, Any]:
    values = iter(row)
    batches, samples, elapsed = next(values), next(values), next(values)
    series = {}
    for key in keys:
        weighted, count, last, size = next(values), next(values), next(values), next(values)
        window = [[next(values), int(next(values))] for _ in range(int(size))]
        series[key] = {"weighted": weighted, "count": int(count), "last": last, "window": window}
    return {"batches": int(batches), "samples": int(samples), "elapsed": elapsed, "series": series}


def _checksum(keys: list[str]) -> float:
    return float(sum(ord(c) * (i + 1) for i, c in enumerate("|".join(keys))) % 1_000_003)


def gather(state: dict[str, Any], rank: int, world: int, reduce: Reduce) -> dict[str, Any]:
    """``{"ranks": [stage state of process 0, 1, ...]}`` from this process's ``state``
    (:meth:`Stage.state`), on every process at once (a collective: every process calls it at
    the same checkpoint). The processes must have the same metrics and windows, as a
    publication needs them to; a ``RuntimeError`` says so otherwise."""
    keys = sorted(state["series"])
    row = _row(state, keys)
    checksum = _checksum(keys)
    agreed = reduce(torch.tensor([1.0, checksum, float(len(row))], dtype=torch.float64))
    if agreed is None:
        return state
    if agreed.tolist() != [float(world), checksum * world, float(len(row)) * world]:
        raise RuntimeError(f"metrics: the processes of this run aggregate different metrics or windows at this "
                           f"checkpoint (this one: {keys}); every process must return the same keys from the step")
    table = torch.zeros(world, len(row), dtype=torch.float64)
    table[rank] = torch.tensor(row, dtype=torch.float64)
    summed = reduce(table.flatten())
    assert summed is not None  # it answered the first reduction
    rows = summed.reshape(world, len(row)).tolist()
    return {"ranks": [_state(r, keys) for r in rows]}


def own(saved: Mapping[str, Any], rank: int, world: int) -> dict[str, Any]:
    """This process's stage state from what :func:`gather` (or, in a run of one process,
    ``Stage.state``) saved: its own row when the processes are as many as wrote it; else the
    sum of them all on the main process and nothing (the same keys, zero counts) on the others."""
    ranks = saved.get("ranks")
    if ranks is not None and len(ranks) == world:
        return dict(ranks[rank])
    whole = _merged(ranks) if ranks is not None else dict(saved)
    return whole if rank == 0 else _nothing(whole)


def _merged(ranks: list[Mapping[str, Any]]) -> dict[str, Any]:
    first = ranks[0]
    series = {}
    for key, one in first["series"].items():
        parts = [r["series"][key] for r in ranks]
        window = [[sum(p["window"][i][0] for p in parts), sum(p["window"][i][1] for p in parts)]
                  for i in range(len(one["window"]))]
        lasts = [p["last"] for p in parts]
        series[key] = {"weighted": sum(p["weighted"] for p in parts), "count": sum(p["count"] for p in parts),
                       "last": sum(lasts) / len(lasts), "window": window}
    return {"batches": first["batches"], "samples": sum(r["samples"] for r in ranks),
            "elapsed": max(r["elapsed"] for r in ranks), "series": series}


def _nothing(whole: Mapping[str, Any]) -> dict[str, Any]:
    """``whole`` with nothing counted: what adds nothing to the sums over the processes (its
    ``last`` is the main process's, so their mean is that)."""
    series = {key: {"weighted": 0.0, "count": 0, "last": s["last"],
                    "window": [[0.0, 0] for _ in s["window"]]}
              for key, s in whole["series"].items()}
    return {"batches": whole["batches"], "samples": 0, "elapsed": whole["elapsed"], "series": series}
