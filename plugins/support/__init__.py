"""Not a plugin: what the plugins share, written once for the built-in plugins and for third-party
plugin authors alike (the core uses none of it). The names below are its public face; each lives in
a module of one concern:

* option checking (:mod:`~hookfit.plugins.support.options`): every option checked when the plugin
  is built, a bad one a ``ValueError`` naming the plugin, the option, what it must be and the value;
* a cadence (:class:`Every`, :mod:`~hookfit.plugins.support.cadence`): ``Every(3).due(6)``, as
  Ignite's ``Events.X(every=n)``;
* a metric watched for its best value (:class:`Monitor`, :mod:`~hookfit.plugins.support.best`), and
  whether a stage's epoch value is whole enough to be best (:func:`cut_short`);
* the user's module inside its wrappers (:func:`unwrap_model`, :mod:`~hookfit.plugins.support.models`):
  ``DistributedDataParallel``/``DataParallel`` (``.module``) and ``torch.compile`` (``._orig_mod``),
  and its parameters' names (:func:`parameter_names`; a few of them as messages name them, :func:`few_parameters`);
* gradients watched for a while (:class:`GradientWatch`, :mod:`~hookfit.plugins.support.gradients`), whether
  those that arrived were accumulated into ``.grad`` (:class:`Accumulation`: not by ``torch.autograd.grad``), and
  the order a step function back-propagates, steps and clears them in (:class:`StepOrder`), and whether it
  changes those an accumulation window holds between its passes (:class:`Untouched`);
* a run's hyperparameters as the loggers record them (:func:`run_hparams`,
  :mod:`~hookfit.plugins.support.hparams`);
* advice for data that holds a stage up (:func:`faster_data`, :mod:`~hookfit.plugins.support.loading`).

Besides, imported from their modules: a model's size (:mod:`~hookfit.plugins.support.summary`), the
text plot the dashboard and the lr finder draw (:mod:`~hookfit.plugins.support.plot`), what the file
loggers share (:mod:`~hookfit.plugins.support.logger`), the CSV tables they append to row by row
(:mod:`~hookfit.plugins.support.tables`), the console's plain ``key=value`` fields
(:mod:`~hookfit.plugins.support.plain`), what the experiment trackers share
(:mod:`~hookfit.plugins.support.tracker`), which processes have a flag set, agreed by all
(:mod:`~hookfit.plugins.support.ranks`), the checkpoint a run that did not complete resumes from, in the
words the console and the dashboard share (:mod:`~hookfit.plugins.support.resumable`), torch's learning-rate
schedulers read without stepping them (:mod:`~hookfit.plugins.support.schedules`), torch's optimizer kernels that
skip a step on a device flag (:mod:`~hookfit.plugins.support.kernels`), the flags of non-finite values made
on the device (:mod:`~hookfit.plugins.support.flags`), sparse gradients checked and refused by torch's clips
(:mod:`~hookfit.plugins.support.sparse`), the share of optimizer steps skipped (:mod:`~hookfit.plugins.support.skips`),
the modules a step function reads from its closure and globals (:mod:`~hookfit.plugins.support.referenced`), and
what a trial of the run's own training changes, put back after it, as lr_find's sweep does
(:mod:`~hookfit.plugins.support.rollback`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hookfit.plugins.support.best import MODES, STAGES, Monitor, cut_short
from hookfit.plugins.support.cadence import Every
from hookfit.plugins.support.options import (check, choice, flag, integer, number, option_error, path, positive_int,
                                             positive_number, text)

if TYPE_CHECKING:  # pragma: no cover
    from hookfit.plugins.support.gradients import Accumulation, GradientWatch, StepOrder, Untouched, changed_in_window
    from hookfit.plugins.support.hparams import Hparam, hparam, hyperparameters, run_hparams
    from hookfit.plugins.support.loading import faster_data
    from hookfit.plugins.support.models import few_parameters, parameter_names, unwrap_model, unwrap_state_dict

_LATER = {"Accumulation": "gradients", "GradientWatch": "gradients", "StepOrder": "gradients",
          "Untouched": "gradients", "changed_in_window": "gradients", "Hparam": "hparams",
          "hparam": "hparams", "hyperparameters": "hparams", "run_hparams": "hparams", "faster_data": "loading",
          "few_parameters": "models", "parameter_names": "models", "unwrap_model": "models", "unwrap_state_dict": "models"}
"""The names whose modules import torch, imported on first use: a module that needs only the
option checks, :class:`Every` or :class:`Monitor` (``hookfit show``, ``hookfit compare``) does
not pay for importing torch."""

__all__ = [
    "MODES", "STAGES", "Every", "GradientWatch", "Hparam", "Monitor", "check", "choice", "flag", "hparam", "hyperparameters",
    "cut_short", "integer", "number", "option_error", "path", "positive_int", "positive_number", "run_hparams", "text",
    "few_parameters", "parameter_names", "unwrap_model", "unwrap_state_dict", "faster_data", "StepOrder", "Accumulation",
    "Untouched", "changed_in_window",
]


def __getattr__(name: str) -> Any:
    if name not in _LATER:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LATER[name]}"), name)


def __dir__() -> list[str]:
    """The public names with the module's own, those imported on first use included (tab completion)."""
    return sorted({*globals(), *__all__})
