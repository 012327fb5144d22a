"""What the file loggers (``tensorboard``, ``csv``) share: when a discovered logger is on, and
their files in the run folder under :mod:`hookfit.files`' policy."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hookfit.files import FileWarning, RunFile

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run


def wanted(loop: Run, plugin: Any, enabled: bool | None) -> bool:
    """Whether a logger takes part in this run: ``enabled`` when given; else when it was given
    to ``Loop(plugins=[...])`` (or registered by hand) or the configuration file gave it any
    option, and not when it was merely discovered."""
    if enabled is not None:
        return enabled
    infos = getattr(loop.pm, "infos", {})
    info = infos.get(getattr(plugin, "name", ""))
    if info is None or info.plugin is not plugin:
        return True  # registered by hand, not through discovery
    return info.source != "entry point" or bool(info.options)


def run_file(loop: Run, name: str, owner: str, binary: bool = False) -> RunFile:
    """A :class:`~hookfit.files.RunFile` for ``name`` in the run folder. A run folder that
    cannot be made warns once (:class:`~hookfit.files.FileWarning`) and gives a file that
    has failed already, which drops every write."""
    try:
        folder = loop.run_dir  # made on first use: it may fail as a write does
    except OSError as error:
        file = RunFile(Path(name), owner, binary=binary)
        file.failed = error
        warnings.warn(f"{owner}: could not create the run folder for {name} ({type(error).__name__}: "
                      f"{error}); training goes on without it", FileWarning, stacklevel=3)
        return file
    return RunFile(folder / name, owner, binary=binary)


def fail(file: RunFile, error: OSError) -> None:
    """Mark ``file`` failed with one :class:`~hookfit.files.FileWarning`, as
    :class:`~hookfit.files.RunFile` does for a failed write (for what a logger writes around it:
    a rewrite through a temporary file)."""
    file.close()
    file.failed = error
    warnings.warn(
        f"{file.owner}: could not write {file.path} ({type(error).__name__}: {error}); "
        f"it is left as it is and training goes on without it",
        FileWarning,
        stacklevel=3,
    )
