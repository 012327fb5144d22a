"""checkpoint scores: the monitored metric of the run's weights, and the checkpoints that
carry it. The rule is written here once:

* a checkpoint's ``metric`` is the score of its own weights: the value of ``monitor`` (the
  epoch mean of its stage) published by a validation of those weights, else ``None``. A
  score belongs to the weights of the global step it was published at: a checkpoint saved at an
  epoch's end right after its validation carries it, one saved after more training does not;
* a publication of the monitored stage is followed by a save of the weights it scored when
  that save is due anyway, or when the score is a new best (``reason="best"``), so the best
  checkpoint holds the best-scored weights. At an epoch's end that save is the epoch's
  (``after_epoch``). A validation inside the training stage (``Loop(val_every_n_steps=N)``)
  runs after its step's ``after_batch``, the moment a run is saved: there the plugin copies
  the run's state as for any save (:class:`Pending`: the position of that step, its validation
  due) and writes the copy once the validation has published, with its score, or lets it go.
  A run resumed from it runs that validation again first, as from any checkpoint written at
  such a step. A validation cut short (a stop, a failure) publishes nothing: the copy is
  written without a metric if the step's save was due, else let go; so is a copy whose
  validation published no metrics of the stage (no metrics plugin: warned once a run), at the
  next save point (:func:`unscored`), so that copies never pile up in the writer's snapshots.
  A run resumed from a checkpoint so written, unscored, owes the save that followed the
  validation: it holds the checkpoint's own contents as the copy (:func:`owed`), so that the
  validation it runs first scores them, written again with that score, or as the best, as the
  run it continues would have written them.
  A sharded run's state is not copied ahead (DCP copies it as it writes): its saves at such
  steps are written at once, without a metric, and its best is among the checkpoints of epoch
  ends.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hookfit.errors import user_level
from hookfit.plugins.checkpoint import sharded
from hookfit.plugins.checkpoint.shardwriter import save_sharded
from hookfit.plugins.checkpoint.storage import CheckpointWarning
from hookfit.plugins.checkpoint.writer import Held
from hookfit.plugins.support import Monitor
from hookfit.position import Position

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.payloads import MetricsSnapshot
    from hookfit.plugins.checkpoint.plugin import Checkpoint
    from hookfit.run import Run

__all__ = ["Pending", "Scores", "hold", "owed", "settle", "unscored"]


@dataclass(frozen=True)
class Pending:
    """A save taken at a step whose validation comes next, waiting for that validation's score:
    where (``position``), whether the step's save was ``due`` anyway, the ``path`` the main
    process writes, and the copy of the state (``None`` off the main process, which writes
    nothing). ``again``: the copy is the contents of the checkpoint the run resumed from, unscored
    (:func:`owed`): written again only with a score."""

    position: Position
    due: bool
    path: Path | None
    copy: Held | None
    again: bool = False


class Scores:
    """The scores of the run's weights by ``monitor`` (see the module)."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        """The metric watched, its direction, and the best checkpoint (kept by the catalog)."""
        self.pending: Pending | None = None
        """The save waiting for the validation that runs next, if any."""
        self._score: tuple[int, float] | None = None  # (the global step it was published at, the score)
        self._asked: float | None = None  # the best metric of the saves asked, written or not yet
        self._warned = False  # a warning said why this run's checkpoints carry no score
        self._scored = False  # a publication of this run carried the metric
        self._finite = False  # one carried it as a finite number
        self.unheard = False
        """Whether a validation of this run published no metrics of the stage (:func:`unscored`)."""

    def start(self) -> None:
        """A new run: no score, no best, nothing pending."""
        self.monitor.start()
        self.pending, self._score, self._asked, self._warned, self.unheard = None, None, None, False, False
        self._scored = self._finite = False

    def begin(self, loop: Run) -> None:
        """As training starts: a warning when the run can never publish the metric (a ``valid``
        one without validation, or with every validation past the run's end:
        :meth:`Monitor.never <hookfit.plugins.support.best.Monitor.never>`, early stopping's error), or when it
        names no set of several validation sets (:meth:`~hookfit.plugins.support.best.Monitor.unset`), a warning
        that then stands for the one its first validation would give."""
        if (never := self.monitor.never(loop)) is not None:
            self._warned, loop.no_validation = True, None  # said here, not again by the core
            warnings.warn(f"{never}; its checkpoints are still written, but none carries a score, so no best "
                          f"checkpoint is kept", CheckpointWarning, stacklevel=user_level())
        elif (unset := self.monitor.unset(loop)) is not None:  # said now, not after the first validation
            self._warned = True
            warnings.warn(f"{unset}; no best checkpoint is kept by it", CheckpointWarning, stacklevel=user_level())

    def end(self, loop: Run) -> None:
        """As a training run that completed ends without a best checkpoint: a warning when no
        publication carried the metric, or none as a finite number, and no earlier warning of this run
        said why. None for an interrupted run (the run resumed from its checkpoint may yet publish it)
        nor a failed one."""
        if self._finite or self._warned or self.unheard or loop.state.status != "completed":
            return
        if self._scored:  # (a best kept from before a resume stays the best)
            if self.monitor.best is not None:
                return
            self._warned, last = True, f" (last: {self._score[1]})" if self._score is not None else ""
            warnings.warn(f"{self.monitor.plugin}: monitor={self.monitor.metric!r} was never a finite number in this "
                          f"run{last}: a non-finite score is never the best, so no best checkpoint is kept "
                          f"(results['best_checkpoint'] is None); its checkpoints are written", CheckpointWarning,
                          stacklevel=user_level())
            return
        self._warned = True
        warnings.warn(f"{self.monitor.plugin}: monitor={self.monitor.metric!r} was never published in this run: "
                      f"it ended before its {self.stage} stage published metrics, or no plugin publishes "
                      f"epoch_metrics (the metrics plugin does); its checkpoints are written, but none carries a "
                      f"score, so no best checkpoint is kept", CheckpointWarning, stacklevel=user_level())

    @property
    def stage(self) -> str | None:
        """The stage whose publications score the weights (``"valid"``), or ``None``."""
        return self.monitor.stage

    def inside(self, loop: Run) -> bool:
        """Whether the monitored validations of this run run inside its training stage."""
        return self.stage == "valid" and loop.val_every_n_steps is not None and loop.val_step is not None

    def follows(self, loop: Run) -> bool:
        """Whether a validation of the monitored stage runs right after this training batch."""
        return self.stage == "valid" and bool(loop.state.val_due)

    def publish(self, loop: Run, metrics: MetricsSnapshot) -> float | None:
        """Take the publication of the monitored stage: the score of the weights now, or
        ``None`` when it lacks the metric (warned once a run)."""
        key = self.monitor.key
        if key is not None and key in metrics.values:
            self.monitor.follow(metrics.best)  # the direction the checkpoints are compared in
            score = float(metrics.values[key].epoch)
            self._score, self._scored = (loop.state.step, score), True
            self._finite = self._finite or math.isfinite(score)
            return score
        self._score = None
        if not self._warned and loop.stop_requested is None:  # (a stage a stop cut short may lack it)
            self._warned = True
            warnings.warn(self.monitor.absent(metrics.values, metrics.epoch, then="no best checkpoint is kept by it"),
                          CheckpointWarning, stacklevel=user_level())
        return None

    def current(self, loop: Run) -> float | None:
        """The score of the run's weights as they are now (published at this global step), or
        ``None``: what a checkpoint saved now carries as its ``metric``."""
        score = self._score
        return score[1] if score is not None and score[0] == loop.state.step else None

    def improves(self, score: float | None) -> bool:
        """Whether ``score`` is a new best: better than the best checkpoint's and than every
        save asked with a metric whose write is not taken yet."""
        if score is None or not self.monitor.improves(score):
            return False
        return self._asked is None or self._better(score, self._asked)

    def asked(self, metric: float | None) -> None:
        """A save carrying ``metric`` was asked (its write may still be going on)."""
        if metric is not None and math.isfinite(metric) and (self._asked is None or self._better(metric, self._asked)):
            self._asked = metric

    def _better(self, score: float, than: float) -> bool:
        return score < than if self.monitor.mode == "min" else score > than

    def failed(self) -> None:
        """A write failed: the best is again the best checkpoint written."""
        self._asked = None


def hold(checkpoint: Checkpoint, loop: Run, due: bool) -> None:
    """``checkpoint``'s save at a step whose validation of the monitored stage comes next
    (``due``: whether the step's save was due anyway): the state copied now, as a save copies
    it, and kept in ``checkpoint.scores.pending`` for :func:`settle` (see the module)."""
    if checkpoint.off:
        return
    checkpoint.collect(loop)
    position = loop.position
    checkpoint.written.asked = position.step  # asked on every process: a later save here asks the main one
    with checkpoint.writer.aside():
        payload = checkpoint.payload(loop, reason="step", metric=None)  # also on other ranks: collectives
        rest, shards = sharded.split(payload)
        if shards:  # DCP copies a sharded state as it writes it: written now, if due
            if due:
                checkpoint.saved_step = position.step
                checkpoint.written.wrote(position.step, None)
                save_sharded(checkpoint, loop, position, rest, shards, ("step", position.step, None, False))
            return
        path = checkpoint.destination(loop, position, "step")
        copy = checkpoint.writer.hold(payload) if loop.is_main else None
    if loop.is_main and copy is None:  # skipped: when_busy="skip" and both snapshots taken
        if due:
            checkpoint.reports.skip(position.step)
        return
    checkpoint.scores.pending = Pending(position, due, path, copy)


def owed(checkpoint: Checkpoint, loop: Run, data: Mapping[str, Any], scheduled: bool) -> None:
    """A training run resumed from a checkpoint (its contents ``data``) taken at a step whose validation of the
    monitored stage was due and never scored it (it failed, or a stop cut it short: the checkpoint says the
    validation is due and carries no score): that validation runs first, and the save that followed it in the run
    this one continues is owed. The checkpoint's contents are held as :func:`hold` holds a copy (due: the step's
    save was, as the checkpoint's ``reason`` says, or ``scheduled``: by the schedule), for :func:`settle` to write
    them again with their score, under the name the step's save has, or to let them go; a checkpoint that carries a
    score of the metric monitored now owes nothing, nor does a sharded one (see the module)."""
    meta, at = data["meta"], Position.from_dict(data["loop"])
    meta = meta if isinstance(meta, Mapping) else {}
    scored = meta.get("monitor") == checkpoint.scores.monitor.metric and isinstance(meta.get("metric"), (int, float))
    if (checkpoint.off or loop.mode != "fit" or not at.val_due or scored or checkpoint.scores.stage != "valid"
            or loop.val_step is None or sharded.placeholders(data)):
        return
    checkpoint.written.asked = at.step  # as hold() asks it, on every process
    due = scheduled or meta.get("reason") == "step"
    path = checkpoint.destination(loop, at, "step")
    copy = None
    if loop.is_main:
        with checkpoint.writer.aside():
            copy = checkpoint.writer.hold(dict(data))
        if copy is None:  # (skipped: when_busy="skip" and both snapshots taken)
            return
    checkpoint.scores.pending = Pending(at, due, path, copy, again=True)


def unscored(checkpoint: Checkpoint, loop: Run) -> None:
    """At a save point (a training batch's, an epoch's): a copy still pending is one whose
    validation published no metrics of the monitored stage (no plugin publishes them: the metrics
    plugin does). Said once a run, then settled without a score."""
    pending = checkpoint.scores.pending
    if pending is None:
        return
    if not checkpoint.scores.unheard:
        checkpoint.scores.unheard = True
        warnings.warn(f"{checkpoint.name}: monitor={checkpoint.scores.monitor.metric!r}: the validation after step "
                      f"{pending.position.step} published no {checkpoint.scores.stage} metrics (no plugin publishes "
                      f"epoch_metrics; the metrics plugin does), so checkpoints carry no metric and no best checkpoint "
                      f"is kept", CheckpointWarning, stacklevel=user_level())
    settle(checkpoint, loop, None)


def settle(checkpoint: Checkpoint, loop: Run, score: float | None) -> None:
    """The pending save after the validation it waited for: written with ``score`` if it was
    due or ``score`` is a new best (or one of the ``keep_best``), else let go (``score`` ``None``: the publication
    lacked the metric, or the validation was cut short and the run ends; a copy of the checkpoint the run resumed
    from, :attr:`Pending.again`, is then let go: that checkpoint holds it already)."""
    scores = checkpoint.scores
    pending, scores.pending = scores.pending, None
    if pending is None:
        return
    if not (pending.due or scores.improves(score) or checkpoint.catalog.ranks(score)) or (
            pending.again and score is None):  # (the checkpoint on disk holds that already)
        if pending.copy is not None:
            checkpoint.writer.drop(pending.copy)
        return
    reason = "step" if pending.due else "best"
    scores.asked(score)
    checkpoint.saved_step = pending.position.step
    checkpoint.written.wrote(pending.position.step, score)
    if pending.copy is None:  # off the main process: the file the main one writes, for best and last
        if pending.path is not None:
            checkpoint.catalog.follow(pending.path, score, reason)
        return
    assert pending.path is not None  # (the main process's own folder)
    pending.copy.state["meta"].update(reason=reason, metric=score)
    checkpoint.writer.release(pending.copy, pending.path, (reason, pending.position.step, score, True))
    if not checkpoint.background:
        checkpoint.collect(loop)
