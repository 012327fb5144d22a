"""Whether a resumed run gets its training data's batches in the order the run it continues
would have: :func:`unrebuilt_order` says why not, and what to use instead."""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from typing import Any

import torch

from hookfit.data import Batches, generators

__all__ = ["unrebuilt_order"]

_INSTEAD = ("torchdata's StatefulDataLoader (it saves its sampler's state: its own samplers, or one with "
            "state_dict()/load_state_dict()), hookfit.data.Batches, or a "
            "DataLoader with the default samplers, shuffling with the global generator or a generator of its "
            "own (generator=), whose states the run's state holds")
_STREAM_INSTEAD = ("torchdata's StatefulDataLoader over a dataset with state_dict()/load_state_dict() (it saves "
                   "the stream's position), hookfit.data.Batches for data in memory, or a dataset whose "
                   "iteration is a pure function of the epoch: "
                   "set_epoch(epoch), which the loop calls before each epoch, seeding its generator from the epoch")


def _own_generator(obj: Any) -> str | None:
    """The name of an attribute of ``obj`` holding a random generator of its own (torch's,
    Python's or NumPy's), whose state a checkpoint does not hold; ``None`` without one."""
    kinds: tuple[type, ...] = (torch.Generator, random.Random)
    try:
        import numpy

        kinds += (numpy.random.Generator, numpy.random.RandomState)
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    attributes: dict[str, Any] = getattr(obj, "__dict__", {})
    for name, value in attributes.items():
        if isinstance(value, kinds):
            return name
    return None


def _buffer_shuffled(data: Any) -> str | None:
    """The name of a Hugging Face ``IterableDataset`` shuffled with a buffer, which its
    ``state_dict()`` does not hold (Hugging Face documents it: the buffer is lost on resume),
    given as it is or inside a loader; else ``None``."""
    for part in (data, getattr(data, "dataset", None)):
        if type(part).__module__.split(".")[0] != "datasets":
            continue
        if getattr(part, "_shuffling", None) is not None:  # datasets 2 and 3 keep the shuffle's settings here
            return type(part).__name__
        stage, seen = getattr(part, "_ex_iterable", None), 0  # later ones: a chain of example iterables
        while stage is not None and seen < 64:
            if "BufferShuffled" in type(stage).__name__:
                return type(part).__name__
            stage, seen = getattr(stage, "ex_iterable", None), seen + 1
    return None


def unrebuilt_order(data: Any, restored: bool = False, held: Collection[str] = ()) -> str | None:
    """Why a resumed run cannot rebuild the order of ``data``'s batches, and what to use
    instead, or ``None`` when it can. hookfit rebuilds an epoch's order by making the data's
    iterator again from the random state the epoch began with (Python's and torch's global
    generators, and the loader's own torch generators, :func:`generators`, all of which the
    run's state holds) and skipping the batches done: that covers lists, :class:`Batches`, data
    with ``iter_from``, a ``DataLoader`` with torch's samplers (the default ones, shuffled or not,
    ``SubsetRandomSampler``, ``WeightedRandomSampler``), on the
    global generator or a generator of its own (``generator=``, or a ``RandomSampler``'s) whose
    state the loaded run state held (``held``: their names in :func:`generators`), and streams
    (an ``IterableDataset``, a generator factory) that draw from the global generators, from
    the loader's worker seeds, or from a generator of their own that ``set_epoch`` seeds (the
    loop calls it before each epoch: :func:`tell_epoch`). It cannot rebuild an order drawn from
    anything else: a custom sampler or batch sampler, a loader's generator whose state the
    loaded state lacks (saved by a run whose data had none), or an iterable (an
    ``IterableDataset`` among them) with a random generator of its own and no ``set_epoch``.
    Data that restored its own state (``restored``: torchdata's ``StatefulDataLoader``) is
    trusted to continue where it was, except a Hugging Face stream shuffled with a buffer, which
    its state does not hold; but one whose sampler has no state of its own (:func:`_unsaved_sampler`)
    makes that sampler's order anew, from the random state the run replays: a plain loader's rules apply."""
    if restored and _unsaved_sampler(data) is None:
        name = _buffer_shuffled(data)
        return None if name is None else (
            f"Hugging Face {name} shuffled with a buffer, which its state_dict() does not hold (the resumed "
            f"stream refills it from where it was); give it to a plain torch DataLoader instead (the loop tells it "
            f"the epoch, and a resume makes the epoch's order again and skips the batches done), or shuffle "
            f"without a buffer")
    if isinstance(data, (Sequence, Batches)) or hasattr(data, "iter_from"):
        return None
    from torch.utils.data import (BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler,
                                  SequentialSampler, SubsetRandomSampler, WeightedRandomSampler)

    what, instead = None, _INSTEAD
    if isinstance(data, DataLoader):
        batches, dataset = data.batch_sampler, data.dataset
        sampler = data.sampler if batches is None else getattr(batches, "sampler", None)  # (batch_size=None: none)
        if isinstance(dataset, IterableDataset):
            if not hasattr(dataset, "set_epoch") and (attr := _own_generator(dataset)) is not None:
                what = (f"DataLoader over the {type(dataset).__name__} dataset, which draws from a random generator "
                        f"of its own ({attr}) that nothing reseeds each epoch")
                instead = _STREAM_INSTEAD
        elif batches is not None and not _default(batches, BatchSampler):
            what = f"DataLoader with the custom batch sampler {type(batches).__name__}"
        elif (own := generators(data)) and not set(own) <= set(held):
            what = ("DataLoader with a generator of its own (generator=), whose state the loaded run state does "
                    f"not hold ({', '.join(sorted(set(own) - set(held)))})")
        elif not _default(sampler, SequentialSampler, RandomSampler, DistributedSampler, SubsetRandomSampler,
                          WeightedRandomSampler):  # (each draws its epoch's order as the epoch begins)
            what = f"DataLoader with the custom sampler {type(sampler).__name__}"
    elif not hasattr(data, "set_epoch") and (attr := _own_generator(data)) is not None:
        what = f"{type(data).__name__}, which draws from a random generator of its own ({attr})"
        instead = _STREAM_INSTEAD
    return None if what is None else f"{what}; use {instead}"


def _default(part: Any, *kinds: type) -> bool:
    """Whether a sampler or batch sampler is one of torch's ``kinds`` or torchdata's own (a
    ``StatefulDataLoader``'s defaults), whose order the loader draws from generators the run holds."""
    return type(part) in kinds or type(part).__module__.startswith("torchdata.")


def _unsaved_sampler(data: Any) -> str | None:
    """The class of a sampler or batch sampler of a loader that restores its own state which
    neither restores its own (``state_dict``/``load_state_dict``, torchdata's, whose iterators
    have it) nor draws one order for an epoch (sequential, ``DistributedSampler``, which the loop
    tells the epoch)."""
    from torch.utils.data import BatchSampler, DistributedSampler, SequentialSampler
    from torch.utils.data.dataloader import _InfiniteConstantSampler

    batches = getattr(data, "batch_sampler", None)
    for part in (batches, getattr(batches, "sampler", None), getattr(data, "sampler", None)):
        if part is None or hasattr(part, "state_dict") and hasattr(part, "load_state_dict"):
            continue
        if not _default(part, BatchSampler, SequentialSampler, DistributedSampler, _InfiniteConstantSampler):
            return type(part).__name__
    return None
