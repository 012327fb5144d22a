"""distributed sharding: each rank's part of the data, with the same number of batches on
every rank (the rules are in :mod:`hookfit.plugins.distributed`'s documentation). Plain
functions of the rank and the world size; the process group is the plugin's
(:mod:`hookfit.plugins.distributed.plugin`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def shard(data: Any, what: str, rank: int, world_size: int, seed: int) -> tuple[Any, Any]:
    """Rank ``rank``'s part of ``data`` (named ``what`` in errors), and the
    ``DistributedSampler`` to tell the epoch at every ``epoch_start`` (``None`` when there is
    none)."""
    world = world_size
    from torch.utils.data import DataLoader

    if callable(getattr(data, "shard", None)):
        if getattr(data, "world_size", 1) != 1:  # sharded by the script already
            return data, None
        return data.shard(rank, world), None
    if isinstance(data, DataLoader):
        return shard_loader(data, what, rank, world_size, seed)
    if isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        per_rank = len(data) // world
        if per_rank == 0:
            raise ValueError(
                f"distributed: {what} has {len(data)} batches, fewer than the {world} "
                f"processes; every process needs at least one batch"
            )
        return list(data[rank::world][:per_rank]), None
    raise TypeError(
        f"distributed: cannot shard {what} of type {type(data).__name__} across {world} "
        f"processes. Pass a hookfit.data.Batches, a DataLoader, a list of batches or an "
        f"object with shard(rank, world_size); or shard it yourself (the same number of "
        f"batches on every rank) and give Distributed(shard_data=False)."
    )


def shard_loader(loader: Any, what: str, rank: int, world_size: int, seed: int) -> tuple[Any, Any]:
    """A ``DataLoader`` rebuilt with a ``DistributedSampler`` (or kept, when it has one), and
    that sampler."""
    from torch.utils.data import (
        DataLoader,
        DistributedSampler,
        IterableDataset,
        RandomSampler,
        SequentialSampler,
    )

    if isinstance(loader.sampler, DistributedSampler):
        return loader, loader.sampler
    fix = (f"give {what} a DistributedSampler yourself (DataLoader(dataset, "
           f"sampler=DistributedSampler(dataset), ...)), or shard the data yourself and give "
           f"Distributed(shard_data=False)")
    if isinstance(loader.dataset, IterableDataset):
        raise TypeError(f"distributed: {what} is a DataLoader over an IterableDataset, which "
                        f"cannot be sharded by index; make each rank's iterator yield its own "
                        f"part and give Distributed(shard_data=False)")
    if loader.batch_size is None or not isinstance(loader.sampler, (RandomSampler, SequentialSampler)):
        raise TypeError(f"distributed: {what} is a DataLoader with a custom sampler or batch "
                        f"sampler, which cannot be sharded automatically; {fix}")
    sampler = DistributedSampler(
        loader.dataset, num_replicas=world_size, rank=rank,
        shuffle=isinstance(loader.sampler, RandomSampler), seed=seed,
        drop_last=loader.drop_last,
    )
    options: dict[str, Any] = {
        "batch_size": loader.batch_size, "sampler": sampler, "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn, "pin_memory": loader.pin_memory,
        "drop_last": loader.drop_last, "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator, "persistent_workers": loader.persistent_workers,
        "pin_memory_device": getattr(loader, "pin_memory_device", ""),
    }
    if loader.num_workers > 0:
        options["prefetch_factor"] = loader.prefetch_factor
    if hasattr(loader, "in_order"):
        options["in_order"] = loader.in_order
    return DataLoader(loader.dataset, **options), sampler


def length(data: Any) -> int:
    """The number of batches of ``data``, ``-1`` when it has no length (of several
    validation sets, a mapping: their sum)."""
    if isinstance(data, Mapping):
        counts = [length(part) for part in data.values()]
        return -1 if -1 in counts else sum(counts)
    try:
        return len(data)
    except TypeError:
        return -1
