"""What the step drives: ``loop.optimizers`` of :class:`ManagedOptimizer`, stepped by the run's :class:`Rules`, and
the record of its toggles (README.md, "Toggles")."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import torch

from hookfit.handlers import Handlers
from hookfit.errors import UsageError
from hookfit.plugins.optim.nonfinite import Deferred, OptimWarning, Policy
from hookfit.plugins.support import few_parameters, hparams, parameter_names
from hookfit.plugins.support import kernels, sparse

if TYPE_CHECKING:
    from hookfit.plugins.optim.clipping import ModelNorm
    from hookfit.plugins.optim.watch import Watch
    from hookfit.plugins.optim.plugin import Window
    from hookfit.run import Run


def class_name(optimizer: Any) -> str:
    """The optimizer's class as recorded in checkpoints: ``torch.optim.adam.Adam``."""
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


class UnknownOptimizer(UsageError, KeyError):
    """``loop.optimizers[name]`` with a name the run does not have."""
    def __str__(self) -> str:
        return str(self.args[0])


@dataclass
class Rules:
    """What every step of a run obeys: optim's parts and options, shared by its optimizers."""

    loop: Run
    window: Window
    policy: Policy
    deferred: Deferred
    watch: Watch
    scaler: torch.amp.GradScaler | None = None
    clip_norm: float | Mapping[str, float] | None = None  # a mapping: by optimizer, those it names only
    clip_value: float | Mapping[str, float] | None = None
    model_norm: ModelNorm | None = None  # clip_scope="model": one norm over the optimizers (clip_norm's)
    check_grads: bool = False  # gradients checked (check_grads, ranks' device path; a policy, no scaler)
    check_norms: bool = False  # a clip's norm checked (a policy, no scaler)
    fuse: bool = True
    prepares: bool = False  # a step unscales, clips or checks the gradients first
    before_step: Handlers = field(default_factory=Handlers)  # the events around each step
    after_step: Handlers = field(default_factory=Handlers)
    scaler_used: bool = False  # the scaler stepped since its last update() (Optim's, once a batch)


class ManagedOptimizer:
    """One of the run's optimizers, stepped under the run's :class:`Rules`."""

    def __init__(self, rules: Rules, name: str, optimizer: torch.optim.Optimizer,
                 schedulers: Sequence[Any] = (), per_step: Sequence[Any] = ()) -> None:
        self.name, self.optimizer = name, optimizer
        self.clip_norm, self.clip_value = (c.get(name) if isinstance(c, Mapping) else c
                                           for c in (rules.clip_norm, rules.clip_value))  # its own
        self.built = hparams.settings(optimizer.param_groups)  # as given to the run: what a resume compares
        hparams.warn_unsaved_schedule("optim", rules.loop, name, optimizer, schedulers, OptimWarning)
        self.schedulers: list[Any] = list(schedulers)  # in the order they step
        self.steps, self.skipped = 0, 0  # real steps, skipped ones
        self.used_lrs: list[Any] | None = None  # each group's rate at its latest step, where it has schedulers
        self.window_open = False  # step() was called inside a window that has not closed
        self._listed: tuple[int, list[torch.Tensor]] = (-1, [])  # (groups, their parameters): see params
        self._rules, self._accumulates = rules, rules.window.size > 1
        self._per_step = list(per_step)  # its schedulers that step after each real step
        self._stepped = False  # a real step happened since the last effective zero_grad()
        self._skips: bool | None = None  # its kernel takes found_inf (see skips_on_device)
        self._groups = 0  # how many parameter groups it had when that was decided
        self._primed = False  # a step skipped inside its kernel leaves it a valid state (cached)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (learning rates live here)."""
        return self.optimizer.param_groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The wrapped optimizer's ``add_param_group``: the group then steps, clips, checks and saves as the others."""
        self.optimizer.add_param_group(param_group)

    @property
    def params(self) -> list[torch.Tensor]:
        """Its groups' parameters, a group added during the run's too: listed again when the groups change in number."""
        if len(groups := self.optimizer.param_groups) != self._listed[0]:  # (kept: clipping reads it every step)
            self._listed = (len(groups), [p for group in groups for p in group["params"]])
        return self._listed[1]

    def unscale_(self) -> bool:
        """``GradScaler.unscale_`` of its gradients, once a step (its step then unscales no more), for a step function
        that clips or reads them: whether they are its step's, ``False`` inside an accumulation window (README.md)."""
        rules = self._rules
        if self._accumulates and not rules.window.closes(rules.loop):
            return False
        if rules.scaler is not None:
            kernels.unscale(rules.scaler, self.optimizer)
        return True

    def step(self, closure: Callable[[], Any] | None = None, *, partial: bool = False) -> Any:
        """Step unless inside a window (``partial``: the stage's end); whether it stepped, or a ``closure``'s loss."""
        rules = self._rules
        if closure is not None and (self._accumulates or rules.prepares or rules.policy.mode is not None):
            raise UsageError(f"optim: optimizer {self.name!r}: step(closure) makes its gradients in torch's step, "
                             f"unchecked, unprepared: give Optim(nonfinite=None), no accumulate, clipping or scaling")
        if self._accumulates and not partial and not rules.window.closes(rules.loop):
            self.window_open = True
            return False
        self.window_open = False
        deferred = rules.deferred
        bad = deferred.flag_for(self) if deferred.bad is not None and not rules.policy.poisoned else None
        if rules.policy.poisoned:  # a non-finite loss in this window: its gradients are incomplete
            return self.skip("non-finite loss")
        grad_bad = None
        if rules.prepares:  # unscaling, clipping, gradient checks (a plain run has none)
            prepared = self._prepare(bad)
            if prepared is None:
                return False
            bad, grad_bad = prepared
        loop, optimizer = rules.loop, self.optimizer
        for call in rules.before_step.calls:
            call(loop, self.name, optimizer)
        watch = rules.watch
        watch.stepping = True  # optim's own step, for the watch on steps that bypass it
        try:
            if rules.scaler is not None:  # skips by itself on inf/NaN gradients (and on bad)
                alone = rules.loop.state.stage is None  # outside any stage (lr_find's sweep): no batch_end updates
                kernels.scaler_step(rules.scaler, optimizer, self.skip_keeps_state, alone)  # (updated at once)
                rules.scaler_used = not alone
            elif bad is not None:  # the fused kernel skips the update where found_inf is set
                kernels.step_on_flag(optimizer, bad if grad_bad is None else torch.maximum(bad, grad_bad.to(bad.dtype)))
            else:
                result = optimizer.step() if closure is None else optimizer.step(closure)
        finally:
            watch.stepping = False
        if bad is not None:
            deferred.stepped_on(self, bad, grad_bad)
        self.steps += 1
        self._stepped = True
        if self.schedulers:  # the rates this step used, kept before its schedulers change them (published)
            self.used_lrs = [lr.clone() if torch.is_tensor(lr := g["lr"]) else lr for g in optimizer.param_groups]
            for scheduler in self._per_step:
                scheduler.step()
        for call in rules.after_step.calls:
            call(loop, self.name, optimizer)
        return True if closure is None else result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients, unless they are accumulated for a later step (README.md, "The accumulation window")."""
        if self._stepped or not self._accumulates:
            self.optimizer.zero_grad(set_to_none=set_to_none)
            self._stepped = False

    def holds_grads(self) -> bool:
        """Gradients back-propagated since its last step and not cleared: a window its step function keeps by hand."""
        return not self._stepped and any(p.grad is not None for p in self.params)

    def flush(self) -> None:
        """At the training stage's end: step the open (partial) window, drop its gradients."""
        if self.window_open:
            self.step(partial=True)
            self.clear()

    def drop_window(self) -> None:
        """A poisoned window closed: skip its step if one was asked for, drop its gradients."""
        if self.window_open:
            self.window_open = False
            self._rules.policy.skip(self, "non-finite loss")
        self.clear()

    def skip(self, why: str) -> bool:
        """Skip this step (``why``: what was not finite), counted by the policy."""
        self._rules.policy.skip(self, why)
        self.clear()
        return False

    def clear(self) -> None:
        """Drop the gradients now, as :meth:`zero_grad` after a step; the window starts afresh."""
        self._stepped = True
        self.zero_grad()

    def _prepare(self, bad: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        """Unscale, check, clip: the window's flag and the gradients' on the device, or ``None`` (skipped)."""
        rules, optimizer, scaler = self._rules, self.optimizer, self._rules.scaler
        if scaler is not None:
            kernels.unscale(scaler, optimizer)  # (not again where the step function called unscale_())
            if bad is not None and not kernels.into_found_inf(scaler, optimizer, bad):
                if rules.deferred.read_flag():  # (a GradScaler whose found_inf was not found)
                    rules.scaler_used = True  # update() resets the unscaled state
                    self.skip("non-finite loss")
                    return None
                bad = None
        grad_bad = None  # 1.0 where the gradients are not finite, on the window flag's device
        try:
            if rules.model_norm is not None:
                grad_bad = rules.model_norm.clip(self, rules.loop, scaler, rules.check_norms)
                if scaler is not None and grad_bad is not None and kernels.into_found_inf(scaler, optimizer, grad_bad):
                    grad_bad = None  # the scaler skips on it (a record not found: read below, bad is None then)
            elif self.clip_norm is not None:
                norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip_norm)
                if rules.check_norms:
                    grad_bad = torch.isfinite(norm).logical_not_()
            elif rules.check_grads and (grads := [p.grad for p in self.params if p.grad is not None]):
                grad_bad = sparse.nonfinite_flag(grads, grads[0].device if bad is None else bad.device)
            if self.clip_value is not None:
                torch.nn.utils.clip_grad_value_(self.params, self.clip_value)
        except (RuntimeError, NotImplementedError):  # torch's clips refuse sparse gradients: say what to do
            for option in ("clip_norm", "clip_value"):
                if (value := getattr(self, option)) is not None:
                    sparse.refuse_clip("optim", option, self.name, optimizer, self.params, [
                        p for p in self.params if p.grad is not None and p.grad.is_sparse],
                        parameter_names(rules.loop.model), list(rules.loop.optimizers), value)
            raise
        if bad is not None:  # the device path: the step skips on both flags
            return bad, None if grad_bad is None else grad_bad.to(bad.device)
        if grad_bad is not None and bool(grad_bad):  # the host path: one read
            self.skip("non-finite gradient")
            return None
        return None, None

    def skips_on_device(self) -> bool:
        """Whether its kernel skips on ``found_inf``, leaving it a valid state (decided once, again on a change)."""
        optimizer = self.optimizer
        if self._skips is None or len(optimizer.param_groups) != self._groups:
            if self._rules.fuse:
                kernels.fuse(optimizer, self._rules.loop.model)
            self._groups, self._primed = len(optimizer.param_groups), False
            self._skips = kernels.skips_on_device(optimizer)
        return self._skips and (self._primed or self.skip_keeps_state())

    def skip_keeps_state(self) -> bool:
        """:func:`kernels.skip_keeps_state`, remembered once true (it stays true)."""
        self._primed = self._primed or kernels.skip_keeps_state(self.optimizer)
        return self._primed

    def state_dict(self) -> dict[str, Any]:
        """Optimizer (with its class), schedulers (with theirs) and counters, for checkpoints; a state sharded over
        the processes is gathered whole on the main one, ``None`` on the others (README.md, "Checkpoints")."""
        optimizer, whole = self.optimizer, True
        if (consolidate := getattr(optimizer, "consolidate_state_dict", None)) is not None:
            consolidate(to=0)
            whole = self._rules.loop.is_main
        return {"class": class_name(optimizer), "optimizer": optimizer.state_dict() if whole else None,
                "schedulers": [s.state_dict() for s in self.schedulers],
                "scheduler_classes": [class_name(s) for s in self.schedulers],
                "steps": self.steps, "skipped": self.skipped, "built": self.built, "used_lrs": self.used_lrs}

    def check_state(self, state: Mapping[str, Any]) -> None:
        """Refuse, with a ``ValueError`` naming this optimizer, a saved state that does not fit it."""
        saved_class, here = state.get("class"), class_name(self.optimizer)
        if saved_class is not None and saved_class != here:
            raise ValueError(f"optim: optimizer {self.name!r} was a {saved_class} in the checkpoint and is a {here} "
                             f"in this run: build the run with a {saved_class} to resume its state, or start afresh")
        groups, mine = state["optimizer"].get("param_groups", []), self.optimizer.param_groups
        if len(groups) != len(mine):
            raise ValueError(f"optim: optimizer {self.name!r} ({here}) has {len(mine)} parameter group(s) in this run "
                             f"and {len(groups)} in the checkpoint: build it with the groups of the run that saved it")
        for index, (saved, group) in enumerate(zip(groups, mine)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"optim: parameter group {index} of optimizer {self.name!r} ({here}) has "
                                 f"{len(group['params'])} parameter(s) in this run and {len(saved['params'])} in "
                                 f"the checkpoint: build it with the same parameters as the run that saved it")
        theirs, ours = list(state["scheduler_classes"]), [class_name(s) for s in self.schedulers]
        if theirs != ours:
            raise ValueError(f"optim: optimizer {self.name!r} has {_listed(ours)} in this run and {_listed(theirs)} "
                             f"in the checkpoint (schedulers): give Optim(schedulers=...) the schedulers of the run "
                             f"that saved it (their states resume), or start afresh")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, once :meth:`check_state` accepted it."""
        hparams.warn_replaced("optim", self.name, self.optimizer, self.built, state.get("built"), OptimWarning)
        self.optimizer.load_state_dict(state["optimizer"])
        self._skips, self._primed = None, False  # its groups' kernels may have changed
        for scheduler, saved in zip(self.schedulers, state["schedulers"]):
            hparams.load_schedule("optim", self.name, scheduler, saved, OptimWarning)
        self.steps, self.skipped, self.used_lrs = state["steps"], state["skipped"], state.get("used_lrs")


def _listed(classes: Sequence[str]) -> str:
    """Scheduler classes as errors name them: ``the schedulers [StepLR, LinearLR]``."""
    return f"the schedulers [{', '.join(c.rsplit('.', 1)[-1] for c in classes)}]" if classes else "no scheduler"


NONE_GIVEN = ("this run has no optimizer: none was given to Loop(optimizers=...); pass the optimizer the step "
              "drives, Loop(optimizers=torch.optim.SGD(model.parameters(), lr=...)), or several as a dict of names")


class NoSingleOptimizer(UsageError, TypeError, AttributeError):
    """An unnamed optimizer's ``step``/``zero_grad``/``param_groups`` asked of several or of none: ``hasattr`` is False."""


class Optimizers(Mapping[str, ManagedOptimizer]):
    """``loop.optimizers`` during a run: its managed optimizers by name; a run with exactly one gets
    :class:`OnlyOptimizer`, which also steps without a name."""

    def __init__(self, managed: dict[str, ManagedOptimizer], loop: Run | None = None) -> None:
        self._managed, self._loop = managed, loop
        self.toggled: list[Toggled] = []  # the running batch's toggles (note_toggles names them)

    def __getitem__(self, name: str) -> ManagedOptimizer:
        try:
            return self._managed[name]
        except KeyError:
            raise UnknownOptimizer(f"unknown optimizer {name!r}; this run's optimizers are: "
                                   f"{', '.join(map(repr, self._managed))}" if self._managed
                                   else f"unknown optimizer {name!r}: {NONE_GIVEN}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._managed)

    def __len__(self) -> int:
        return len(self._managed)

    def __getattr__(self, what: str) -> Any:
        """``step``, ``zero_grad``, ``param_groups``, ``add_param_group``: an :class:`OnlyOptimizer`'s."""
        if what not in ("step", "zero_grad", "param_groups", "add_param_group"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {what!r}")
        several = f"this run has {len(self._managed)} optimizers ({', '.join(map(repr, self._managed))})"
        raise NoSingleOptimizer(f"{several}; name one: loop.optimizers[name].{what}" if self._managed
                      else f"loop.optimizers.{what}: {NONE_GIVEN}")

    def unscale_(self) -> bool:
        """Each optimizer's :meth:`ManagedOptimizer.unscale_` (those stepped in the batch already left as they are)."""
        return all([managed.unscale_() for managed in self._managed.values()])

    @contextlib.contextmanager
    def toggle(self, name: str) -> Iterator[ManagedOptimizer]:
        """Freeze the parameters of every optimizer but ``name`` for the ``with`` block, restored after it."""
        active = self[name]
        own = {id(p) for p in active.params}  # frozen, by optimizer: those requiring a gradient now (not others)
        frozen = {other.name: [p for p in other.params if id(p) not in own and p.requires_grad]
                  for other in self._managed.values() if other is not active}
        now = stamp(self._loop)  # this batch's toggles, the latest of each name
        self.toggled = [t for t in self.toggled if t.at == now and t.name != name]
        self.toggled.append(Toggled(name, {n: ps for n, ps in frozen.items() if ps}, now))
        params = [p for ps in frozen.values() for p in ps]
        for p in params:
            p.requires_grad_(False)
        try:
            yield active
        finally:
            for p in params:
                p.requires_grad_(True)


class OnlyOptimizer(ManagedOptimizer, Optimizers):
    """A run's one managed optimizer, which is also ``loop.optimizers``: a collection of one whose item is itself
    (not a collection in front of it: two calls fewer a batch, above benchmarks/overhead.py's noise)."""

    __eq__, __hash__ = object.__eq__, object.__hash__  # an optimizer: equal to itself only, not as a mapping

    def __init__(self, rules: Rules, name: str, optimizer: torch.optim.Optimizer,
                 schedulers: Sequence[Any] = (), per_step: Sequence[Any] = ()) -> None:
        ManagedOptimizer.__init__(self, rules, name, optimizer, schedulers, per_step)
        Optimizers.__init__(self, {name: self}, rules.loop)


class Toggled(NamedTuple):
    """A ``toggle(name)`` entered during a batch: the parameters it froze, by optimizer."""

    name: str
    frozen: Mapping[str, list[torch.Tensor]]
    at: Any  # the batch it was entered in (stamp)


def stamp(loop: Run | None) -> Any:
    """Which batch of the run is running: toggles are remembered for the batch they came in."""
    return None if loop is None else (loop.state.epoch, loop.state.stage, loop.state.batch_idx, loop.state.step)


def note_toggles(optimizers: Optimizers | None, loop: Run, error: RuntimeError) -> None:
    """Add a note naming this batch's toggles to torch's error for a backward pass through nothing to train."""
    if optimizers is None or "does not require grad" not in str(error):  # torch's, for a pass through nothing
        return
    toggled = [t for t in optimizers.toggled if t.at == stamp(loop) and t.frozen]  # this batch's
    if not toggled:
        return
    names = parameter_names(loop.model)
    lines = "".join(f"  loop.optimizers.toggle({t.name!r}) froze " + "; ".join(
        f"the {len(params)} parameter tensor(s) of optimizer {other!r} ({few_parameters(params, names)})"
        for other, params in t.frozen.items()) + "\n" for t in toggled)
    error.add_note(
        "optim: this batch ran loop.optimizers.toggle(...), which freezes the parameters of the other "
        "optimizers (requires_grad=False) for its `with` block, so that a backward pass there trains the "
        "toggled optimizer's alone:\n" + lines +
        "A tensor computed inside such a block (a generator's output inside the discriminator's toggle) "
        "records no gradient through the parameters it froze: a loss computed from it later trains none of "
        "them and, with nothing else requiring a gradient, has no grad_fn, as here. Compute that tensor "
        "outside the block (and detach it where the toggled optimizer's model reads it: D(fake.detach())), "
        "or inside the toggle of the optimizer its loss trains.")
