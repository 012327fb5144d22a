"""DataLoaders' worker processes across a resume: persistent ones (``persistent_workers=True``),
and how many a loader has (:func:`workers`).

Such a loader makes its iterator, and starts its worker processes, at its first ``iter()``;
every later ``iter()`` resets that iterator. A new iterator draws its workers' base seed from
the loader's generator (the global one without) before its sampler draws the epoch's order; a
reset draws no seed. So the epochs after a run's first see their order drawn straight from the
random state the epoch began with, and a resumed run whose loader made a new iterator would draw
it one seed later. The run's state names its data that had made such an iterator at its position
(``"persistent_iterators"``, see :mod:`hookfit.position`); a resumed run makes theirs first, with
the random state kept (:func:`hookfit.states.load_run_state`), so that its first epoch resets
them as the run it continues did, and draws the same order and the same random stream.

What a resume cannot rebuild is the worker processes: the run it continues started them in an
earlier epoch, and they keep what they drew since (a random augmentation drawn as a worker loads
a sample) and the copy of an ``IterableDataset`` they started with. :func:`unrebuilt_workers`
says so. Without persistent workers each epoch starts its workers from that epoch's base seed,
which a resume draws again: exact.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

__all__ = ["made", "made_iterators", "named", "other_workers", "persistent", "release", "unrebuilt_workers",
           "workers"]


def persistent(data: Any) -> bool:
    """Whether ``data`` is a ``DataLoader`` with persistent worker processes and no state of its
    own to restore (torchdata's ``StatefulDataLoader`` restores its iterator itself, and makes one
    as its state is taken)."""
    from torch.utils.data import DataLoader

    return (isinstance(data, DataLoader) and data.persistent_workers and data.num_workers > 0
            and not hasattr(data, "load_state_dict"))


def made(data: Any) -> bool:
    """Whether ``data`` is a ``DataLoader`` with persistent workers that has made its iterator,
    so that its next ``iter()`` resets that one (torch keeps it in the loader's ``_iterator``
    from its first ``iter()`` on)."""
    return persistent(data) and getattr(data, "_iterator", None) is not None


def named(train_data: Any, val_data: Any) -> dict[str, Any]:
    """The run's data by the names the run's state gives them: ``"train"``, ``"valid"``, or
    ``"valid/<name>"`` for each of several validation sets; ``None`` (no data) left out."""
    sets = ({f"valid/{name}": data for name, data in val_data.items()} if isinstance(val_data, Mapping)
            else {"valid": val_data})
    return {name: data for name, data in {"train": train_data, **sets}.items() if data is not None}


def made_iterators(train_data: Any, val_data: Any) -> list[str]:
    """The names (:func:`named`) of the data that has made its persistent iterator (:func:`made`)."""
    return [name for name, data in named(train_data, val_data).items() if made(data)]


def _label(name: str) -> str:
    return "train_data" if name == "train" else "val_data" if name == "valid" else f"val_data[{name[6:]!r}]"


def unrebuilt_workers(train_data: Any, val_data: Any, made_before: Collection[str]) -> str | None:
    """Why a resumed run cannot rebuild what the persistent workers of its data hold, or
    ``None``: ``made_before`` names the data whose iterator the run it continues had made
    (its workers started in an earlier epoch; the resumed run made theirs anew). Data whose
    iterator this process made before the resume (an earlier run over the same loader) and the
    run it continues had not resets it where that run made a new one: its order differs too."""
    started, stale = [], []
    for name, data in named(train_data, val_data).items():
        if name in made_before and persistent(data):
            started.append(_label(name))
        elif made(data):
            stale.append(_label(name))
    said = []
    if started:
        said.append(
            f"the random state of the persistent worker processes of {', '.join(started)} "
            f"(DataLoader(persistent_workers=True)) cannot be rebuilt: the run it continues started them before the "
            f"position it resumes from and they keep what they drew since (a random augmentation drawn as a worker loads a sample) and "
            f"the copy of an IterableDataset they started with, while the resumed run starts new ones, so what they "
            f"draw differs from the run it continues (the order of the batches and the main process's random stream "
            f"are rebuilt); with persistent_workers=False each epoch starts its workers from a seed a resume draws "
            f"again")
    if stale:
        said.append(
            f"{', '.join(stale)} had made its iterator with persistent workers in this process before the resume "
            f"(an earlier run over the same DataLoader), so the resumed run resets it where the run it continues "
            f"made a new one, which draws the workers' base seed before the epoch's order: that order and the random "
            f"draws after it cannot be rebuilt; give the resumed run a new DataLoader")
    return "; and ".join(said) or None


def workers(train_data: Any, val_data: Any) -> dict[str, int]:
    """How many worker processes each of the run's loaders has (its ``num_workers``), by name (:func:`named`)."""
    return {name: data.num_workers for name, data in named(train_data, val_data).items()
            if isinstance(getattr(data, "num_workers", None), int)}


def other_workers(train_data: Any, val_data: Any, saved: Any) -> str | None:
    """What a resumed run's training loader does with another worker count than the run it continues had
    (``saved``: its :func:`workers`), or ``None``: what each worker draws (a random augmentation as it loads a
    sample) comes from a seed per worker, so the draws differ from that run's."""
    if not isinstance(saved, Mapping):
        return None
    now = workers(train_data, None)  # the training data's: a validation rarely draws at random
    changed = [f"{_label(name)} has num_workers={now[name]}, the run it continues had {saved[name]}"
               for name in now if isinstance(saved.get(name), int) and saved[name] != now[name]]
    return ("; ".join(changed) + ": random draws made in the worker processes (a random augmentation as a sample "
            "loads; an IterableDataset's interleaving of its workers) differ from that run's, so the resumed run is "
            "not exact; resume with the worker count it had") if changed else None


def release(train_data: Any, val_data: Any) -> None:
    """At the run's end: the persistent worker processes of its loaders are shut down and their
    iterators let go, so a later run over the same loader starts them afresh, as a new process
    would (and as a resumed run does). Left to the loader, they would end when Python's cycle
    collector frees it (the run's objects refer to each other): a shutdown there waits for each
    worker's status-check timeout, about 5 s a worker, at whatever moment the collector runs."""
    for data in named(train_data, val_data).values():
        if made(data):  # (torch's DataLoader keeps it in _iterator, and its __del__ calls _shutdown_workers)
            iterator = getattr(data, "_iterator")
            setattr(data, "_iterator", None)
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
