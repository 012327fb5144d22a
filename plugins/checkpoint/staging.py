"""checkpoint staging: host buffers a checkpoint's tensors are copied into, so that the
training thread pays one copy and a writer thread reads a state that training cannot change.

A :class:`Staging` holds one buffer per tensor of the state, keyed by the tensor's place in
it (``("model", "0.weight")``), allocated at its first use and reused by every later copy while
the tensor at that place keeps its shape and dtype (a buffer whose tensor changed is made
again, one whose place is gone is let go; the others stay). A tensor on an accelerator is copied
into pinned host memory, without blocking, on a stream of the staging's own that starts after
the work already queued on the tensor's stream; that stream then waits for the copy before
its next work (training cannot change a tensor being copied), and :meth:`Staging.ready`,
called by the writer before it reads, waits for the copy: no copy of the state is made in
device memory. Tensors that are not plain dense tensors (sparse, quantized, subclasses such
as ``DTensor``) are cloned instead.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Staging"]

_CUDA: Any = torch.cuda  # (its Stream and Event are untyped)
_SCALARS = (int, float, str, bool, bytes, type(None))


class Staging:
    """Reusable host buffers for the tensors of a checkpoint's state (see the module)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._events: list[Any] = []  # the device copies' events, waited for by ready()
        self._streams: dict[torch.device, Any] = {}

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The buffers of the last copy, in the order the state's tensors were met."""
        return list(self._buffers.values())

    @property
    def nbytes(self) -> int:
        """The host memory the buffers hold."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, state: Any) -> Any:
        """``state`` with every tensor replaced by its buffer holding a copy of it (dicts,
        lists and tuples rebuilt, other values shared as they are)."""
        found: dict[tuple[Any, ...], torch.Tensor] = {}
        self._events = []
        staged = self._walk(state, (), found)
        self._buffers = {place: self._buffers[place] for place in found}  # places gone: let go
        self._copy(found)
        return staged

    def ready(self) -> None:
        """Wait for copies from a device still in flight (the writer, before it reads)."""
        for event in self._events:
            event.synchronize()

    def release(self) -> None:
        """Let go of every buffer (the next copy allocates again)."""
        self.ready()
        self._buffers, self._events, self._streams = {}, [], {}

    # -- inside ---------------------------------------------------------------------------
    def _walk(self, obj: Any, place: tuple[Any, ...], found: dict[tuple[Any, ...], torch.Tensor]) -> Any:
        if isinstance(obj, torch.Tensor):
            if not _plain(obj):
                return obj.detach().clone()
            found[place] = obj
            return self._buffer(place, obj)
        if isinstance(obj, dict):
            return {k: self._walk(v, (*place, k), found) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            if all(type(v) in _SCALARS for v in obj):  # (a random state: hundreds of numbers)
                return list(obj) if isinstance(obj, list) else obj
            items = [self._walk(v, (*place, i), found) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        return obj

    def _buffer(self, place: tuple[Any, ...], tensor: torch.Tensor) -> torch.Tensor:
        """The buffer at ``place`` for ``tensor``: the one there if it fits, else a new one."""
        pinned = tensor.device.type != "cpu" and torch.cuda.is_available()
        have = self._buffers.get(place)
        if have is not None and have.shape == tensor.shape and have.dtype == tensor.dtype and (
                have.is_pinned() == pinned):
            return have
        made = self._buffers[place] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
        return made

    def _copy(self, sources: dict[tuple[Any, ...], torch.Tensor]) -> None:
        """One call per device for all its tensors: the interpreter is let go once for the
        whole copy, not once per tensor (a writer thread would take it at each)."""
        on_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for place, source in sources.items():
            buffers, tensors = on_device.setdefault(source.device, ([], []))
            buffers.append(self._buffers[place])
            tensors.append(source.detach())
        for device, (buffers, tensors) in on_device.items():
            if device.type == "cpu":
                torch._foreach_copy_(buffers, tensors)
            else:
                self._copy_from(device, buffers, tensors)

    def _copy_from(self, device: torch.device, buffers: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
        if device.type != "cuda":  # another accelerator: a plain blocking copy
            torch._foreach_copy_(buffers, tensors)
            return
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = _CUDA.Stream(device)
        training = torch.cuda.current_stream(device)
        stream.wait_stream(training)  # the copy reads what the work queued so far wrote
        with torch.cuda.stream(stream):
            torch._foreach_copy_(buffers, tensors, non_blocking=True)
            event = _CUDA.Event()
            event.record(stream)
        training.wait_stream(stream)  # training's next writes to these tensors wait for the copy
        self._events.append(event)


def _plain(tensor: torch.Tensor) -> bool:
    """A dense tensor of a plain dtype that a buffer can hold (not a subclass)."""
    return (type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.layout == torch.strided
            and not tensor.is_quantized and tensor.device.type != "meta")
