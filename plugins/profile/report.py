"""What the profile plugin reports at the end of a run: each recorded cycle (:class:`Cycle`),
the operators' times added up over the cycles (:class:`Report`), and the ``key=value`` fields of
its lines."""

from __future__ import annotations

from dataclasses import dataclass, field as dataclass_field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from torch.autograd.profiler_util import FunctionEventAvg

__all__ = ["Cycle", "Report", "Sum", "Table", "field", "span"]


def field(key: str, value: str) -> str:
    """``key=value``, the value quoted when it has spaces or quotes (a path, a sentence)."""
    if value and not any(c.isspace() or c in "\"'" for c in value):
        return f"{key}={value}"
    return '{}="{}"'.format(key, value.replace("\\", "\\\\").replace('"', '\\"'))


def span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


class Table(Protocol):
    """What the report uses of torch's ``EventList``: its table as text."""

    def table(self, *, sort_by: str, row_limit: int) -> str: ...


class Sum(Protocol):
    """What the report uses of torch's ``FunctionEventAvg``: adding another operator's times."""

    def add(self, other: FunctionEventAvg) -> object: ...


@dataclass
class Cycle:
    """One recorded cycle of the schedule."""

    steps: list[tuple[int, int]]  # (the run's step, the profiler's step) of each recorded batch
    active: int  # the steps the schedule wanted recorded
    cut: bool  # the run ended during it
    trace: Path | None = None  # the file written, or None
    error: str | None = None  # why it was not written


@dataclass
class Report:
    cycles: list[Cycle] = dataclass_field(default_factory=list)
    averages: dict[str, Sum] = dataclass_field(default_factory=dict)  # operator -> FunctionEventAvg, over the cycles
    use_device: str | None = None
