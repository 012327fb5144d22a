"""The validation cadence, warned of where it validates nothing: :func:`unvalidated`, after
``fit_start``, of an interval known to be over the run (:func:`foreseen`: ``loop.no_validation``);
:func:`never_validated`, as a fit with validation ends ``completed`` having run none, of what
could not be known before (training data of no length, ``max_steps`` ending the first epoch)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from hookfit.data import length
from hookfit.errors import HookfitWarning, user_level

if TYPE_CHECKING:  # pragma: no cover
    from hookfit.run import Run

__all__ = ["foreseen", "never_validated", "unvalidated"]


def foreseen(run: Run) -> str | None:
    """Why a fit can never validate, as known before ``fit_start``, or ``None``: a ``val_every_n_steps``
    over its training steps (:attr:`~hookfit.run.Run.max_train_steps`, where known), a ``val_every_n_epochs``
    over its epochs (``loop.max_epochs``, where that bounds the run, or ``max_steps`` over data of a length sets it)."""
    steps, most, epochs = run.val_every_n_steps, run.max_train_steps, run.max_epochs
    if run.mode != "fit" or run.val_step is None:
        return None
    epochs_known = run.config.epochs_given or run.max_steps is None or length(run.train_data) is not None
    if steps is not None and most is not None and steps > most:
        return f"val_every_n_steps={steps} is more than the run's {most} training steps: no validation will run"
    if (every := run.val_every_n_epochs) is not None and epochs_known and every > epochs:
        return f"val_every_n_epochs={every} is more than the run's {epochs} epochs: no validation will run"
    return None


def unvalidated(run: Run) -> None:
    """After ``fit_start``: ``loop.no_validation`` warned about, unless a plugin said it in its own
    words and cleared it (a checkpoint monitoring a ``valid/`` metric)."""
    if run.no_validation is not None:
        warnings.warn(run.no_validation, HookfitWarning, stacklevel=user_level())


def never_validated(run: Run) -> None:
    """As a fit given ``val_step`` and ``val_data`` ends ``completed`` by its bounds: one warning when
    it validated nothing, naming the interval and how far the run went. Silent where a validation
    ran (``state.time_split`` has a ``"valid"`` stage), where the run it resumed had gone past the
    interval (its validations ran there), where a stop was asked (early stopping, the user), and
    where it was known at the start (:func:`foreseen`: said then, by the core or a plugin). Validation at
    epoch ends that ``max_steps`` cut off inside the first epoch is said so, with the ways to validate."""
    state, every_steps, every_epochs = run.state, run.val_every_n_steps, run.val_every_n_epochs
    if (run.mode != "fit" or run.val_step is None or state.status != "completed" or run.stop_requested is not None
            or "valid" in state.time_split or foreseen(run) is not None):
        return
    before = state.resumed_from
    if every_steps is not None:
        if before is not None and before.step >= every_steps:
            return
        interval = f"val_every_n_steps={every_steps}"
    elif every_epochs is not None:
        if before is not None and before.epoch >= every_epochs:
            return
        interval = f"val_every_n_epochs={every_epochs}"
    else:
        return
    epochs = state.epoch + 1
    if every_steps is None and epochs == 1 and run.max_steps is not None and state.step >= run.max_steps:
        warnings.warn(f"no validation ran: it comes at epoch ends ({interval}), and max_steps={run.max_steps} "
                      f"ended the run after {state.step} training step{'s' * (state.step != 1)}, inside its first "
                      f"epoch: give val_every_n_steps={run.max_steps} or less, a max_steps that reaches an epoch's "
                      f"end, or no val_data", HookfitWarning, stacklevel=user_level())
        return
    warnings.warn(f"{interval}: the run completed ({state.stop_reason}) after {state.step} training "
                  f"step{'s' * (state.step != 1)} in {epochs} epoch{'s' * (epochs != 1)} without a single "
                  f"validation: the interval is longer than the run; give a shorter one, or no val_data",
                  HookfitWarning, stacklevel=user_level())
