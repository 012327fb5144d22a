"""A run's folder and its record: where the files of a run go (``runs/<name>/<date>-<time>``
unless ``Loop(run_dir=...)`` says otherwise), and ``run.jsonl`` in it, one ``"run"`` line as a
``fit()`` starts writing there and one ``"end"`` line when it ends, read back by
:mod:`hookfit.tools.runs` (``hookfit runs``)."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import hookfit
from hookfit.files import RunFile

if TYPE_CHECKING:  # pragma: no cover
    from hookfit.run import Run

__all__ = ["RUNS", "RunFolder", "script_name"]

RUNS = Path("runs")
"""Where runs keep their folders unless ``Loop(run_dir=...)`` says otherwise:
``runs/<name>/<date>-<time>``."""


def script_name() -> str:
    """The name of the script being run (``train`` for ``python train.py``), ``"run"`` when
    there is none (an interactive session, ``python -c``)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None) or (sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c") else None)
    stem = Path(path).stem if path else ""
    if stem == "__main__" and path:  # python -m package: the package's name
        stem = Path(path).parent.name
    return stem or "run"


class RunFolder:
    """The folder of one run and its ``run.jsonl``: created on first use, so a run that writes
    nothing gets no folder."""

    def __init__(self, run: Run, given: Path | None) -> None:
        self.run = run
        self.folder = given
        self.given = given is not None
        self.used = False
        self.log: RunFile | None = None  # run.jsonl, once the run has a folder

    @property
    def path(self) -> Path:
        if self.folder is None:
            self.folder = self.new()
        if not self.used:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.used = True
            self.record_start(self.folder)
        return self.folder

    def new(self) -> Path:
        """A folder for a new run of this name that does not exist yet:
        ``runs/<name>/<date>-<time>`` (with ``-2``, ``-3``... if that one is taken)."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        base = (RUNS / self.run.name / stamp).absolute()
        candidate, n = base, 1
        while candidate.exists():
            n += 1
            candidate = base.with_name(f"{stamp}-{n}")
        return candidate

    def continue_in(self, folder: str | os.PathLike[str]) -> None:
        """See :meth:`hookfit.run.Run.continue_in`."""
        folder = Path(folder)
        if self.given and self.folder is not None and folder.resolve() != self.folder.resolve():
            raise ValueError(f"continue_in({str(folder)!r}): this run's folder is run_dir={str(self.folder)!r}")
        if self.used and (self.folder is None or folder.resolve() != self.folder.resolve()):
            raise RuntimeError(f"continue_in({str(folder)!r}): the run already writes to {self.folder}; "
                               "call it at configure, before any plugin uses loop.run_dir")
        self.folder = folder

    def record_start(self, folder: Path) -> None:
        """One line in ``run.jsonl`` for this ``fit()`` (a resumed run adds its own): what made
        the run, for a person or a tool looking at it later, with the ``pid`` and ``host`` of
        the process, so a reader can tell a live run from a dead one (:mod:`hookfit.tools.runs`).
        Main process only."""
        run = self.run
        if not run.is_main:
            return
        record = {
            "event": "run", "name": run.name, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "argv": list(sys.argv), "seed": run.seed, "deterministic": run.deterministic,
            "resume": run.resume, "max_epochs": run.max_epochs, "max_steps": run.max_steps,
            "pid": os.getpid(), "host": socket.gethostname(),
            "plugins": run.pm.participants(),
            "versions": {"hookfit": hookfit.__version__, "torch": torch.__version__, "python": sys.version.split()[0]},
        }
        self.log = log = RunFile(folder / "run.jsonl", "hookfit")
        log.write(json.dumps(record) + "\n")
        log.close()

    def record_end(self) -> None:
        """The ``"end"`` line of this ``fit()``, after ``fit_end`` (so the status is final):
        ``status``, ``reason``, ``by``, ``duration`` (seconds, as ``state.elapsed``),
        ``epochs`` (counted from 1, as printed), ``steps``, ``time_split`` (``{stage: {"data":
        s, "step": s, "plugins": s, "batches": n}}``, see :class:`hookfit.payloads.TimeSplit`)
        and ``pid``. Main process only, and only when the run has a folder (a plugin used
        ``run_dir``). Written through the same :class:`hookfit.files.RunFile` as the start
        line, so a folder that cannot be written warns once, not twice."""
        log = self.log
        if log is None or not self.run.is_main:
            return
        state = self.run.state
        record = {
            "event": "end", "status": state.status, "reason": state.stop_reason, "by": state.stopped_by,
            "duration": round(state.elapsed, 3), "epochs": state.epoch + 1, "steps": state.step,
            "time_split": {stage: split.as_dict() for stage, split in state.time_split.items()},
            "pid": os.getpid(),
        }
        log.write(json.dumps(record) + "\n")
        log.close()
