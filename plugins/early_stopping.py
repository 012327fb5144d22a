"""early_stopping: end training when a monitored metric stops improving.

``EarlyStopping(monitor="valid/loss", mode=None, patience=3, min_delta=0.0)`` in
``Loop(plugins=[...])``. Discovered like every plugin, it is inert until given a ``monitor``:
without one it is left out of the run before ``configure`` (given without one, it warns and
unregisters itself there), so it is not among the run's plugins and none of its hooks is
called, as ``hookfit plugins`` says (``[inert]``).

* It reads the epoch means a metrics plugin publishes in ``epoch_metrics`` (a
  :class:`hookfit.payloads.MetricsSnapshot`), nothing else: ``monitor`` is ``"<stage>/<metric>"``
  with stage ``train`` or ``valid``.
* Which way is better is the metric's direction as the metrics plugin publishes it (the
  snapshot's ``best``, from ``Metrics(best={"valid/acc": "max"})``), else ``"min"``, unless
  ``mode`` is given: a given ``mode`` that contradicts the published direction is kept, with
  one ``HookfitWarning`` a run naming the metric and both directions (the warning comes with
  the first epoch's metrics, when the direction is first known; a run is not ended for it).
* An epoch improves on the best so far when its value is below ``best - min_delta`` (``"min"``)
  or above ``best + min_delta`` (``"max"``); a non-finite value never improves. After
  ``patience`` epochs in a row without improvement, it asks the loop to stop at the end of that
  epoch (``epoch_end``: the epoch's checkpoint is written first), with ``complete=True``: the
  run ends ``completed``, no further batch runs, and the reason names the metric, the best
  value and its epoch (counted from 1, as everything a user reads).
* With validation inside training (``Loop(val_every_n_steps=N)``) a ``valid`` monitor counts
  validations, not epochs: after ``patience`` validations in a row without improvement it stops
  right after the one that decided (at its ``stage_end``, before any further training batch),
  and the reason names the step of the best value too. With validation every few epochs
  (``Loop(val_every_n_epochs=N)``) it counts validations as well: ``patience=2`` with ``N=2``
  stops after four epochs without improvement, and the reason says validations.
* A ``valid`` monitor in a run without validation, or whose validations all fall past its end
  (``val_every_n_epochs`` more than the epochs it trains, ``val_every_n_steps`` more than
  ``max_steps``: :meth:`hookfit.plugins.support.Monitor.never`), is an error when training
  starts; a checkpoint's ``monitor`` gets the same words as a warning then. So is a ``valid``
  monitor that names no set of a run with several validation sets (``valid/loss`` where the sets'
  metrics are ``valid/<set>/loss``: :meth:`hookfit.plugins.support.Monitor.unset`). A metric
  the run never produces is an error as soon as the first metrics of its stage are published
  (the end of the first training stage, or of the first validation), before that epoch's
  ``epoch_end`` and checkpoint: it names the metrics the stage has and the closest of them
  (``did you mean monitor='valid/loss'?``). A checkpoint's ``monitor`` naming no metric gets the
  same words as a warning, since its checkpoints are still written; early stopping with no
  metric could never stop the run, so it does not let it train on as if it could.
* Its state (best value, its epoch, its direction, epochs without improvement) is saved in
  checkpoints, so a resumed run decides as the uninterrupted one would. A run resumed after it
  stopped stops again before its first batch, with a warning that says so, unless given a larger ``patience``.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Literal, Mapping

from hookfit import hookimpl
from hookfit.config import records_options
from hookfit.errors import HookfitWarning, user_level
from hookfit.manager import chosen
from hookfit.payloads import MetricsSnapshot
from hookfit.plugins.support import Every, Monitor, integer

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

__all__ = ["EarlyStopping"]


@records_options
class EarlyStopping:
    """Stop training when ``monitor`` has not improved for ``patience`` epochs (validations,
    with ``Loop(val_every_n_steps=N)`` or ``val_every_n_epochs=N``; see the module documentation). Every option is checked
    here, with a ``ValueError`` naming it."""

    name = "early_stopping"

    def __init__(self, monitor: str | None = None, mode: Literal["min", "max"] | None = None, patience: int = 3,
                 min_delta: float = 0.0) -> None:
        self._monitor = Monitor(monitor, mode, min_delta, plugin=self.name, category=HookfitWarning)  # checks all three
        self._monitor.qualified(mode=mode, min_delta=min_delta or None)
        self.patience = integer(self.name, "patience", patience, least=0, meaning="epochs")
        self.monitor = monitor
        self.mode = mode
        """The ``mode`` given (``None``: the direction the metrics plugin publishes, else ``"min"``)."""
        self.min_delta = self._monitor.min_delta
        self._reset()

    @property
    def best(self) -> float | None:
        """The best value of ``monitor`` so far (``None`` before a finite one)."""
        return self._monitor.best

    @property
    def best_epoch(self) -> int | None:
        """The epoch of :attr:`best`, from 0 as ``loop.state.epoch``."""
        at = self._monitor.best_at
        return None if at is None else at[0]

    @property
    def best_step(self) -> int | None:
        """The global step at which :attr:`best` was published."""
        at = self._monitor.best_at
        return None if at is None else at[1]

    def _reset(self) -> None:
        self._monitor.start()
        self.wait = 0  # epochs in a row without improvement
        self._heard: int | None = None  # the last epoch whose monitored stage was published
        self._epoch_step = 0  # the global step as the current epoch started

    # -- events -----------------------------------------------------------------------------
    def inert(self, chosen: bool) -> str | None:
        """What ``hookfit plugins`` says of it (:func:`hookfit.discovery.inert`): inert until
        given a ``monitor``."""
        if self.monitor is not None:
            return None
        return ('given a monitor: EarlyStopping(monitor="valid/loss") in Loop(plugins=[...]), or '
                'monitor = "valid/loss" in [plugins.early_stopping] of hookfit.toml')

    @hookimpl
    def configure(self, loop: Run) -> None:
        self._reset()  # a state from a checkpoint comes later (load_state)
        if (how := self.inert(True)) is None:
            return
        if chosen(loop.pm, self):  # asked for, and it would do nothing
            warnings.warn(f"early_stopping: chosen for this run but without a monitor it never stops the run; "
                          f"it is inert until {how}", HookfitWarning, stacklevel=user_level())
        loop.pm.unregister(self)  # inert, as hookfit plugins says: not in the run, none of its hooks is called

    @hookimpl
    def fit_start(self, loop: Run) -> None:
        # a stop it could never decide, or a monitor no set's (said now, not after the first validation)
        if (never := self._monitor.never(loop) or self._monitor.unset(loop)) is not None:
            raise ValueError(never)

    @hookimpl
    def epoch_start(self, loop: Run, epoch: int) -> None:
        self._epoch_step = loop.state.step
        if self.monitor is not None and self.wait and self.wait >= self.patience:
            # resumed after it stopped (a best or none: a metric never finite stops as well): no batch
            warnings.warn(f"early_stopping: the run resumed had stopped early ({self._reason(loop)}): this fit trains "
                          f"nothing and ends at once, completed as before; to train on, give EarlyStopping(patience=...)"
                          f" above {self.wait}, or disable early_stopping", HookfitWarning, stacklevel=user_level())
            loop.request_stop(self._reason(loop), complete=True)

    @hookimpl
    def epoch_metrics(self, loop: Run, stage: str, metrics: MetricsSnapshot) -> None:
        key = self._monitor.key  # None exactly when there is no monitor
        if key is None or stage != self._monitor.stage:
            return
        self._heard = metrics.epoch
        if key not in metrics.values:  # the earliest it can know: no batch, checkpoint or epoch_end after it
            if loop.stop_requested is not None:  # a stage a stop cut short (a set of several not reached): no answer
                return
            raise ValueError(self._monitor.absent(metrics.values, metrics.epoch))
        self._monitor.follow(metrics.best)  # the direction in force, before comparing
        if self._monitor.update(float(metrics.values[key].epoch), at=(metrics.epoch, metrics.step)):
            self.wait = 0
        else:
            self.wait += 1
        if self._by_step(loop) and self.wait and self.wait >= self.patience:
            loop.request_stop(self._reason(loop), complete=True)  # at this validation's stage_end

    @hookimpl
    def epoch_end(self, loop: Run, epoch: int) -> None:
        if self.monitor is None:
            return
        if self._heard != epoch and self._published(loop, epoch):
            raise ValueError(
                f"early_stopping: monitor={self.monitor!r}, and no plugin published the "
                f"{self._monitor.stage} metrics of epoch {epoch + 1} (epoch_metrics): is the "
                f"metrics plugin enabled?"
            )
        if self._heard == epoch and self.wait and self.wait >= self.patience and not self._by_step(loop):
            loop.request_stop(self._reason(loop), complete=True)

    @hookimpl
    def save_state(self) -> dict[str, Any] | None:
        if self.monitor is None:
            return None
        return {"monitor": self.monitor, "best": self.best, "best_epoch": self.best_epoch, "wait": self.wait,
                "best_step": self.best_step, "mode": self._monitor.mode}

    @hookimpl
    def load_state(self, state: Mapping[str, Any]) -> None:
        if self.monitor is None:
            return
        if state.get("monitor") != self.monitor:
            return  # it watched another metric: its best says nothing about this one; start fresh
        self._monitor.reset(state["best"], (state["best_epoch"], state.get("best_step")), state.get("mode"))
        self.wait = int(state["wait"])

    # -- deciding ---------------------------------------------------------------------------
    def _published(self, loop: Run, epoch: int) -> bool:
        """Whether the monitored stage ran in ``epoch`` (validation may run every n epochs)."""
        if self._monitor.stage == "train":
            return True
        if loop.val_step is None:
            return False
        if loop.val_every_n_steps is not None:  # a multiple of N among this epoch's steps
            return Every(loop.val_every_n_steps).between(self._epoch_step, loop.state.step) > 0
        return Every(loop.val_every_n_epochs).due(epoch + 1)

    def _by_step(self, loop: Run) -> bool:
        """Whether the monitored metric comes from validations inside training, counted one
        by one rather than by epoch."""
        return loop.val_every_n_steps is not None and self._monitor.stage == "valid"

    def _every_few(self, loop: Run) -> bool:
        """Whether the monitored metric comes from validations every few epochs (``val_every_n_epochs`` > 1),
        each counted once: patience is then a number of validations, as with validations inside training."""
        return self._monitor.stage == "valid" and (loop.val_every_n_epochs or 1) > 1

    def _reason(self, loop: Run) -> str:
        by = f" by more than {self.min_delta:g}" if self.min_delta else ""
        record = self._monitor.record  # (best, (its epoch, its step)): the best and where, together
        if record is None:
            best = "none"
        else:
            value, (epoch, step) = record
            if self._by_step(loop) and step is not None:
                best = f"{value:.6g} at step {step} (epoch {epoch + 1})"
            else:
                best = f"{value:.6g} at epoch {epoch + 1}"
        counted = "validation(s)" if self._by_step(loop) or self._every_few(loop) else "epoch(s)"
        return (f"early stopping: {self.monitor} did not improve{by} for {self.wait} {counted} "
                f"(patience {self.patience}); best ({self._monitor.mode}) {best}")
