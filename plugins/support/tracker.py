"""What the experiment trackers (``mlflow``, ``wandb``) share: when a discovered tracker is on,
its run id in checkpoints, which values it logs at which global step, and the order of its
events. A tracker says how to start (or continue) its tracker run, how to log values at a step,
how to keep a checkpoint and how to end."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hookfit import hookimpl
from hookfit.payloads import MetricsSnapshot
from hookfit.plugins.support.logger import inert as logger_inert
from hookfit.plugins.support.logger import wanted

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run


def require(plugin: str, module: str, package: str, install: str) -> None:
    """Say how to install a tracker's package if it is not installed (without importing it:
    trackers' packages are slow to import)."""
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"{plugin}: the plugin needs the {package}, which is not installed; "
                          f"install it with `{install}`")


class Tracker:
    """The events every tracker handles alike (see :mod:`hookfit.plugins.mlflow` and
    :mod:`hookfit.plugins.wandb` for what each records). A subclass sets ``name``,
    ``run_label`` (what its run id is, for errors), ``enabled``, ``every_publication`` and
    ``log_checkpoints``, and implements :meth:`_require`, :meth:`_open` (start or continue the
    tracker run: whether there is one), :meth:`_log`, :meth:`_keep` and :meth:`_close`."""

    name = "tracker"
    run_label = "a tracker run id"
    observer = True  # a logger: its failures switch it off, never the run
    inert = logger_inert  # what hookfit plugins says of it (hookfit.discovery.inert)
    enabled: bool | None
    every_publication: bool
    log_checkpoints: bool

    def __init__(self) -> None:
        self.run_id: str | None = None
        """The tracker run of the current or last run (``None`` before its first epoch, and when off)."""
        self._resume_id: str | None = None  # the tracker run a checkpoint's state names
        self._lr_step: int | None = None
        self._off = False  # not the main process: nothing to log in this run
        self._step: int | None = None  # the step of the last values logged
        self._at_step: set[str] = set()  # the metrics logged at that step
        self._checkpoint: tuple[int, frozenset[str]] | None = None  # a checkpoint's step, what it had logged there

    # -- events -------------------------------------------------------------------------------
    @hookimpl
    def configure(self, loop: Run) -> None:
        self._reset()
        self.run_id, self._resume_id, self._lr_step, self._off = None, None, None, False
        self._step, self._at_step, self._checkpoint = None, set(), None
        if not wanted(loop, self, self.enabled):
            loop.pm.unregister(self)  # inert: none of the hooks below costs anything
            return
        self._require()  # an observer: a missing package is one warning, and training goes on

    @hookimpl
    def load_state(self, loop: Run, state: Any) -> None:
        run_id = state.get("run_id") if isinstance(state, Mapping) else None
        step, logged = (state.get("step"), state.get("logged", ())) if isinstance(state, Mapping) else (None, ())
        if not isinstance(run_id, str) or not run_id or not (step is None or isinstance(step, int)) or not (
                isinstance(logged, (list, tuple)) and all(isinstance(key, str) for key in logged)):
            raise ValueError(f"{self.name}: the checkpoint's state of this plugin is {state!r}; expected "
                             f"{{'run_id': <{self.run_label}>}}, with the 'step' it was saved at and the "
                             f"metrics 'logged' at that step")
        if loop.mode == "fit":  # an evaluation (Loop.validate(resume=...)) is a tracker run of its own
            self._resume_id = run_id
            self._checkpoint = None if step is None else (step, frozenset(logged))

    @hookimpl
    def save_state(self, loop: Run) -> Any:
        self._start(loop)
        if self.run_id is None:
            return None
        step = loop.state.step
        return {"run_id": self.run_id, "step": step, "logged": sorted(self._at_step) if step == self._step else []}

    @hookimpl
    def epoch_start(self, loop: Run) -> None:
        self._start(loop)

    @hookimpl
    def metrics_update(self, loop: Run, stage: str, metrics: MetricsSnapshot) -> None:
        if stage == "train" and self.every_publication and self._start(loop):
            values = {f"train_step/{key}": value.running for key, value in metrics.values.items()}
            self._record(metrics.step, {**values, **self._rates(metrics)})

    @hookimpl
    def epoch_metrics(self, loop: Run, stage: str, metrics: MetricsSnapshot) -> None:
        if not self._start(loop):
            return
        values: dict[str, float] = {f"{stage}/{key}": value.epoch for key, value in metrics.values.items()}
        if stage == "train":
            values.update({"epoch": metrics.epoch + 1, **self._rates(metrics)})
        self._record(metrics.step, values)

    @hookimpl
    def checkpoint_saved(self, loop: Run, path: str, reason: str, step: int) -> None:
        if self.log_checkpoints and not loop.smoke and self._start(loop):  # (a smoke run keeps no checkpoint)
            self._keep(path, reason, step, folder=os.path.isdir(path))  # a folder: a sharded checkpoint

    @hookimpl(trylast=True)  # after the checkpoint plugin's last save and announcement
    def fit_end(self, loop: Run) -> None:
        self._close(loop, self._running())  # never starts one: a run failed before its first epoch logs nothing

    # -- what every tracker shares --------------------------------------------------------------
    def _start(self, loop: Run) -> bool:
        """Start (or continue) the tracker run on first use; whether there is one to log to."""
        if self._running():
            return True
        if self._off or self.run_id is not None or not loop.is_main:  # not main, or ended already
            self._off = True
            return False
        return self._open(loop)

    def _record(self, step: int, values: dict[str, float]) -> None:
        """Log ``values`` at ``step``, keeping which metrics have been logged at the latest step
        (what a checkpoint taken now has logged there: this plugin's state)."""
        values = {self._key(key): value for key, value in values.items()}
        if step != self._step:
            self._step, self._at_step = step, set()
        self._at_step.update(values)
        self._log(step, values)

    def logged_after_checkpoint(self, key: str, step: int) -> bool:
        """Whether the tracker run's point of ``key`` at ``step`` was logged after the
        checkpoint this run resumed from, at its step: the means of a stage that a stop cut
        short, which the resumed run logs again, whole (a tracker that can log a second point
        at a step it has logs it; none can remove the first)."""
        checkpoint = self._checkpoint
        return checkpoint is not None and step == checkpoint[0] and key not in checkpoint[1]

    def _rates(self, metrics: MetricsSnapshot) -> dict[str, float]:
        """``lr/<optimizer>`` values, once per global step."""
        if not metrics.lr or self._lr_step == metrics.step:
            return {}
        self._lr_step = metrics.step
        return {f"lr/{name}": rate for name, rate in metrics.lr.items()}

    # -- what each tracker does its own way ------------------------------------------------------
    def _key(self, name: str) -> str:
        """A metric's name (``<stage>/<metric>``, ``lr/<optimizer>``...) as the tracker takes it."""
        return name

    def _reset(self) -> None:
        """Forget the last run's tracker objects (at ``configure``)."""

    def _require(self) -> None:  # pragma: no cover - every tracker has its own
        raise NotImplementedError

    def _running(self) -> bool:  # pragma: no cover
        """Whether a tracker run is open in this process."""
        raise NotImplementedError

    def _open(self, loop: Run) -> bool:  # pragma: no cover
        """Start the tracker run, or continue ``self._resume_id``'s; set ``self.run_id``."""
        raise NotImplementedError

    def _log(self, step: int, values: dict[str, float]) -> None:  # pragma: no cover
        """Log ``values`` at the global ``step``, leaving out steps the tracker run already has."""
        raise NotImplementedError

    def _keep(self, path: str, reason: str, step: int, folder: bool) -> None:  # pragma: no cover
        """Keep the checkpoint at ``path`` with the tracker run."""
        raise NotImplementedError

    def _close(self, loop: Run, running: bool) -> None:  # pragma: no cover
        """End the tracker run (``running``: there is one) with the run's final status."""
        raise NotImplementedError
