"""A run's JSON-lines files read with care and past damage, for :mod:`hookfit.tools.runs`: only
a regular file of the run, bounded (:func:`read_bytes`); which lines are not JSON objects (a torn
or cut line), and which values of a line are not what hookfit writes there (:func:`checked`),
each said in a note naming the file and the line (:func:`read_jsonl`, :func:`read_metrics`)."""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeGuard

__all__ = ["CUT", "LIMIT", "NOTED", "checked", "count", "note", "numeric", "objects", "read_bytes", "read_jsonl", "read_metrics"]

NOTED = 5
"""The most damaged lines and values of one file a note names (then it counts the others)."""

CUT = "its last line is cut short (a run killed while writing it, or a full disk): skipped"
"""What a note says of a last line without its newline that is not JSON."""


def objects(data: bytes, live: bool = False) -> tuple[list[tuple[int, dict[str, Any]]], list[tuple[int, str]]]:
    """The JSON objects of a ``.jsonl`` file's ``data`` with their line numbers (from 1), and what
    was skipped and why, by line number. ``live``: the file is being written, so a last line
    without its newline is one being written, skipped without a word."""
    rows: list[tuple[int, dict[str, Any]]] = []
    damaged: list[tuple[int, str]] = []
    lines = data.split(b"\n")
    last = len(lines) - 1  # the part after the last newline: empty, or a line being (or cut while) written
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        text = raw.decode("utf-8", errors="replace")
        try:
            row = json.loads(text)
        except ValueError:
            if number <= last:
                damaged.append((number, f"line {number} is not JSON ({_line_shown(text)}): skipped"))
            elif not live:
                damaged.append((number, CUT))
            continue
        if not isinstance(row, dict):
            damaged.append((number, f"line {number} is not a JSON object ({_line_shown(text)}): skipped"))
        else:
            rows.append((number, row))
    return rows, damaged


def _shown(value: object) -> str:
    """A value as JSON writes it (a line as it is), at most 40 characters."""
    text = json.dumps(value, default=repr)
    return text if len(text) <= 40 else text[:37] + "..."


def _line_shown(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:37] + "...")


def note(notes: list[str] | None, path: Path, damaged: list[tuple[int, str]]) -> None:
    """One note in ``notes`` for the file ``path``: the first :data:`NOTED` of ``damaged``
    (line number, what), in the order of the lines."""
    if notes is None or not damaged:
        return
    said = [text for _, text in sorted(damaged, key=lambda item: item[0])]
    more = len(said) - NOTED
    notes.append(f"{path.name}: {'; '.join(said[:NOTED])}" + (f"; and {more} more" if more > 0 else ""))


def count(value: object) -> TypeGuard[int]:
    """Whether ``value`` is a count: an ``int`` (not a ``bool``), not negative."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


Check = Callable[[Any], bool]
"""Whether a value read from a line is what hookfit writes there."""

_PLACE: dict[str, tuple[Check, str]] = {
    "stage": (lambda v: isinstance(v, str) and bool(v), "a stage name"),
    "epoch": (lambda v: count(v) and v >= 1, "an epoch counted from 1"),
    "step": (count, "a step count"),
}
"""The fields that place a row (a row without them as they should be cannot be placed)."""

_SECONDS: tuple[Check, str] = (lambda v: _number(v) and v >= 0, "a number of seconds")

_FIELDS: dict[str, tuple[Check, str]] = {
    "batches": (count, "a count"), "samples": (count, "a count"), "total": (count, "a count"), "time": _SECONDS,
    "samples_per_s": (lambda v: _number(v) or _nan(v), "a number"),
    "stopped": (lambda v: v is True, "true"),  # a stage a stop cut short (metrics_log)
    "evaluation": (lambda v: v is True, "true"),  # written by Loop.validate() (metrics_log)
}
"""The other fields of a row that are not metrics, and what each is."""

_TEXT: tuple[Check, str] = (lambda v: v is None or isinstance(v, str), "a text or null")

_OTHER: dict[str, dict[str, tuple[Check, str]]] = {
    "resume": {"step": (count, "a step count"), "epoch": (count, "an epoch"), "batch": (count, "a count"),
               "from": (lambda v: isinstance(v, str), "a file name")},
    "end": {"step": (count, "a step count"), "epoch": (count, "an epoch"), "time": _SECONDS,
            "status": (lambda v: isinstance(v, str), "a status"), "skipped": (count, "a count"),
            "reason": _TEXT, "by": _TEXT, "duration": _SECONDS, "steps": (count, "a step count"),
            "epochs": (count, "an epoch count")},
    "run": {"name": _TEXT, "started": _TEXT, "identity": _TEXT, "host": _TEXT, "mode": _TEXT},
    "checkpoint": {"step": (count, "a step count")},
}
"""The fields of the other lines that readers use, and what each is (a damaged one is left out):
of ``metrics.jsonl`` and of ``run.jsonl`` (its ``"run"`` and ``"end"`` lines), whose values
``hookfit runs`` shows and writes as JSON: a text field holding a number (``NaN``) or a number
of seconds that is not finite is left out, never passed on."""


def _nan(value: object) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def checked(line: Mapping[str, Any], damaged: list[tuple[int, str]] | None = None, number: int = 0
            ) -> dict[str, Any] | None:
    """A line of a ``metrics.jsonl`` or a ``run.jsonl`` as hookfit wrote it, or ``None`` when it cannot be placed.
    In an ``"epoch"`` or ``"step"`` row, ``stage``, ``epoch`` and ``step`` must be what they are
    (else the row is skipped), the other progress fields and every metric and learning rate
    numbers (a metric may be NaN or infinite: a run that diverged); a value that is not is left
    out. In ``"resume"``, ``"end"``, ``"run"`` and ``"checkpoint"`` lines, a field readers use that is not
    what it is is left out (a resume line without its step is skipped). Each is said in
    ``damaged`` (with the line's ``number``)."""
    where = f"line {number}" if number else "a line"
    event = line.get("event")

    def say(text: str) -> None:
        if damaged is not None:
            damaged.append((number, f"{where}: {text}"))

    if event in ("epoch", "step"):
        for key, (good, what) in _PLACE.items():
            if not good(line.get(key)):
                say(f"{key!r} is {_shown(line.get(key))}, not {what}: the line is skipped")
                return None
        out: dict[str, Any] = {}
        for key, value in line.items():
            field = _FIELDS.get(key)
            if key in _PLACE or key == "event":
                out[key] = value
            elif field is not None:
                if field[0](value):
                    out[key] = value
                else:
                    say(f"{key!r} is {_shown(value)}, not {field[1]}: left out")
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out[key] = value
            else:
                say(f"{key!r} is {_shown(value)}, not a number: left out")
        return out
    fields = _OTHER.get(event) if isinstance(event, str) else None
    if fields is None:
        return dict(line)
    if event == "resume" and not count(line.get("step")):  # where the run resumed: nothing without it
        say(f"'step' of its resume line is {_shown(line.get('step'))}, not a step count: the line is skipped")
        return None
    out = {}
    for key, value in line.items():
        field = fields.get(key)
        if field is None or field[0](value):
            out[key] = value
        else:
            say(f"{key!r} of its {event} line is {_shown(value)}, not {field[1]}: left out")
    return out


def _number(value: object) -> bool:
    return numeric(value) and math.isfinite(value)


def numeric(value: object) -> TypeGuard[int | float]:
    """Whether ``value`` is a number (not a ``bool``), NaN and infinities included."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


LIMIT = 256 * 2**20
"""The most bytes read of one file of a run (a larger file is skipped, with a note)."""

def read_bytes(path: Path, notes: list[str] | None = None, offset: int = 0) -> bytes | None:
    """The bytes of ``path``, a file of a run folder, from ``offset`` on, read with care: only a
    regular file (never a FIFO, a device or a folder: they are not opened for reading), through
    a symlink only to a file inside the same run folder, at most :data:`LIMIT` bytes. ``None``
    when it does not exist or is skipped; what was skipped and why is added to ``notes``."""
    def skip(why: str) -> None:
        if notes is not None:
            notes.append(f"{path.name} {why}")

    try:
        if path.is_symlink():
            target = path.resolve(strict=True)
            inside = path.parent.resolve()
            if not target.is_relative_to(inside):
                skip(f"is a symlink out of the run ({target}): skipped")
                return None
        info = os.stat(path)
    except FileNotFoundError:
        if path.is_symlink():
            skip("is a broken symlink: skipped")
        return None
    except (OSError, RuntimeError) as error:  # a symlink loop, a folder that cannot be read
        skip(f"cannot be read ({type(error).__name__}: {error}): skipped")
        return None
    if not stat.S_ISREG(info.st_mode):
        skip(f"is not a regular file ({_kind(info.st_mode)}): skipped")
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as error:
        skip(f"cannot be read ({type(error).__name__}: {error}): skipped")
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced since it was looked at
            skip("is not a regular file: skipped")
            return None
        if offset:
            os.lseek(fd, offset, os.SEEK_SET)
        chunks, size = [], 0
        while size <= LIMIT:
            chunk = os.read(fd, min(2**20, LIMIT + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as error:
        skip(f"cannot be read ({type(error).__name__}: {error}): skipped")
        return None
    finally:
        os.close(fd)
    if size > LIMIT:
        skip(f"is larger than {LIMIT} bytes: skipped")
        return None
    return b"".join(chunks)


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a file"


def read_jsonl(path: Path, notes: list[str] | None = None) -> list[dict[str, Any]]:
    """The JSON objects of a ``.jsonl`` file (``run.jsonl``), in order, each :func:`checked`;
    ``[]`` when it does not exist or cannot be read (see :func:`read_bytes`, which says why in
    ``notes``). The lines that are not JSON objects are skipped, and the damaged values left out,
    each said in ``notes`` (one note for the file)."""
    data = read_bytes(path, notes)
    rows, damaged = objects(data) if data is not None else ([], [])
    out = [kept for number, row in rows if (kept := checked(row, damaged, number)) is not None]
    note(notes, path, damaged)
    return out


def read_metrics(path: Path, notes: list[str] | None = None, live: bool = False) -> list[dict[str, Any]]:
    """The lines of a ``metrics.jsonl`` as :func:`read_jsonl` reads them, each :func:`checked`:
    what is damaged is skipped or left out, and said in ``notes`` (one note for the file).
    ``live``: the run is still writing, so a last line without its newline is one being written,
    skipped without a note."""
    data = read_bytes(path, notes)
    rows, damaged = objects(data, live) if data is not None else ([], [])
    out = []
    for number, row in rows:
        kept = checked(row, damaged, number)
        if kept is not None:
            out.append(kept)
    note(notes, path, damaged)
    return out
