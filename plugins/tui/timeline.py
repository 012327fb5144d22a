"""Where a run stands in what ends it, as the dashboard's progress bars and ETA say it: the run's
:class:`Progress` (the running stage's batches, rates, the time of a batch per stage), the step
``max_steps`` ends it at (:func:`steps_end`), the seconds left (:func:`eta`) and the fraction done
(:func:`run_fraction`), counted in steps when ``max_steps`` comes before the end of the last epoch,
in epochs otherwise."""

from __future__ import annotations

from dataclasses import dataclass, field

from hookfit.plugins.support import Every

__all__ = ["Progress", "eta", "run_fraction", "steps_end"]


@dataclass
class Progress:
    """What the progress bars show: the running stage's batches (``batches`` of ``total``),
    its rate (batches/s), and per stage the mean time of a batch and the batches of an epoch."""

    stage: str = "train"
    batches: int = 0
    total: int | None = None
    rate: float = 0.0  # batches/s
    step_time: dict[str, float] = field(default_factory=dict)  # stage -> s per batch
    totals: dict[str, int | None] = field(default_factory=dict)  # stage -> batches per epoch
    epoch: int = 0
    rates: dict[str, float] = field(default_factory=dict)  # stage -> last known batches/s


def steps_end(max_steps: int | None, max_epochs: int, per_epoch: int | None) -> int | None:
    """The step the run ends at by ``max_steps``, when that comes before the end of its last
    epoch (as far as the epoch's length, ``per_epoch`` training batches, is known); else ``None``."""
    if max_steps is None:
        return None
    if per_epoch and max_steps > max_epochs * per_epoch:
        return None
    return max_steps


def eta(p: Progress, step: int, epoch: int, max_epochs: int, end: int | None, val_every: int | None) -> float | None:
    """Seconds left in a running run at ``step`` of ``epoch`` (``end``: :func:`steps_end`),
    counting the validation stages still to come; ``None`` while the time of a batch is unknown."""
    train_total, valid_total = p.totals.get("train"), p.totals.get("valid")
    t_train, t_valid = p.step_time.get("train"), p.step_time.get("valid")
    if t_train is None:
        return None
    if end is not None:
        left = max(end - step, 0) * t_train
        last = end // train_total if train_total else epoch + 1  # epochs complete by then
    else:
        if train_total is None:
            return None
        left = (max_epochs - epoch - 1) * train_total * t_train
        if p.stage == "train" and p.total:
            left += (p.total - p.batches) * t_train
        last = max_epochs
    if val_every and t_valid is not None and valid_total:
        vals_left = Every(val_every).between(epoch, last)
        if p.stage == "valid":
            left += max(valid_total - p.batches, 0) * t_valid
            vals_left -= 1
        left += max(vals_left, 0) * valid_total * t_valid
    return left


def run_fraction(p: Progress, step: int, epoch: int, max_epochs: int, end: int | None) -> float:
    """How much of a run not yet completed is done, from 0 to 1, in what ends it."""
    if end is not None:
        return min(step / end, 1.0) if end > 0 else 1.0
    done = epoch + (min(p.batches, p.total) / p.total if p.total else 0)
    return min(done / max_epochs, 1.0) if max_epochs > 0 else 1.0
