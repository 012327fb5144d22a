"""tensorboard: the run's metrics, learning rates and hyperparameters as TensorBoard event files.

``Loop(plugins=[TensorBoard()])``, or ``[plugins.tensorboard]`` in ``hookfit.toml``
(an empty table is enough). Discovered like every plugin, it is inert
until then: it unregisters itself at ``configure``, so it costs a run nothing.
``TensorBoard(enabled=False)`` switches it off wherever it comes from. It needs the
``tensorboard`` package (``pip install hookfit[tensorboard]``); without it, a run that wants it
gets one warning naming that command and trains on (an ``enabled=True`` given in code fails
at once).

What it writes, in the run folder (``loop.run_dir``), so ``tensorboard --logdir runs`` shows
every run of every script, named ``<name>/<date>-<time>``:

* ``<stage>/<metric>``: the epoch mean of every metric the metrics plugin publishes at the end
  of a stage (``epoch_metrics``: ``train/loss``, ``valid/loss``, ``valid/accuracy``), at the
  global step the stage ended at; and ``epoch``, the epoch (counted from 1) each training
  stage ended, at the same step, to map steps to epochs.
* ``train_step/<metric>``: with ``every_publication=True`` (the default), the running mean of
  every publication of the training stage (``metrics_update``: at most every ``interval``
  seconds of the metrics plugin), at the global step it was taken. Validation publications
  all share one global step, so only their epoch means are written.
* ``lr/<optimizer>``: the learning rate of each optimizer's first parameter group
  (``"default"`` for a single optimizer), from the same snapshots, once per global step.
* Names in tags: a tag takes letters, digits, ``_``, ``-``, ``.`` and ``/`` (TensorFlow's rule
  for summary names, which TensorBoard's tools assume; ``/`` groups the charts), and does not
  start with ``/``. A metric or optimizer name with anything else (a space, ``=``, a quote, a
  line break) has each such character written ``_`` (``top 1 acc`` as ``train/top_1_acc``),
  with a ``_2``, ``_3``... where that would merge it with another name of the run; each name
  changed so is said once a run, in a :class:`hookfit.HookfitWarning` naming both.
* Hyperparameters, for TensorBoard's HParams dashboard: written once at ``fit_start``
  (a session start) with the run's name, ``max_epochs``, ``max_steps``, ``seed``,
  ``deterministic``, ``val_every_n_epochs``/``val_every_n_steps`` (as ``loop.*``), each
  optimizer's class and the scalar settings of its first parameter group
  (``optimizer.<name>``, ``optimizer.<name>.lr``, ...), the scalar options of every plugin
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

Each ``fit()`` starts a new event file. A resumed run (``Loop(resume=...)``, which writes in
the folder of the run it continues) reads as the run that never stopped: it marks where it
continues with a ``SessionLog.START`` event at the checkpoint's step, from which TensorBoard
drops every point the earlier files have (the purge that ``SummaryWriter(purge_step=...)``
writes), and writes again at that step the values the earlier run had written there when the
checkpoint was taken (this plugin's state in checkpoints: the step and those values). So what
the earlier run wrote after its checkpoint is gone, the means of a stage that a stop cut short
included (``train/<metric>`` and ``epoch`` at the stop's step, which the resumed run writes
whole at the epoch's end), and the points up to the checkpoint stay. Only the main process
writes (under ``torchrun`` the distributed plugin switches observers off on the others).
"""

from __future__ import annotations

import io
import itertools
import os
import re
import socket
import time
import warnings
from collections.abc import Mapping
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from hookfit import hookimpl
from hookfit.errors import HookfitWarning
from hookfit.files import RunFile
from hookfit.payloads import MetricsSnapshot, ResumeInfo
from hookfit.plugins.support.logger import run_file, wanted
from hookfit.plugins.support.logger import inert as logger_inert
from hookfit.plugins.support import Hparam, flag, hyperparameters, run_hparams

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

__all__ = ["INSTALL", "TensorBoard"]

INSTALL = "pip install hookfit[tensorboard]"
"""The command that installs what this plugin needs."""

_files = itertools.count()

_NOT_IN_TAGS = re.compile(r"[^-/\w.]")


def tag_part(name: str) -> str:
    """``name`` (a metric's, an optimizer's) as a part of a TensorBoard tag: each character but
    letters, digits, ``_``, ``-``, ``.`` and ``/`` as ``_``, no leading ``/``; ``_`` for nothing."""
    return _NOT_IN_TAGS.sub("_", name).lstrip("/") or "_"


def _require() -> None:
    """Import TensorBoard, or say how to install it."""
    try:
        import tensorboard  # noqa: F401
        import torch.utils.tensorboard  # noqa: F401
    except ImportError as error:
        raise ImportError(f"tensorboard: the plugin needs the tensorboard package, which is not installed "
                          f"({error}); install it with `{INSTALL}`") from error


class TensorBoard:
    """Writes the run's epoch means, running means, learning rates and hyperparameters as
    TensorBoard event files in the run folder (see the module documentation). Options are
    checked here, with a ``ValueError`` naming them.

    * ``enabled``: ``None`` (the default): on when given to ``Loop(plugins=[...])`` or
      configured in ``hookfit.toml``, off when only discovered; ``True``/``False`` force it.
    * ``every_publication``: also write the training stage's running means at every
      publication (``train_step/<metric>``), not only the epoch means.
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
        """The event file of the current or last run (``None`` before one, and when off)."""
        self._file: RunFile | None = None
        self._loop: Run | None = None
        self._lr_step: int | None = None  # the step the learning rates were last written at
        self._proto: Any = None  # TensorBoard's protobuf and summary modules, imported at fit_start
        self._names: dict[str, str] = {}  # a metric's or an optimizer's name -> its part of the run's tags
        self._step: int | None = None  # the step of the last scalars written
        self._at_step: dict[str, float] = {}  # the scalars written at that step: this plugin's state
        self._restore: Mapping[str, Any] | None = None  # the state a resumed run writes again (load_state)

    # -- events -------------------------------------------------------------------------------
    @hookimpl
    def configure(self, loop: Run) -> None:
        self._file, self._loop, self._lr_step, self.path = None, None, None, None
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
        self._names = {}
        self._step, self._at_step, self._restore = None, {}, None
        if not loop.is_main:
            return
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}."
                f"{next(_files)}")
        self._file = run_file(loop, name, self.name, binary=True)
        self.path = self._file.path
        self._write([event_pb2.Event(wall_time=time.time(), step=loop.state.step, file_version="brain.Event:2")])
        start = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
        for key, value in sorted(self.run_hparams(loop).items()):
            if isinstance(value, bool):
                start.hparams[key].bool_value = value
            elif isinstance(value, str):
                start.hparams[key].string_value = value
            else:
                start.hparams[key].number_value = float(value)
        self._session(loop, metadata.SESSION_START_INFO_TAG,
                      plugin_data_pb2.HParamsPluginData(session_start_info=start))

    @hookimpl
    def save_state(self, loop: Run) -> dict[str, Any] | None:
        """The scalars written at the current step, which a run resumed from this checkpoint
        writes again after dropping that step; ``None`` when there are none."""
        if self._file is None or not self._at_step or self._step != loop.state.step:
            return None
        return {"step": self._step, "scalars": dict(self._at_step)}

    @hookimpl
    def load_state(self, state: Any) -> None:
        scalars = state.get("scalars") if isinstance(state, Mapping) else None
        if not (isinstance(scalars, Mapping) and isinstance(state.get("step"), int)
                and all(isinstance(k, str) and isinstance(v, (int, float)) for k, v in scalars.items())):
            raise ValueError(f"{self.name}: the checkpoint's state of this plugin is {state!r:.200}; expected "
                             f"{{'step': <int>, 'scalars': {{<tag>: <number>}}}}")
        self._restore = state

    @hookimpl
    def resumed(self, loop: Run, info: ResumeInfo) -> None:
        restore, self._restore = self._restore, None
        if self._file is None:
            return
        event_pb2 = self._proto.event_pb2
        # TensorBoard drops every point of the files before this event at its step or later (the
        # session start of this fit(), at step 0, stays): what the earlier run wrote at the
        # checkpoint's step is written again, what it wrote after its checkpoint is gone
        purge = max(info.step, 1)
        self._write([event_pb2.Event(wall_time=time.time(), step=purge,
                                     session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START))])
        if restore is not None and restore["step"] == info.step == purge:
            self._scalars(info.step, sorted(restore["scalars"].items()))
            if any(tag.startswith("lr/") for tag in restore["scalars"]):
                self._lr_step = info.step  # the learning rates are once per step: these were

    @hookimpl
    def metrics_update(self, loop: Run, stage: str, metrics: MetricsSnapshot) -> None:
        if self._file is None or not self.every_publication or stage != "train":
            return
        values = [(f"train_step/{self._part(key)}", value.running) for key, value in sorted(metrics.values.items())]
        self._scalars(metrics.step, values + self._rates(metrics))

    @hookimpl
    def epoch_metrics(self, loop: Run, stage: str, metrics: MetricsSnapshot) -> None:
        if self._file is None:
            return
        values = [(f"{self._part(stage)}/{self._part(key)}", value.epoch)
                  for key, value in sorted(metrics.values.items())]
        if stage == "train":
            values.append(("epoch", metrics.epoch + 1))
            values += self._rates(metrics)
        self._scalars(metrics.step, values)

    @hookimpl(trylast=True)  # after the metrics plugin publishes a stage a stop cut short
    def fit_end(self, loop: Run) -> None:
        if self._file is not None and self._proto is not None:
            proto = self._proto
            api_pb2, metadata, plugin_data_pb2 = proto.api_pb2, proto.metadata, proto.plugin_data_pb2
            status = {"completed": "STATUS_SUCCESS", "failed": "STATUS_FAILURE"}.get(loop.state.status,
                                                                                     "STATUS_UNKNOWN")
            end = plugin_data_pb2.SessionEndInfo(status=api_pb2.Status.Value(status), end_time_secs=time.time())
            self._session(loop, metadata.SESSION_END_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_end_info=end))
            self._file.close()
        self._file, self._loop = None, None

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
        """``name`` as it goes into this run's tags (:func:`tag_part`, kept apart from the other
        names of the run), said once when it is not ``name`` itself."""
        known = self._names.get(name)
        if known is not None:
            return known
        base = part = tag_part(name)
        taken = set(self._names.values())
        n = 1
        while part in taken:
            n += 1
            part = f"{base}_{n}"
        self._names[name] = part
        if part != name:
            warnings.warn(f"{self.name}: {name!r} is written as {part!r} in the TensorBoard tags of this run "
                          f"(a tag takes letters, digits, '_', '-', '.' and '/' only"
                          f"{'; ' + repr(base) + ' was taken by another name' if part != base else ''})",
                          HookfitWarning, stacklevel=2)
        return part

    def _scalars(self, step: int, values: list[tuple[str, float]]) -> None:
        event_pb2, summary_pb2, summary = self._proto.event_pb2, self._proto.summary_pb2, self._proto.summary
        merged = summary_pb2.Summary(value=[v for tag, x in values for v in summary.scalar(tag, float(x)).value])
        self._write([event_pb2.Event(wall_time=time.time(), step=step, summary=merged)])
        if step != self._step:
            self._step, self._at_step = step, {}
        self._at_step.update((tag, float(x)) for tag, x in values)

    def _session(self, loop: Run, tag: str, data: Any) -> None:
        event_pb2, summary_pb2, metadata = self._proto.event_pb2, self._proto.summary_pb2, self._proto.metadata
        value = summary_pb2.Summary.Value(tag=tag, metadata=metadata.create_summary_metadata(data))
        self._write([event_pb2.Event(wall_time=time.time(), step=loop.state.step,
                                     summary=summary_pb2.Summary(value=[value]))])

    def _write(self, events: list[Any]) -> None:
        """Frame ``events`` as TensorBoard records and append them in one write."""
        file = self._file
        assert file is not None  # every caller writes to the run's open file
        buffer = io.BytesIO()
        records = self._proto.RecordWriter(buffer)
        for event in events:
            records.write(event.SerializeToString())
        file.write(buffer.getvalue())
