"""A metric watched for its best value (:class:`Monitor`): the checkpoint plugin keeps its best
checkpoint by one, early stopping counts the epochs without improvement by one, the console and
the dashboard pick best values with them."""

from __future__ import annotations

import difflib
import math
import re
import warnings
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from hookfit.errors import HookfitWarning, user_level
from hookfit.plugins.support.options import check, choice, number

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.payloads import MetricsSnapshot
    from hookfit.run import Run

__all__ = ["MODES", "STAGES", "Monitor", "cut_short"]

MODES = ("min", "max")
"""The directions of a metric: ``"min"`` (lower is better) and ``"max"`` (higher is better)."""

STAGES = ("train", "valid")
"""The stages whose metrics a monitor names: ``"<stage>/<metric>"``."""

_METRIC_MUST = "be '<stage>/<metric>' with stage train or valid (like 'valid/loss'), or None"
HIGHER_IS_BETTER = re.compile(r"(acc|accuracy|f1|auc|auroc|auprc|precision|recall|iou|miou|dice|map\d*|bleu|rouge\w*"
                              r"|r2|top\d+|ndcg|psnr|ssim)")
"""Words of a metric's name where higher is usually better: the default direction, ``"min"``,
is warned of for such a metric (never decided by the name: the direction is the one given or
published)."""


def cut_short(loop: Run, snapshot: MetricsSnapshot) -> bool:
    """Whether the final ``snapshot`` is of a stage that a stop interrupting the run (status
    ``"interrupted"``) cut short: fewer batches than the stage's ``total``, or, the total
    unknown, any stage published at such a stop. Its epoch values are the means over some of
    the stage's batches: the run's last values, never its best. A stage the stop came right
    after the last batch of is whole, and so is every stage of a run that completed
    (``max_steps``, early stopping)."""
    if loop.state.status != "interrupted":
        return False
    return snapshot.total is None or snapshot.batches < snapshot.total


_QUALIFIES = {"mode": "the direction", "min_delta": "the least change that counts as an improvement"}


def _stage_metric(metric: Any) -> bool:
    """Whether ``metric`` is ``"<stage>/<name>"`` with a known stage and a name (or ``None``)."""
    if metric is None:
        return True
    if not isinstance(metric, str) or "/" not in metric:
        return False
    stage, name = metric.split("/", 1)
    return stage in STAGES and bool(name.strip())


class Monitor:
    """A metric watched for its best value.

    * ``metric``: ``"<stage>/<metric>"`` (``"valid/loss"``: the epoch mean of ``loss`` in the
      validation stage, as a metrics plugin publishes it), or ``None`` for a monitor that only
      compares values (a plugin switched off, a console ranking any metric).
    * ``mode``: ``"min"`` (lower is better), ``"max"``, or ``None`` (the default): the
      direction the metrics snapshots publish for ``metric``
      (:attr:`hookfit.payloads.MetricsSnapshot.best`, ``Metrics(best=...)``), else ``"min"``.
    * ``min_delta``: how much better a value must be to improve, a finite number ``>= 0``.

    All three are checked here, with the error every option gives (naming ``plugin``;
    ``must`` keeps a plugin's own wording of what ``metric`` must be). A value improves when it
    is below ``best - min_delta`` (``"min"``) or above ``best + min_delta`` (``"max"``); the first
    value improves on nothing; NaN and infinities never improve, so never become the best (a
    diverged epoch is no best checkpoint). Of equal values the first stays the best.

    The plugin hands it each snapshot of ``metric``'s stage (:meth:`follow`) before comparing
    that snapshot's value: :attr:`mode` is then the direction in force. A given ``mode`` is kept
    even where a snapshot publishes the other direction (the user said so for this plugin), with
    one warning of ``category`` a run (:meth:`start`), naming the plugin, the metric and both.

    Thread-safe for one writer: the best and where it was seen change together, so a reader on
    another thread never sees one without the other."""

    __slots__ = ("metric", "stage", "key", "given", "mode", "min_delta", "plugin", "option", "category", "_record",
                 "_warned")

    def __init__(self, metric: str | None = None, mode: str | None = None, min_delta: float = 0.0, *,
                 plugin: str = "monitor", option: str = "monitor", must: str | None = None,
                 category: type[Warning] = HookfitWarning) -> None:
        check(plugin, option, metric, _stage_metric, must or _METRIC_MUST)
        self.metric: str | None = metric
        """``"<stage>/<metric>"``, or ``None``."""
        stage, key = metric.split("/", 1) if metric is not None else (None, None)
        self.stage: str | None = stage
        """The stage of ``metric`` (``"valid"``), or ``None``."""
        self.key: str | None = key
        """The metric's name within its stage (``"loss"``), or ``None``."""
        self.given: str | None = None if mode is None else choice(plugin, "mode", mode, MODES)
        """The ``mode`` given, or ``None``: the published direction, else ``"min"``."""
        self.mode: str = self.given or "min"
        """The direction in force: the given one, else the latest snapshot's (``"min"`` before one)."""
        self.min_delta: float = number(plugin, "min_delta", min_delta, least=0)
        self.plugin, self.option, self.category = plugin, option, category
        self._record: tuple[float, Any] | None = None
        self._warned = False

    @property
    def best(self) -> float | None:
        """The best value so far, or ``None`` before any finite one."""
        record = self._record
        return None if record is None else record[0]

    @property
    def best_at(self) -> Any:
        """Where the best value was seen (what ``update`` was given as ``at``), or ``None``."""
        record = self._record
        return None if record is None else record[1]

    @property
    def record(self) -> tuple[float, Any] | None:
        """``(best, best_at)`` together, or ``None`` before any finite value."""
        return self._record

    def improves(self, value: float) -> bool:
        """Whether ``value`` improves on the best so far (by more than ``min_delta``)."""
        value = float(value)
        if not math.isfinite(value):
            return False
        record = self._record
        if record is None:
            return True
        if self.mode == "min":
            return value < record[0] - self.min_delta
        return value > record[0] + self.min_delta

    def update(self, value: float, at: Any = None) -> bool:
        """Take ``value`` (seen ``at`` an epoch, a step, a file...) as the best if it improves
        on it; returns whether it did."""
        if not self.improves(value):
            return False
        self._record = (float(value), at)
        return True

    def start(self) -> None:
        """A new run: the best forgotten, the direction back to the given one (``"min"`` until a
        snapshot says, when none was given), a contradiction warned of again."""
        self.reset()
        self.mode, self._warned = self.given or "min", False

    def follow(self, published: Mapping[str, str]) -> str:
        """Take the directions a snapshot of ``metric``'s stage publishes (its ``best``: bare
        metric name -> ``"min"``/``"max"``); returns :attr:`mode`, the direction in force."""
        found = published.get(self.key) if self.key is not None else None
        if self.given is None:
            self.mode = found if found in MODES else "min"
            words = re.split(r"[^a-z0-9]+", (self.key or "").lower())
            if found not in MODES and not self._warned and any(HIGHER_IS_BETTER.fullmatch(w) for w in words):
                self._warned = True
                warnings.warn(f"{self.plugin}: {self.metric} is compared as lower is better ('min', the default: "
                              f"{self.plugin} was given no mode and Metrics(best=...) names no direction for it); "
                              f"if higher is better, give mode='max' or Metrics(best={{{self.metric!r}: 'max'}})",
                              self.category, stacklevel=user_level())
        elif self.contradicted(published) is not None:
            warnings.warn(f"{self.plugin}: mode={self.given!r} for {self.metric}, whose direction the metrics "
                          f"plugin publishes as {found!r} (Metrics(best=...)); {self.plugin} keeps {self.given!r}: "
                          f"leave mode out to follow the metrics plugin", self.category, stacklevel=user_level())
        return self.mode

    def contradicted(self, published: Mapping[str, str]) -> str | None:
        """The direction a snapshot of ``metric``'s stage publishes for it (its ``best``) where that is not the
        ``mode`` given, the first time a run (:meth:`start`); else ``None`` (no mode given, none published, the
        same, or already told). :meth:`follow` warns of it; a plugin whose mode is given another way (an object of
        the user's that it steps) asks here and warns in its own words."""
        found = published.get(self.key) if self.key is not None else None
        if self.given is None or found is None or found == self.given or self._warned:
            return None
        self._warned = True
        return found

    def absent(self, published: Iterable[str], epoch: int, then: str = "") -> str:
        """What to say of a snapshot of ``metric``'s stage that lacks it: the plugin, the option,
        the metrics that stage published in ``epoch`` (from 0, said from 1), ``then`` (what the
        plugin does about it) and the closest of those metrics, as ``"<stage>/<metric>"`` to paste
        into the option. The plugin decides whether that is an error or a warning."""
        names = sorted(published)
        close = difflib.get_close_matches(self.key or "", names, n=1, cutoff=0.5)
        meant = f"; did you mean {self.option}={f'{self.stage}/{close[0]}'!r}?" if close else ""
        return (f"{self.plugin}: {self.option}={self.metric!r} names a metric this run does not produce: the "
                f"{self.stage} metrics of epoch {epoch + 1} are {', '.join(names) or 'none'}"
                f"{f'; {then}' if then else ''}{meant}")

    def qualified(self, **given: Any) -> None:
        """Refuse options of the plugin that qualify its monitored metric (``mode``, ``min_delta``; ``None``: not
        given) when it monitors none, naming the plugin and each option."""
        given = {option: value for option, value in given.items() if value is not None}
        if self.metric is None and given:
            named = ", ".join(f"{option}={value!r} is {_QUALIFIES[option]}" for option, value in given.items())
            raise ValueError(f"{self.plugin}: {named} of the monitored metric, and no monitor is given: give "
                             f"monitor='valid/loss' (the metric it applies to), or leave {' and '.join(given)} out")

    def never(self, loop: Run) -> str | None:
        """Why ``loop`` can never publish ``metric``, as known when training starts (``fit_start``), or
        ``None`` where it may: a ``valid`` metric in a training run without validation, or whose validations
        all fall past its end (``val_every_n_epochs`` more than the epochs it trains at most, or
        ``val_every_n_steps`` more than its training steps, ``loop.max_train_steps``, where known).
        ``Loop.validate()`` validates: never said there. The words name the plugin, the option and what
        to change; the plugin decides whether that is an error or a warning, and adds what it does about
        it. A plugin that warns of it clears ``loop.no_validation``: the core's warning of the same cause."""
        if self.stage != "valid" or loop.mode != "fit":
            return None
        head = f"{self.plugin}: {self.option}={self.metric!r} needs validation, and this run"
        other = "or monitor a 'train/' metric"
        if loop.val_step is None:
            return f"{head} has none: give Loop(val_step=..., val_data=...), {other}"
        every, steps, epochs = loop.val_every_n_epochs, loop.val_every_n_steps, loop.max_epochs
        if every is not None and every > epochs:
            bound = "max_epochs" if loop.config.epochs_given or loop.max_steps is None else f"max_steps={loop.max_steps}"
            return (f"{head} never validates: val_every_n_epochs={every}, and it trains {epochs} epoch(s) at most "
                    f"({bound}); give val_every_n_epochs={epochs} or less, {other}")
        if steps is not None and (most := loop.max_train_steps) is not None and steps > most:
            bound = "max_steps" if most == loop.max_steps else f"max_epochs={epochs} of {most // epochs} batches"
            return (f"{head} never validates: val_every_n_steps={steps}, and it trains {most} step(s) at most "
                    f"({bound}); give val_every_n_steps={most} or less, {other}")
        return None

    def unset(self, loop: Run) -> str | None:
        """Why ``metric``, a ``valid`` one, names no metric of ``loop``'s several validation sets
        (``Loop(val_data={name: data, ...})``), as known from ``configure`` on, or ``None``: the step's
        metrics of such a validation are named per set (``valid/<set>/<metric>``), so a name whose first
        part is no set's (``valid/loss``) is published only as a plugin's ``metrics_values`` answer,
        which is never ruled out where a plugin of the run implements that event. The words name the
        plugin, the option and the name in each set; the plugin decides whether that is an error or a
        warning, as for :meth:`absent`, and says it before the first batch instead of after the first
        validation."""
        sets = loop.config.val_data
        if self.stage != "valid" or self.key is None or not isinstance(sets, Mapping) or (
                self.key.split("/", 1)[0] in sets):
            return None
        if loop.hooks.plugins("metrics_values"):  # (declared in every run) a gauge may be named so
            return None
        meant = " or ".join(repr(f"valid/{name}/{self.key}") for name in sets)
        return (f"{self.plugin}: {self.option}={self.metric!r} names no validation set, and this run validates "
                f"{len(sets)} set{'' if len(sets) == 1 else 's'} ({', '.join(map(repr, sets))}), whose metrics are named per set "
                f"('valid/<set>/<metric>'): give {self.option}={meant}")

    def reset(self, best: float | None = None, at: Any = None, mode: str | None = None) -> None:
        """Forget the best, or set it (a best restored from a checkpoint; one that is not a
        finite number is forgotten); ``mode``: the direction it was found in, taken as the one in
        force when none was given (a restored run knows it before its first snapshot)."""
        self._record = None
        if mode in MODES and self.given is None:
            self.mode = str(mode)
        if best is not None and math.isfinite(float(best)):
            self._record = (float(best), at)

    def __repr__(self) -> str:
        return f"Monitor({self.metric!r}, mode={self.mode!r}, min_delta={self.min_delta:g}, best={self.best!r})"


