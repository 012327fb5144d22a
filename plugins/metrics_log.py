"""metrics_log: the run's metric log, ``metrics.jsonl`` in the run folder, written from the
events alone.

On by default, like every built-in; ``Loop(disable=["metrics_log"])`` or
``HOOKFIT_DISABLE_PLUGINS=metrics_log`` leaves it out. It knows no metrics plugin: every line
comes from the metrics role's events (``metrics_update``, ``epoch_metrics``) and the core's
(``resumed``, ``fit_end``), so a metrics plugin that publishes nothing but
:class:`~hookfit.payloads.MetricsSnapshot` objects, the built-in ``metrics`` or a replacement,
gets the same file. ``hookfit runs``, ``hookfit show`` and ``hookfit compare`` read their
metrics from it.

The format: one JSON object a line, appended (a resumed run continuing in the same folder adds
to what the earlier run wrote); ``epoch`` counts from 1 in every line, as everything written for
people does:

* ``{"event": "resume", "from": <checkpoint>, "epoch": <epoch>, "batch": <training batches of
  that epoch already done>, "step": <global step>}`` where a resumed run continues
  (``resumed``).
* ``{"event": "best", "metrics": {"<stage>/<name>": "min" | "max", ...}}``: which value of each
  metric is best, as the snapshots carry it (:attr:`~hookfit.payloads.MetricsSnapshot.best`,
  configured by the user, never guessed), for every stage seen so far, in the order the
  snapshots give them (the built-in metrics plugin's: the order of ``Metrics(best=...)``, then
  ``loss``); written before the first row whose snapshot has directions, and again whenever
  they change. A reader takes the last such line; its first metric that is not a loss, a
  validation one first, is the one a run is judged by (:func:`hookfit.tools.runs.default_metric`).
* ``{"event": "epoch", **snapshot.row()}`` for every ``epoch_metrics`` snapshot: ``stage``,
  ``epoch``, ``step`` (the global step the stage ended at), ``batches``, ``samples``,
  ``time`` (seconds in the stage), ``samples_per_s``, each metric's epoch mean by name, and
  ``lr_<optimizer>``. A stage a stop cut short (a stop request, ``max_steps``) has its row too,
  with the ``batches`` it got, and ``"stopped": true`` where the stop interrupted the run
  (status ``"interrupted"``) before the stage's last batch (its length unknown: anywhere in it):
  the mean of some of the batches, never a run's best
  (:func:`hookfit.plugins.support.best.cut_short`); a resumed
  run that completes that epoch writes the epoch's row again, whole, after its ``resume`` line:
  a reader takes the last row of a stage's epoch.
* ``{"event": "step", **snapshot.row()}`` with ``every_n_steps=N``: at the first training
  ``metrics_update`` at or after every N-th training step; the epoch means so far. A metrics
  plugin publishes at a bounded rate, the built-in at most every ``Metrics(interval=0.5)``
  seconds: lines are at least that far apart, and a run shorter than that may have none.
  ``Metrics(interval=0)`` publishes after every batch, so every N-th step has its line.
* ``{"event": "checkpoint", "step": <global step>, "reason": ..., "file": <its name>}`` for
  every checkpoint written (``checkpoint_saved``, the checkpoint role's event): ``hookfit
  show`` draws its ``C`` mark. It is written when the file is whole, so a checkpoint written in the
  background may come after lines of later steps: its ``step`` says which step it holds.
* ``{"event": "start"}`` where a fit that does not resume (``resume=None``) begins writing into
  a log that holds lines already (a script run again in its ``run_dir``): a new history begins,
  and readers take the lines after the last such line (:func:`hookfit.tools.runs.current`), as
  they take the fits of ``run.jsonl`` from its last ``"run"`` line with ``"resume": null``.
* ``{"event": "end", "status": ..., "reason": ..., "by": ..., "epoch": <epoch the run was in>,
  "step": ..., "time": <seconds>, "skipped": <optimizer steps skipped in this fit()>,
  "skipped_reason": <why the last one was, or null>}`` when the run ends (``fit_end``,
  ``trylast``: after the metrics plugin published a partial last stage), whatever happened;
  the skipped steps are counted from ``step_skipped`` (the optimizer role's event).

An evaluation (``Loop.validate()``) writes the same lines, each with ``"evaluation": true``: in
the folder of the run it evaluates (the same ``run_dir``) they are not the run's (its resume
line is not a resume of it), and ``hookfit runs``, ``show`` and ``compare`` leave them out there.

Only the main process writes (``loop.is_main``). The file is a
:class:`hookfit.files.RunFile`: flushed a line at a time, so what a killed run wrote stays; a
full disk or a read-only run folder warns once (:class:`~hookfit.files.FileWarning`, naming
this plugin and the file) and training goes on without it. An observer: if it fails otherwise,
it is switched off with one warning and the run goes on.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from hookfit import hookimpl
from hookfit.config import records_options
from hookfit.files import RunFile
from hookfit.payloads import MetricsSnapshot, ResumeInfo
from hookfit.plugins.support.logger import run_file
from hookfit.plugins.support import Every
from hookfit.plugins.support.best import cut_short

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

__all__ = ["FILENAME", "MetricsLog"]

FILENAME = "metrics.jsonl"
"""The log's name in the run folder."""


@records_options
class MetricsLog:
    """Writes the run's metric log, ``metrics.jsonl`` (the module's documentation has its format).

    * ``every_n_steps``: also a step line at the first publication at or after every N-th
      training step; publications come at most every ``Metrics(interval=0.5)`` seconds, so a
      fast run gets fewer (``Metrics(interval=0)``: one after every batch, and every line).
    """

    name = "metrics_log"
    observer = True

    def __init__(self, every_n_steps: int | None = None) -> None:
        self._steps = Every(every_n_steps, plugin=self.name, option="every_n_steps",
                            meaning="training steps between step lines of metrics.jsonl")
        self.every_n_steps = every_n_steps
        self._file: RunFile | None = None
        self._started = False
        self._last_step = 0  # the step of the last step line (or where the run resumed)
        self._directions: dict[str, str] = {}
        self._written: dict[str, str] = {}
        self._skipped = 0  # optimizer steps skipped in this fit() (step_skipped)
        self._skip_reason: str | None = None  # why the last one was

    @hookimpl
    def fit_start(self) -> None:
        self._started = True  # a run that fails before it (in configure) leaves no log
        self._last_step, self._directions, self._written = 0, {}, {}
        self._skipped, self._skip_reason = 0, None

    @hookimpl
    def step_skipped(self, reason: str) -> None:
        self._skipped += 1
        self._skip_reason = reason

    @hookimpl
    def resumed(self, loop: Run, info: ResumeInfo) -> None:
        self._last_step = info.step
        self._write(loop, {"event": "resume", "from": info.source, "epoch": info.epoch + 1,
                           "batch": info.batch, "step": info.step})

    @hookimpl(optionalhook=True)
    def metrics_update(self, loop: Run, stage: str, metrics: MetricsSnapshot) -> None:
        if stage != "train" or not self._steps.between(self._last_step, metrics.step):
            return
        self._last_step = metrics.step
        self._row(loop, "step", metrics)

    @hookimpl(optionalhook=True)
    def checkpoint_saved(self, loop: Run, path: str, reason: str, step: int) -> None:
        self._write(loop, {"event": "checkpoint", "step": step, "reason": reason, "file": os.path.basename(path)})

    @hookimpl(optionalhook=True)
    def epoch_metrics(self, loop: Run, metrics: MetricsSnapshot) -> None:
        self._row(loop, "epoch", metrics)

    @hookimpl(trylast=True)  # after the metrics plugin's fit_end, which publishes a stage cut short
    def fit_end(self, loop: Run) -> None:
        try:
            if self._started:
                state = loop.state
                self._write(loop, {"event": "end", "status": state.status, "reason": state.stop_reason,
                                   "by": state.stopped_by, "epoch": state.epoch + 1, "step": state.step,
                                   "time": round(state.elapsed, 3), "skipped": self._skipped,
                                   "skipped_reason": self._skip_reason})
        finally:
            if self._file is not None:
                self._file.close()
            self._file, self._started = None, False

    def _row(self, loop: Run, event: str, metrics: MetricsSnapshot) -> None:
        """A row, after a ``best`` line when the snapshot brings directions not yet written."""
        if metrics.best:
            self._directions.update({f"{metrics.stage}/{name}": mode for name, mode in metrics.best.items()})
            if self._directions != self._written:
                self._written = dict(self._directions)
                self._write(loop, {"event": "best", "metrics": self._written})
        cut = {"stopped": True} if cut_short(loop, metrics) else {}
        self._write(loop, {"event": event, **metrics.row(), **cut})

    def _write(self, loop: Run, record: dict[str, Any]) -> None:
        if not loop.is_main:
            return
        if loop.mode != "fit":  # Loop.validate()'s: not a line of the run whose folder it may share
            record["evaluation"] = True
        if self._file is None:
            self._file = run_file(loop, FILENAME, self.name)
            if loop.mode == "fit" and loop.resume is None and _holds_lines(self._file.path):
                self._file.write(json.dumps({"event": "start"}) + "\n")  # a new history in a used folder
        self._file.write(json.dumps(record, default=float) + "\n")


def _holds_lines(path: os.PathLike[str]) -> bool:
    try:
        return os.path.getsize(path) > 0
    except OSError:
        return False
