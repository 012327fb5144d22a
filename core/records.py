"""A run's identity, folder and record: where the files of a run go (``runs/<name>/<date>-<time>``
unless ``Loop(run_dir=...)`` says otherwise), ``run.jsonl`` in it, one ``"run"`` line as a
``fit()`` starts writing there, a ``"warning"`` line for each warning it showed
(:mod:`hookfit.runwarnings`) and one ``"end"`` line, the last, when it ends, read back by
:mod:`hookfit.tools.runs` (``hookfit runs``), and the lock that keeps a second process out of
a folder a live run writes (:mod:`hookfit.locks`).

**Identity.** A run's name is what its folder is called (``train`` for ``python train.py``);
its *identity* is what ``resume="latest"`` matches: the script's absolute path (so
``experiments/a/train.py`` and ``experiments/b/train.py`` share ``runs/train/`` but never each
other's "latest"), a notebook's path (``JPY_SESSION_NAME``, VS Code's ``__vsc_ipynb_file__``;
the run is named after the notebook), or, for a kernel that names no notebook, that kernel
alone (``kernel:<host>:<pid>``). ``Loop(name=...)`` and ``Loop(run_dir=...)`` name the identity
themselves: every run of that name, or in that folder, is one identity. The identity is stored
in ``run.jsonl``; a run written before identities were recorded matches any identity of its
name, as it always did.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable

import torch

import hookfit
from hookfit.errors import user_level
from hookfit.files import FileWarning, RunFile, folder_found, folder_lost
from hookfit.locks import LOCK, FolderInUse, FolderLock
from hookfit.runwarnings import WarningRecorder

if TYPE_CHECKING:  # pragma: no cover
    from hookfit.loop import Loop
    from hookfit.run import Run

__all__ = ["RUNS", "Identity", "RunFolder", "identify", "kernel_notebook", "recorded_identity", "script_name"]

RUNS = Path("runs")
"""Where runs keep their folders unless ``Loop(run_dir=...)`` says otherwise:
``runs/<name>/<date>-<time>``."""

KERNEL_NAME = "notebook"
"""The name of a run started from a Jupyter kernel that names no notebook."""


class Identity:
    """Who a run is: ``name`` (its folder under ``runs/``), ``key`` (what ``resume="latest"``
    matches, stored in ``run.jsonl``) and ``explicit`` (``Loop(name=...)`` or
    ``Loop(run_dir=...)``: the name alone is the identity, and every run of it matches)."""

    __slots__ = ("explicit", "key", "name")

    def __init__(self, name: str, key: str, explicit: bool = False) -> None:
        self.name = name
        self.key = key
        self.explicit = explicit

    def matches(self, recorded: str | None) -> bool:
        """Whether a run whose ``run.jsonl`` records the identity ``recorded`` (``None``: one
        written before identities were recorded) is a run of this identity."""
        return self.explicit or recorded is None or recorded == self.key

    def __repr__(self) -> str:
        return f"Identity({self.name!r}, {self.key!r}, explicit={self.explicit})"


def _notebook(main: Any) -> str | None:
    """The path of the notebook this process runs, if it says: VS Code's
    ``__vsc_ipynb_file__`` in the notebook's namespace, else Jupyter's ``JPY_SESSION_NAME``."""
    namespaces = [getattr(main, "__dict__", {})]
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    shell = get() if callable(get) else None
    if shell is not None and isinstance(getattr(shell, "user_ns", None), dict):
        namespaces.append(shell.user_ns)
    for namespace in namespaces:
        path = namespace.get("__vsc_ipynb_file__")
        if isinstance(path, str) and path.strip():
            return path
    path = os.environ.get("JPY_SESSION_NAME", "").strip()
    return path or None


def kernel_notebook() -> Path | None:
    """The notebook this process runs as its Jupyter kernel, where the kernel names one that is a
    file (the path the run's identity is taken from: VS Code's ``__vsc_ipynb_file__``, else
    ``JPY_SESSION_NAME``; a relative one from the current folder), else ``None``: a run's
    ``hookfit.toml`` is looked for next to it (:func:`hookfit.config.find`), whatever folder the kernel
    started in. A script that a notebook starts (``!python train.py``) is not in the kernel: its own."""
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c") else None
    notebook = _notebook(sys.modules.get("__main__"))
    if notebook is None or not _in_kernel(argv0):
        return None
    path = Path(notebook).expanduser()
    return path if path.is_file() else None


def _in_kernel(argv0: str | None) -> bool:
    """Whether this process is a Jupyter (IPython) kernel."""
    if argv0 and Path(argv0).stem == "ipykernel_launcher":
        return True
    return "ipykernel" in sys.modules and "ipykernel.kernelapp" in sys.modules


def identify(config: Loop) -> Identity:
    """The identity of a run of ``config``: ``Loop(name=...)``, else ``Loop(run_dir=...)``'s
    folder, else the notebook's or the script's path (see the module's documentation)."""
    if config.name:
        return Identity(config.name, f"name:{config.name}", explicit=True)
    if config.run_dir is not None:
        return Identity(config.run_dir.name, f"dir:{config.run_dir.absolute()}", explicit=True)
    main = sys.modules.get("__main__")
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c") else None
    notebook = _notebook(main)
    if notebook is not None:
        path = Path(notebook).expanduser()
        key = str(path.absolute()) if path.is_absolute() else notebook
        return Identity(path.stem or KERNEL_NAME, f"notebook:{key}")
    if _in_kernel(argv0):  # a kernel that names no notebook: only itself
        return Identity(KERNEL_NAME, f"kernel:{socket.gethostname()}:{os.getpid()}")
    name = script_name()
    file = getattr(main, "__file__", None) or argv0
    if not file:
        return Identity(name, f"interactive:{name}")
    return Identity(name, str(Path(file).absolute().resolve()))


def script_name() -> str:
    """The name of the script being run (``train`` for ``python train.py``), ``"run"`` when
    there is none (an interactive session, ``python -c``)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None) or (sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c") else None)
    stem = Path(path).stem if path else ""
    if stem == "__main__" and path:  # python -m package: the package's name
        stem = Path(path).parent.name
    return stem or "run"


def recorded_identity(folder: Path) -> str | None:
    """The identity the first ``"run"`` line of ``folder``'s ``run.jsonl`` records, ``None``
    when it records none (a run from before identities, or no ``run.jsonl``); read with the
    run commands' care (:func:`hookfit.tools.runs.read_jsonl`)."""
    from hookfit.tools.runs import read_jsonl

    for line in read_jsonl(folder / "run.jsonl"):
        if line.get("event") == "run":
            found = line.get("identity")
            return found if isinstance(found, str) else None
    return None


ASIDE_FOLDER = re.compile(r"earlier-run-(\d+)")
"""The name of a subfolder that holds what a run set aside of an earlier run, in the run folder or in a subfolder
of it (``checkpoints/earlier-run-N/``)."""
ASIDE_FILE = re.compile(r".+\.earlier-run-(\d+)\.[^.]+")
"""The name of a file that a run set aside of an earlier run in the run folder (``metrics.earlier-run-N.csv``)."""


def earlier_numbers(folder: Path) -> set[int]:
    """The ``N`` of the names hookfit gives what runs set aside in the run folder ``folder``: its subfolders
    ``earlier-run-N`` and those of its subfolders (:data:`ASIDE_FOLDER`), and its files ``<name>.earlier-run-N.<ext>``
    (:data:`ASIDE_FILE`); no other name counts, whatever it holds (a user's ``data/earlier-run-20261130.npz``)."""
    def entries(where: Path) -> list[str]:
        try:
            return os.listdir(where)
        except OSError:  # (missing, or not to be listed: the moves there say so)
            return []

    found: set[int] = set()
    for entry in entries(folder):
        path = folder / entry
        if (aside := ASIDE_FOLDER.fullmatch(entry) or ASIDE_FILE.fullmatch(entry)) is not None:
            found.add(int(aside[1]))
        elif path.is_dir():
            found |= {int(aside[1]) for sub in entries(path)
                      if (aside := ASIDE_FOLDER.fullmatch(sub)) is not None and (path / sub).is_dir()}
    return found


class RunFolder:
    """The folder of one run and its ``run.jsonl``: created on first use, so a run that writes
    nothing gets no folder. The main process locks it on first use (:class:`FolderLock`) until
    :meth:`record_end`, unless a plugin placed it (:meth:`place`: that plugin holds the folder).
    A folder that cannot be created (a read-only parent, a script started
    from a read-only folder) is said once in a :class:`~hookfit.files.FileWarning` naming it,
    and the run trains on without its files."""

    def __init__(self, run: Run, given: Path | None) -> None:
        self.run = run
        self.folder = given
        self.given = given is not None
        self.used = False
        self.lock_wanted = True
        self.released: list[Callable[[], None]] = []  # what placed folders call at record_end (place)
        self.lock: FolderLock | None = None
        self.refused: FolderInUse | None = None  # raised again at every later use
        self.over = False  # the run ended (record_end): a later use takes no lock and records nothing
        self.log: RunFile | None = None  # run.jsonl, once the run has a folder
        self.earlier: tuple[Path | None, int] | None = None  # (the folder, earlier_run() there), once asked
        self.warned = WarningRecorder(run)  # the run's warnings, as lines of run.jsonl (hookfit.runwarnings)

    @property
    def path(self) -> Path:
        if self.refused is not None:
            raise self.refused
        if self.folder is None:
            try:
                self.folder = self.new()
            except OSError as error:  # runs/ cannot be made (a script started from a read-only folder)
                self.folder = self.planned()
                self._lost(error)
        if not self.used and self.over:  # asked after the run (loop.run.run_dir): a folder, no run in it
            self.folder.mkdir(parents=True, exist_ok=True)
        elif not self.used:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                self._lost(error)
                return self.folder
            self._take_lock()
            self.used = True
            self.run.state.run_dir = self.folder
            self.record_start(self.folder)
        return self.folder

    def claim(self) -> None:
        """At the run's start (after ``configure``), a folder another live process may hold is taken: one an
        evaluation (``Loop.validate()``) was given, and one that has a lock file (a run wrote there: a given
        ``run_dir`` used before, a resumed run's); held, the run is refused here, as the run's error, not where the
        first plugin writes (an observer's error only switches it off). A new folder is made on first use. The
        ``N`` of :meth:`earlier_run` is counted here."""
        if not self.run.is_main:
            return
        self.earlier_run()  # counted before any plugin sets an earlier run's files aside, whichever asks first
        if self.given and self.run.mode != "fit":
            self.path  # noqa: B018 - the lock and run.jsonl's start, or FolderInUse
        elif self.folder is not None and (self.folder / LOCK).is_file():
            self._take_lock()

    def _take_lock(self) -> None:
        if self.lock is None and self.lock_wanted and self.run.is_main and self.folder is not None:
            lock = FolderLock(self.folder, "hookfit")
            try:
                lock.acquire(f"this run ({self.run.identity.name}, pid {os.getpid()})")
            except FolderInUse as error:
                self.refused = error
                raise
            self.lock = lock

    def _lost(self, error: OSError) -> None:
        """The run folder cannot be made: one :class:`~hookfit.files.FileWarning` naming it, and
        the run trains on without it (no lock, no record; the files plugins would write in it
        fail quietly, :func:`hookfit.files.folder_lost`)."""
        assert self.folder is not None
        self.used = True
        folder_lost(self.folder, error)
        warnings.warn(f"hookfit: could not create the run folder {self.folder} ({type(error).__name__}: {error}); "
                      f"the run trains on without the files it would write there (run.jsonl, the metric log, "
                      f"checkpoints, captured output); give Loop(run_dir=...) a folder that can be written",
                      FileWarning, stacklevel=user_level())

    def planned(self) -> Path:
        """Where :meth:`new` makes a new run's folder: ``runs/<name>/<date>-<time>``, absolute."""
        return (RUNS / self.run.name / time.strftime("%Y%m%d-%H%M%S")).absolute()

    def new(self) -> Path:
        """A new folder for a run of this name, made here so that no other process takes it:
        ``runs/<name>/<date>-<time>`` (with ``-2``, ``-3``... if that one is taken)."""
        base = self.planned()
        stamp = base.name
        base.parent.mkdir(parents=True, exist_ok=True)
        candidate, n = base, 1
        while True:
            try:
                candidate.mkdir()
                return candidate
            except FileExistsError:
                n += 1
                candidate = base.with_name(f"{stamp}-{n}")

    def earlier_run(self) -> int:
        """See :attr:`hookfit.run.Run.earlier_run`: counted at the first ask (and again only if the folder was
        changed since), without making the folder."""
        if self.earlier is None or self.earlier[0] != self.folder:
            taken = set() if self.folder is None else earlier_numbers(self.folder)
            self.earlier = (self.folder, 1 + max(taken, default=0))
        return self.earlier[1]

    def continue_in(self, folder: str | os.PathLike[str]) -> None:
        """See :meth:`hookfit.run.Run.continue_in`."""
        folder = Path(folder)
        if self.run.mode != "fit":  # an evaluation never writes into the run it reads
            return
        if self.given and self.folder is not None and folder.resolve() != self.folder.resolve():
            raise ValueError(f"continue_in({str(folder)!r}): this run's folder is run_dir={str(self.folder)!r}")
        if self.used and (self.folder is None or folder.resolve() != self.folder.resolve()):
            raise RuntimeError(f"continue_in({str(folder)!r}): the run already writes to {self.folder}; "
                               "call it at configure, before any plugin uses loop.run_dir")
        self.folder = folder

    def place(self, folder: str | os.PathLike[str], released: Callable[[], None] | None = None) -> None:
        """See :meth:`hookfit.run.Run.place_run_dir`."""
        if self.used:
            raise RuntimeError(f"place_run_dir({str(folder)!r}): the run already writes to {self.folder}; "
                               "call it at configure, before any plugin uses loop.run_dir")
        self.folder, self.given, self.lock_wanted = Path(folder), True, False
        if released is not None:
            self.released.append(released)

    def record_start(self, folder: Path) -> None:
        """One line in ``run.jsonl`` for this ``fit()`` (a resumed run adds its own): what made
        the run, for a person or a tool looking at it later, with the ``pid`` and ``host`` of
        the process, so a reader can tell a live run from a dead one (:mod:`hookfit.tools.runs`),
        its ``identity`` (what ``resume="latest"`` matches) and ``mode`` (``"fit"``, or
        ``"validate"`` for ``Loop.validate()``). Main process only."""
        run = self.run
        if not run.is_main:
            return
        record = {
            "event": "run", "name": run.name, "identity": run.identity.key, "mode": run.mode,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "argv": list(sys.argv), "seed": run.seed, "deterministic": run.deterministic,
            "resume": run.resume, "max_epochs": run.max_epochs, "max_steps": run.max_steps,
            "pid": os.getpid(), "host": socket.gethostname(),
            "plugins": run.pm.participants(),
            "versions": {"hookfit": hookfit.__version__, "torch": torch.__version__, "python": sys.version.split()[0]},
        }
        self.log = log = RunFile(folder / "run.jsonl", "hookfit")
        log.write(json.dumps(record) + "\n")
        log.close()
        self.warned.opened(log)

    def record_end(self) -> None:
        """The ``"end"`` line of this ``fit()``, after ``fit_end`` (so the status is final):
        ``status``, ``reason``, ``by``, ``duration`` (seconds, as ``state.elapsed``),
        ``epochs`` (counted from 1, as printed), ``steps``, ``time_split`` (``{stage: {"data":
        s, "step": s, "plugins": s, "batches": n}}``, see :class:`hookfit.payloads.TimeSplit`),
        ``pid`` and ``results`` (``state.results``, what every plugin reported: the metrics,
        the best checkpoint, the optimizer steps skipped...; paths and other objects as text). Main process only, and only when the run has a folder (a plugin used
        ``run_dir``). Written through the same :class:`hookfit.files.RunFile` as the start
        line, so a folder that cannot be written warns once, not twice. Then the folder's lock
        is released, and the plugin that placed the folder is told (:meth:`place`)."""
        try:
            self.warned.closed()  # the end line is the last
            self._write_end()
        finally:
            self.over = True
            if self.folder is not None:
                folder_found(self.folder)
            if self.lock is not None:
                self.lock.release()
                self.lock = None
            released, self.released = self.released, []
            for callback in released:
                callback()

    def _write_end(self) -> None:
        log = self.log
        if log is None or not self.run.is_main:
            return
        state = self.run.state
        record = {
            "event": "end", "status": state.status, "reason": state.stop_reason, "by": state.stopped_by,
            "duration": round(state.elapsed, 3), "epochs": state.epoch + 1, "steps": state.step,
            "time_split": {stage: split.as_dict() for stage, split in state.time_split.items()},
            "pid": os.getpid(), "results": _plain(state.results),
        }
        log.write(json.dumps(record, default=str) + "\n")
        log.close()


def _plain(value: object) -> object:
    """``value`` as JSON holds it: mappings as objects, sequences as lists, numbers, text and
    ``None`` as they are, anything else as its text (a path)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
