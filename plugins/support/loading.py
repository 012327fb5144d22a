"""What may bring a stage's batches faster, from how its data is loaded: the advice of a bottleneck warning."""

from __future__ import annotations

from typing import Mapping

from torch.utils.data import DataLoader


def faster_data(data: object) -> str:
    """Advice for ``data`` whose loading holds a stage up: workers for a ``DataLoader`` without them, more of
    them, a deeper prefetch and workers kept between epochs for one with them."""
    if isinstance(data, Mapping):  # several validation sets
        return "try DataLoader num_workers, pin_memory"
    if not isinstance(data, DataLoader):
        return "try a torch DataLoader with num_workers, pin_memory"
    if data.num_workers == 0:
        return "try DataLoader num_workers, pin_memory"
    more = f"try more workers than {data.num_workers}, a larger prefetch_factor"
    return more if data.persistent_workers else f"{more}, persistent_workers=True (its workers start every epoch)"
