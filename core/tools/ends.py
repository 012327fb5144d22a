"""How a run ended, read from its end lines, for :mod:`hookfit.tools.runs`: the ``"end"`` line of
its last ``fit()`` in ``run.jsonl`` (the core's), else the metrics log's, and whether a run without
one is still running here."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from hookfit.tools.jsonlines import count


def alive(record: Mapping[str, Any]) -> bool:
    """Whether the process that wrote ``record`` (a ``"run"`` line: ``pid``, ``host``) is alive
    on this machine; ``False`` for one on another machine, which cannot be asked."""
    pid, host = record.get("pid"), record.get("host")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or host != socket.gethostname():
        return False  # (kill(0) and kill(-1) would ask about process groups, not a process)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid > 0
    return True


def end_of_last_fit(lines: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The ``"end"`` line that follows the last ``"run"`` line of a ``run.jsonl``, or ``None``
    (that ``fit()`` is still running, or was killed)."""
    marks = [line for line in lines if line.get("event") in ("run", "end")]
    return marks[-1] if marks and marks[-1].get("event") == "end" else None


def ended_epochs(end: Mapping[str, Any] | None) -> int | None:
    """The epoch the run was in when it ended, counted from 1 as the console prints it (an epoch
    that a stop, a failure or an abort cut short is one), as an end line records it: the core's
    ``"epochs"`` (``run.jsonl``), the metrics log's ``"epoch"``; ``None`` without a count there."""
    found = None if end is None else end.get("epochs", end.get("epoch"))
    return found if count(found) and found > 0 else None


def ended_best(end: Mapping[str, Any] | None, metric: str) -> tuple[float, int] | None:
    """``metric``'s best and its epoch as the core's end line records them (``results["best"]``), if it does."""
    results = end.get("results") if end is not None else None
    held = results.get("best") if isinstance(results, dict) else None
    kept = held.get(metric) if isinstance(held, dict) else None
    if isinstance(kept, list) and len(kept) == 2 and isinstance(kept[0], (int, float)) and count(kept[1]):
        return float(kept[0]), int(kept[1])
    return None
