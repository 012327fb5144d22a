"""tensorboard: the run's metrics, learning rates and hyperparameters as TensorBoard event files.

``Loop(plugins=[TensorBoard()])``, or ``[plugins.tensorboard]`` in ``hookfit.toml``
(an empty table is enough). Discovered like every plugin, it is inert until then: the run
leaves it out before ``configure`` (:func:`hookfit.manager.leave_inert`), so it costs a run
nothing. ``TensorBoard(enabled=False)`` switches it off wherever it comes from (given, it
unregisters itself at ``configure``). It needs the
``tensorboard`` package (``pip install hookfit[tensorboard]``); without it, a run that wants it
gets one warning naming that command and trains on (an ``enabled=True`` given in code fails
at once).

What it writes, in the run folder (``loop.run_dir``), so ``tensorboard --logdir runs`` shows
every run of every script, named ``<name>/<date>-<time>`` (an evaluation, ``Loop.validate()``, in
its ``evaluation/`` subfolder: a run of its own, beside the training run's when it shares its folder):

* ``<stage>/<metric>``: the epoch mean of every metric the metrics plugin publishes at the end
  of a stage (``epoch_metrics``: ``train/loss``, ``valid/loss``, ``valid/accuracy``), at the
  global step the stage ended at; and ``epoch``, the epoch (counted from 1) each training
  stage ended, at the same step, to map steps to epochs.
* ``train_step/<metric>``: with ``every_publication=True`` (the default), the running mean of
  every publication of the training stage (``metrics_update``: at most every ``interval``
  seconds of the metrics plugin), at the global step it was taken. Validation publications
  all share one global step, so only their epoch means are written.
* ``lr/<optimizer>``: the learning rate of each optimizer's first parameter group
  (``"default"`` for a single optimizer), and ``lr/<optimizer>/<group>`` of each further
  group (its ``"name"`` entry, else its index), from the same snapshots, once per global step:
  every publication's and every training stage's end, not a training stage a stop cut short
  (which a resumed run writes again at the epoch's end).
* Names in tags: a tag takes letters, digits, ``_``, ``-``, ``.`` and ``/`` (TensorFlow's rule
  for summary names, which TensorBoard's tools assume; ``/`` groups the charts), and does not
  start with ``/``. A metric or optimizer name with anything else (a space, ``=``, a quote, a
  line break) has each such character written ``_`` (``top 1 acc`` as ``train/top_1_acc``),
  with a ``_2``, ``_3``... where that would merge it with another name of the run; each name
  changed so is said once a run, in a :class:`hookfit.HookfitWarning` naming both.
* Hyperparameters, for TensorBoard's HParams dashboard: written once at ``fit_start``
  (a session start) with the run's name, ``max_epochs``, ``max_steps``, ``seed``,
  ``deterministic``, ``val_every_n_epochs``/``val_every_n_steps`` (as ``loop.*``), each
  optimizer's class and its parameter groups' scalar settings as given (``optimizer.<name>``,
  ``optimizer.<name>.lr``, the rate given where a scheduler has scaled it already; a later group's
  setting that differs from the first's as ``optimizer.<name>.group<i>.<setting>``), the scalar options of every plugin
  of the run (``plugin.<name>.<option>``) and whatever ``TensorBoard(hparams={...})`` adds
  (which wins on a clash). ``fit_end`` ends the session with the run's status (``completed``
  is a success, ``failed`` a failure, ``interrupted`` unknown). No experiment summary is
  written: TensorBoard builds the experiment from every run's session, so runs with
  different settings compare side by side, and its metrics are the run's scalars, whose last
  values are the run's final metrics.

Every write is synchronous and flushed (one write per publication, never one per batch), so
what a run wrote survives a ``kill -9``; the file is a :class:`hookfit.files.RunFile`: a full
disk or a read-only run folder warns once (``FileWarning``) and training goes on without it.
The event records are TensorBoard's own (``torch.utils.tensorboard.summary`` builds the
scalars, TensorBoard's record writer frames them); ``SummaryWriter`` is not used because it
writes from a thread of its own, where a failed write surfaces late, as an exception of a
later call and a traceback on stderr.

Each ``fit()`` starts a new event file, with its first write (a run that ends before its first epoch
begins, refused at its start, writes none). A fit that does not continue the events of its folder (a
script run again with the same ``run_dir`` and no resume, or a ``resume="latest"`` that found no
checkpoint) first moves an earlier run's event files there, the evaluations' in ``evaluation/``
with them, into its ``earlier-run-1/`` subfolder (``-2`` next; never deleted), where TensorBoard
shows them as a run of their own (evaluations in one folder are one run, ``evaluation/``, each at
the step it evaluated), and says so in one ``HookfitWarning``: its curves never jump back to step 0 (a
file that cannot be moved is named in a ``FileWarning`` and stays, its points shown with this
run's). A resumed run (``Loop(resume=...)``, which writes in the folder of the run it continues)
reads as the run that never stopped: it marks where it continues with a ``SessionLog.START`` event
at the checkpoint's step, from which TensorBoard drops every point the earlier files have (the purge
that ``SummaryWriter(purge_step=...)`` writes), and writes again the points the earlier files have
at that step, but for those the resumed run writes again
(:func:`hookfit.plugins.support.logger.written_again`, the rule the ``csv`` plugin keeps too): the
means of a stage a stop cut short there (``train/<metric>`` and ``epoch`` inside a training stage,
which the resumed run writes whole at the epoch's end; ``valid/<metric>`` inside a validation, which
it runs again). So every epoch curve is the uninterrupted run's, point for point, and so is every
other curve (``lr/`` too) where no step is a timer's choice: the publications' points
(``train_step/``, ``lr/`` between epoch ends) are at the steps a timer chose
(``Metrics(interval=0)``: every step). An earlier file that cannot be read warns (``FileWarning``)
and the purge is at the step after the checkpoint's, keeping what the earlier run wrote at its step.
Only the main process writes (under ``torchrun`` the distributed plugin switches observers off on
the others).
"""

from __future__ import annotations

import importlib
import io
import itertools
import os
import re
import socket
import struct
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from hookfit import hookimpl
from hookfit.config import records_options
from hookfit.errors import user_level
from hookfit.files import FileWarning, RunFile
from hookfit.payloads import MetricsSnapshot, ResumeInfo
from hookfit.plugins.support.logger import SafeNames, afresh, run_file, set_aside, wanted, written_again
from hookfit.plugins.support.logger import inert as logger_inert
from hookfit.plugins.support import Hparam, flag, hyperparameters, run_hparams

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

__all__ = ["INSTALL", "TensorBoard"]

INSTALL = "pip install hookfit[tensorboard]"
"""The command that installs what this plugin needs."""

EVALUATION = "evaluation"
"""The subfolder of the run folder an evaluation (``Loop.validate()``) writes its events in."""

_files = itertools.count()

_NOT_IN_TAGS = re.compile(r"[^-/\w.]")


def tag_part(name: str) -> str:
    """``name`` (a metric's, an optimizer's) as a part of a TensorBoard tag: each character but
    letters, digits, ``_``, ``-``, ``.`` and ``/`` as ``_``, no leading ``/``; ``_`` for nothing."""
    return _NOT_IN_TAGS.sub("_", name).lstrip("/") or "_"


def _event_file_name(loop: Run, folder: str = "") -> str:
    """A new event file's name, TensorBoard's ``events.out.tfevents.<seconds>.<host>.<pid>.<n>``,
    its seconds past those of every event file in the run folder: TensorBoard reads a folder's
    files in the order of their names, and a resumed run's file (its purge) comes after the
    earlier run's, even one of the same second (of the same process too)."""
    seconds = int(time.time())
    try:
        for path in (loop.run_dir / folder).glob("events.out.tfevents.*"):
            written = path.name.split(".")[3]
            if written.isdigit():
                seconds = max(seconds, int(written) + 1)
    except OSError:  # a run folder that cannot be made or listed: the file's writes say so
        pass
    return f"events.out.tfevents.{seconds:010d}.{socket.gethostname()}.{os.getpid()}.{next(_files)}"


def _records(path: Path) -> Iterator[bytes]:
    """The records of an event file, in TensorBoard's framing (a record's length, its checksum,
    the record, its checksum), up to the end or a last record cut short (a ``kill -9``). The
    checksums are not checked: reading a long run's file then takes a fraction of a second."""
    with open(path, "rb") as file:
        while True:
            header = file.read(12)
            if len(header) < 12:
                return
            (length,) = struct.unpack("<Q", header[:8])
            record = file.read(length)
            if len(record) < length or len(file.read(4)) < 4:
                return
            yield record


def _require() -> None:
    """Import TensorBoard, or say how to install it."""
    try:
        import tensorboard  # noqa: F401
        import torch.utils.tensorboard  # noqa: F401
    except ImportError as error:
        raise ImportError(f"tensorboard: the plugin needs the tensorboard package, which is not installed "
                          f"({error}); install it with `{INSTALL}`") from error


@records_options
class TensorBoard:
    """Writes the run's epoch means, running means, learning rates and hyperparameters as
    TensorBoard event files in the run folder (see the module documentation). Options are
    checked here, with a ``ValueError`` naming them.

    * ``enabled``: ``None`` (the default): on when given to ``Loop(plugins=[...])`` or
      configured in ``hookfit.toml``, off when only discovered; ``True``/``False`` force it.
    * ``every_publication``: also write the training stage's running means at every
      publication (``train_step/<metric>``), not only the epoch means; the built-in metrics
      plugin publishes at most every ``Metrics(interval=0.5)`` seconds (``Metrics(interval=0)``:
      after every batch).
    * ``hparams``: more hyperparameters (names to numbers, strings or booleans) to record
      with the run's own.
    """

    name = "tensorboard"
    observer = True  # a logger: its failures switch it off, never the run
    inert = logger_inert  # what hookfit plugins says of it (hookfit.discovery.inert)

    def __init__(self, enabled: bool | None = None, every_publication: bool = True,
                 hparams: Mapping[str, Any] | None = None) -> None:
        flag(self.name, "enabled", enabled, none=True)
        flag(self.name, "every_publication", every_publication)
        extra = hyperparameters(self.name, "hparams", hparams)
        if enabled:
            _require()  # asked for in so many words: say what is missing now, not at fit()
        self.enabled = enabled
        self.every_publication = every_publication
        self.hparams: dict[str, Hparam] = extra
        """The hyperparameters given here (the run's own are added at ``fit_start``)."""
        self.path: os.PathLike[str] | None = None
        """The event file of the current or last run (``None`` before a run wrote one, and when off)."""
        self._file: RunFile | None = None  # opened by the run's first write (_open)
        self._on = False  # this run writes: the main process's, from fit_start to fit_end
        self._header: list[Any] = []  # the events the file starts with, made at fit_start
        self._loop: Run | None = None
        self._lr_step: int | None = None  # the step the learning rates were last written at
        self._proto: Any = None  # TensorBoard's protobuf and summary modules, imported at fit_start
        self._names = SafeNames(self.name, tag_part, "in the TensorBoard tags of this run (a tag takes letters, "
                                                     "digits, '_', '-', '.' and '/' only")

    # -- events -------------------------------------------------------------------------------
    @hookimpl
    def configure(self, loop: Run) -> None:
        self._file, self._loop, self._lr_step, self.path, self._on = None, None, None, None, False
        if not wanted(loop, self, self.enabled):
            loop.pm.unregister(self)  # inert: none of the hooks below costs anything
            return
        _require()  # an observer: a missing package is one warning, and training goes on

    @hookimpl
    def fit_start(self, loop: Run) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter
        from torch.utils.tensorboard import summary

        self._proto = SimpleNamespace(event_pb2=event_pb2, summary_pb2=summary_pb2, api_pb2=api_pb2,
                                      metadata=metadata, plugin_data_pb2=plugin_data_pb2,
                                      RecordWriter=RecordWriter, summary=summary)
        self._loop = loop
        self._names.reset()
        if not loop.is_main:
            return
        self._on = True  # its file opens with the first write (_open)
        self._header = [event_pb2.Event(wall_time=time.time(), step=loop.state.step, file_version="brain.Event:2")]
        start = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
        for key, value in sorted(self.run_hparams(loop).items()):
            if isinstance(value, bool):
                start.hparams[key].bool_value = value
            elif isinstance(value, str):
                start.hparams[key].string_value = value
            else:
                start.hparams[key].number_value = float(value)
        self._header.append(self._session(loop, metadata.SESSION_START_INFO_TAG,
                                          plugin_data_pb2.HParamsPluginData(session_start_info=start)))

    @hookimpl
    def resumed(self, loop: Run, info: ResumeInfo) -> None:
        if not self._on or afresh(loop) or loop.mode != "fit":  # (a run afresh or an evaluation purges nothing)
            return
        event_pb2 = self._proto.event_pb2
        kept = self._kept(loop, info) if info.step > 0 else None
        # TensorBoard drops every point of the files before this event at its step or later (the
        # session start of this fit(), at step 0, stays); what stays of the checkpoint's step is
        # written again after it
        purge = info.step if kept is not None else info.step + 1
        self._write([event_pb2.Event(wall_time=time.time(), step=purge,
                                     session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START))])
        if kept:
            self._scalars(info.step, kept)
            if any(tag.startswith("lr/") for tag, _ in kept):
                self._lr_step = info.step  # once per step: the resumed run's next ones are at a later step

    @hookimpl
    def metrics_update(self, loop: Run, stage: str, metrics: MetricsSnapshot) -> None:
        if not self._on or not self.every_publication or stage != "train":
            return
        values = [(f"train_step/{self._part(key)}", value.running) for key, value in sorted(metrics.values.items())]
        self._scalars(metrics.step, values + self._rates(metrics))

    @hookimpl
    def epoch_metrics(self, loop: Run, stage: str, metrics: MetricsSnapshot) -> None:
        if not self._on:
            return
        values = [(f"{self._part(stage)}/{self._part(key)}", value.epoch)
                  for key, value in sorted(metrics.values.items())]
        if stage == "train":
            values.append(("epoch", metrics.epoch + 1))
            # a stage a stop cut short (published at fit_end, outside every stage) has no learning rate
            # point: the run that goes on from there writes the epoch's, whole, at its end
            values += self._rates(metrics) if loop.state.stage is not None else []
        self._scalars(metrics.step, values)

    @hookimpl(trylast=True)  # after the metrics plugin publishes a stage a stop cut short
    def fit_end(self, loop: Run) -> None:
        # a run that ended before its first epoch began (refused at its start) and wrote nothing writes nothing
        if self._on and (self._file is not None or loop.started):
            proto = self._proto
            api_pb2, metadata, plugin_data_pb2 = proto.api_pb2, proto.metadata, proto.plugin_data_pb2
            status = {"completed": "STATUS_SUCCESS", "failed": "STATUS_FAILURE"}.get(loop.state.status,
                                                                                     "STATUS_UNKNOWN")
            end = plugin_data_pb2.SessionEndInfo(status=api_pb2.Status.Value(status), end_time_secs=time.time())
            self._write([self._session(loop, metadata.SESSION_END_INFO_TAG,
                                       plugin_data_pb2.HParamsPluginData(session_end_info=end))])
        if self._file is not None:
            self._file.close()
        self._file, self._loop, self._on, self._header = None, None, False, []

    # -- what is written ---------------------------------------------------------------------
    def run_hparams(self, loop: Run) -> dict[str, Hparam]:
        """The hyperparameters recorded for ``loop``: :func:`hookfit.plugins.support.run_hparams`
        with this plugin's ``hparams``."""
        return run_hparams(loop, self.hparams)

    def _rates(self, metrics: MetricsSnapshot) -> list[tuple[str, float]]:
        """``lr/<optimizer>`` values, once per global step."""
        if not metrics.lr or self._lr_step == metrics.step:
            return []
        self._lr_step = metrics.step
        return [(f"lr/{self._part(name)}", rate) for name, rate in sorted(metrics.lr.items())]

    def _part(self, name: str) -> str:
        """``name`` as it goes into this run's tags (:func:`tag_part`, kept apart from the other names of the run)."""
        return self._names.of(name)

    def _scalars(self, step: int, values: list[tuple[str, float]]) -> None:
        event_pb2, summary_pb2, summary = self._proto.event_pb2, self._proto.summary_pb2, self._proto.summary
        merged = summary_pb2.Summary(value=[v for tag, x in values for v in summary.scalar(tag, float(x)).value])
        self._write([event_pb2.Event(wall_time=time.time(), step=step, summary=merged)])

    def _kept(self, loop: Run, info: ResumeInfo) -> list[tuple[str, float]] | None:
        """The scalars the earlier event files of the run folder have at the checkpoint's step,
        as TensorBoard reads them, less those the resumed run writes again
        (:func:`~hookfit.plugins.support.logger.written_again`: the means of a stage a stop
        cut short there); ``None``, with a ``FileWarning``, when a file cannot be read."""
        decode_error = importlib.import_module("google.protobuf.message").DecodeError  # (untyped package)

        event_pb2 = self._proto.event_pb2
        start = event_pb2.SessionLog.START
        found: dict[str, float] = {}
        own = None if self._file is None else self._file.path
        reading: Path | None = None
        try:
            for reading in sorted(loop.run_dir.glob("events.out.tfevents.*")):  # in TensorBoard's order
                if reading == own:
                    continue
                for record in _records(reading):
                    event = event_pb2.Event.FromString(record)
                    if event.HasField("session_log") and event.session_log.status == start and event.step <= info.step:
                        found.clear()  # a later run's purge: what it dropped is not there
                    elif event.step == info.step and event.HasField("summary"):
                        found.update((v.tag, v.simple_value) for v in event.summary.value if v.HasField("simple_value"))
        except (OSError, decode_error) as error:
            warnings.warn(f"{self.name}: could not read {reading or 'the run folder'} ({type(error).__name__}: "
                          f"{error}); the resumed run's curves keep what the earlier run wrote after its checkpoint", FileWarning,
                          stacklevel=user_level())
            return None
        again = written_again(info, bool(loop.state.val_due))
        epoch = found.get("epoch")  # the epoch of the training means at this step
        train = again(None if epoch is None else int(epoch), info.step, "train")
        valid = again(None, info.step, "valid")

        def stays(tag: str) -> bool:
            stage = tag.partition("/")[0] if "/" in tag else None
            return not ((train and (tag == "epoch" or stage == "train")) or (valid and stage == "valid"))

        return sorted(item for item in found.items() if stays(item[0]))

    def _session(self, loop: Run, tag: str, data: Any) -> Any:
        """The event of a session's start or end (HParams)."""
        event_pb2, summary_pb2, metadata = self._proto.event_pb2, self._proto.summary_pb2, self._proto.metadata
        value = summary_pb2.Summary.Value(tag=tag, metadata=metadata.create_summary_metadata(data))
        return event_pb2.Event(wall_time=time.time(), step=loop.state.step, summary=summary_pb2.Summary(value=[value]))

    def _open(self) -> RunFile:
        """The run's event file, opened by its first write (never at ``fit_start``: a run refused there
        writes nothing, and whether it continues the events in its folder is known by then): a run afresh
        (:func:`~hookfit.plugins.support.logger.afresh`) first moves an earlier run's event files from
        the folder it writes in into ``earlier-run-N/``."""
        loop = self._loop
        assert loop is not None  # a run's write
        folder = "" if loop.mode == "fit" else EVALUATION  # an evaluation is a run of its own beside the fit's
        if afresh(loop):  # (a fit: its folder's events and the evaluations' of the earlier run's checkpoints)
            try:
                where = loop.run_dir
                earlier = sorted(str(p.relative_to(where)) for events in (where, where / EVALUATION)
                                 for p in events.glob("events.out.tfevents.*") if p.is_file())
                set_aside(where, earlier, self.name, lambda name, n: f"earlier-run-{n}/{name}",
                          lambda stayed: "TensorBoard shows them as a run of their own, this run's events in a "
                                         "fresh file", stuck="this run's events are written beside it, in the same "
                                                             "TensorBoard run",
                          advice="Give each run its own run_dir, or resume it (resume='latest') to continue it",
                          least=loop.earlier_run)
            except OSError:  # a run folder that cannot be made or listed: the file's writes say so
                pass
        self._file = run_file(loop, os.path.join(folder, _event_file_name(loop, folder)), self.name, binary=True)
        self.path = self._file.path
        return self._file

    def _write(self, events: list[Any]) -> None:
        """Frame ``events`` as TensorBoard records and append them in one write."""
        file = self._file
        if file is None:  # the run's first write
            file, events = self._open(), [*self._header, *events]
        buffer = io.BytesIO()
        records = self._proto.RecordWriter(buffer)
        for event in events:
            records.write(event.SerializeToString())
        file.write(buffer.getvalue())
