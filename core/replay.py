"""How a stage resumed inside an epoch gets back to its batch: :func:`iterate` makes the stage's
iterator from the random state the epoch's iterator was made from, drops the batches done (data
with ``iter_from(start)`` starts there; data that restored its own state is there), then gives
the random state back, so the rest of the epoch sees the batches and the random stream of the run
it continues.

What it cannot replay is said: a stream that draws from torch's global generator as it goes (a
``torch.randperm`` per shard in its ``__iter__``) drew, in the run it continues, between the
model's own draws (dropout, noise); dropped here without them, its later draws differ, and so
may the batches after the resumed one."""

from __future__ import annotations

import collections
import itertools
import warnings
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from hookfit.errors import HookfitWarning, user_level
from hookfit.position import rng_state, set_rng_state

if TYPE_CHECKING:  # pragma: no cover
    from hookfit.run import Run

__all__ = ["iterate"]


def iterate(run: Run, data: Iterable[Any], start: int, train: bool) -> Iterator[Any]:
    """The stage's batches from batch ``start``. A fresh training stage notes the random state
    as it makes its iterator (:meth:`hookfit.position.Cursor.iterator_begins`). A resumed one
    makes its iterator from that state and drops the batches done, then gives the random state
    back; a stream that drew from torch's generator past its first batch is warned of."""
    cursor = run.cursor
    if not start:
        if train:
            cursor.iterator_begins(data)
        return iter(data)
    replay = cursor.iter_rng if train else None
    keep = rng_state(data) if replay is not None else None
    try:
        if replay is not None:
            set_rng_state(replay, data)
        if (iter_from := getattr(data, "iter_from", None)) is not None:
            return iter(iter_from(start))
        batches = iter(data)
        if not (train and "train" in cursor.restored):
            _drop(batches, start, replay is not None and _stream(data))
        return batches
    finally:
        if keep is not None:
            set_rng_state(keep, data)


def _stream(data: Any) -> bool:
    """Whether ``data`` may carry a draw from one batch to the next (a shard's order): anything but a ``DataLoader``
    over a map-style dataset, whose draws in ``__getitem__`` (an augmentation) are each batch's own."""
    from torch.utils.data import DataLoader, IterableDataset

    return not isinstance(data, DataLoader) or isinstance(data.dataset, IterableDataset)


def _drop(batches: Iterator[Any], done: int, replayed: bool) -> None:
    """Drop the ``done`` batches; where the random state was replayed, say so if the stream drew from torch's
    generator past its first batch (two reads of the generator's state, once a resume)."""
    if not replayed or done < 2:
        collections.deque(itertools.islice(batches, done), maxlen=0)
        return
    next(batches, None)
    first = torch.get_rng_state()
    collections.deque(itertools.islice(batches, done - 1), maxlen=0)
    if not torch.equal(first, torch.get_rng_state()):
        warnings.warn(
            f"resume: the training data drew from torch's global random generator while the {done} batches done "
            f"were dropped (a torch.randperm or torch.rand in its __iter__, past its first batch): in the run it "
            f"continues those draws came between the model's own (dropout, noise), so where a draw serves later "
            f"batches too (a shard's order), the resumed run trains on other batches from here (a draw for one batch "
            f"alone, noise added to it, resumes exactly); give the data a generator of its own "
            f"(torch.Generator().manual_seed(...), seeded from the epoch in set_epoch), or draw in DataLoader workers",
            HookfitWarning,
            stacklevel=user_level())
