"""metrics' per-batch fast paths keep the sums exact: a key whose values change kind in the
middle of a stage, and the device path's one batched fold (``defer=True``, as on an
accelerator) with mixed dtypes and shapes."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import hookfit
from hookfit.plugins.metrics import Metrics


class Collect:
    name = "collect"

    def __init__(self) -> None:
        self.epochs: list = []

    @hookfit.hookimpl
    def epoch_metrics(self, metrics):
        self.epochs.append(metrics)


def epoch_values(step, batches: int, tmp_path: Path, **options) -> dict:
    collect = Collect()
    hookfit.Loop(step, [(torch.zeros(i % 3 + 1, 2),) for i in range(batches)], max_epochs=1, run_dir=tmp_path,
                 plugins=[Metrics(**options), collect]).fit()
    (snapshot,) = collect.epochs
    return dict(snapshot.values)


def weighted_mean(pairs: list[tuple[float, int]]) -> float:
    return sum(v * n for v, n in pairs) / sum(n for _, n in pairs)


@pytest.mark.parametrize("interval", [3600, 0])  # one fold at the end; a fold after every batch
def test_a_key_whose_values_change_kind_within_a_stage_is_summed_exactly(tmp_path: Path, interval) -> None:
    """A key first given a CPU scalar tensor takes the item()-only path from then on; a later
    non-scalar tensor is ignored (as it is at any batch), and Python numbers, NumPy scalars
    and a bool tensor under the same key still count, weighted by their batch's size."""
    values = [torch.tensor(1.5), torch.ones(3), 2.0, np.float32(0.25), torch.tensor(True), 7,
              torch.tensor([4.0, 5.0]), torch.tensor(3, dtype=torch.int64), np.int64(9), torch.tensor(0.5)]

    def step(loop, batch):
        return {"x": values[loop.state.batch_idx]}

    got = epoch_values(step, len(values), tmp_path, interval=interval)["x"]
    kept = [(float(v), i % 3 + 1) for i, v in enumerate(values)
            if not (isinstance(v, torch.Tensor) and v.numel() != 1)]
    assert got.epoch == pytest.approx(weighted_mean(kept), rel=1e-12)
    assert got.last == 0.5


def test_the_device_fold_is_one_batched_read_and_exact_for_mixed_dtypes(tmp_path: Path, monkeypatch) -> None:
    """``defer=True`` keeps every value as a tensor until the stage ends, then reads them all
    in one transfer: large int64 counts next to float32 and float16 values are not rounded
    to the narrower float a single stacking would promote them to, and a ``(1,)``-shaped
    value among 0-d ones still counts."""
    reads = {"item": 0, "tolist": 0}
    item, tolist = torch.Tensor.item, torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "item", lambda self, *a: (reads.__setitem__("item", reads["item"] + 1), item(self, *a))[1])
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: (reads.__setitem__("tolist", reads["tolist"] + 1), tolist(self))[1])
    big = 2**40 + 1  # exact in float64, not in float32

    def step(loop, batch):
        i = loop.state.batch_idx
        loss = torch.tensor(0.1 * i, dtype=torch.float32)
        return {"count": torch.tensor(big + i), "loss": loss if i != 5 else loss.reshape(1),
                "half": torch.tensor(0.5 + i, dtype=torch.float16)}

    got = epoch_values(step, 12, tmp_path, defer=True, interval=3600)
    assert reads == {"item": 0, "tolist": 1}
    sizes = [i % 3 + 1 for i in range(12)]
    assert got["count"].epoch == weighted_mean([(float(big + i), n) for i, n in enumerate(sizes)])
    assert got["count"].last == float(big + 11)
    loss = [(float(torch.tensor(0.1 * i, dtype=torch.float32)), n) for i, n in enumerate(sizes)]
    assert got["loss"].epoch == pytest.approx(weighted_mean(loss), rel=1e-12)
    assert got["half"].epoch == pytest.approx(weighted_mean([(0.5 + i, n) for i, n in enumerate(sizes)]), rel=1e-12)
    assert not any(math.isnan(v.epoch) for v in got.values())
