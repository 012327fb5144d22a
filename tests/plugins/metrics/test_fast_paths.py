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
                 plugins=[Metrics(log=False, **options), collect]).fit()
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


def counting_reads(monkeypatch) -> dict[str, int]:
    """Count ``Tensor.item`` and ``Tensor.tolist`` calls from now on."""
    reads = {"item": 0, "tolist": 0}
    for name in reads:
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, _name=name, _original=original, **kwargs):
            reads[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    return reads


def test_cpu_tensors_are_kept_and_read_at_the_fold_not_at_their_batch(tmp_path: Path, monkeypatch) -> None:
    """By default a CPU scalar tensor is not read at its batch (a torch call between two
    training steps costs 2 us or more; the same calls in one loop at a fold cost a tenth of
    that): 300 batches of two tensors are read when they fold, after 256 batches (at the
    next look at the clock) and at the stage's end, and the weighted means are exact."""
    reads = counting_reads(monkeypatch)
    seen: list[int] = []

    class After:
        name = "after"

        @hookfit.hookimpl(trylast=True)
        def batch_end(self):
            seen.append(reads["item"])

    def step(loop, batch):
        i = loop.state.batch_idx
        return {"loss": torch.tensor(0.1 * i, dtype=torch.float32), "n": torch.tensor(i)}

    collect = Collect()
    hookfit.Loop(step, [(torch.zeros(i % 3 + 1, 2),) for i in range(300)], max_epochs=1, run_dir=tmp_path,
                 plugins=[Metrics(interval=3600), collect, After()]).fit()
    got = dict(collect.epochs[0].values)
    fold = next(i for i, count in enumerate(seen) if count)  # the batch of the first fold
    assert 255 <= fold < 255 + 16  # the first look at the clock at or after 256 batches
    assert set(seen[fold:]) == {2 * (fold + 1)}  # two keys, every batch so far, read at once
    assert reads == {"item": 600, "tolist": 0}
    sizes = [i % 3 + 1 for i in range(300)]
    loss = [(float(torch.tensor(0.1 * i, dtype=torch.float32)), n) for i, n in enumerate(sizes)]
    assert got["loss"].epoch == weighted_mean(loss)  # the same sum, in the same order, as item() a batch
    assert got["n"].epoch == weighted_mean([(float(i), n) for i, n in enumerate(sizes)])
    assert got["n"].last == 299.0


def test_defer_false_reads_cpu_tensors_at_their_batch(tmp_path: Path, monkeypatch) -> None:
    reads = counting_reads(monkeypatch)
    got = epoch_values(lambda loop, batch: {"loss": torch.tensor(2.0)}, 10, tmp_path, interval=3600, defer=False)
    assert reads["item"] == 10 and got["loss"].epoch == 2.0


def test_a_tensor_changed_in_place_after_its_batch_warns_naming_the_key_and_is_read_at_its_batch_after(tmp_path: Path) -> None:
    """A step that returns one tensor it keeps adding to: the kept values all read the last
    count, so the fold says so (a HookfitWarning naming the key) and the key is read at its
    batch for the rest of the run: the second epoch's mean is exact."""
    from hookfit.errors import HookfitWarning

    count = torch.zeros(())
    collect = Collect()

    def step(loop, batch):
        count.add_(1)
        return {"count": count, "fresh": count.clone()}

    with pytest.warns(HookfitWarning, match=r"'count' was changed in place after the batch") as caught:
        hookfit.Loop(step, [(torch.zeros(1, 2),)] * 4, max_epochs=2, run_dir=tmp_path,
                     plugins=[Metrics(log=False, interval=3600), collect]).fit()
    assert len([w for w in caught if "changed in place" in str(w.message)]) == 1
    first, second = (dict(snapshot.values) for snapshot in collect.epochs)
    assert first["fresh"].epoch == 2.5 and second["fresh"].epoch == 6.5  # a new tensor a batch: exact
    assert first["count"].epoch == 4.0  # every kept value read as it was at the fold
    assert second["count"].epoch == 6.5  # read at its batch since


def test_a_tensor_folded_before_it_changes_needs_no_warning(tmp_path: Path, recwarn) -> None:
    """With a publication after every batch (something listens to ``metrics_update``) each
    value is read before the step changes it."""
    count = torch.zeros(())
    updates: list = []

    class Listen:
        name = "listen"

        @hookfit.hookimpl
        def metrics_update(self, metrics):
            updates.append(metrics.values["count"].last)

    def step(loop, batch):
        count.add_(1)
        return {"count": count}

    hookfit.Loop(step, [(torch.zeros(1, 2),)] * 4, max_epochs=1, run_dir=tmp_path,
                 plugins=[Metrics(interval=0), Listen()]).fit()
    assert updates == [1.0, 2.0, 3.0, 4.0]
    assert not [w for w in recwarn if "changed in place" in str(w.message)]
