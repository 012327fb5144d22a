"""Smoke runs: ``HOOKFIT_SMOKE=1 python train.py`` or ``Loop(smoke=True)``.

The first thing to do with a new script: one epoch of two training batches and two
validation batches, through every plugin, in a temporary run folder that is removed
afterwards (so nothing is kept: no metrics log, no checkpoint, no resume from an earlier run;
the folder of a smoke run that was killed is removed by the next one),
then a report on stderr of what ran: how it ended, what each step function returned, and each
plugin with the events it handled. A plugin that writes files somewhere of its own choosing
reads ``loop.smoke`` and keeps them in ``loop.run_dir`` instead. What the run returns
(``loop.state.results``) points at nothing that was removed: a path into the temporary folder
(``best_checkpoint``, ``last_checkpoint``...) becomes ``None``, and the report names those
results.

The core knows only the flag (``loop.smoke``); this plugin, discovered like every other, makes
the run a smoke run. Its ``configure`` is a ``tryfirst`` wrapper: before every other plugin
configures, it sets the run's bounds (one epoch, no ``max_steps``, a validation every epoch or
after every step as asked), clears ``resume`` and places the temporary folder
(``loop.place_run_dir``); after them (a distributed plugin has sharded the data) it cuts the
data to its first batches and starts watching which plugin handles which event. The report and
the folder's removal come once the run is over and its ``run.jsonl`` written (the folder's
``released`` call). A run that is not a smoke run leaves it out before ``configure`` (its
``inert`` answer for the run; given to ``Loop``, it unregisters itself at ``configure``), so
it costs nothing. Disabled (``HOOKFIT_PLUGINS`` without it, ``enabled = false`` in
``hookfit.toml``), a smoke run fails after ``configure`` naming it, rather than train for real.
"""

from __future__ import annotations

import itertools
import shutil
import sys
import tempfile
import warnings
from collections.abc import Generator, Iterable, Iterator, Mapping, Sized
from os import PathLike
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, cast

from hookfit.config import records_options
from hookfit.data import length
from hookfit.errors import HookfitWarning, user_level
from hookfit.manager import hookimpl
from hookfit.locks import LOCK, FolderInUse, FolderLock

if TYPE_CHECKING:  # pragma: no cover
    from hookfit.run import Run

__all__ = ["BATCHES", "PREFIX", "FirstBatches", "Smoke", "remove_abandoned"]

NAME = "smoke"
BATCHES = 2
"""Batches of each stage in a smoke run."""
PREFIX = "hookfit-smoke-"
"""The name of every smoke run's temporary folder begins so (in :func:`tempfile.gettempdir`)."""


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
                          f"({type(error).__name__}: {error})", HookfitWarning, stacklevel=user_level())
        finally:
            lock.release()
    return removed


@records_options
class Smoke:
    """Makes a run that asks for it (``loop.smoke``) a smoke run: a temporary folder, one epoch
    of the first batches of the data once plugins have set it up, and the report."""

    name = NAME

    def __init__(self) -> None:
        self.folder: Path | None = None
        self.lock: FolderLock | None = None
        self.handled: dict[str, set[str]] = {}  # plugin -> events it handled
        self.returned: dict[str, set[str]] = {}  # stage -> keys the step returned
        self._undo: Callable[[], None] | None = None

    def inert(self, chosen: bool, loop: Run | None = None) -> str | None:
        """What ``hookfit plugins`` says of it (:func:`hookfit.discovery.inert`): it takes part
        in smoke runs only, which a run asking (``loop``) says it is or not."""
        if loop is not None and loop.smoke:
            return None
        return "a smoke run is asked: Loop(smoke=True), or HOOKFIT_SMOKE=1"

    @hookimpl(wrapper=True, tryfirst=True)
    def configure(self, loop: Run) -> Generator[None, None, None]:
        if not loop.smoke:
            loop.pm.unregister(self)  # not a smoke run: none of the hooks below costs anything
            return (yield)
        self.start(loop)
        result = yield
        self.watch(loop)  # the data as configure left it (sharded), cut short
        return result

    def start(self, loop: Run) -> None:
        """Before any other plugin configures: the folder, the bounds, no resume."""
        remove_abandoned()
        self.folder = Path(tempfile.mkdtemp(prefix=PREFIX))
        self.lock = FolderLock(self.folder, "hookfit smoke")
        self.lock.acquire("this smoke run")  # held while it runs: a later smoke run leaves it alone
        self.handled, self.returned, self._undo = {}, {}, None
        loop.smoke_by = loop.pm.get_name(self) or NAME
        loop.place_run_dir(self.folder, released=lambda: self.finish(loop))
        loop.max_epochs, loop.max_steps = 1, None  # one epoch, validated: inside training too when asked
        if loop.val_every_n_epochs is not None:
            loop.val_every_n_epochs = 1
        if loop.val_every_n_steps is not None:
            loop.val_every_n_steps = 1
        loop.resume = None  # a smoke run resumes nothing

    def watch(self, loop: Run) -> None:
        """After every plugin configured: cut the data to its first batches, and watch which
        plugin handles which event."""
        loop.train_data = _first(loop.train_data)
        loop.val_data = _first(loop.val_data)

        def before(hook: str, impls: list[Any], kwargs: dict[str, Any]) -> None:
            for impl in impls:
                self.handled.setdefault(impl.plugin_name, set()).add(hook)

        self._undo = loop.pm.add_hookcall_monitoring(before, lambda *args: None)

    @hookimpl
    def step_output(self, loop: Run, output: Mapping[str, Any]) -> None:
        if loop.state.stage is not None:
            self.returned.setdefault(loop.state.stage, set()).update(map(str, output))

    def finish(self, loop: Run) -> None:
        """The run is over and its folder released: stop watching, report, remove the folder."""
        if self._undo is not None:
            self._undo()
            self._undo = None
        try:
            gone = self.forget(loop)
            self.report(loop)
            if gone:
                print(f"hookfit smoke: results that pointed into the temporary folder are None: {', '.join(gone)}",
                      file=sys.stderr, flush=True)
        finally:
            if self.lock is not None:
                self.lock.release()
            if self.folder is not None:
                shutil.rmtree(self.folder, ignore_errors=True)
            self.lock = self.folder = None

    def forget(self, loop: Run) -> list[str]:
        """Set to ``None`` every path in ``loop.state.results`` (at any depth of its mappings and
        lists) that lies in the temporary folder, which is about to be removed; return the
        names of the results that had one."""
        folder = self.folder
        if folder is None:
            return []
        root = folder.resolve()
        results, gone = {}, []
        for key, value in loop.state.results.items():
            results[key] = kept = _outside(value, root)
            if kept is not value:
                gone.append(key)
        if gone:
            loop.state.results = MappingProxyType(results)
        return gone

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
        me = run.smoke_by
        registered = run.pm.participants()
        names = [name for name in registered if name != me]  # the report's own plugin is not what ran
        print(f"hookfit smoke: plugins ({len(names)}), with the events each handled:", file=out)
        for name in names:
            events = sorted(self.handled.get(name, ())) or ["none"]
            print(f"hookfit smoke:   {name}: {', '.join(events)}", file=out)
        helpers = sorted(set(self.handled) - set(registered) - {me})  # registered by plugins themselves
        for name in helpers:
            print(f"hookfit smoke:   {name} (registered by a plugin): {', '.join(sorted(self.handled[name]))}",
                  file=out)
        out.flush()


def _outside(value: Any, root: Path) -> Any:
    """``value`` with every path (a string or a path object) inside ``root`` replaced by
    ``None``, through mappings, lists and tuples; ``value`` itself when nothing changed."""
    if isinstance(value, (str, PathLike)):
        try:
            inside = Path(value).resolve().is_relative_to(root)
        except (OSError, ValueError, TypeError):
            return value
        return None if inside else value
    if isinstance(value, Mapping):
        items = {k: _outside(v, root) for k, v in value.items()}
        return items if any(items[k] is not v for k, v in value.items()) else value
    if isinstance(value, (list, tuple)):
        parts = [_outside(v, root) for v in value]
        return type(value)(parts) if any(a is not b for a, b in zip(parts, value)) else value
    return value
