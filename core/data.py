"""Batches of in-memory tensors: seeded, resumable mid-epoch without replay, shardable; and what
the loop asks of any data.

:class:`Batches` replaces ``DataLoader(TensorDataset(x, y), batch_size=..., shuffle=...)``
for data that already sits in tensors. It indexes whole batches at once instead of collating
single samples, so a batch costs a few microseconds instead of a few hundred.

Of any data the loop and the plugins ask: :func:`length` (how many batches, ``None`` for a
stream), :func:`stage_length` (a run's ``train_data`` or ``val_data``, several validation sets
summed), :func:`one_pass` (an iterator, used up after one pass), :func:`tell_epoch` (the epoch
before each one, to the training data); :func:`check_passes` refuses, as a ``Loop`` is made, data that would fail the run
later (used up after one pass, an empty validation set); whether a resume rebuilds its order is :mod:`hookfit.order`'s.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from hookfit.errors import HookfitWarning, user_level
from hookfit.reproducibility import as_int

__all__ = ["FACTORY", "Batches", "check_passes", "generators", "length", "one_pass", "stage_length",
           "tell_epoch"]

_MASK = (1 << 64) - 1
_GATHER_BYTES = 256 << 10
"""Shuffled batches are gathered this many bytes of rows at a time (at least one batch)."""
_STRUCTURE = ("num_samples", "batch_size", "shuffle", "drop_last", "rank", "world_size")


def length(data: Any) -> int | None:
    """How many batches ``data`` yields, or ``None`` when it cannot say: it has no
    ``__len__``, or one that raises ``TypeError`` (every ``DataLoader`` has ``__len__``, and
    over an ``IterableDataset`` without a length it raises). The one answer the core and every
    plugin use: ``hasattr(data, "__len__")`` is true of a streaming ``DataLoader``."""
    try:
        return len(data)
    except TypeError:
        return None


def stage_length(data: Any) -> int | None:
    """How many batches a stage over a run's ``train_data`` or ``val_data`` runs: :func:`length`,
    and of several validation sets (``Loop(val_data={name: data, ...})``, a mapping) the sum of
    theirs, ``None`` when one of them cannot say (``len()`` of the mapping counts its sets)."""
    if isinstance(data, Mapping):
        counts = [length(part) for part in data.values()]
        return sum(count for count in counts if count is not None) if None not in counts else None
    return length(data)


def bounded_length(data: Any) -> int | None:
    """:func:`length` where it bounds the batches ``data`` yields, else ``None``: a ``DataLoader`` over an
    ``IterableDataset`` takes the dataset's ``len()`` on trust, which its workers' streams may overrun
    (every worker yields its own part), so a run does not count on it."""
    return None if _streamed(data) is not None else length(data)


def one_pass(data: Any) -> bool:
    """Whether ``data`` is known to give its batches once only: an iterator (``iter(data) is
    data``: a generator object, ``map(...)``, a file), which a second ``iter()`` finds used up.
    Told without calling ``iter()`` (which would start a ``DataLoader``'s workers): an iterator
    has ``__next__``. Re-iterable data (a list, a ``DataLoader``, a generator factory: an object
    whose ``__iter__`` is a generator function) gives a new pass each time."""
    return isinstance(data, Iterator)


def tell_epoch(data: Any, epoch: int, again: bool = False) -> None:
    """Tell ``data`` the epoch it is about to be iterated for, so that an order or a shuffle it
    draws can be a pure function of the epoch (which a resumed run can rebuild): data with
    ``set_epoch(epoch)`` (:class:`Batches`, a Hugging Face ``IterableDataset``, a generator
    factory), else the ``IterableDataset`` of a ``DataLoader`` when that has one (the loader's
    workers get a copy of it as each epoch's iterator is made; persistent workers keep the copy
    of the first epoch: ``again``, the run's second epoch, warns of them, unless the dataset is a Hugging Face
    ``IterableDataset``, whose epoch they share). The loop tells the training data only:
    validation data is never told the epoch, so every validation of a fit, and a
    ``Loop.validate()`` of its weights, reads the same batches (a held-out stream that draws
    its order from the epoch would otherwise score other rows each time; a validation
    ``DistributedSampler`` keeps its epoch 0, and with it the same part of the set on each rank)."""
    target = data if hasattr(data, "set_epoch") else _streamed(data)
    setter = getattr(target, "set_epoch", None)
    if callable(setter):
        setter(epoch)
        shared = type(target).__module__.startswith("datasets.")  # Hugging Face's: its epoch in memory workers share
        if again and target is not data and data.persistent_workers and data.num_workers > 0 and not shared:
            warnings.warn(f"set_epoch reaches the {type(target).__name__} of a DataLoader, not its persistent workers "
                          f"(persistent_workers=True), which keep their copy of it from the run's first epoch: an "
                          f"order it draws from the epoch is not redrawn there (nor rebuilt at a resume); give "
                          f"persistent_workers=False (each epoch's workers then get the dataset as set_epoch left "
                          f"it)", HookfitWarning, stacklevel=user_level())


def generators(data: Any) -> dict[str, torch.Generator]:
    """The torch generators of its own that a ``DataLoader`` draws its order and its workers'
    base seed from, by where they sit: ``"generator"`` (``DataLoader(generator=...)``, which a
    shuffling loader also gives its ``RandomSampler``), ``"sampler.generator"`` and
    ``"batch_sampler.sampler.generator"`` (a sampler given with a generator of its own), each
    generator once, under the first of these names that holds it. Empty for any other data, and
    for a loader that draws from the global generator. The run keeps their states with its
    random state (:mod:`hookfit.position`)."""
    from torch.utils.data import DataLoader

    found: dict[str, torch.Generator] = {}
    if not isinstance(data, DataLoader):
        return found
    sampler = getattr(data.batch_sampler, "sampler", None)
    for name, holder in (("generator", data), ("sampler.generator", data.sampler),
                         ("batch_sampler.sampler.generator", sampler)):
        generator = getattr(holder, "generator", None)
        if isinstance(generator, torch.Generator) and all(g is not generator for g in found.values()):
            found[name] = generator
    return found


def _streamed(data: Any) -> Any:
    """The ``IterableDataset`` a ``DataLoader`` streams from, else ``None``."""
    from torch.utils.data import DataLoader, IterableDataset

    if isinstance(data, DataLoader) and isinstance(data.dataset, IterableDataset):
        return data.dataset
    return None


def _splitmix64(value: int) -> int:
    """One step of the SplitMix64 generator: a bijection on 64-bit ints that scatters bits."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of epoch ``epoch``'s shuffle: ``splitmix64(splitmix64(seed) ^ epoch)``, a
    64-bit int. For one ``seed`` distinct epochs never collide (both steps are bijections);
    nearby pairs such as ``(0, 1)`` and ``(1, 0)`` get unrelated seeds."""
    return _splitmix64(_splitmix64(seed & _MASK) ^ (epoch & _MASK))


class Batches:
    """Batches of rows of ``tensors``, each a tuple with one tensor per input, like
    ``DataLoader(TensorDataset(*tensors), batch_size=batch_size, shuffle=shuffle,
    drop_last=drop_last)`` yields.

    Without ``shuffle`` a batch is a slice of each tensor: a view, no copy, so writing into
    it writes into the data (``DataLoader`` would have copied). With ``shuffle`` the order of
    an epoch is ``torch.randperm`` drawn from a private ``torch.Generator`` seeded with
    :func:`epoch_seed` ``(seed, epoch)``: a pure function of ``(seed, epoch)``, the same on
    every device and every rank, and the global RNG is never touched. The permutation is
    drawn once per epoch (on the CPU, then moved to the data's device) and cached; batches are
    gathered from it with ``index_select``, several at a time (up to 256 KiB of rows, or one
    batch if that is larger) and split. Gathering as we go, rather than permuting the whole
    tensors once an epoch, keeps memory flat (the extra is the epoch's index, 8 bytes a row,
    and one gather) and makes :meth:`iter_from` instant. Gathering several batches a call
    brings it within a few us a batch of permuting everything up front, where one call a
    batch cost about 3x as much on narrow rows (``benchmarks/data.py``, ``permute-epoch``).

    The protocol (the one :class:`hookfit.Loop` uses):

    * :meth:`set_epoch` chooses the epoch; iterating never advances it, so iterating the same
      epoch twice gives the same batches.
    * ``iter(batches)`` yields the current epoch's batches from batch 0;
      :meth:`iter_from` ``(k)`` from batch ``k``, without producing the earlier ones.
    * :meth:`shard` ``(rank, world_size)`` gives one rank's part, like ``DistributedSampler``.
    * :meth:`state_dict` / :meth:`load_state_dict` save and restore the seed and epoch; the
      position inside an epoch is the caller's to keep (pass it to :meth:`iter_from`).
    """

    def __init__(
        self, *tensors: torch.Tensor, batch_size: int, shuffle: bool = False, seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if not tensors:
            raise ValueError("Batches needs at least one tensor")
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"Batches takes tensors, not {type(tensor).__name__}")
            if tensor.dim() == 0:
                raise ValueError("Batches needs tensors with a first dimension, not 0-d tensors")
        lengths = [len(tensor) for tensor in tensors]
        if len(set(lengths)) > 1:
            raise ValueError(f"tensors differ in their first dimension: {lengths}")
        if lengths[0] == 0:
            raise ValueError("Batches needs at least one sample; the tensors have 0 rows")
        if (size := as_int(batch_size)) is None or size < 1:
            raise ValueError(f"batch_size must be a positive int, not {batch_size!r}")
        self.tensors = tensors
        self.num_samples = lengths[0]
        self.batch_size = size  # (NumPy's integers too)
        self.shuffle = bool(shuffle)
        if (seeded := as_int(seed)) is None:
            raise TypeError(f"Batches: seed must be an int, not {seed!r}")
        self.seed = seeded
        self.drop_last = bool(drop_last)
        self.rank = 0
        self.world_size = 1
        self.even = True
        """Whether every shard has the same number of samples (see :meth:`shard`)."""
        self._epoch = 0
        self._cached: tuple[int, int, list[torch.Tensor]] | None = None  # seed, epoch, indices

    @property
    def epoch(self) -> int:
        """The epoch whose order :meth:`__iter__` and :meth:`iter_from` produce."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch to iterate; with ``shuffle`` each epoch has its own order."""
        self._epoch = operator.index(epoch)

    def _shard_samples(self) -> int:
        """Samples this shard has each epoch (padding included)."""
        if not self.even:
            return len(range(self.rank, self.num_samples, self.world_size))
        if self.drop_last:
            return self.num_samples // self.world_size
        return -(-self.num_samples // self.world_size)

    def __len__(self) -> int:
        """Batches per epoch, for this shard."""
        samples = self._shard_samples()
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)

    def __repr__(self) -> str:
        shard = (f", rank={self.rank}, world_size={self.world_size}{'' if self.even else ', even=False'}"
                 if self.world_size > 1 else "")
        return (f"Batches({self.num_samples} samples, batch_size={self.batch_size}, "
                f"shuffle={self.shuffle}, seed={self.seed}, drop_last={self.drop_last}, "
                f"epoch={self._epoch}{shard})")

    def _indices(self) -> list[torch.Tensor] | None:
        """This shard's rows for the current epoch, one index tensor per input tensor (on its
        device), or ``None`` when batches are plain slices (no shuffle, one shard)."""
        if not self.shuffle and self.world_size == 1:
            return None
        if self._cached is not None and self._cached[:2] == (self.seed, self._epoch):
            return self._cached[2]
        if self.shuffle:
            generator = torch.Generator().manual_seed(epoch_seed(self.seed, self._epoch))
            order = torch.randperm(self.num_samples, generator=generator)
        else:
            order = torch.arange(self.num_samples)
        total = self._shard_samples() * self.world_size if self.even else self.num_samples
        if total > len(order):  # pad by wrapping around, as DistributedSampler does
            order = order.repeat(-(-total // len(order)))
        order = order[self.rank:total:self.world_size]
        on_device = {t.device: order.to(t.device) for t in self.tensors}
        indices = [on_device[t.device] for t in self.tensors]
        self._cached = (self.seed, self._epoch, indices)
        return indices

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        """The batches of the current epoch, from batch 0."""
        return self.iter_from(0)

    def iter_from(self, start: int) -> Iterator[tuple[torch.Tensor, ...]]:
        """Batches ``start``, ``start + 1``, ... of the current epoch, exactly those that
        ``list(self)[start:]`` holds; earlier batches are never gathered. ``start`` may be
        ``len(self)`` (nothing left); beyond that, or negative, is a ``ValueError``."""
        start = operator.index(start)
        if not 0 <= start <= len(self):
            raise ValueError(f"iter_from({start}): start must be in 0..{len(self)}, the number of batches")
        return self._batches(start, len(self), self._indices())

    def _batches(self, start: int, stop: int, indices: list[torch.Tensor] | None,
                 ) -> Iterator[tuple[torch.Tensor, ...]]:
        tensors, size = self.tensors, self.batch_size
        if indices is None:
            for begin in range(start * size, stop * size, size):
                yield tuple([t[begin:begin + size] for t in tensors])
            return
        # One index_select per tensor for several batches at once (up to _GATHER_BYTES of
        # rows), then split: each call costs a few us whatever its size, which dominates on
        # batches of narrow rows.
        row_bytes = sum(t[0].numel() * t.element_size() for t in tensors)
        step = max(1, _GATHER_BYTES // max(1, row_bytes * size))
        for first in range(start, stop, step):
            rows = slice(first * size, min(first + step, stop) * size)
            gathered = [t.index_select(0, i[rows]) for t, i in zip(tensors, indices)]
            if step == 1:
                yield tuple(gathered)
            else:
                yield from zip(*[torch.split(g, size) for g in gathered])

    def shard(self, rank: int, world_size: int, *, even: bool = True) -> Batches:
        """A new ``Batches`` over rank ``rank``'s part of the data among ``world_size`` ranks,
        at this one's seed and epoch. As with ``DistributedSampler``: the epoch's order is
        the same on every rank (the global permutation, or ``0..n-1``) and rank ``r`` takes
        its rows ``r, r + world_size, ...``; every rank gets the same number of samples, the
        order wrapping around to fill the last ones, or, with ``drop_last``, the remainder
        dropped. With ``even=False`` (validation) nothing is repeated or left out: every
        sample is in exactly one shard, and shards may differ by one sample (and so by one
        batch). Shard the whole data only: a shard cannot be sharded again."""
        rank, world_size = operator.index(rank), operator.index(world_size)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"shard({rank}, {world_size}): need world_size >= 1 and 0 <= rank < world_size")
        if self.world_size != 1:
            raise ValueError(f"already a shard (rank {self.rank} of {self.world_size}); shard the whole data")
        part = Batches(*self.tensors, batch_size=self.batch_size, shuffle=self.shuffle,
                       seed=self.seed, drop_last=self.drop_last)
        part.rank, part.world_size = rank, world_size
        part.set_epoch(self._epoch)
        part.even = bool(even)
        return part

    def state_dict(self) -> dict[str, Any]:
        """Everything that fixes the order of batches, as plain ints and bools (readable with
        ``torch.load(weights_only=True)``). Not the position inside the epoch: the caller
        keeps that and passes it to :meth:`iter_from`."""
        return {"seed": self.seed, "epoch": self._epoch, "batch_size": self.batch_size,
                "shuffle": self.shuffle, "drop_last": self.drop_last, "rank": self.rank,
                "world_size": self.world_size, "num_samples": self.num_samples}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the seed and epoch of :meth:`state_dict`. ``ValueError``, naming what
        differs, when it was saved by batches of other data (number of samples), another
        batch size, shuffle or drop_last setting, or another number of shards (world size):
        resuming those would not continue the same sequence of batches. The rank may differ:
        with several processes, rank 0 saves and every rank loads; each keeps its own shard.
        The world size and batch size may differ together when their product, the global
        batch, is the same (2 processes with batches of 32 resumed on one with 64): the ranks'
        batches of a step are then the same samples (up to the padding of the last batch)."""
        missing = [key for key in ("seed", "epoch", *_STRUCTURE) if key not in state]
        if missing:
            raise ValueError(f"not a Batches state: missing {', '.join(missing)}")
        mine = self.state_dict()
        # another number of shards with the same global batch (batch_size * world_size) runs
        # the same global batches: rank r of w takes rows r, r + w, ... of the epoch's order
        regrouped = state["batch_size"] * state["world_size"] == mine["batch_size"] * mine["world_size"]
        differ = [f"{key} {state[key]!r} saved, {mine[key]!r} here" for key in _STRUCTURE
                  if key != "rank" and state[key] != mine[key]
                  and not (regrouped and key in ("batch_size", "world_size"))]
        if differ:
            raise ValueError("the saved state is for other batches: " + "; ".join(differ))
        self.seed = operator.index(state["seed"])
        self._epoch = operator.index(state["epoch"])


FACTORY = ("for data made anew each epoch, pass a generator factory: an object whose __iter__ is a generator "
           "function (class Stream: def __iter__(self): yield ...), or a list or a DataLoader")
"""The advice given where data is used up after one pass."""


def check_passes(train_data: Any, val_data: Any, max_epochs: int | None, max_steps: int | None,
                 val_every_n_epochs: int | None, val_every_n_steps: int | None) -> None:
    """A ``ValueError`` when data known to give its batches once only (an iterator: a generator
    object, ``map(...)``) would be iterated more than once: training data with several epochs,
    validation data with several validations (as far as their number is known now); a validation set
    known to be empty (``len() == 0``), which would fail the run only once an epoch had trained."""
    sets = val_data.items() if isinstance(val_data, Mapping) else [("val_data", val_data)]
    for name, data in sets:
        if data is not None and length(data) == 0:
            where = name if name == "val_data" else f"val_data[{name!r}]"
            raise ValueError(f"{where} is empty (len() is 0; a DataLoader with drop_last=True and fewer samples than "
                             f"its batch_size has no batch): every validation would fail, the first after an epoch "
                             f"of training; give it batches, or leave it out")
    epochs = max_epochs if max_epochs is not None else 1 if max_steps is None else None  # None: max_steps decides
    if one_pass(train_data) and epochs is not None and epochs > 1:
        raise ValueError(f"train_data is a {type(train_data).__name__}, an iterator that gives its batches once "
                         f"only, and the run has max_epochs={epochs}: the second epoch would find it used up; "
                         f"{FACTORY}")
    used = [(name if name == "val_data" else f"val_data[{name!r}]", data) for name, data in sets if one_pass(data)]
    if not used:
        return
    if val_every_n_steps is None:
        every = val_every_n_epochs or 1
        times = epochs // every if epochs is not None else None
        how = f"max_epochs={epochs}" + (f", val_every_n_epochs={every}" if every > 1 else ", one each epoch")
    else:
        per_epoch = length(train_data)
        by_epochs = epochs * per_epoch if epochs is not None and per_epoch is not None else None
        steps = [n for n in (max_steps, by_epochs) if n is not None]
        times = min(steps) // val_every_n_steps if steps else None
        how = f"val_every_n_steps={val_every_n_steps} over {min(steps) if steps else '?'} training steps"
    if times is not None and times > 1:
        name, data = used[0]
        raise ValueError(f"{name} is a {type(data).__name__}, an iterator that gives its batches once only, and "
                         f"validation runs {times} times ({how}): the second validation would find it used "
                         f"up; {FACTORY}")
