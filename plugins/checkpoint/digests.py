"""checkpoint digests: the checksum a checkpoint carries of its own contents (``digest``), so that a
bit changed in a file after it was written is found when it is read
(:func:`hookfit.plugins.checkpoint.storage.read`)."""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any, Callable

import torch

__all__ = ["DIGEST", "PIECE", "Crc32", "digest"]

DIGEST = "crc32"
"""The checksum of a checkpoint's ``digest`` entry (:func:`digest`) and of a sharded checkpoint's
files: CRC-32 finds torn writes and flipped bits (as zip and gzip do); it is no defence against
deliberate tampering (files load with ``weights_only=True``)."""
PIECE = 4 << 20
"""Bytes a background writer hashes or writes between two chances to step aside."""


def digest(payload: Mapping[str, Any], between: Callable[[], None] | None = None) -> str:
    """``"crc32:<8 hex digits>"`` over everything in ``payload`` but its ``digest`` entry: every
    tensor's dtype, shape and bytes and every other value, in a fixed order (mappings by
    their keys, sorted), so a bit that changed in a file after it was written is found
    (CRC-32: torn writes and flipped bits, not deliberate tampering; see :data:`DIGEST`).
    ``between`` is called before each tensor is hashed (as :func:`hookfit.plugins.checkpoint.storage.atomic_save`'s)."""
    h = Crc32()
    _feed(h, {k: v for k, v in payload.items() if k != "digest"}, between or _nothing)
    return f"{DIGEST}:{h.hexdigest()}"


class Crc32:
    """A running ``zlib.crc32`` with a hash object's ``update()`` and ``hexdigest()`` (8 hex
    digits). ``zlib.crc32`` releases the GIL on large buffers, so a writer thread's pieces run
    beside training's Python."""

    def __init__(self) -> None:
        self.crc = 0

    def update(self, data: Any) -> None:
        self.crc = zlib.crc32(data, self.crc)

    def hexdigest(self) -> str:
        return f"{self.crc:08x}"


def _nothing() -> None:
    return None


def _feed(h: Crc32, obj: Any, between: Callable[[], None]) -> None:
    if isinstance(obj, torch.Tensor):
        between()
        tensor = obj.detach()
        if tensor.layout != torch.strided:
            tensor = tensor.to_dense()
        tensor = tensor.cpu().contiguous().reshape(-1)
        h.update(f"T{tensor.dtype}{tuple(obj.shape)}:".encode())
        data = tensor.view(torch.uint8) if tensor.element_size() and tensor.dtype != torch.uint8 else tensor
        view = data.numpy().data.cast("B") if data.numel() else memoryview(b"")  # (the array's buffer)
        for start in range(0, len(view), PIECE):  # (hashed in pieces: the same digest as at once)
            if start:
                between()
            h.update(view[start:start + PIECE])
    elif isinstance(obj, Mapping):
        h.update(f"D{len(obj)}:".encode())
        for key, value in sorted(obj.items(), key=lambda kv: (type(kv[0]).__name__, repr(kv[0]))):
            _feed(h, key, between)
            _feed(h, value, between)
    elif isinstance(obj, (list, tuple)):
        h.update(f"{'L' if isinstance(obj, list) else 'U'}{len(obj)}:".encode())
        for value in obj:
            _feed(h, value, between)
    else:
        text = repr(obj)
        h.update(f"V{type(obj).__name__}:{len(text)}:{text}".encode())
