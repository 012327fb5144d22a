"""csv: the run's metrics as CSV tables in the run folder, one row per stage of every epoch.

``Loop(plugins=[CSVLogger()])``, or a ``[plugins.csv]`` table in ``hookfit.toml`` (even
empty). Discovered like every plugin, it is inert until then: the run leaves it out before
``configure`` (:func:`hookfit.manager.leave_inert`), so it costs a run nothing.
``CSVLogger(enabled=False)`` switches it off wherever it comes from (given, it unregisters
itself at ``configure``).

Files, in the run folder (``loop.run_dir``):

* ``metrics.csv``: a row at the end of every stage (``epoch_metrics``):
  ``epoch,step,stage``, then the epoch mean of every metric, then the learning rates as
  ``MetricsSnapshot.lr`` names them, ``lr_`` before each (``lr_default`` for one optimizer's
  unnamed first group, ``lr_<optimizer>/<group>`` for a group by its ``"name"`` entry or index):
  the rate the latest step used.
  ``epoch`` counts from 1, as ``metrics.jsonl`` and the console do; ``step`` is the global
  step the stage ended at; ``stage`` is ``train`` or ``valid``, so a run validating inside its
  epochs (``Loop(val_every_n_steps=N)``) simply has more ``valid`` rows.
* An evaluation (``Loop.validate()``) writes ``evaluation.csv`` and ``evaluation_updates.csv``
  instead, the same tables: in the folder of the run it evaluates they leave the run's own alone.
  After the leading columns, ``checkpoint``: the absolute path of the checkpoint evaluated (of
  ``loop.state.resumed_from``'s ``source``, as ``results["last_checkpoint"]`` names it; empty for an
  evaluation of the model's weights as they are), so the evaluations of
  checkpoints of two runs at the same step tell apart; a table written without that column is widened.
* ``metrics_updates.csv``, with ``every_publication=True``: a row at every publication of the
  metrics plugin (``metrics_update``: the built-in publishes at most every
  ``Metrics(interval=0.5)`` seconds, so a run shorter than that may have no row;
  ``Metrics(interval=0)`` publishes after every batch), training and
  validation alike: ``epoch,step,stage,batches`` (batches done in the stage), then the
  *running* mean of every metric, then the learning rates.

The header is stable: the leading columns are fixed, the metric columns come sorted by name,
then the learning rates sorted by optimizer. A cell is empty where a row has no value (a
metric only the validation reports). A metric that appears after the header was written (a
validation-only metric after the first training row, a key a step starts returning later)
adds its column: the file is rewritten once, atomically (a new file replacing the old with
``os.replace``), with the wider header and the earlier rows unchanged, their new cells empty.
So every row always lines up with the header, and ``pandas.read_csv`` reads any state of it.
A metric's name is a column name as the csv module writes it: one with a comma, a quote or a
line break is quoted (every field of a record holding a carriage return is), so any CSV reader
gets the name back as it was, and a run continued in the folder finds its columns. A metric
named as a column of the tables' own (``epoch``, ``step``, ``stage``, ``batches``, a learning
rate's ``lr_<optimizer>``) has the column ``metric.<name>``, said once a run in a
``HookfitWarning``.

A fit that does not continue the tables an earlier run left in its folder (a script run again with
the same ``run_dir`` and no resume, or a ``resume="latest"`` that found no checkpoint) sets them
aside at its first write, the evaluations of that run's checkpoints with them, as
``metrics.earlier-run-1.csv`` and ``evaluation.earlier-run-1.csv`` (``-2`` next, one number for the
tables of one earlier run; never deleted), and starts fresh ones (evaluations in one folder add
their rows to one ``evaluation.csv``, each naming the checkpoint and step it evaluated), with one ``HookfitWarning`` naming both; a run that ends before it
writes (refused at its start) leaves them as they are. A table that cannot be moved is named in a
``FileWarning``, left as it is and not written. A resumed run (``Loop(resume=...)``)
appends to the same files under their header, never repeating it. It first drops
the rows the earlier run wrote after the checkpoint it continues from (a later step, the
validation it is about to run again, and the row of a training stage that a stop cut short,
which the resumed run writes whole at the epoch's end:
:func:`hookfit.plugins.support.logger.written_again`, the rule the ``tensorboard`` plugin keeps
too), so each file reads as the run's that had never stopped, row for row. A
last line cut short (a ``kill -9`` in the middle of a write) is dropped. A file whose header
is not one of these tables is left alone, with a warning, and not written to.

Writes go through :class:`hookfit.files.RunFile` (flushed, one write per row, never per
batch): a full disk or a read-only run folder warns once (``FileWarning``, naming the file
that failed first) and training goes on without the tables: the other table, failing for the
same reason, says nothing more and is written no longer. Only the main process writes.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hookfit import hookimpl
from hookfit.config import records_options
from hookfit.errors import HookfitWarning, user_level
from hookfit.payloads import MetricsSnapshot, ResumeInfo
from hookfit.plugins.support.logger import afresh, set_aside, table_of, wanted, written_again
from hookfit.plugins.support.logger import inert as logger_inert
from hookfit.plugins.support import flag
from hookfit.plugins.support.tables import LR, Failure, Table

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

__all__ = ["EPOCH_COLUMNS", "UPDATE_COLUMNS", "CSVLogger"]

EPOCH_COLUMNS = ("epoch", "step", "stage")
"""The leading columns of ``metrics.csv``."""
UPDATE_COLUMNS = ("epoch", "step", "stage", "batches")
"""The leading columns of ``metrics_updates.csv``."""
CHECKPOINT = "checkpoint"
"""The column of an evaluation's tables, after the leading ones, naming the checkpoint it evaluated."""
RENAMED = "metric."
"""The prefix of the column of a metric named as a column of the tables' own (``metric.step``)."""
TABLES = ("metrics.csv", "metrics_updates.csv", "evaluation.csv", "evaluation_updates.csv")
"""Every table the plugin writes: a fit's, then an evaluation's (``Loop.validate()``)."""


@records_options
class CSVLogger:
    """Writes ``metrics.csv`` (a row per stage of every epoch) and, with
    ``every_publication=True``, ``metrics_updates.csv`` (a row per publication) in the run
    folder (see the module documentation). Options are checked here, with a ``ValueError``
    naming them.

    * ``enabled``: ``None`` (the default): on when given to ``Loop(plugins=[...])`` or
      configured in ``hookfit.toml``, off when only discovered; ``True``/``False`` force it.
    * ``every_publication``: also write a row for every ``metrics_update``, which the built-in
      metrics plugin publishes at most every ``Metrics(interval=0.5)`` seconds
      (``Metrics(interval=0)``: after every batch).
    """

    name = "csv"
    observer = True  # a logger: its failures switch it off, never the run
    inert = logger_inert  # what hookfit plugins says of it (hookfit.discovery.inert)

    def __init__(self, enabled: bool | None = None, every_publication: bool = False) -> None:
        flag(self.name, "enabled", enabled, none=True)
        flag(self.name, "every_publication", every_publication)
        self.enabled = enabled
        self.every_publication = every_publication
        self._failure = Failure()  # one warning a run for both tables
        self._epochs = Table(self.name, "metrics.csv", EPOCH_COLUMNS, self._failure, self._first_write)
        self._updates = Table(self.name, "metrics_updates.csv", UPDATE_COLUMNS, self._failure, self._first_write)
        self._written = False  # whether this run has begun writing (after setting an earlier run's tables aside)
        self._loop: Run | None = None
        self._renamed: set[str] = set()  # metrics named as a column of the tables' own, said this run

    @property
    def path(self) -> os.PathLike[str] | None:
        """``metrics.csv`` of the current or last run (``None`` before one wrote a row)."""
        return self._epochs.path

    @property
    def updates_path(self) -> os.PathLike[str] | None:
        """``metrics_updates.csv`` of the current or last run (``None`` before one wrote a row)."""
        return self._updates.path

    # -- events -------------------------------------------------------------------------------
    @hookimpl
    def configure(self, loop: Run) -> None:
        self._close()
        evaluating = loop.mode != "fit"  # an evaluation's rows are no epochs of the run whose folder it may share
        self._epochs.name = "evaluation.csv" if evaluating else "metrics.csv"
        self._updates.name = "evaluation_updates.csv" if evaluating else "metrics_updates.csv"
        self._epochs.after = self._updates.after = (CHECKPOINT,) if evaluating else ()
        if not wanted(loop, self, self.enabled):
            loop.pm.unregister(self)  # inert: none of the hooks below costs anything

    @hookimpl
    def fit_start(self, loop: Run) -> None:
        self._loop = loop if loop.is_main else None
        self._renamed = set()

    @hookimpl
    def resumed(self, loop: Run, info: ResumeInfo) -> None:
        if self._loop is None or afresh(loop) or loop.mode != "fit":  # (a run afresh or an evaluation drops no row)
            return
        again = written_again(info, bool(loop.state.val_due))
        for table, means in ((self._epochs, True), (self._updates, False)):

            def keep(entry: Mapping[str, str], means: bool = means) -> bool:
                try:
                    epoch, step = int(entry.get("epoch") or ""), int(entry.get("step") or "")
                except ValueError:
                    return True  # not a row this plugin wrote: kept as it is
                return not again(epoch if means else None, step, entry.get("stage") or "")

            if table.open(loop) is not None and table.columns is not None:
                table.rewrite(table.columns, keep=keep)

    @hookimpl
    def metrics_update(self, loop: Run, stage: str, metrics: MetricsSnapshot) -> None:
        if self._loop is None or not self.every_publication:
            return
        row = self._row(loop, metrics, {k: v.running for k, v in metrics.values.items()})
        row["batches"] = metrics.batches
        self._updates.write(loop, row)

    @hookimpl
    def epoch_metrics(self, loop: Run, stage: str, metrics: MetricsSnapshot) -> None:
        if self._loop is None:
            return
        self._epochs.write(loop, self._row(loop, metrics, {k: v.epoch for k, v in metrics.values.items()}))

    @hookimpl(trylast=True)  # after the metrics plugin publishes a stage a stop cut short
    def fit_end(self, loop: Run) -> None:
        self._close()

    # -- an earlier run's tables --------------------------------------------------------------
    def _first_write(self, loop: Run) -> None:
        """Before the run's first write, not at ``fit_start``: a run refused before it writes leaves
        the folder as it was, and whether it continues the tables there (:func:`afresh`: a resume that
        found no checkpoint does not) is known by then. A run afresh sets an earlier run's tables aside,
        as ``metrics.earlier-run-N.csv``."""
        if self._written:
            return
        self._written = True
        if not afresh(loop):
            return
        try:
            folder = loop.run_dir
        except OSError:  # a run folder that cannot be made: the writes say so
            return
        tables = (self._epochs, self._updates)  # (and the evaluations of the earlier run's checkpoints)
        earlier = [(name, t.leading) for t in tables for name in (t.name, t.name.replace("metrics", "evaluation"))]
        names = [name for name, leading in earlier if table_of(folder / name, leading)]
        writes = [t.name for t in tables if t is self._epochs or self.every_publication]
        advice = "Give each run its own run_dir, or resume it (resume='latest') to continue it"

        def fresh(stayed: list[str]) -> str:
            fresh = [name for name in writes if name not in stayed]
            return f"this run writes a fresh {', '.join(fresh)}" if fresh else "this run writes no table"

        stayed = set_aside(folder, names, self.name, lambda name, n: name.replace(".csv", f".earlier-run-{n}.csv"),
                           fresh, stuck="it is left as it is and this run does not write it", advice=advice,
                           least=loop.earlier_run, also=TABLES)
        for table in tables:
            table.stuck = table.name in stayed

    # -- rows ---------------------------------------------------------------------------------
    def _row(self, loop: Run, metrics: MetricsSnapshot, values: dict[str, float]) -> dict[str, Any]:
        rates = {f"{LR}{name}": float(rate) for name, rate in metrics.lr.items()}
        row: dict[str, Any] = {self._column(k, rates): float(v) for k, v in values.items()}
        row.update(rates)
        row.update(epoch=metrics.epoch + 1, step=metrics.step, stage=metrics.stage)
        if self._epochs.after:  # an evaluation's: the checkpoint it evaluated
            row[CHECKPOINT] = None if (info := loop.state.resumed_from) is None else os.path.abspath(info.source)
        return row

    def _column(self, metric: str, rates: Mapping[str, float]) -> str:
        """The column of ``metric``: its name, unless that is a column of the table's own (a
        leading column, an evaluation's ``checkpoint``, a learning rate's): then ``metric.<name>``, said once a
        run."""
        if metric not in UPDATE_COLUMNS and metric not in self._epochs.after and metric not in rates:
            return metric
        column = f"{RENAMED}{metric}"
        if metric not in self._renamed:
            self._renamed.add(metric)
            warnings.warn(f"{self.name}: the metric {metric!r} is written in the column {column!r} of the CSV "
                          f"tables: {metric!r} is a column of their own", HookfitWarning, stacklevel=user_level())
        return column

    def _close(self) -> None:
        self._epochs.close()
        self._updates.close()
        self._failure.error = None
        self._loop, self._written = None, False
