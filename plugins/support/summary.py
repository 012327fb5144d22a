"""The size of a model: :func:`summarize` counts the parameters and buffers of ``loop.model``
into a :class:`hookfit.payloads.ModelSummary`.

Any plugin can call it, usually at ``fit_start``: ``summarize(loop.model)`` (the console prints
it, the dashboard shows it). It reads the model and changes nothing; its cost is one pass over
the model's modules and tensors, never over their elements. This module imports torch; the
payload it returns does not need it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from hookfit.payloads import ModelSummary, ModuleRow
from hookfit.plugins.support import unwrap_model

__all__ = ["DIRECT", "summarize"]

DIRECT = "(direct)"
"""The name of the row for the tensors a model holds itself, outside any child module."""


def _roots(model: Any, prefix: str = "") -> Iterator[tuple[str, torch.nn.Module]]:
    """``(name, module)`` for each model of ``Loop(model=...)``: a module (named ``""``), or
    those of a mapping (by key) or a list (by index), dotted when nested."""
    if isinstance(model, torch.nn.Module):
        yield prefix, unwrap_model(model)
    elif isinstance(model, Mapping):
        for key, value in model.items():
            yield from _roots(value, f"{prefix}{key}" if not prefix else f"{prefix}.{key}")
    elif isinstance(model, (list, tuple)):
        for index, value in enumerate(model):
            yield from _roots(value, f"{prefix}{index}" if not prefix else f"{prefix}.{index}")
    else:
        where = f" at model[{prefix!r}]" if prefix else ""
        raise TypeError(f"summarize: the model must be a torch.nn.Module, a mapping or a list of "
                        f"modules; got {type(model).__name__}{where}")


class _Tally:
    """Sums over tensors, each counted once (by identity). With ``owners`` (shared by the rows of
    one summary: tensor id -> the row that counted it), a tensor an earlier row counted is left
    out here and that row's name kept in ``tied``."""

    __slots__ = ("seen", "parameters", "trainable", "parameter_bytes", "buffer_bytes", "uninitialised", "owners",
                 "name", "tied")

    def __init__(self, owners: dict[int, str] | None = None, name: str = "") -> None:
        self.seen: set[int] = set()
        self.parameters = self.trainable = self.parameter_bytes = self.buffer_bytes = self.uninitialised = 0
        self.owners, self.name = owners, name
        self.tied: dict[str, None] = {}

    def _first(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is counted here: not seen here, nor counted by another row."""
        if id(tensor) in self.seen:
            return False
        self.seen.add(id(tensor))
        if self.owners is not None and (owner := self.owners.setdefault(id(tensor), self.name)) != self.name:
            self.tied[owner] = None
            return False
        return True

    def add(self, parameters: Iterable[torch.Tensor], buffers: Iterable[torch.Tensor]) -> None:
        for p in parameters:
            if not self._first(p):
                continue
            if is_lazy(p):
                self.uninitialised += 1
                continue
            n = p.numel()
            self.parameters += n
            if p.requires_grad:
                self.trainable += n
            self.parameter_bytes += n * p.element_size()
        for b in buffers:
            if not self._first(b):
                continue
            if is_lazy(b):
                self.uninitialised += 1
                continue
            self.buffer_bytes += b.numel() * b.element_size()

    def row(self, module: torch.nn.Module) -> ModuleRow:
        return ModuleRow(self.name, type(module).__name__, self.parameters, self.trainable,
                         self.parameter_bytes + self.buffer_bytes, self.uninitialised, tuple(self.tied))


def _row(name: str, module: torch.nn.Module, owners: dict[int, str]) -> ModuleRow:
    tally = _Tally(owners, name)
    tally.add(module.parameters(), module.buffers())
    return tally.row(module)


def summarize(model: Any) -> ModelSummary:
    """Count the parameters and buffers of ``model`` (what ``Loop(model=...)`` takes: a module,
    or a dict or list of modules; wrappers are looked through with :func:`unwrap`).

    Totals count each parameter and buffer once, however many modules share it, and so do the
    rows: a tensor shared by several rows (a tied weight) is counted in the first, and each
    later one names it in ``tied``. Rows: for a single model, one per child module, plus one
    named ``"(direct)"`` for the tensors the model holds itself when it holds parameters itself
    (its own buffers alone make no row); for a dict or list of models, one per model, named by
    its key or index. Parameters and buffers of lazy modules not initialised yet are counted in
    ``uninitialised`` only. ``None`` (no model) gives an empty summary.
    """
    if model is None:
        return ModelSummary(0, 0, 0, 0)
    single = isinstance(model, torch.nn.Module)
    total = _Tally()
    rows: list[ModuleRow] = []
    owners: dict[int, str] = {}  # each tensor's row: the first that holds it
    for name, root in _roots(model):
        total.add(root.parameters(), root.buffers())
        if not single:  # a dict or list of models: one row per model
            rows.append(_row(name, root, owners))
            continue
        for child_name, child in root.named_children():
            rows.append(_row(child_name, unwrap_model(child), owners))
        own = _Tally(owners, DIRECT)
        own.add(root.parameters(recurse=False), root.buffers(recurse=False))
        if any(True for _ in root.parameters(recurse=False)):
            rows.append(own.row(root))
    kind = type(unwrap_model(model)).__name__ if single else type(model).__name__
    return ModelSummary(total.parameters, total.trainable, total.parameter_bytes, total.buffer_bytes,
                        tuple(rows), total.uninitialised, kind)
