"""distributed sharding: each rank's part of the data, with the same number of batches on
every rank (the rules are in :mod:`hookfit.plugins.distributed`'s documentation). Plain
functions of the rank and the world size; the process group is the plugin's
(:mod:`hookfit.plugins.distributed.plugin`)."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from hookfit.data import stage_length
from hookfit.errors import HookfitWarning, user_level


class ExactSampler(DistributedSampler[int]):
    """A ``DistributedSampler`` that neither repeats nor drops a sample: rank ``r`` takes
    indices ``r, r + num_replicas, ...`` of the epoch's order (shuffled with ``seed`` and the
    epoch, or ``0..n-1``), so the ranks together see every sample exactly once and may differ
    by one sample. For validation, whose metrics then equal one process's."""

    def __init__(self, dataset: Any, num_replicas: int, rank: int, shuffle: bool = False, seed: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=False)
        self.num_samples = len(range(rank, len(dataset), num_replicas))
        self.total_size = len(dataset)  # the dataset's length, read once (as DistributedSampler does)

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.total_size, generator=generator).tolist()
        else:
            order = list(range(self.total_size))
        return iter(order[self.rank::self.num_replicas])


def shard(data: Any, what: str, rank: int, world_size: int, seed: int,
          even: bool = True) -> tuple[Any, DistributedSampler[Any] | None]:
    """Rank ``rank``'s part of ``data`` (named ``what`` in errors), and the
    ``DistributedSampler`` to tell the epoch at every ``epoch_start`` (``None`` when there is
    none). ``even``: every rank gets as many batches as the others (training: the ranks'
    collectives must match), by repeating or leaving out a few samples; ``even=False``
    (validation): every sample exactly once, the ranks' parts differing by at most one
    sample or batch."""
    world = world_size
    from torch.utils.data import DataLoader

    if callable(getattr(data, "shard", None)):
        if getattr(data, "world_size", 1) != 1:  # sharded by the script already
            return data, None
        samples = getattr(data, "num_samples", None)  # (hookfit.data.Batches has it)
        if not even and isinstance(samples, int) and samples < world:  # the same on every rank
            raise ValueError(f"distributed: {what} has {samples} samples, fewer than the {world} processes; "
                             f"every process needs at least one batch")
        if not even and "even" in inspect.signature(data.shard).parameters:
            return data.shard(rank, world, even=False), None
        return data.shard(rank, world), None
    if isinstance(data, DataLoader):
        return shard_loader(data, what, rank, world_size, seed, even)
    if isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        if len(data) < world:
            raise ValueError(
                f"distributed: {what} has {len(data)} batches, fewer than the {world} "
                f"processes; every process needs at least one batch"
            )
        if not even:
            return list(data[rank::world]), None
        return list(data[rank::world][:len(data) // world]), None
    raise TypeError(
        f"distributed: cannot shard {what} of type {type(data).__name__} across {world} "
        f"processes. Pass a hookfit.data.Batches, a DataLoader, a list of batches or an "
        f"object with shard(rank, world_size); or shard it yourself (the same number of "
        f"batches on every rank) and give Distributed(shard_data=False)."
    )


def shard_loader(loader: Any, what: str, rank: int, world_size: int, seed: int,
                 even: bool = True) -> tuple[Any, DistributedSampler[Any]]:
    """A ``DataLoader`` rebuilt with a ``DistributedSampler`` (an :class:`ExactSampler` when
    not ``even``), or kept when it has one (not ``even``: one that pads or drops is replaced,
    :func:`_exact`), and that sampler."""
    from torch.utils.data import IterableDataset, RandomSampler, SequentialSampler

    if isinstance(loader.sampler, DistributedSampler):
        exact = None if even else _exact(loader, what, rank, world_size)
        return (loader, loader.sampler) if exact is None else (_rebuilt(loader, exact), exact)
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
    shuffle = isinstance(loader.sampler, RandomSampler)
    if not even:
        _enough(loader.dataset, what, world_size)
        sampler: DistributedSampler[int] = ExactSampler(loader.dataset, world_size, rank, shuffle=shuffle, seed=seed)
    else:
        sampler = DistributedSampler(loader.dataset, num_replicas=world_size, rank=rank, shuffle=shuffle,
                                     seed=seed, drop_last=loader.drop_last)
    return _rebuilt(loader, sampler), sampler


def _exact(loader: Any, what: str, rank: int, world_size: int) -> ExactSampler | None:
    """For the validation ``loader`` given with a ``DistributedSampler`` of its own: the
    :class:`ExactSampler` that takes its place where it would repeat samples to pad the ranks'
    parts to one length, or leave some out (``drop_last=True``), and is torch's own class for
    this process group (its rank and size, over the loader's dataset): the same order, shuffled
    or not, with the same seed, each sample once; checked as a set the plugin splits itself
    (:func:`_enough`). ``None`` keeps it: exact already, or a sampler that cannot be judged.
    A sampler made for another rank or size warns on every process that finds it so, whether
    or not its size divides evenly; a subclass or one over another dataset that pads or drops
    warns on the main process, with the samples counted twice or left out and the fix."""
    sampler = loader.sampler
    if sampler.num_replicas != world_size or sampler.rank != rank:
        warnings.warn(
            f"distributed: {what}'s sampler was made for rank {sampler.rank} of num_replicas="
            f"{sampler.num_replicas}, but this process is rank {rank} of {world_size}: processes validate the "
            f"wrong samples (some twice, some never); give {what} without a sampler (DataLoader(dataset, "
            f"batch_size=...)), and the plugin splits validation exactly, every sample once",
            HookfitWarning, stacklevel=user_level())
        return None
    count = len(sampler.dataset)
    off = sampler.total_size - count  # samples repeated (>0) or left out (<0) over the ranks' parts
    if off == 0:
        return None
    if type(sampler) is DistributedSampler and sampler.dataset is loader.dataset:
        _enough(loader.dataset, what, world_size)
        return ExactSampler(loader.dataset, world_size, rank, shuffle=sampler.shuffle, seed=sampler.seed)
    if rank == 0:
        what_off = (f"repeats {off} of its {count} samples to pad the {sampler.num_replicas} parts to "
                    f"{sampler.num_samples} samples each, counting them twice" if off > 0 else
                    f"leaves out {-off} of its {count} samples (drop_last=True)")
        warnings.warn(
            f"distributed: {what}'s sampler, a {type(sampler).__name__} of its own, {what_off} in every "
            f"validation's metrics, and a Checkpoint(monitor=...) ranks checkpoints on them: give {what} without "
            f"a sampler (DataLoader(dataset, batch_size=...)), and the plugin splits validation exactly, every "
            f"sample once", HookfitWarning, stacklevel=user_level())
    return None


def _enough(dataset: Any, what: str, world_size: int) -> None:
    """A validation set split exactly by the plugin needs a sample on every process (else
    the ranks' metric sums differ in size and the collective fails): a clear error first."""
    if len(dataset) < world_size:
        raise ValueError(f"distributed: {what} has {len(dataset)} samples, fewer than the "
                         f"{world_size} processes; every process needs at least one batch")


def _rebuilt(loader: Any, sampler: DistributedSampler[Any]) -> Any:
    """``loader`` made again with ``sampler``, its other options kept."""
    from torch.utils.data import DataLoader

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
    return DataLoader(loader.dataset, **options)


def length(data: Any) -> int:
    """The number of batches of ``data``, ``-1`` when it has no length (of several
    validation sets, a mapping: their sum)."""
    counted = stage_length(data)
    return -1 if counted is None else counted
