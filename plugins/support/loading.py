"""What may bring a stage's batches faster, from how its data is loaded: the advice of a bottleneck warning."""

from __future__ import annotations

import os
from typing import Mapping

import torch
from torch.utils.data import DataLoader


def faster_data(data: object) -> str:
    """Advice for ``data`` whose loading holds a stage up: workers for a ``DataLoader`` without them, more of
    them while they are fewer than the cores, a deeper prefetch and workers kept between epochs for one with
    them; ``pin_memory`` only where an accelerator is there to copy batches to (on the CPU it does nothing)."""
    pin = ", pin_memory" if torch.accelerator.is_available() else ""
    if isinstance(data, Mapping):  # several validation sets
        return f"try DataLoader num_workers{pin}"
    if not isinstance(data, DataLoader):
        return f"try a torch DataLoader with num_workers{pin}"
    if data.num_workers == 0:
        return f"try DataLoader num_workers{pin}"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if data.num_workers < cores:
        more = f"try more workers than {data.num_workers}, a larger prefetch_factor"
    else:  # more workers than cores only share them
        more = (f"its {data.num_workers} workers have the {cores} cores already: try cheaper items (decode or "
                "augment less per item), a larger prefetch_factor")
    return more if data.persistent_workers else f"{more}, persistent_workers=True (its workers start every epoch)"
