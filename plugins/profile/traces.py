"""A profiler's trace written whole or not at all: the profiler's own export reports no error
when it cannot write (a full disk leaves a torn file behind without a word), so the trace is
exported to a temporary file, checked, copied in under a temporary name and renamed."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from torch.profiler import profile as Profiler

__all__ = ["export", "whole"]


def export(prof: Profiler, path: Path) -> OSError | None:
    """Write the profiler's trace to ``path``: exported to a temporary file, checked, copied
    in under a temporary name and renamed, so ``path`` is whole or absent."""
    temp: str | None = None
    partial = path.with_name(path.name + ".partial")
    try:
        handle, temp = tempfile.mkstemp(prefix="hookfit-profile-", suffix=".pt.trace.json")
        os.close(handle)
        prof.export_chrome_trace(temp)
        if not whole(temp):
            raise OSError(f"the profiler could not export its trace to {temp} (is the temporary folder "
                          f"{tempfile.gettempdir()} full?)")
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copyfile(temp, partial)
            os.replace(partial, path)
        except OSError:
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
            raise
        return None
    except OSError as error:
        return error
    finally:
        if temp is not None:
            with contextlib.suppress(OSError):
                os.unlink(temp)


def whole(path: str) -> bool:
    """Whether an exported trace is complete: a JSON object, so its last character is ``}``."""
    try:
        with open(path, "rb") as file:
            file.seek(0, os.SEEK_END)
            size = file.tell()
            if size == 0:
                return False
            file.seek(max(0, size - 64))
            return file.read().rstrip().endswith(b"}")
    except OSError:
        return False
