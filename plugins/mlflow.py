"""mlflow: the run in an MLflow tracking store: hyperparameters, metrics at the global step,
learning rates, checkpoints as artifacts (optional) and the final status.

``Loop(plugins=[MLflow(tracking_uri="sqlite:///mlflow.db", experiment="digits")])``, or
``[plugins.mlflow]`` in ``hookfit.toml`` (an empty table is enough).
Discovered like every plugin, it is inert until then: the run leaves it out before
``configure`` (:func:`hookfit.manager.leave_inert`), so no event of the run reaches it, not
even ``fit_end`` after a start-up that failed. ``MLflow(enabled=False)`` switches it off
wherever it comes from (given, it unregisters itself at ``configure``). It
needs MLflow (``pip install hookfit[mlflow]``: ``mlflow-skinny`` with SQLAlchemy and Alembic,
for a SQLite or other database store, a tracking server, or Databricks; the full ``mlflow``
package works as well); without it, a run that wants it gets one warning naming that command
and trains on (an ``enabled=True`` given in code fails at once). A smoke run (``HOOKFIT_SMOKE=1``)
logs to a SQLite store in its temporary folder, so nothing reaches the tracking store.

What it records, through ``mlflow.tracking.MlflowClient`` (MLflow's global active run is left
alone), in the experiment ``experiment`` (the run's name by default: ``train`` for ``python
train.py``), as a tracker run named ``run_name`` (by default the run folder's name,
``<date>-<time>``), tagged ``hookfit.run_dir`` with the run folder:

* Parameters: the run's hyperparameters (:func:`hookfit.plugins.support.run_hparams`: the
  ``Loop``'s settings, the optimizers' classes and settings, every plugin's options), and
  whatever ``MLflow(hparams={...})`` adds, logged when the tracker run starts.
* Metrics, at the global step, with the same names as the ``tensorboard`` plugin's:
  ``<stage>/<metric>``, the epoch means the metrics plugin publishes at the end of a stage
  (``epoch_metrics``), and ``epoch`` (counted from 1) when a training stage ends;
  ``train_step/<metric>``, the running means of every training publication
  (``metrics_update``; ``every_publication=False`` leaves them out); ``lr/<optimizer>``, each
  optimizer's learning rate, once per global step. A name MLflow refuses (``acc (top1)``) is
  written with ``_`` for each character it does not take (:func:`metric_key`), said once a run.
* Checkpoints, with ``log_checkpoints=True``: every checkpoint the checkpoint plugin announces
  (``checkpoint_saved``) is copied to the run's artifacts under ``checkpoints/``.
* The end (``fit_end``, after every other plugin's, so after the last checkpoint): the tracker
  run's status, ``FINISHED`` for a completed run, ``FAILED`` for a failed one, ``KILLED`` for an
  interrupted one, and the tags ``hookfit.status`` and ``hookfit.stop_reason``.

The tracker run starts when the run's first epoch does (after a resume: ``load_state`` has
run). Its id is this plugin's state in every checkpoint (with the checkpoint's step and the
metrics logged at it), so a resumed run (``Loop(resume=...)``) continues the same tracker run:
it sets it running again and logs the parameters it did not have. A parameter the resumed run
changed, such as ``max_epochs``, keeps its first value, as MLflow requires, and one
``HookfitWarning`` names it (the optimizers' settings are read after the checkpoint's state was
loaded into them: a learning rate a schedule changed is no change). It logs no step twice: for
every metric, the points at steps the tracker run already has (a run killed after its last
checkpoint logged past it) are left out, so each metric's history has each step once, with
one exception. A run stopped inside a stage logs that stage's means so far at the stop's step
(``train/<metric>`` and ``epoch`` inside a training stage, ``valid/<metric>`` inside a
validation), after its checkpoint; the resumed run logs the stage whole at its end, and MLflow
cannot remove a logged point, so the history keeps both: a training stage's partial means are
one point more than the uninterrupted run has, at the stop's step, and a validation's whole
means come as a second point at the same step as its partial ones (the later one, which MLflow
reads as the value at that step). Every other point is the uninterrupted run's.
``Loop.validate(resume=...)`` is an MLflow run of its own: it never changes the training's.

Only the main process logs (under ``torchrun`` the distributed plugin switches observers off on
the others): two processes creating the same SQLite store at once is what fails a run that logs
from every rank. An observer: a tracking store that fails (unreachable, full) switches the
plugin off with one warning naming it, and training goes on.
"""

from __future__ import annotations

import importlib
import os
import re
import time
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hookfit.config import records_options
from hookfit.errors import HookfitWarning, user_level
from hookfit.plugins.support.logger import SafeNames
from hookfit.plugins.support.tracker import Tracker, require
from hookfit.plugins.support import Hparam, flag, hyperparameters, path, run_hparams, text

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

__all__ = ["INSTALL", "MLflow"]

INSTALL = "pip install hookfit[mlflow]"
"""The command that installs what this plugin needs."""

STATUS = {"completed": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}
"""The MLflow status of a run that ended with each of hookfit's statuses."""

_BATCH = 100  # MLflow takes at most 100 parameters in one log_batch
_NOT_IN_NAMES = re.compile(r"[^-/\w. ]")


def metric_key(name: str) -> str:
    """``name`` as MLflow takes a metric's: each character but letters, digits, ``_``, ``-``, ``.``, space and
    ``/`` as ``_``, and ``_`` for an empty, ``.`` or ``..`` part between slashes (MLflow refuses both)."""
    return "/".join(p if p not in ("", ".", "..") else "_" for p in _NOT_IN_NAMES.sub("_", name).split("/"))


def _require() -> None:
    """Say how to install MLflow if it is not installed (without importing it: it is slow)."""
    require("mlflow", "mlflow", "mlflow package (mlflow-skinny or mlflow)", INSTALL)


@records_options
class MLflow(Tracker):
    """Logs the run to MLflow: hyperparameters, metrics at the global step, learning rates,
    checkpoints (optional) and the final status (see the module documentation). Options are
    checked here, with a ``ValueError`` naming them.

    * ``tracking_uri``: where the tracking store is (``"sqlite:///mlflow.db"``,
      ``"http://host:5000"``, ``"databricks"``...); ``None`` (the default): MLflow's own
      (``MLFLOW_TRACKING_URI``, else its default).
    * ``experiment``: the experiment's name, created if missing; ``None``: the run's name.
    * ``run_name``: the tracker run's name; ``None``: the run folder's name.
    * ``log_checkpoints``: copy every finished checkpoint to the run's artifacts.
    * ``every_publication``: also log the training stage's running means at every publication.
    * ``hparams``: more parameters (names to numbers, strings or booleans) to log with the
      run's own (they win on a clash).
    * ``enabled``: ``None`` (the default): on when given to ``Loop(plugins=[...])`` or
      configured in ``hookfit.toml``, off when only discovered; ``True``/``False`` force it.
    """

    name = "mlflow"
    run_label = "an MLflow run id"

    def __init__(self, tracking_uri: str | os.PathLike[str] | None = None, experiment: str | None = None,
                 run_name: str | None = None, log_checkpoints: bool = False, every_publication: bool = True,
                 hparams: Mapping[str, Any] | None = None, enabled: bool | None = None) -> None:
        self.tracking_uri: str | None = None if tracking_uri is None else os.fspath(
            path(self.name, "tracking_uri", tracking_uri, none=True, what="a tracking URI or a folder"))
        self.experiment = text(self.name, "experiment", experiment, none=True)
        self.run_name = text(self.name, "run_name", run_name, none=True)
        self.log_checkpoints = flag(self.name, "log_checkpoints", log_checkpoints)
        self.every_publication = flag(self.name, "every_publication", every_publication)
        self.hparams: dict[str, Hparam] = hyperparameters(self.name, "hparams", hparams)
        """The parameters given here (the run's own are added when the tracker run starts)."""
        self.enabled = flag(self.name, "enabled", enabled, none=True)
        if enabled:
            _require()  # asked for in so many words: say what is missing now, not at fit()
        super().__init__()
        self._client: Any = None
        self._entities: Any = None
        self._last: dict[str, int] = {}  # metric -> the last step the tracker run has (a resumed one)
        self._names = SafeNames(self.name, metric_key, "in MLflow (a metric's name takes letters, digits, '_', "
                                                        "'-', '.', ' ' and '/' only, no empty part")

    # -- the tracker run ----------------------------------------------------------------------
    def _reset(self) -> None:
        self._client, self._last = None, {}
        self._names.reset()

    def _key(self, name: str) -> str:
        return self._names.of(name)

    def _require(self) -> None:
        _require()

    def _running(self) -> bool:
        return self._client is not None

    def _keep(self, path: str, reason: str, step: int, folder: bool) -> None:
        if folder:
            self._client.log_artifacts(self.run_id, path, artifact_path=f"checkpoints/{os.path.basename(path)}")
        else:
            self._client.log_artifact(self.run_id, path, artifact_path="checkpoints")

    def _close(self, loop: Run, running: bool) -> None:
        if running:
            state = loop.state
            tags = {"hookfit.status": state.status, "hookfit.stop_reason": state.stop_reason or ""}
            self._client.log_batch(self.run_id, tags=[self._entities.RunTag(k, v) for k, v in tags.items()])
            self._client.set_terminated(self.run_id, STATUS.get(state.status, "FINISHED"))
        self._client = None

    def _open(self, loop: Run) -> bool:
        # a smoke run keeps nothing: a store of its own in its temporary folder
        uri = f"sqlite:///{os.path.abspath(loop.run_dir / 'mlflow.db')}" if loop.smoke else self.tracking_uri
        client = importlib.import_module("mlflow.tracking").MlflowClient(tracking_uri=uri)
        self._entities = importlib.import_module("mlflow.entities")
        params = {key: str(value) for key, value in run_hparams(loop, self.hparams).items()}
        if self._resume_id is not None:
            run = client.get_run(self._resume_id)
            client.update_run(run.info.run_id, status="RUNNING")
            had = run.data.params
            changed = sorted(key for key, value in params.items()  # (not the optimizers' state, as resumed)
                             if key in had and had[key] != value and not key.startswith("optimizer."))
            if changed:
                warnings.warn(f"mlflow: run {run.info.run_id} keeps the parameters it started with, as MLflow "
                              f"requires; this resumed run changed {', '.join(changed)}", HookfitWarning,
                              stacklevel=user_level())
            params = {key: value for key, value in params.items() if key not in had}
            last = {key: max((m.step for m in client.get_metric_history(run.info.run_id, key)), default=-1)
                    for key in run.data.metrics}
            self._last = {key: step - 1 if self.logged_after_checkpoint(key, step) else step
                          for key, step in last.items()}
        else:
            name = self.experiment or loop.name
            experiment = client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment is not None else client.create_experiment(name)
            run = client.create_run(experiment_id, run_name=self.run_name or loop.run_dir.name,
                                    tags={"hookfit.run_dir": os.path.abspath(loop.run_dir)})
        self._client, self.run_id = client, run.info.run_id
        items = sorted(params.items())
        for start in range(0, len(items), _BATCH):
            client.log_batch(self.run_id, params=[self._entities.Param(k, v) for k, v in items[start:start + _BATCH]])
        return True

    def _log(self, step: int, values: dict[str, float]) -> None:
        """Log ``values`` at ``step`` in one call, leaving out the steps the tracker run has."""
        now, last = int(time.time() * 1000), self._last
        points = [self._entities.Metric(key, float(value), now, step) for key, value in values.items()
                  if step > last.get(key, -1)]
        if points:
            self._client.log_batch(self.run_id, metrics=points)
