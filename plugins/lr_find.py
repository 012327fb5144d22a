"""lr_find: the learning-rate range test, run at the start of a ``fit()``.

``LRFinder(start_lr=1e-7, end_lr=10.0, num_steps=100)`` in ``Loop(plugins=[...])``, or a
``[plugins.lr_find]`` table in ``hookfit.toml`` (an empty table too). Discovered like every
plugin, it is inert until configured that way: the run leaves the instance discovered without
options out before ``configure`` (:func:`hookfit.manager.leave_inert`), so a run pays nothing
for it.

* **The sweep.** At ``fit_start`` (``trylast``: after every other plugin started, and after the
  optimizer role filled ``loop.optimizers`` at ``configure``) it calls the run's own training
  step (``loop.train_step``, wrapped as the run wraps it) on up to ``num_steps`` training
  batches, taken from ``loop.train_data`` from its start (again from the start when the data
  runs out), with the run's optimizers. Before batch ``i`` every parameter group of the swept
  optimizer gets the rate ``start_lr * (end_lr / start_lr) ** (i / (num_steps - 1))``: it rises
  exponentially. With several optimizers, ``optimizer="name"`` says which one's rate is swept
  (the others step at their own rates). No batch event fires for these batches (metrics,
  loggers and ``loop.state.step`` do not count them); ``loop.training`` is true during them.
* **The optimizer's events.** Each of the sweep's steps fires ``before_optimizer_step`` and
  ``after_optimizer_step``, as a training step does, so that what plugins do to a step (clip,
  mask, average: undone afterwards) is swept too; they fire outside any stage (``loop.state.stage``
  is ``None``), which is how a plugin tells them from the run's. The rate is the sweep's: a rate
  an implementation of ``before_optimizer_step`` (or the step) sets instead is replaced after them
  (``trylast``), with one warning naming the plugins that implement it (one of them, or the
  step, set it), so that the rates reported are those the steps used.
* **Resumed and smoke runs.** A resumed run does not sweep: its optimizers' states, restored
  from the checkpoint, hold the rates it trains with (one line says so; ``skipped="resumed"``).
  A run asked to resume (``loop.resume``) knows whether it did only after ``fit_start``: its
  sweep runs at the first ``epoch_start`` (``tryfirst``) instead, if nothing was resumed. A
  smoke run (``loop.smoke``) sweeps one pass of the batches it keeps, to check the step and
  the putting back: one line, no plot, no suggestion, ``skipped="smoke"``.
* **The loss.** What the step returns under ``key`` (``"loss"``; a tensor is the loss itself; a
  step that returns ``None`` skips the batch) is smoothed exponentially
  (``avg = smoothing * avg + (1 - smoothing) * loss``, bias-corrected as Adam's moments are).
  The sweep stops early when the smoothed loss exceeds ``diverge`` times the best smoothed loss
  so far (that point is kept: the plot shows the blow-up), or when the loss is not finite.
* **The suggestion** is the rate where the smoothed loss falls fastest against the rate on its
  log axis: the most negative slope (central differences over ``log10(rate)``), leaving out the
  first tenth of the points (the loss has not moved yet) and the last one (a point of
  divergence). Fewer than 5 points give no suggestion (``None``, one warning). ``finder.rates``,
  ``finder.losses`` (smoothed), ``finder.raw_losses``, ``finder.suggestion``, and
  ``loop.state.results["lr_find"]`` (``suggestion``, ``steps``, ``diverged``) hold the result.
* **Afterwards** the run is put back exactly where it was: the parameters and buffers of ``model=``
  (bitwise) and their training flags, every tensor an optimizer steps (in ``model=`` or not: a free
  ``nn.Parameter`` too) and its gradient, each optimizer's ``state_dict()`` (its rates included),
  every plugin's state (``loop.plugin_states()``: the optimizer role's counters and schedulers,
  EMA's average...), the random state (Python's, torch's, NumPy's, CUDA's, and the training data's
  own generators, :func:`hookfit.data.generators`: a ``DataLoader``'s ``generator=``, its
  samplers'), ``loop.carry`` and the data's own state (``state_dict()``) where it has one; so with
  ``then="train"`` (the default) the training that follows is bitwise the run without the finder
  (the optimizer role's per-step schedulers step during the sweep too, and are put back after it:
  one made for a fixed number of steps, as ``OneCycleLR``, must allow ``num_steps`` more, or the
  sweep fails with torch's error and a note naming it). ``then="stop"`` ends the run after the sweep
  instead: ``completed``, with a reason that says so and gives the suggestion. Training data that is
  an iterator (used up by the sweep) is refused with ``then="train"``, and so is an optimizer
  without ``param_groups``, ``state_dict`` and ``load_state_dict`` (it could not be put back). Not put back:
  buffers of modules outside ``model=`` (pass the module that holds them as ``model=``), a random generator
  a dataset holds itself, and what the workers of a ``DataLoader`` with ``persistent_workers`` keep across passes.
* **The plot**: the smoothed loss against the rate on a log x axis (clipped at 1.5 times its
  highest value in the first tenth of the sweep), ``^`` under the suggestion, with the
  dashboard's text plot (:mod:`hookfit.plugins.support.plot`), printed to standard error.
* One process only: under ``torchrun`` it fails at ``configure``: run it with plain ``python``.

Options are checked at construction, with a ``ValueError`` naming ``lr_find`` and the option.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

from hookfit import config, hookimpl
from hookfit.errors import HookfitWarning, user_level
from hookfit.plugins.support import check, choice, number, option_error, positive_int, positive_number, text
from hookfit.plugins.support.rollback import Rollback

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.payloads import ResumeInfo
    from hookfit.run import Run

__all__ = ["LRFinder", "suggest"]

NAME = "lr_find"


@config.records_options
class LRFinder:
    """The learning-rate range test (see the module documentation): ``num_steps`` batches from
    ``start_lr`` to ``end_lr``, stopped past ``diverge`` times the best loss (``None``: never);
    then ``then="train"`` or ``"stop"``. ``optimizer`` names the optimizer swept when the run has
    several; ``key`` is the loss in the step's output; ``smoothing`` the weight of the past in
    the loss's moving average (0: none)."""

    name = NAME

    def __init__(self, start_lr: float = 1e-7, end_lr: float = 10.0, num_steps: int = 100,
                 diverge: float | None = 4.0, smoothing: float = 0.98, then: Literal["train", "stop"] = "train",
                 optimizer: str | None = None, key: str = "loss") -> None:
        self.start_lr = positive_number(NAME, "start_lr", start_lr, meaning="the first rate of the sweep")
        self.end_lr = positive_number(NAME, "end_lr", end_lr, meaning="the last rate of the sweep")
        if self.end_lr <= self.start_lr:
            raise option_error(NAME, "end_lr", end_lr, f"be greater than start_lr ({self.start_lr:g})")
        self.num_steps = positive_int(NAME, "num_steps", num_steps, meaning="training batches the sweep runs")
        check(NAME, "num_steps", num_steps, lambda n: n >= 2, "be at least 2 (the sweep needs two rates)")
        self.diverge = number(NAME, "diverge", diverge, none=True, least=1.0,
                              meaning="stop when the smoothed loss exceeds this many times its best")
        if self.diverge == 1.0:
            raise option_error(NAME, "diverge", diverge, "be greater than 1 (the best loss itself would stop it)")
        self.smoothing = number(NAME, "smoothing", smoothing, least=0.0,
                                meaning="the weight of the past in the loss's moving average")
        check(NAME, "smoothing", smoothing, lambda s: s < 1, "be below 1 (1 would never move)")
        self.then: str = choice(NAME, "then", then, ("train", "stop"))
        self.optimizer = text(NAME, "optimizer", optimizer, none=True)
        self.key = text(NAME, "key", key)
        self.rates: list[float] = []
        """The rate of each point of the last sweep."""
        self.losses: list[float] = []
        """The smoothed loss at each rate of :attr:`rates` (what the suggestion reads)."""
        self.raw_losses: list[float] = []
        """The loss the step returned at each rate of :attr:`rates`."""
        self.suggestion: float | None = None
        """The suggested rate (steepest descent of the smoothed loss), or ``None``."""
        self.diverged = False
        """Whether the last sweep stopped early: the loss diverged or was not finite."""
        self.skipped: str | None = None
        """Why the last run made no full sweep: ``"resumed"``, ``"smoke"``, or ``None``."""
        self._batch, self._rate = 0, self.start_lr  # where the sweep is, for an error's note
        self._waiting = False  # asked to resume: the sweep waits for the resume's outcome
        self._held: str | None = None  # the swept optimizer's name during the sweep, whose rate is the sweep's
        self._overridden = False  # an implementation of before_optimizer_step set another rate: said once a run

    # -- events ---------------------------------------------------------------------------
    def inert(self, chosen: bool) -> str | None:
        """What ``hookfit plugins`` says of it (:func:`hookfit.discovery.inert`): inert until
        chosen: merely discovered, it leaves the run before ``configure``."""
        if chosen:
            return None
        return ("given to Loop(plugins=[LRFinder(...)]), or named by a [plugins.lr_find] table in hookfit.toml "
                "(even empty)")

    @hookimpl
    def configure(self, loop: Run) -> None:
        self.rates, self.losses, self.raw_losses, self.suggestion, self.diverged = [], [], [], None, False
        self.skipped, self._waiting, self._held, self._overridden = None, False, None, False
        if loop.mode != "fit":  # (an inert one is not in the run: hookfit.manager.leave_inert)
            loop.pm.unregister(self)  # an evaluation: none of the hooks below costs anything
            return
        if loop.state.world_size > 1:
            raise RuntimeError(f"{NAME}: the learning-rate range test runs on one process, and this run has "
                               f"{loop.state.world_size}: run it with plain python, without torchrun")

    @hookimpl(trylast=True)  # every other plugin has started: the states taken here are complete
    def fit_start(self, loop: Run) -> None:
        self._waiting = loop.resume is not None  # a resumed run does not sweep: known after fit_start
        if not self._waiting:
            self._start(loop)

    @hookimpl(trylast=True)  # after the line that says where the run resumed from
    def resumed(self, loop: Run, info: ResumeInfo) -> None:
        self._waiting, self.skipped = False, "resumed"
        if loop.is_main:
            print(f"hookfit lr_find: no sweep: this run resumed from {info.source}, whose optimizers' state holds "
                  f"the learning rates it trains with", file=sys.stderr, flush=True)

    @hookimpl(tryfirst=True)  # asked to resume and nothing was: the sweep, before the first epoch's events
    def epoch_start(self, loop: Run, epoch: int) -> None:
        if self._waiting:
            self._waiting = False  # once
            self._start(loop)

    @hookimpl(trylast=True)  # after the other implementations: the sweep's step uses the sweep's rate
    def before_optimizer_step(self, loop: Run, name: str, optimizer: Any) -> None:
        if name != self._held:  # (after the sweep: one Python call per step)
            return
        if others := {group["lr"] for group in optimizer.param_groups} - {self._rate}:
            for group in optimizer.param_groups:
                group["lr"] = self._rate
            if not self._overridden:
                self._overridden = True
                setters = ", ".join(repr(n) for n in loop.hooks.plugins("before_optimizer_step") if n != NAME)
                by = f"one of the plugins that implement before_optimizer_step ({setters}) or " if setters else ""
                warnings.warn(f"{NAME}: optimizer {name!r} was about to step in the sweep at the learning rate "
                              f"{min(others):.3g}, not the sweep's {self._rate:.3g}: set after the sweep's by {by}the "
                              f"step; the sweep's rate is put back for each of its steps. A plugin tells "
                              f"the sweep's steps by loop.state.stage being None (outside any stage)",
                              HookfitWarning, stacklevel=user_level())

    def _start(self, loop: Run) -> None:
        """The sweep, the run put back, the report (see the module documentation)."""
        name, optimizer = self._swept(loop)
        if self.then == "train" and _iterator(loop.train_data):
            raise ValueError(f"{NAME}: the training data is an iterator ({type(loop.train_data).__name__}), which "
                             f"the sweep would use up before training: pass a list, a DataLoader or another "
                             f"re-iterable, or then='stop'")
        saved = Rollback(loop, NAME, "the sweep")
        try:
            self._held = name
            self._sweep(loop, optimizer)
        except Exception as error:
            error.add_note(f"{NAME}: raised during the learning-rate range test, at its batch {self._batch + 1} "
                           f"(lr={self._rate:.3g}); the run's per-step schedulers step with it (one made for a "
                           f"fixed number of steps, as OneCycleLR, needs them to cover num_steps={self.num_steps} "
                           f"more)")
            raise
        finally:
            self._held = None
            saved.restore(loop)
        if loop.smoke:  # a check of the sweep, too short to suggest anything
            self.skipped = "smoke"
            lines = [f"hookfit lr_find: smoke run: {len(self.rates)} step(s), one pass over its batches, to check the "
                     f"sweep (num_steps={self.num_steps} in a run that is not a smoke run); no suggestion"]
        else:
            self.suggestion = suggest(self.rates, self.losses)
            if self.suggestion is None:
                warnings.warn(f"{NAME}: {len(self.rates)} point(s) are too few to suggest a learning rate (at least "
                              f"5; raise num_steps, or diverge if the sweep stopped early)", HookfitWarning,
                              stacklevel=user_level())
            lines = self.report(name)
        if loop.is_main:
            print("\n".join(lines), file=sys.stderr, flush=True)
        if self.then == "stop":
            found = f"{self.suggestion:.3g}" if self.suggestion is not None else "none"
            loop.request_stop(f"{NAME}: learning-rate range test done (then='stop'); suggested lr={found}",
                              by=NAME, complete=True)

    @hookimpl
    def results(self) -> Mapping[str, Any]:
        found = {"suggestion": self.suggestion, "steps": len(self.rates), "diverged": self.diverged}
        return {NAME: found if self.skipped is None else {**found, "skipped": self.skipped}}

    # -- the sweep ------------------------------------------------------------------------
    def _swept(self, loop: Run) -> tuple[str, Any]:
        """The name and the object of the optimizer whose rate is swept."""
        optimizers = loop.optimizers
        if optimizers is None:
            raise ValueError(f"{NAME}: the run has no optimizers: give Loop(optimizers=...)")
        if isinstance(optimizers, Mapping):
            names = ", ".join(map(repr, optimizers))
            if self.optimizer is None:
                if len(optimizers) != 1:
                    raise ValueError(f"{NAME}: the run has several optimizers ({names}): say whose rate to sweep "
                                     f"with optimizer='name'")
                return next(iter(optimizers.items()))
            if self.optimizer not in optimizers:
                raise option_error(NAME, "optimizer", self.optimizer, f"name one of the run's optimizers ({names})")
            return self.optimizer, optimizers[self.optimizer]
        if self.optimizer not in (None, "default"):
            raise option_error(NAME, "optimizer", self.optimizer,
                               "be None or 'default': the run has one optimizer, named 'default'")
        return "default", optimizers

    def _sweep(self, loop: Run, optimizer: Any) -> None:
        groups = optimizer.param_groups
        ratio = self.end_lr / self.start_lr
        avg, best, beta = 0.0, math.inf, self.smoothing
        loop.training = True
        batches = _batches(loop.train_data, again=not loop.smoke)  # a smoke run: one pass of its batches
        for i, batch in zip(range(self.num_steps), batches):
            rate = self.start_lr * ratio ** (i / (self.num_steps - 1))
            self._batch, self._rate = i, rate
            for group in groups:
                group["lr"] = rate
            loss = self._loss(loop, batch)
            if loss is None:
                continue
            if not math.isfinite(loss):
                self.diverged = True
                return
            avg = beta * avg + (1 - beta) * loss
            smooth = avg / (1 - beta ** (len(self.rates) + 1))
            self.rates.append(rate)
            self.raw_losses.append(loss)
            self.losses.append(smooth)
            best = min(best, smooth)
            if self.diverge is not None and smooth > self.diverge * best:
                self.diverged = True
                return

    def _loss(self, loop: Run, batch: Any) -> float | None:
        output = loop.train_step(loop, batch)
        if output is None:
            return None
        if isinstance(output, Mapping):
            if self.key not in output:
                raise ValueError(f"{NAME}: the step's output has no {self.key!r} (it has "
                                 f"{', '.join(map(repr, output)) or 'nothing'}): return the loss under that key, "
                                 f"or name it with LRFinder(key=...)")
            output = output[self.key]
        try:
            return float(output.detach() if hasattr(output, "detach") else output)
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(f"{NAME}: the step's {self.key!r} must be a number or a one-element tensor, got "
                            f"{type(output).__name__} ({error})") from error

    # -- the report -----------------------------------------------------------------------
    def report(self, optimizer: str = "default", width: int = 60, height: int = 12) -> list[str]:
        """The lines printed after the sweep: a header, the plot of the smoothed loss against the
        rate (log x axis, the suggestion marked ``^``) and the suggestion."""
        from hookfit.plugins.support.plot import column, text_plot

        end = "stopped early: the loss diverged" if self.diverged else "done"
        head = (f"hookfit lr_find: {len(self.rates)} step(s), lr of {optimizer!r} from {self.start_lr:g} "
                f"to {self.end_lr:g}: {end}")
        xs = [math.log10(r) for r in self.rates]
        lines = [head]
        # the blow-up is clipped where it leaves the range the loss started in, so the fall stays readable
        cap = 1.5 * max(self.losses[: len(self.losses) // 10 + 1], default=math.inf)
        plot = text_plot({"loss": [(x, min(y, cap), min(y, cap)) for x, y in zip(xs, self.losses)]},
                         width=width, height=height)
        if plot:
            x0, x1 = min(xs), max(xs)
            plot[-1] = " " * 12 + _axis(self.rates[0], self.rates[-1], width)
            if self.suggestion is not None:
                col = column(math.log10(self.suggestion), x0, x1, width)
                plot.insert(-1, " " * 12 + " " * col + "^")
            lines += plot + [" " * 12 + "learning rate (log scale)".center(width)]
        if self.suggestion is not None:
            lines.append(f"hookfit lr_find: suggested lr={self.suggestion:.3g} (^: where the smoothed loss falls "
                         f"fastest)")
        else:
            lines.append("hookfit lr_find: no suggestion (too few points)")
        return lines


def _axis(first: float, last: float, width: int) -> str:
    left, right = f"{first:.0e}", f"{last:.0e}"
    return left + right.rjust(max(0, width - len(left)))


def suggest(rates: list[float], losses: list[float]) -> float | None:
    """The rate where ``losses`` fall fastest against ``log10(rate)``: the most negative slope by
    central differences (one-sided at the ends), leaving out the first tenth of the points and
    the last one; ``None`` for fewer than 5 points."""
    n = len(rates)
    if n < 5 or len(losses) != n:
        return None
    xs = [math.log10(r) for r in rates]

    def slope(i: int) -> float:
        a, b = max(0, i - 1), min(n - 1, i + 1)
        return (losses[b] - losses[a]) / (xs[b] - xs[a])

    candidates = range(n // 10, n - 1)
    return rates[min(candidates, key=slope)]


def _iterator(data: Any) -> bool:
    """Whether ``data`` is used up by iterating it (an iterator or a generator); told without
    calling ``iter()``, which may change data that keeps its own state."""
    return isinstance(data, Iterator) or callable(getattr(data, "__next__", None))


def _batches(data: Any, again: bool = True) -> Iterator[Any]:
    """The data's batches, from its start again whenever it runs out (``again``), else once."""
    while True:
        empty = True
        for batch in data:
            empty = False
            yield batch
        if empty:
            raise ValueError(f"{NAME}: the training data yielded no batches for the sweep")
        if not again:
            return
