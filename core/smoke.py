"""Smoke runs: ``HOOKFIT_SMOKE=1 python train.py`` or ``Loop(smoke=True)``.

The first thing to do with a new script: one epoch of two training batches and two
validation batches, through every plugin, in a temporary run folder that is removed
afterwards (so nothing is kept: no metrics log, no checkpoint, no resume from an earlier run;
the folder of a smoke run that was killed is removed by the next one),
then a report on stderr of what ran: how it ended, what each step function returned, and each
plugin with the events it handled. A plugin that writes files somewhere of its own choosing
reads ``loop.smoke`` and keeps them in ``loop.run_dir`` instead.
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sized
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, cast

from hookfit.data import length
from hookfit.manager import HookfitWarning, hookimpl
from hookfit.records import LOCK, FolderInUse, FolderLock

if TYPE_CHECKING:  # pragma: no cover
    from hookfit.run import Run

__all__ = ["BATCHES", "ENV_SMOKE", "PREFIX", "FirstBatches", "Smoke", "remove_abandoned", "wanted"]

ENV_SMOKE = "HOOKFIT_SMOKE"
BATCHES = 2
"""Batches of each stage in a smoke run."""
PREFIX = "hookfit-smoke-"
"""The name of every smoke run's temporary folder begins so (in :func:`tempfile.gettempdir`)."""
WATCH = "hookfit.smoke"  # the name the report's own watcher is registered under


def wanted(smoke: bool | None) -> bool:
    """``Loop(smoke=...)``, else whether ``HOOKFIT_SMOKE`` is set to a true value."""
    if smoke is not None:
        return smoke
    return os.environ.get(ENV_SMOKE, "").strip().lower() in ("1", "true", "yes", "on")


class FirstBatches:
    """The first ``n`` batches of ``data``; without a length, as ``data`` is (see
    :class:`SizedFirstBatches`)."""

    def __init__(self, data: Iterable[Any], n: int) -> None:
        self.data = data
        self.n = n

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.data), self.n)


class SizedFirstBatches(FirstBatches):
    """The first ``n`` batches of data that has a length."""

    def __len__(self) -> int:
        return min(self.n, len(cast(Sized, self.data)))  # made only for data with __len__ (_first)


def _first(data: Any) -> Any:
    if data is None:
        return None
    if isinstance(data, Mapping):  # several validation sets: the first batches of each
        return {name: _first(part) for name, part in data.items()}
    return (FirstBatches if length(data) is None else SizedFirstBatches)(data, BATCHES)


def remove_abandoned(where: str | None = None) -> list[Path]:
    """Remove the temporary folders of smoke runs that were killed before they could (their
    process is gone, so nothing holds the folder's lock any more); returns them. A folder of a
    live smoke run is locked and left alone, as is one without a lock file (a smoke run
    between making its folder and locking it)."""
    removed = []
    for folder in Path(where or tempfile.gettempdir()).glob(PREFIX + "*"):
        if folder.is_symlink() or not (folder / LOCK).is_file():
            continue
        lock = FolderLock(folder, "hookfit smoke")
        try:
            lock.acquire()
        except (FolderInUse, OSError):
            continue
        try:
            shutil.rmtree(folder)
            removed.append(folder)
        except OSError as error:
            warnings.warn(f"hookfit smoke: could not remove {folder}, a killed smoke run's temporary folder "
                          f"({type(error).__name__}: {error})", HookfitWarning, stacklevel=3)
        finally:
            lock.release()
    return removed


class _Watch:
    """Registered during a smoke run so that step outputs go through an event call the
    report's monitor sees; it does nothing itself."""

    @hookimpl
    def step_output(self, output: Any) -> None:
        pass


class Smoke:
    """What a smoke run adds to a :class:`hookfit.run.Run`: a temporary folder, the first
    batches of the data once plugins have set it up, and the report."""

    def __init__(self) -> None:
        remove_abandoned()
        self.folder = Path(tempfile.mkdtemp(prefix=PREFIX))
        self.lock = FolderLock(self.folder, "hookfit smoke")
        self.lock.acquire("this smoke run")  # held while it runs: a later smoke run leaves it alone
        self.handled: dict[str, set[str]] = {}  # plugin -> events it handled
        self.returned: dict[str, set[str]] = {}  # stage -> keys the step returned
        self._undo: Callable[[], None] | None = None

    def start(self, run: Run) -> None:
        """After ``configure`` (a distributed plugin has sharded the data): cut the data to
        its first batches, and watch which plugin handles which event."""
        run.train_data = _first(run.train_data)
        run.val_data = _first(run.val_data)

        pm = run.pm
        assert pm is not None
        watch = _Watch()
        pm.register(watch, name=WATCH)

        def before(hook: str, impls: list[Any], kwargs: dict[str, Any]) -> None:
            for impl in impls:
                self.handled.setdefault(impl.plugin_name, set()).add(hook)
            if hook == "step_output" and run.state.stage is not None:
                self.returned.setdefault(run.state.stage, set()).update(map(str, kwargs["output"]))

        undo = pm.add_hookcall_monitoring(before, lambda *args: None)

        def stop() -> None:
            undo()
            pm.unregister(watch)

        self._undo = stop

    def finish(self, run: Run) -> None:
        """Report, stop watching and remove the folder."""
        if self._undo is not None:
            self._undo()
            self._undo = None
        try:
            self.report(run)
        finally:
            self.lock.release()
            shutil.rmtree(self.folder, ignore_errors=True)

    def report(self, run: Run, stream: Any = None) -> None:
        out = stream if stream is not None else sys.stderr
        state = run.state
        seconds = (state.ended_at or 0) - (state.started_at or 0)
        validated = run.val_step is not None
        how = state.status if state.status != "failed" else f"failed: {state.stop_reason}"
        print(f"hookfit smoke: {how} after {state.step} training batch(es)"
              f"{' and validation' if validated and 'valid' in self.returned else ''} in {seconds:.2f} s "
              f"(at most {BATCHES} batches a stage, 1 epoch); nothing was kept: the run folder was temporary",
              file=out)
        for stage, step in (("train", run.train_step), ("valid", run.val_step)):
            if step is None:
                continue
            name = getattr(step, "__qualname__", repr(step))
            keys = ", ".join(sorted(self.returned.get(stage, ()))) or "nothing to report"
            print(f"hookfit smoke: {stage} step {name!r} returned: {keys}", file=out)
        names = run.pm.participants() if run.pm is not None else []
        print(f"hookfit smoke: plugins ({len(names)}), with the events each handled:", file=out)
        for name in names:
            events = sorted(self.handled.get(name, ())) or ["none"]
            print(f"hookfit smoke:   {name}: {', '.join(events)}", file=out)
        helpers = sorted(set(self.handled) - set(names) - {WATCH})  # registered by plugins themselves
        for name in helpers:
            print(f"hookfit smoke:   {name} (registered by a plugin): {', '.join(sorted(self.handled[name]))}",
                  file=out)
        out.flush()
