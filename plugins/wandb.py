"""wandb: the run in Weights & Biases: hyperparameters, metrics at the global step, learning
rates, checkpoints as artifacts (optional) and the final status.

``Loop(plugins=[WandB(project="digits")])``, or ``[plugins.wandb]`` in ``hookfit.toml``
(an empty table is enough). Discovered like every plugin, it is inert until then: the run
leaves it out before ``configure`` (:func:`hookfit.manager.leave_inert`), so no event of the run
reaches it, not even ``fit_end`` after a start-up that failed. ``WandB(enabled=False)``
switches it off wherever it comes from (given, it unregisters itself at ``configure``). It
needs the ``wandb`` package (``pip install
hookfit[wandb]``); without it, a run that wants it gets one warning naming that command and
trains on (an ``enabled=True`` given in code fails at once). Online, log in first (``wandb
login`` or ``WANDB_API_KEY``); ``mode="offline"`` (or ``WANDB_MODE=offline``) writes the run to
disk only, for ``wandb sync`` later. A smoke run (``HOOKFIT_SMOKE=1``) logs offline into its temporary
folder, so nothing reaches the project.

What it records, in a W&B run of ``project`` (the run's name by default: ``train`` for ``python
train.py``) named ``run_name`` (by default the run folder's name, ``<date>-<time>``), whose
files W&B keeps under ``dir`` (by default ``WANDB_DIR``, else the run folder: ``<run
folder>/wandb/``):

* Config: the run's hyperparameters (:func:`hookfit.plugins.support.run_hparams`: the ``Loop``'s
  settings, the optimizers' classes and settings, every plugin's options), and whatever
  ``WandB(hparams={...})`` adds, with the run folder as ``hookfit.run_dir``.
* Metrics, at the global step (W&B's ``step``), with the same names as the ``tensorboard``
  plugin's: ``<stage>/<metric>``, the epoch means the metrics plugin publishes at the end of a
  stage (``epoch_metrics``), and ``epoch`` (counted from 1) when a training stage ends;
  ``train_step/<metric>``, the running means of every training publication (``metrics_update``;
  ``every_publication=False`` leaves them out); ``lr/<optimizer>``, each optimizer's learning
  rate, once per global step. What is logged at one step is one row of the run's history.
* Checkpoints, with ``log_checkpoints=True``: every checkpoint the checkpoint plugin announces
  (``checkpoint_saved``) as a version of the artifact ``checkpoint-<run id>`` (type ``model``),
  with the aliases ``latest`` and ``step-<step>`` and its ``reason`` and ``step`` as metadata.
* The end (``fit_end``, after every other plugin's, so after the last checkpoint):
  ``hookfit/status`` and ``hookfit/stop_reason`` in the run's summary, and the run finished
  with exit code 1 for a failed run, 0 otherwise.

The W&B run starts when the run's first epoch does (after a resume: ``load_state`` has run).
Its id is this plugin's state in every checkpoint, so a resumed run (``Loop(resume=...)``)
continues the same W&B run (``resume="allow"``), its config updated, and logs only the steps
after the last one W&B has. Offline, W&B cannot look a run up: the resumed run writes a new
offline run folder with the same id, which starts at the step after the checkpoint's (a run
killed after its last checkpoint wrote a few steps past it, which ``wandb sync`` then has twice).
W&B cannot remove a row of a run's history either, so a run stopped inside a stage leaves
what it logged of that stage after its checkpoint, its means so far at the stop's step
(``train/<metric>`` and ``epoch`` inside a training stage, ``valid/<metric>`` inside a
validation): a training stage's are one point more than the uninterrupted run has, before the
stage's whole means at the epoch's end; a validation's stay the values at that step of an
online run, which takes no row at a step it has passed (offline, the resumed run's folder has
the whole ones at the same step, after them).
``Loop.validate(resume=...)`` is a W&B run of its own: it never changes the training's.
W&B writes its files from a process of its own (its service): an offline run's file is whole
a moment after ``fit()`` returns, and always once the script has ended.

``init`` passes more arguments to ``wandb.init`` (``{"tags": [...], "group": ..., "notes":
...}``); ``settings`` in it default to ``{"console": "off"}``, so W&B does not take over the
output the console and the dashboard print. Only the main process logs (under ``torchrun`` the
distributed plugin switches observers off on the others). An observer: if W&B fails, the plugin
is switched off with one warning naming it, and training goes on.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hookfit.config import records_options
from hookfit.plugins.support.tracker import Tracker, require
from hookfit.plugins.support import Hparam, check, choice, flag, hyperparameters, path, run_hparams, text

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

__all__ = ["INSTALL", "MODES", "WandB"]

INSTALL = "pip install hookfit[wandb]"
"""The command that installs what this plugin needs."""

MODES = ("online", "offline", "disabled")
"""W&B's modes: ``mode=None`` leaves the choice to W&B (``WANDB_MODE``, else online)."""

MANAGED = frozenset({"project", "entity", "name", "dir", "mode", "config", "id", "resume", "reinit",
                     "allow_val_change"})
"""``wandb.init`` arguments this plugin sets itself, which ``init`` may not give."""


def _require() -> None:
    """Say how to install W&B if it is not installed (without importing it: it is slow)."""
    require("wandb", "wandb", "wandb package", INSTALL)


def _smoke_mode(mode: str | None) -> str:
    """A smoke run's W&B mode: ``"disabled"`` where that is asked (the option, else ``WANDB_MODE``), else offline."""
    return "disabled" if (mode or os.environ.get("WANDB_MODE")) == "disabled" else "offline"


@records_options
class WandB(Tracker):
    """Logs the run to Weights & Biases: hyperparameters, metrics at the global step, learning
    rates, checkpoints (optional) and the final status (see the module documentation). Options
    are checked here, with a ``ValueError`` naming them.

    * ``project``: the W&B project; ``None``: the run's name.
    * ``mode``: ``"online"``, ``"offline"`` or ``"disabled"``; ``None``: W&B's own choice.
    * ``entity``: the W&B user or team; ``None``: W&B's default.
    * ``run_name``: the W&B run's display name; ``None``: the run folder's name.
    * ``dir``: where W&B keeps its files; ``None``: ``WANDB_DIR``, else the run folder.
    * ``log_checkpoints``: log every finished checkpoint as a version of an artifact.
    * ``every_publication``: also log the training stage's running means at every publication.
    * ``hparams``: more config values (names to numbers, strings or booleans) for the run's own.
    * ``init``: more keyword arguments of ``wandb.init`` (not those this plugin sets).
    * ``enabled``: ``None`` (the default): on when given to ``Loop(plugins=[...])`` or
      configured in ``hookfit.toml``, off when only discovered; ``True``/``False`` force it.
    """

    name = "wandb"
    run_label = "a W&B run id"

    def __init__(self, project: str | None = None, mode: str | None = None, entity: str | None = None,
                 run_name: str | None = None, dir: str | os.PathLike[str] | None = None,
                 log_checkpoints: bool = False, every_publication: bool = True,
                 hparams: Mapping[str, Any] | None = None, init: Mapping[str, Any] | None = None,
                 enabled: bool | None = None) -> None:
        self.project = text(self.name, "project", project, none=True)
        self.mode: str | None = choice(self.name, "mode", mode, MODES, none=True)
        self.entity = text(self.name, "entity", entity, none=True)
        self.run_name = text(self.name, "run_name", run_name, none=True)
        self.dir: str | os.PathLike[str] | None = path(self.name, "dir", dir, none=True, what="a folder")
        self.log_checkpoints = flag(self.name, "log_checkpoints", log_checkpoints)
        self.every_publication = flag(self.name, "every_publication", every_publication)
        self.hparams: dict[str, Hparam] = hyperparameters(self.name, "hparams", hparams)
        """The config values given here (the run's own are added when the W&B run starts)."""
        check(self.name, "init", init, lambda v: v is None or (isinstance(v, Mapping) and all(
            isinstance(k, str) for k in v)), "map wandb.init's argument names to values, or be None")
        taken = sorted(MANAGED.intersection(init or {}))
        if taken:
            raise ValueError(f"wandb: init may not give {', '.join(taken)}: the plugin sets them (options "
                             f"project, entity, run_name, dir, mode, hparams; the run id comes from checkpoints)")
        self.init: dict[str, Any] = dict(init or {})
        self.enabled = flag(self.name, "enabled", enabled, none=True)
        if enabled:
            _require()  # asked for in so many words: say what is missing now, not at fit()
        super().__init__()
        self.run: Any = None
        """The ``wandb`` run of the current run (``None`` before its first epoch, after its end, and when off)."""
        self._first = 0  # the first step the W&B run has no row for

    # -- the W&B run --------------------------------------------------------------------------
    def _reset(self) -> None:
        self.run, self._first = None, 0

    def _require(self) -> None:
        _require()

    def _running(self) -> bool:
        return self.run is not None

    def _keep(self, path: str, reason: str, step: int, folder: bool) -> None:
        wandb = importlib.import_module("wandb")
        artifact = wandb.Artifact(f"checkpoint-{self.run_id}", type="model", metadata={"reason": reason, "step": step})
        if folder:
            artifact.add_dir(path, name=os.path.basename(path))
        else:
            artifact.add_file(path, name=os.path.basename(path))
        self.run.log_artifact(artifact, aliases=["latest", f"step-{step}"])

    def _close(self, loop: Run, running: bool) -> None:
        run = self.run if running else None
        self.run = None
        if run is not None:
            state = loop.state
            run.summary.update({"hookfit/status": state.status, "hookfit/stop_reason": state.stop_reason or ""})
            run.finish(exit_code=1 if state.status == "failed" else 0)

    def _open(self, loop: Run) -> bool:
        wandb = importlib.import_module("wandb")
        config: dict[str, Any] = {**run_hparams(loop, self.hparams), "hookfit.run_dir": os.path.abspath(loop.run_dir)}
        # WANDB_DIR as it is now: W&B reads its environment once a process, at its first run; and
        # absolute: the W&B service that writes the files may be another process's, elsewhere
        # a smoke run keeps nothing: offline, in its temporary folder
        folder = os.path.abspath(loop.run_dir if loop.smoke else self.dir or os.environ.get("WANDB_DIR") or loop.run_dir)
        os.makedirs(folder, exist_ok=True)
        options = {"settings": {"console": "off"}, **self.init}
        resume = self._resume_id
        run = wandb.init(project=self.project or loop.name, entity=self.entity, name=self.run_name or loop.run_dir.name,
                         dir=folder, mode=_smoke_mode(self.mode) if loop.smoke else self.mode, id=resume,
                         resume="allow" if resume else None, reinit="create_new", config=config,
                         allow_val_change=True, **options)
        if resume and run.resumed:  # online: W&B has the run's rows up to its step
            run.config.update(config, allow_val_change=True)
            self._first = run.step
        self.run, self.run_id = run, run.id
        return True

    def _log(self, step: int, values: dict[str, float]) -> None:
        """One history row at ``step`` (several calls at one step are one row), unless W&B has it."""
        if step >= self._first and values:
            self.run.log(values, step=step)
