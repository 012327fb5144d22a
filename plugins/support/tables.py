"""A CSV table a logger appends to row by row in the run folder (the ``csv`` plugin's ``metrics.csv``):
its header read back from the file an earlier run left, a last line cut short dropped, a header
widened by an atomic rewrite, rows dropped likewise; writes through :class:`hookfit.files.RunFile`,
a failure of the file system shared by the logger's tables (:class:`Failure`)."""

from __future__ import annotations

import csv
import io
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from hookfit.errors import user_level
from hookfit.files import FileWarning, RunFile
from hookfit.plugins.support.logger import fail, run_file

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

__all__ = ["LR", "Failure", "Table"]

LR = "lr_"
"""The prefix of the learning-rate columns."""


def _line(fields: Iterable[Any]) -> str:
    """One CSV record, ending with a newline; a field with a comma, a quote or a line break (a
    metric name) is quoted, as the csv module reads it back."""
    fields = list(fields)
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerow(fields)
    line = text.getvalue()
    if "\r" in line:  # csv leaves a lone carriage return unquoted (Python < 3.12): the record would break
        text = io.StringIO()
        csv.writer(text, lineterminator="\n", quoting=csv.QUOTE_ALL).writerow(fields)
        line = text.getvalue()
    return line


def _order(leading: tuple[str, ...], names: Iterable[str], after: tuple[str, ...] = ()) -> list[str]:
    """The header: the leading columns, those of ``after`` among ``names``, the metrics sorted, then the
    learning rates sorted."""
    names = set(names)
    rest = names - set(leading) - set(after)
    return [*leading, *(n for n in after if n in names), *sorted(n for n in rest if not n.startswith(LR)),
            *sorted(n for n in rest if n.startswith(LR))]


class Failure:
    """The first failure of the file system in a run (a full disk, a read-only folder), said once
    by the table it came to: it fails the other table too, quietly, as it would fail it."""

    def __init__(self) -> None:
        self.error: OSError | None = None


class Table:
    """One CSV file of the run, appended to row by row; its header widens by a rewrite."""

    def __init__(self, owner: str, name: str, leading: tuple[str, ...], failure: Failure,
                 opening: Callable[[Run], None] | None = None) -> None:
        self.owner, self.name, self.leading = owner, name, leading
        self.failure = failure
        self.opening = opening  # called before the file is opened, once a run (an earlier run's set aside)
        self.file: RunFile | None = None
        self.columns: list[str] | None = None  # the header of the file, once known
        self.path: os.PathLike[str] | None = None  # the file of the current or last run
        self.stuck = False  # an earlier run's table that could not be set aside: not written this run
        self.after: tuple[str, ...] = ()
        """Columns that follow the leading ones where rows have them; a file whose header lacks them is still
        this table, widened to hold them like a new metric's column."""

    def open(self, loop: Run) -> RunFile | None:
        """The file, its header read when it exists already; ``None`` once it or the other table
        has failed (the first failure warned, naming its file and the error)."""
        if self.failure.error is not None:  # the other table failed: this one goes without a warning of its own
            if self.file is None:
                self.file = RunFile(self._path(loop), self.owner)
                self.path = self.file.path
            if self.file.failed is None:
                self.file.close()
                self.file.failed = self.failure.error
            return None
        if self.file is None:
            if self.opening is not None:
                self.opening(loop)
            self.file = run_file(loop, self.name, self.owner)
            self.path = self.file.path
            if self.stuck:  # (said by set_aside)
                self.file.failed = OSError("an earlier run's table, which could not be set aside")
            if self.file.failed is None:
                try:
                    self.columns = self._existing(self.file)
                except OSError as error:
                    fail(self.file, error)
        return self._checked()

    def _path(self, loop: Run) -> Path:
        try:
            return loop.run_dir / self.name
        except OSError:  # a run folder that could not be made
            return Path(self.name)

    def _checked(self) -> RunFile | None:
        """The file, unless it failed: then ``None``, and a failure of the file system (a full
        disk, a read-only folder: an error with an ``errno``) is the plugin's, which the other
        table then shares (a file that is not this plugin's table fails that file alone)."""
        file = self.file
        if file is None or file.failed is None:
            return file
        if self.failure.error is None and file.failed.errno is not None:
            self.failure.error = file.failed
        return None

    def _existing(self, file: RunFile) -> list[str] | None:
        """The header of the file already there (an earlier run's), its cut-short last line
        dropped; ``None`` when there is no file or nothing in it yet. A file that is not one of
        this plugin's tables is left alone: it warns and fails."""
        path = file.path
        if not path.exists():
            return None
        with open(path, "rb+") as raw:
            size = raw.seek(0, os.SEEK_END)
            if size:
                raw.seek(size - 1)
                if raw.read(1) != b"\n":  # a write cut short: keep what ends with a newline
                    _truncate_to_last_line(raw, size)
        with open(path, newline="", encoding="utf-8", errors="replace") as text:
            try:  # the first record, which a quoted line break in a metric's name spreads over lines
                header = next(csv.reader(text), None)
            except csv.Error:
                header = ["(not CSV)"]
        if not header:
            return None
        if tuple(header[:len(self.leading)]) != self.leading:
            file.failed = OSError(f"not a table of this plugin: its header is {','.join(header)[:200]!r}")
            warnings.warn(f"{self.owner}: {path} is not a table this plugin writes (its header starts "
                          f"{','.join(header[:len(self.leading)])!r}, not {','.join(self.leading)!r}); it is "
                          f"left as it is and training goes on without it", FileWarning, stacklevel=user_level())
            return None
        return header

    def write(self, loop: Run, row: Mapping[str, Any]) -> None:
        file = self.open(loop)
        if file is None:
            return
        try:
            if self.columns is None:
                self.columns = _order(self.leading, row, self.after)
                if not file.write(_line(self.columns)):
                    return
            elif not set(row) <= set(self.columns):
                if not self.rewrite(_order(self.leading, [*self.columns, *row], self.after)):
                    return
            file.write(_line(_cell(row.get(c)) for c in self.columns))
        finally:
            self._checked()

    def rewrite(self, columns: list[str], keep: Callable[[Mapping[str, str]], bool] | None = None) -> bool:
        """Rewrite the file with ``columns`` as its header, keeping the rows ``keep`` accepts
        (all by default): into a new file that then replaces it (``os.replace``), so a failure
        leaves the old file as it was. ``False`` when the file has failed."""
        file = self.file
        if file is None or file.failed is not None:
            return False
        file.close()  # reopened by the next write: the file it appends to is then the new one
        path = file.path
        spare = path.with_name(path.name + ".tmp")
        try:
            if path.exists():
                with open(path, newline="", encoding="utf-8") as old, \
                        open(spare, "w", newline="", encoding="utf-8") as new:
                    reader = csv.DictReader(old)
                    new.write(_line(columns))
                    for entry in reader:
                        if keep is None or keep(entry):
                            new.write(_line(entry.get(c) or "" for c in columns))
                    new.flush()
                    os.fsync(new.fileno())
                os.replace(spare, path)
            self.columns = columns
            return True
        except OSError as error:
            try:
                spare.unlink(missing_ok=True)
            except OSError:
                pass
            fail(file, error)
            self._checked()
            return False

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        self.file, self.columns, self.stuck = None, None, False


def _truncate_to_last_line(raw: BinaryIO, size: int) -> None:
    """Cut the file open in ``raw`` just after its last newline (to nothing if it has none)."""
    position = size
    while position > 0:
        start = max(0, position - 4096)
        raw.seek(start)
        chunk = raw.read(position - start)
        at = chunk.rfind(b"\n")
        if at >= 0:
            raw.truncate(start + at + 1)
            return
        position = start
    raw.truncate(0)


def _cell(value: Any) -> Any:
    return "" if value is None else value
