"""hookfit.persistent: DataLoaders with persistent workers end their worker processes with the
run (a later run starts them afresh), whatever way the run ended. How a resume rebuilds their
order is tested in test_loader_generator.py."""

from __future__ import annotations

from typing import Any

import pytest
from torch.utils.data import DataLoader

import hookfit


class Workers:
    """Keeps the worker processes of the training and validation loaders, as the run sees them."""

    name = "workers"

    def __init__(self) -> None:
        self.seen: dict[str, list[Any]] = {}

    @hookfit.hookimpl
    def batch_end(self, loop: Any) -> None:
        data = loop.train_data if loop.training else loop.val_data
        self.seen.setdefault(loop.state.stage, list(data._iterator._workers))


def loader() -> DataLoader:
    return DataLoader(list(range(8)), batch_size=2, num_workers=2, persistent_workers=True)


@pytest.mark.parametrize("ends", ["completed", "failed"])
def test_a_runs_persistent_workers_end_with_the_run_and_a_later_run_starts_them_afresh(ends: str) -> None:
    """The workers of both loaders are shut down, and the loaders' iterators let go, by the time
    ``fit()`` returns or raises; left to Python's cycle collector (the run's objects refer to each
    other) their shutdown would wait about 5 s a worker, whenever it ran. A second run over the same
    loaders makes new iterators and trains on every batch."""
    train, valid = loader(), loader()
    workers = Workers()
    batches = []

    def step(loop, batch):
        batches.append(batch.tolist())
        if ends == "failed" and loop.state.epoch == 1:
            raise ValueError("the step's own error")

    run = hookfit.Loop(step, train, val_step=lambda loop, b: None, val_data=valid, max_epochs=2, plugins=[workers])
    if ends == "failed":
        with pytest.raises(ValueError, match="the step's own error"):
            run.fit()
    else:
        run.fit()
    assert sorted(workers.seen) == ["train", "valid"] and all(len(w) == 2 for w in workers.seen.values())
    assert train._iterator is None and valid._iterator is None
    assert not [w for started in workers.seen.values() for w in started if w.is_alive()]

    batches.clear()
    again = Workers()
    hookfit.Loop(lambda loop, b: batches.append(b.tolist()), train, val_step=lambda loop, b: None, val_data=valid,
                 plugins=[again]).fit()
    assert sorted(batches) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert not set(map(id, again.seen["train"])) & set(map(id, workers.seen["train"]))  # new processes
    assert train._iterator is None


@pytest.mark.parametrize("then", [0, 1])
def test_a_run_resumed_with_another_worker_count_is_told_its_workers_draws_differ(tmp_path: Any, then: int) -> None:
    """A random augmentation drawn as a worker loads a sample comes from that worker's seed: resumed with
    another ``num_workers`` the run is not the one it continues, and nothing said so. With the same count,
    nothing is said."""
    import warnings

    import torch

    from hookfit.plugins.checkpoint import Checkpoint

    def run(workers: int, **options: Any) -> list[str]:
        model = torch.nn.Linear(1, 1)
        data = DataLoader(torch.arange(8.0).reshape(8, 1), batch_size=4, num_workers=workers)
        valid = DataLoader(torch.arange(4.0).reshape(4, 1), batch_size=4, num_workers=1 - workers)  # not said
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hookfit.Loop(lambda loop, b: None, data, val_step=lambda loop, b: None, val_data=valid, model=model,
                         run_dir=tmp_path, plugins=[Checkpoint(background=False)], **options).fit()
        return [str(w.message) for w in caught if "num_workers" in str(w.message)]

    assert run(1, max_epochs=1) == []
    said = run(then, max_epochs=2, resume="latest")
    assert said == ([] if then == 1 else [
        "load_state_dict: train_data has num_workers=0, the run it continues had 1: random draws made in the worker "
        "processes (a random augmentation as a sample loads; an IterableDataset's interleaving of its workers) differ "
        "from that run's, so the resumed run is not exact; resume with the worker count it had"])
