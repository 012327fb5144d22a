"""The objects the step function drives: ``loop.optimizers`` (:class:`Optimizers`), each of its
:class:`ManagedOptimizer` entries, and :class:`UnknownOptimizer` for a name the run lacks."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import torch

from hookfit.plugins.optim import kernels
from hookfit.plugins.optim.toggles import Toggled, stamp

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from hookfit.plugins.optim.plugin import Optim


def class_name(optimizer: Any) -> str:
    """The optimizer's class as recorded in checkpoints: ``torch.optim.adam.Adam``."""
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


class UnknownOptimizer(KeyError):
    """``loop.optimizers[name]`` with a name the run does not have."""

    def __str__(self) -> str:
        return str(self.args[0])


class ManagedOptimizer:
    """One of the run's optimizers, stepped under the plugin's rules."""

    def __init__(self, plugin: Optim, name: str, optimizer: torch.optim.Optimizer,
                 schedulers: Sequence[Any] = ()) -> None:
        self.plugin = plugin
        self.name = name
        self.optimizer = optimizer
        self.schedulers: list[Any] = list(schedulers)
        """Its learning-rate schedulers, in the order they step (see
        :mod:`hookfit.plugins.optim.schedulers`)."""
        self._per_step = [s for s in self.schedulers if plugin._interval(s) == "step"]  # after each real step
        self.steps = 0
        self.skipped = 0
        self._deferred = False  # step() was called inside an accumulation window
        self._stepped = False  # a real step happened since the last effective zero_grad()
        self._fast = False  # step() can step at once: no window, poison, scaling, clipping,
        # step-wise scheduler or hook around it (kept by Optim._set_fast_paths)
        self._fast_watched = False  # the same, while steps that bypass optim are watched for
        self._fast_device = False  # the same on the device path, where the kernel skips on the flag
        self._each_batch = plugin.accumulate == 1  # zero_grad() always takes effect
        if self._each_batch:  # then it is the optimizer's own, with no call in between
            self.zero_grad = optimizer.zero_grad  # type: ignore[method-assign]  # bound per instance: no call in between
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        self._own = False  # optim itself is stepping the optimizer (read by the watch's hook)
        # whether its kernel takes found_inf, so that it can skip on the device: decided at its
        # first step on the device path (where optim may switch it to torch's fused kernel),
        # again when its parameter groups change or a state is loaded
        self._skips_on_device: bool | None = None
        self._groups = 0  # how many parameter groups it had then
        self._primed = False  # a step skipped inside its kernel leaves it a valid state (cached)
        self._watch: RemovableHandle | None = None  # the handle of the step pre-hook while watching

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (learning rates live here)."""
        return self.optimizer.param_groups

    @property
    def scheduler(self) -> Any:
        """Its only scheduler, or ``None`` (with several, :attr:`schedulers`)."""
        return self.schedulers[0] if len(self.schedulers) == 1 else None

    def step(self) -> bool:
        """Step now if this batch closes an accumulation window; return whether it stepped
        (``False`` inside a window or when the step was skipped for a non-finite value)."""
        if self._fast:
            self.optimizer.step()
            self.steps += 1
            self._stepped = True
            return True
        if not self._each_batch and not self.plugin._window_closes():
            self._deferred = True
            return False
        if self._fast_device and self._primed and self._skips_on_device:
            # the device path's common case: the fused kernel skips on the window's flag
            plugin, optimizer = self.plugin, self.optimizer
            bad = plugin._bad
            if plugin._due is None and bad is not None and len(optimizer.param_groups) == self._groups:
                _step_on_flag(optimizer, bad)
                plugin._bad_stepped.append((self, bad, None))  # counted at the next host read if set
                self.steps += 1
                self._stepped = True
                return True
            return self._step()
        if self._fast_watched:  # the fast path while bypassing steps are watched (see watch())
            self._own = True
            try:
                self.optimizer.step()
            finally:
                self._own = False
            self.steps += 1
            self._stepped = True
            return True
        return self._step()

    def watch(self) -> None:
        """Watch for steps of the wrapped optimizer that do not come through this object (a
        step function calling its own optimizer variable's ``step()``), with torch's step
        pre-hook, until :meth:`unwatch`. Meanwhile optim's own steps are marked (``_own``):
        the plugin turns ``_fast`` off and ``_fast_watched`` on (``Optim._set_fast_paths``)."""
        if self._watch is None:
            self._watch = self.optimizer.register_step_pre_hook(self._stepped_elsewhere)

    def unwatch(self) -> None:
        """Remove the hook."""
        handle, self._watch = self._watch, None
        if handle is not None:
            handle.remove()

    def _stepped_elsewhere(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                           kwargs: dict[str, Any]) -> None:
        if not self._own:
            self.plugin._bypassed(self)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients, unless they are being accumulated for a later step: with
        accumulation it takes effect only once after each step, so calling it before
        ``backward`` or after ``step()`` in every batch both work."""
        if self._stepped or self._each_batch:
            self.optimizer.zero_grad(set_to_none=set_to_none)
            self._stepped = False

    def _step(self) -> bool:
        plugin, loop = self.plugin, self.plugin.loop
        assert loop is not None  # a step, during the run
        self._deferred = False
        scaler = plugin.scaler
        if plugin._poisoned:
            plugin._expire_poison()
        if plugin._poisoned:  # a non-finite loss in this window: its gradients are incomplete
            return self._skip("non-finite loss")
        bad = plugin._window_flag() if plugin._deferring else None  # the device path's flag
        if bad is not None and (self._skips_on_device is None or len(self.optimizer.param_groups) != self._groups):
            self._skips_on_device = self._device_kernel()
        # no device-side skip for this optimizer, or not yet (see kernels.skip_keeps_state):
        # one host read
        if bad is not None and scaler is None and not (self._skips_on_device and self._skip_keeps_state()):
            if plugin._read_flag():
                return self._skip("non-finite loss")
            bad = None
        if scaler is not None:
            scaler.unscale_(self.optimizer)
            if bad is not None and not _into_found_inf(scaler, self.optimizer, bad):
                if plugin._read_flag():  # (a GradScaler whose found_inf was not found)
                    plugin._scaler_used = True  # update() resets the unscaled state
                    return self._skip("non-finite loss")
                bad = None
        # the gradients' check: read on the host, or (where the step skips on the device, bad
        # set) a flag of this step's own, on the device; with a scaler, scaler.step() skips by
        # itself on non-finite gradients, so nothing is checked
        finite, grad_bad = True, None
        check = plugin.nonfinite is not None and scaler is None
        if plugin.clip_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self._params, plugin.clip_norm)
            if check and bad is None:
                finite = bool(torch.isfinite(norm))
            elif check and bad is not None:  # (the branch above took bad None)
                grad_bad = torch.isfinite(norm).logical_not_().to(bad.device)
        elif plugin.check_grads and check:
            grads = [p.grad for p in self._params if p.grad is not None]
            if bad is None:
                finite = all(bool(torch.isfinite(g).all()) for g in grads)
            elif grads:
                grad_bad = torch.stack([torch.isfinite(g).all().to(bad.device) for g in grads]).all().logical_not_()
        if plugin.clip_value is not None:
            torch.nn.utils.clip_grad_value_(self._params, plugin.clip_value)
        if not finite:
            return self._skip("non-finite gradient")
        if (call := loop.hooks.before_optimizer_step) is not None:
            call(loop, self.name, self.optimizer)
        self._own = True  # for the watch on steps that bypass optim (see watch())
        try:
            if scaler is not None:  # skips by itself on inf/NaN gradients (and on bad)
                if getattr(self.optimizer, "_step_supports_amp_scaling", False) and not self._skip_keeps_state():
                    _scaler_reads(scaler, self.optimizer)
                else:
                    scaler.step(self.optimizer)
                plugin._scaler_used = True
            elif bad is not None:  # the fused kernel skips the update where found_inf is set
                _step_on_flag(self.optimizer, bad if grad_bad is None else torch.maximum(bad, grad_bad.to(bad.dtype)))
            else:
                self.optimizer.step()
        finally:
            self._own = False
        if bad is not None:  # counted at the next host read if a flag it stepped on was set
            plugin._bad_stepped.append((self, bad, grad_bad))
        self.steps += 1
        self._stepped = True
        for scheduler in self._per_step:
            scheduler.step()
        if (call := loop.hooks.after_optimizer_step) is not None:
            call(loop, self.name, self.optimizer)
        return True

    def _device_kernel(self) -> bool:
        """Whether this optimizer skips on the device (see :mod:`kernels`): decided at its first
        step on the device path, and again when its parameter groups changed or a state was
        loaded. Unless ``Optim(fuse=False)``, the groups of torch's optimizers that can run
        the fused kernel, whose kernel was left to torch, are switched to it first."""
        if self.plugin.fuse:
            assert self.plugin.loop is not None  # at a step, during the run
            kernels.fuse(self.optimizer, self.plugin.loop.model)
        self._groups, self._primed = len(self.optimizer.param_groups), False
        return kernels.skips_on_device(self.optimizer)

    def _skip_keeps_state(self) -> bool:
        """:func:`kernels.skip_keeps_state`, remembered once true (it stays true)."""
        if not self._primed:
            self._primed = kernels.skip_keeps_state(self.optimizer)
        return self._primed

    def _skip(self, why: str) -> bool:
        self.plugin._nonfinite(why, self)
        self._clear()
        return False

    def _clear(self) -> None:
        """Drop the gradients now; the window starts afresh."""
        self.optimizer.zero_grad(set_to_none=True)
        self._stepped = False

    def state_dict(self) -> dict[str, Any]:
        """Optimizer (with its class), schedulers (with theirs) and counters, for checkpoints."""
        return {
            "class": class_name(self.optimizer),
            "optimizer": self.optimizer.state_dict(),
            "schedulers": [s.state_dict() for s in self.schedulers],
            "scheduler_classes": [class_name(s) for s in self.schedulers],
            "steps": self.steps,
            "skipped": self.skipped,
        }

    def check_state(self, state: Mapping[str, Any]) -> None:
        """Refuse, with a ``ValueError`` naming this optimizer, a saved state that does not fit
        it: another optimizer class (Adam's moments loaded into SGD would load without a word
        and train wrongly), other parameter groups, or other schedulers (their number and
        classes: a resumed run would step another schedule). (States saved before the classes
        were recorded are checked for what they hold.)"""
        saved_class, here = state.get("class"), class_name(self.optimizer)
        if saved_class is not None and saved_class != here:
            raise ValueError(
                f"optim: optimizer {self.name!r} was a {saved_class} in the checkpoint and is a "
                f"{here} in this run: its state cannot be loaded into another type of optimizer; "
                f"build the run with a {saved_class}, or start it afresh"
            )
        groups = state["optimizer"].get("param_groups", [])
        mine = self.optimizer.param_groups
        if len(groups) != len(mine):
            raise ValueError(
                f"optim: optimizer {self.name!r} ({here}) has {len(mine)} parameter group(s) in this "
                f"run and {len(groups)} in the checkpoint: build it with the same parameter groups "
                f"as the run that saved it"
            )
        for index, (saved, group) in enumerate(zip(groups, mine)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"optim: parameter group {index} of optimizer {self.name!r} ({here}) has "
                    f"{len(group['params'])} parameter(s) in this run and {len(saved['params'])} in "
                    f"the checkpoint: build it with the same parameters as the run that saved it"
                )
        saved_schedulers = _saved_schedulers(state)
        classes = state.get("scheduler_classes")
        mine_classes = [class_name(s) for s in self.schedulers]
        if len(saved_schedulers) != len(self.schedulers) or (classes is not None and list(classes) != mine_classes):
            theirs = _listed(classes) if classes is not None else f"{len(saved_schedulers)} scheduler(s)"
            raise ValueError(
                f"optim: optimizer {self.name!r} has {_listed(mine_classes)} in this run and {theirs} in the "
                f"checkpoint (schedulers): give Optim(schedulers=...) the schedulers of the run that saved it "
                f"(their states resume), or start afresh"
            )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (checked first: :meth:`check_state`)."""
        self.check_state(state)
        self.optimizer.load_state_dict(state["optimizer"])
        self._skips_on_device, self._primed = None, False  # its groups' kernels may have changed
        for scheduler, saved in zip(self.schedulers, _saved_schedulers(state)):
            scheduler.load_state_dict(saved)
        self.steps, self.skipped = state["steps"], state["skipped"]


def _listed(classes: Sequence[str]) -> str:
    """Scheduler classes as errors name them: ``the schedulers [StepLR, LinearLR]``."""
    if not classes:
        return "no scheduler"
    return f"the schedulers [{', '.join(c.rsplit('.', 1)[-1] for c in classes)}]"


def _saved_schedulers(state: Mapping[str, Any]) -> list[Any]:
    """The scheduler states of a saved optimizer state (one ``"scheduler"`` in states saved
    before a list was kept)."""
    if "schedulers" in state:
        return list(state["schedulers"])
    return [] if state.get("scheduler") is None else [state["scheduler"]]


def _step_on_flag(optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> None:
    """Step ``optimizer``'s fused kernel with ``flag`` (a float32 1.0 or 0.0 on the device, see
    :class:`~hookfit.plugins.optim.nonfinite.Flags`) as its ``found_inf``: the kernel leaves
    parameters and state as they are where it is 1.0. That is GradScaler's contract with the
    fused kernels: attributes of the optimizer that its declared type lacks, so set by name."""
    setattr(optimizer, "found_inf", flag)
    setattr(optimizer, "grad_scale", None)
    try:
        optimizer.step()
    finally:
        delattr(optimizer, "found_inf")
        delattr(optimizer, "grad_scale")


def _scaler_reads(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """``scaler.step(optimizer)`` through the scaler's own host read of ``found_inf`` rather
    than the optimizer's kernel, for a fused optimizer whose state a step skipped inside the
    kernel would leave invalid (torch's fused SGD with momentum before its first step)."""
    # (torch's private flag, which GradScaler reads: not in the optimizer's declared type)
    setattr(optimizer, "_step_supports_amp_scaling", False)
    try:
        scaler.step(optimizer)
    finally:
        setattr(optimizer, "_step_supports_amp_scaling", True)


def _into_found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, bad: torch.Tensor) -> bool:
    """Add the window's non-finite flag to what ``scaler`` found in ``optimizer``'s gradients
    at ``unscale_``, on the flag's device, so that ``scaler.step`` skips the step (and the
    scale backs off, as for an overflow). ``False`` when the scaler keeps no such record
    there (its layout is torch's, not public API): the caller then reads the flag itself."""
    record = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer), {})
    found = record.get("found_inf_per_device", {}).get(bad.device)
    if not isinstance(found, torch.Tensor):
        return False
    found.add_(bad).clamp_(max=1.0)  # fused kernels skip only where found_inf is exactly 1
    return True


NONE_GIVEN = ("this run has no optimizer: none was given to Loop(optimizers=...); pass the "
              "optimizer the step drives, Loop(optimizers=torch.optim.SGD(model.parameters(), "
              "lr=...)), or several as a dict of names")


class Optimizers(Mapping[str, ManagedOptimizer]):
    """``loop.optimizers`` during a run: named :class:`ManagedOptimizer` objects; with exactly
    one, ``step()``, ``zero_grad()`` and ``param_groups`` work without a name."""

    def __init__(self, managed: dict[str, ManagedOptimizer]) -> None:
        self._managed = managed
        self._toggled: list[Toggled] = []  # the toggles of the running batch (for a backward's error)
        self._single = next(iter(managed.values())) if len(managed) == 1 else None
        if self._single is not None:  # one optimizer: no lookup on the hot path
            self.step = self._single.step  # type: ignore[method-assign]  # bound per instance: the hot path
            self.zero_grad = self._single.zero_grad  # type: ignore[method-assign]  # bound per instance: the hot path

    def __getitem__(self, name: str) -> ManagedOptimizer:
        try:
            return self._managed[name]
        except KeyError:
            if not self._managed:
                raise UnknownOptimizer(f"unknown optimizer {name!r}: {NONE_GIVEN}") from None
            raise UnknownOptimizer(
                f"unknown optimizer {name!r}; this run's optimizers are: "
                f"{', '.join(map(repr, self._managed))}"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._managed)

    def __len__(self) -> int:
        return len(self._managed)

    def _only(self, what: str) -> ManagedOptimizer:
        if self._single is not None:
            return self._single
        if not self._managed:
            raise TypeError(f"loop.optimizers.{what}: {NONE_GIVEN}")
        if len(self._managed) != 1:
            raise TypeError(
                f"this run has {len(self._managed)} optimizers "
                f"({', '.join(map(repr, self._managed)) or 'none'}); name one: "
                f"loop.optimizers[name]"
            )
        return next(iter(self._managed.values()))

    def step(self) -> bool:
        """Step the only optimizer (see :meth:`ManagedOptimizer.step`)."""
        return (self._single or self._only("step()")).step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the only optimizer's gradients (see :meth:`ManagedOptimizer.zero_grad`)."""
        (self._single or self._only("zero_grad()")).zero_grad(set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The only optimizer's parameter groups."""
        return self._only("param_groups").param_groups

    @contextlib.contextmanager
    def toggle(self, name: str) -> Iterator[ManagedOptimizer]:
        """Freeze the parameters of every optimizer but ``name`` for the ``with`` block (their
        ``requires_grad`` flags are restored after it). A backward pass of the batch that fails
        for want of a gradient gets a note naming the toggle and what it froze
        (:mod:`hookfit.plugins.optim.toggles`)."""
        active = self[name]
        own = {id(p) for p in active._params}
        # the parameters it freezes, by optimizer: those that require a gradient now (one frozen
        # already, by an enclosing toggle or the user, is left as it is, and so restored)
        frozen = {
            other.name: [p for p in other._params if id(p) not in own and p.requires_grad]
            for other in self._managed.values() if other is not active
        }
        now = stamp(active.plugin.loop)  # this batch's toggles, the latest of each name
        self._toggled = [t for t in self._toggled if t.at == now and t.name != name]
        self._toggled.append(Toggled(name, {n: ps for n, ps in frozen.items() if ps}, now))
        for params in frozen.values():
            for p in params:
                p.requires_grad_(False)
        try:
            yield active
        finally:
            for params in frozen.values():
                for p in params:
                    p.requires_grad_(True)
