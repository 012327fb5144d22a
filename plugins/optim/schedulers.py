"""optim's learning-rate schedulers (:class:`Schedules`), checked as soon as each can be told (README.md)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Collection, Mapping

from torch.optim import lr_scheduler

from hookfit.data import bounded_length, length
from hookfit.errors import user_level
from hookfit.payloads import MetricsSnapshot
from hookfit.plugins.optim.nonfinite import OptimWarning
from hookfit.plugins.support import Monitor, choice, hparams, schedules

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

NAME = "optim"
PLATEAU = lr_scheduler.ReduceLROnPlateau
class Schedules:
    """``Optim``'s schedulers: those :meth:`per_step` names step with their optimizer, the others here."""

    def __init__(self, schedulers: Any, scheduler_interval: Any, monitor: str | None) -> None:
        by_name = dict(scheduler_interval) if isinstance(scheduler_interval, Mapping) else {None: scheduler_interval}
        for k, v in by_name.items():  # by optimizer name (the others' None), or one for all
            choice(NAME, "scheduler_interval" + ("" if k is None else f"[{k!r}]"), v, ("step", "epoch"), none=k is None)
        self.monitor, self._by_name, self._given = monitor, by_name, schedules.given(NAME, schedulers)
        self._monitor = Monitor(monitor, plugin=NAME, option="monitor") if monitor is not None else None
        plateaus = [g.scheduler for g in self._given if isinstance(g.scheduler, PLATEAU)]
        if plateaus and monitor is None:
            raise ValueError("optim: schedulers has a ReduceLROnPlateau, which steps on a metric: give monitor="
                             "'<stage>/<metric>', the epoch mean it reduces the learning rate on (monitor='valid/loss')")
        if monitor is not None and not plateaus:
            held = ", ".join(type(g.scheduler).__name__ for g in self._given) or "no scheduler"
            raise ValueError(f"optim: monitor={monitor!r} is the metric a ReduceLROnPlateau steps on, and schedulers "
                             f"has none ({held}): give schedulers=ReduceLROnPlateau(optimizer, ...), or leave "
                             f"monitor out")
        if plateaus and scheduler_interval == "step":
            self._plateau_stepped(None)
        self._assigned: dict[str, list[Any]] = {}
        self._epochwise: set[int] = set()  # the schedulers (ids) that step at each epoch's end
        self._awaiting: int | None = None  # the epoch whose monitored stage ended, its metrics not heard
        self._modes: list[tuple[str, Monitor]] = []  # each ReduceLROnPlateau's optimizer, and its mode (_told)

    def _plateau_stepped(self, name: str | None) -> None:
        option = "scheduler_interval" + ("" if name is None else f"[{name!r}]")
        raise ValueError(f"optim: {option}='step' cannot step a ReduceLROnPlateau: it steps on monitor={self.monitor!r} "
                         f"once the stage is complete (once per epoch); leave {option} out (then the others step "
                         f"after every step) or give 'epoch'")

    def per_step(self, schedulers: list[Any]) -> list[Any]:
        """Those of ``schedulers`` that step after each real step of their optimizer."""
        return [s for s in schedulers if not isinstance(s, PLATEAU) and id(s) not in self._epochwise]

    def assign(self, loop: Run, optimizers: Mapping[str, Any], accumulate: int = 1) -> dict[str, list[Any]]:
        """At ``configure``: each optimizer's schedulers, in order, checked against the run's optimizers."""
        self._awaiting, self._epochwise, self._first, self._modes = None, set(), True, []
        out = self._assigned = {name: [] for name in optimizers}
        if loop.mode != "fit":
            return out
        for option, names in (("schedulers", [g.name for g in self._given]), ("scheduler_interval", self._by_name)):
            if unknown := sorted({repr(n) for n in names if n is not None and n not in optimizers}):
                raise ValueError(f"optim: {option} [{', '.join(unknown)}] name no optimizer; optimizers are "
                                 f"{sorted(optimizers)}")
        owners = {id(opt): name for name, opt in optimizers.items()}
        listing = ", ".join(f"{n!r}: {type(o).__name__}" for n, o in optimizers.items()) or "none"
        for item in self._given:
            owner, what = owners.get(id(item.scheduler.optimizer)), type(item.scheduler).__name__
            if owner is None:
                raise ValueError(f"optim: {item.where}: the {what} is built on a "
                                 f"{type(item.scheduler.optimizer).__name__} that is not one of this run's optimizers "
                                 f"({listing}): build it on the optimizer given to Loop(optimizers=...)")
            if item.name is not None and owner != item.name:
                raise ValueError(f"optim: {item.where}: the {what} is built on optimizer {owner!r}, not "
                                 f"{item.name!r}: put it under {owner!r}, or build it on {item.name!r}")
            out[owner].append(item.scheduler)
            if isinstance(item.scheduler, PLATEAU):  # its mode, told against the metric's published direction
                self._modes.append((owner, Monitor(self.monitor, item.scheduler.mode, plugin=NAME)))
            interval = self._by_name.get(owner, self._by_name.get(None))
            if interval == "epoch" and not isinstance(item.scheduler, PLATEAU):
                self._epochwise.add(id(item.scheduler))
            elif interval == "step" and isinstance(item.scheduler, PLATEAU):
                self._plateau_stepped(owner)
        if self._monitor is not None and self._monitor.stage == "valid" and loop.val_step is None:
            raise ValueError(f"optim: monitor={self.monitor!r} steps the ReduceLROnPlateau on a validation metric, "
                             f"and this run has no validation: give Loop(val_step=..., val_data=...), or monitor a "
                             f"'train/' metric")
        if self._monitor is not None and (unset := self._monitor.unset(loop)) is not None:
            raise ValueError(unset)  # now, not after the first validation
        self._advise(loop, accumulate)
        return out

    def _advise(self, loop: Run, accumulate: int) -> None:
        """Warn of a per-step scheduler done in the first epoch (``schedules.passing``), a OneCycleLR the run outruns."""
        batches = length(loop.train_data) or 0  # (0: unknown, nothing is said)
        run = min(loop.max_steps or batches * loop.max_epochs, batches * loop.max_epochs)  # the run's batches
        per_epoch, total = -(-batches // accumulate), schedules.optimizer_steps(run, batches, accumulate)
        for name, scheduler in ((n, s) for n, held in self._assigned.items() for s in self.per_step(held)):
            if isinstance(scheduler, lr_scheduler.OneCycleLR) and scheduler.total_steps < total:  # (a GAN's may not)
                warnings.warn(f"optim: the OneCycleLR of optimizer {name!r} has total_steps={scheduler.total_steps}, "
                              f"and this run takes {total} optimizer steps if it steps at every window ({per_epoch} an "
                              f"epoch, accumulate={accumulate}, max_steps={loop.max_steps}); torch raises once it "
                              f"runs out: build it with total_steps={total}", OptimWarning, stacklevel=user_level())
            if run > batches and (found := schedules.passing(scheduler, per_epoch)) is not None:  # (a second epoch)
                interval = "'epoch'" if len(self._assigned) == 1 else f"{{{name!r}: 'epoch'}}"
                inside = "" if found is scheduler else f" (its {type(found).__name__})"  # (which one in a chain)
                warnings.warn(f"optim: the {type(scheduler).__name__}{inside} of optimizer {name!r} steps after each "
                              f"optimizer step and passes its schedule within the first epoch ({per_epoch} steps): it "
                              f"looks counted in epochs. Give Optim(scheduler_interval={interval}) to step it at each "
                              f"epoch's end, or count it in optimizer steps", OptimWarning, stacklevel=user_level())
                run = 0  # one warning (the other schedulers are still checked for the error above)

    def sized_in_batches(self, loop: Run, accumulate: int) -> None:
        """At ``fit_start``: warn of per-step schedules as long as the batches the run trains, where accumulation
        makes its optimizer steps fewer (README.md, "Schedulers")."""
        batches, per_epoch = loop.max_train_steps, bounded_length(loop.train_data)
        if accumulate == 1 or batches is None:
            return
        steps, said = schedules.optimizer_steps(batches, per_epoch, accumulate), []
        for name, given in ((n, s) for n, held in self._assigned.items() for s in self.per_step(held)):
            for what, attr, horizon, start in schedules.horizons(given):
                if horizon + start in (batches, loop.max_steps) and 0 < steps - start < horizon:  # (only that length)
                    sized = "max_steps" if horizon + start == loop.max_steps else "the batches this run trains"
                    since = f" from its milestone {start} (to step {horizon + start})" if start else ""
                    said.append(f"the {what} of optimizer {name!r} has {attr}={horizon}{since}, as many as {sized}, "
                                f"and would run only {steps - start} of those steps: give {attr}={steps - start}")
            for what, one, start in schedules.held(given):  # a LambdaLR's or MultiplicativeLR's lambda, probed
                for end in sorted({batches, loop.max_steps or batches}):
                    if 0 < steps - start < end - start and (
                            value := schedules.lambda_end(one, end - start, steps - start)) is not None:
                        sized = "max_steps" if end == loop.max_steps else "the batches this run trains"
                        since = f" ({end - start} steps from its milestone {start})" if start else ""
                        said.append(f"the {what} of optimizer {name!r} reaches its end (a factor of {value:g}) at "
                                    f"step {end}{since}, as many as {sized}, and would run only {steps - start} of "
                                    f"those steps: size its lambda to {steps - start} steps")
                        break
        if said:
            each = f", {-(-per_epoch // accumulate)} an epoch of {per_epoch}" if per_epoch else (
                ", or more where an epoch of data without a len() ends inside a window")
            warnings.warn(f"optim: {'; '.join(said)} (accumulate={accumulate}: the optimizers step {steps} times in "
                          f"the run's {batches} batches{each}). A scheduler stepped after each optimizer step counts "
                          f"optimizer steps: size its schedule to them", OptimWarning, stacklevel=user_level())

    def stage_ended(self, loop: Run, stage: str) -> None:
        """The monitored stage is complete: its ``epoch_metrics`` steps the ``ReduceLROnPlateau``."""
        if self._monitor is not None and stage == self._monitor.stage and loop.mode == "fit":
            self._awaiting = loop.state.epoch

    def epoch_metrics(self, stage: str, metrics: MetricsSnapshot) -> None:
        """Step the ``ReduceLROnPlateau`` on the monitored epoch mean."""
        monitor = self._monitor
        if monitor is None or stage != monitor.stage or self._awaiting is None:
            return  # not the monitored stage, or one that did not run to its end
        self._awaiting, key = None, monitor.key
        assert key is not None  # a monitor given has a metric
        if key not in metrics.values:
            raise ValueError(monitor.absent(metrics.values, metrics.epoch))  # (the closest metric suggested)
        self._told(metrics)
        self._step_all(True, float(metrics.values[key].epoch))

    def _told(self, metrics: MetricsSnapshot) -> None:
        """Warn, once a run, of a ``ReduceLROnPlateau`` whose mode is not the monitored metric's published direction."""
        for name, monitor in self._modes:
            if (found := monitor.contradicted(metrics.best)) is not None:
                warnings.warn(f"optim: the ReduceLROnPlateau of optimizer {name!r} has mode={monitor.given!r} and "
                              f"steps on monitor={self.monitor!r}, whose direction the metrics plugin publishes as "
                              f"{found!r} (Metrics(best=...)): it takes each improvement for none and cuts the learning"
                              f" rate while {self.monitor} improves. Build it with ReduceLROnPlateau(opt, "
                              f"mode={found!r})", OptimWarning, stacklevel=user_level())

    def epoch_end(self, epoch: int, stepped: Collection[str]) -> None:
        """The epoch-wise schedulers step (``stepped``: optimizers the run stepped); a monitored stage is published."""
        if self._awaiting is not None:
            stage = self._monitor.stage if self._monitor is not None else None
            raise ValueError(f"optim: monitor={self.monitor!r}, and no plugin published the {stage} metrics of epoch "
                             f"{epoch + 1} (epoch_metrics) for the ReduceLROnPlateau to step on: is the metrics "
                             f"plugin enabled?")
        self._step_all(False, stepped=stepped if self._first else ())  # (only a resume's first can be early)
        self._first = False

    def _step_all(self, plateaus: bool, *value: float, stepped: Collection[str] = ()) -> None:
        """Step every ``ReduceLROnPlateau`` (``plateaus``, on ``value``), or every epoch-wise scheduler."""
        for name, schedulers in self._assigned.items():
            for scheduler in schedulers:
                if isinstance(scheduler, PLATEAU) if plateaus else id(scheduler) in self._epochwise:
                    with hparams.resumed_schedule(name in stepped):
                        scheduler.step(*value)

