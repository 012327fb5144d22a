"""The ``Optim`` plugin: its options, its events, the fast paths, mixed precision and
checkpoints. The other parts of its class have a module each: the accumulation windows
(:mod:`hookfit.plugins.optim.windows`), the non-finite policy and its device path, with
:class:`OptimWarning` (:mod:`hookfit.plugins.optim.nonfinite`), and the watch for steps that
bypass it (:mod:`hookfit.plugins.optim.watch`)."""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping

import torch

from hookfit import hookimpl
from hookfit.modes import modules
from hookfit.plugins.support import check, choice, flag, positive_int, positive_number
from hookfit.plugins.optim import hookspecs
from hookfit.plugins.optim.managed import ManagedOptimizer, Optimizers
from hookfit.plugins.optim.nonfinite import READ_EVERY, Flags, NonFinite, OptimWarning, _finite
from hookfit.plugins.optim.schedulers import Scheduling
from hookfit.plugins.optim.toggles import note_toggles
from hookfit.plugins.optim.watch import Watch
from hookfit.plugins.optim.windows import Windows

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run, Step

__all__ = ["Optim", "OptimWarning"]


class Optim(NonFinite, Windows, Watch, Scheduling):
    """Manual optimizer stepping with accumulation, clipping, AMP and non-finite policies.

    ``accumulate=N``: the optimizers step after every N-th training batch of an epoch
    (windows aligned to batch indices, also in a run resumed mid-epoch) and after its last
    batch, and each loss is divided by the number of batches of its window, so that a
    window's update is that of its batches taken as one large batch (a mean-reduced loss,
    batches of one size). That number is N but in the epoch's last window when the training
    data's length (``len()``) makes it partial: 9 batches with ``accumulate=4`` are windows of
    4, 4 and 1. When the length is unknown (no ``__len__``, or one that raises ``TypeError``,
    as a ``DataLoader``'s over an ``IterableDataset`` does) every loss is divided by N, the
    partial window's too, which then weighs less than a full one. ``max_steps`` may end a run
    inside a window, which is then not stepped: the run's end cut it, not the data, so its
    gradients keep the weighting of the window the data makes; a checkpoint keeps them and a
    longer run resumed from it completes the window as an uninterrupted run would. The
    divisor is a Python int: no host read on the device path; a ``GradScaler`` scales the
    divided loss.

    On an accelerator (a loss not on the CPU; ``defer=True`` takes the same path on the CPU,
    ``defer=False`` never takes it) the non-finite check of the loss never waits for the
    device. ``backward`` back-propagates every loss and folds ``~isfinite(loss)`` into a flag
    tensor of the accumulation window, on the device (a window's first loss costs one kernel,
    into a zero made ahead of time; see :class:`~hookfit.plugins.optim.nonfinite.Flags`). A step
    of that window then skips on the device, with no host read, when it can:

    * an optimizer that accepts ``found_inf`` in every parameter group (torch's ``fused=True``
      Adam, AdamW, SGD, Adagrad; another class that sets ``_step_supports_amp_scaling``) gets
      the flag as ``found_inf``, and its kernel leaves the parameters and the state as they
      were. A fused SGD with momentum given so reads the flag instead until every parameter
      with a gradient has its momentum buffer: torch's fused kernel, skipped before, would
      leave the buffers uninitialised (Adam, AdamW and Adagrad make their state before the
      kernel runs);
    * ``fuse=True`` (default): the parameter groups of torch's Adam, AdamW and SGD whose kernel
      you left to torch (``fused`` and ``foreach`` not given, not ``differentiable``) are
      switched to torch's fused kernel at the first step on this path (and a group added later
      at the next step), where that kernel is known to take them (see
      :mod:`hookfit.plugins.optim.kernels`: floating point parameters on a device torch has
      fused kernels for; for SGD plain tensors, no module with ``sparse=True``, and with
      momentum no dampening and every parameter requiring a gradient, when it gets zero
      momentum buffers, which make its first update torch's). The groups then say
      ``fused=True``, also in checkpoints. torch's fused kernels compute the same update as
      its other kernels up to rounding, and are its fastest. ``fuse=False`` keeps the kernel
      torch picks;
    * with a ``GradScaler`` the flag is added to the scaler's ``found_inf`` for the optimizer,
      so ``scaler.step`` skips it (with a fused optimizer without a host read; with another,
      ``scaler.step`` reads ``found_inf`` once, as it always does);
    * any other optimizer (a kernel you chose, Adagrad, another class, a group the fused
      kernel would not take) has no device-side skip short of copying its parameters and state
      every step: its step reads the flag on the host, once per step (not per ``backward``;
      with the flags kept for the steps that skipped on the device, in one transfer), and skips
      exactly as on the CPU. ``Optim(nonfinite=None)`` removes that read.

    Steps skipped on the device are counted, warned about or raised for at the next host
    read: the metrics' publication (``metrics_update``), every ``READ_EVERY`` windows, the
    training stage's end, a checkpoint, the end of the run. Until then such a step looks like
    a real one: ``step()`` returned ``True``, the optimizer hooks fired, a per-step scheduler
    stepped, and ``steps``/``skipped`` count it as stepped. ``nonfinite="raise"`` raises
    ``FloatingPointError`` at that read (once every window it read is counted), naming the
    batch of the non-finite loss; that window's steps were skipped on the device, so no
    parameter took it in, and the windows after it stepped as usual. A read made for a
    checkpoint keeps the error for optim's next step or read, so the save is whole; at the end
    of a run that completed (``max_steps`` may end one before a stage end reads) the error is
    raised, at the end of an interrupted or failed one it is warned about.

    Gradient checks (``clip_norm`` with a non-finite policy, ``check_grads``) are a flag of the
    step's own there, joined to the loss's in ``found_inf``: such a step is skipped for that
    optimizer alone (as on the CPU), reported as a non-finite gradient at the next host read;
    where the step reads the loss's flag, the check is read too. With a ``GradScaler`` optim
    checks no gradient: ``unscale_`` finds non-finite ones itself.

    ``schedulers``, ``scheduler_interval`` and ``monitor``: learning-rate schedulers as scripts
    use them, per step, per epoch, chained, and ``ReduceLROnPlateau`` on the epoch mean
    ``monitor`` names; checked here (see :mod:`hookfit.plugins.optim.schedulers`).
    """

    name = "optim"
    hookspecs = hookspecs  # the events it declares, added to every run (core/hooks.md)

    def __init__(
        self,
        accumulate: int = 1,
        clip_norm: float | None = None,
        clip_value: float | None = None,
        amp: bool | torch.amp.GradScaler = False,
        nonfinite: Literal["skip", "raise"] | None = "skip",
        check_grads: bool = False,
        schedulers: Any = None,
        scheduler_interval: Literal["step", "epoch"] | None = None,
        monitor: str | None = None,
        precision: Literal["32", "bf16-mixed", "16-mixed"] = "32",
        defer: bool | None = None,
        fuse: bool = True,
    ) -> None:
        name = self.name
        positive_int(name, "accumulate", accumulate)
        choice(name, "nonfinite", nonfinite, ("skip", "raise"), none=True)
        choice(name, "precision", precision, PRECISIONS)
        flag(name, "defer", defer, none=True)
        flag(name, "fuse", fuse)
        flag(name, "check_grads", check_grads)
        check(name, "amp", amp, lambda v: isinstance(v, (bool, torch.amp.GradScaler)),
              "be True, False or a torch.amp.GradScaler")
        if precision == "bf16-mixed" and amp is not False:
            raise ValueError("optim: precision='bf16-mixed' needs no loss scaling: leave amp unset "
                             "(precision='16-mixed' scales the loss itself)")
        self.precision = precision
        self.accumulate = accumulate
        self.clip_norm = positive_number(name, "clip_norm", clip_norm, none=True)
        self.clip_value = positive_number(name, "clip_value", clip_value, none=True)
        self.amp = amp
        self.nonfinite = nonfinite
        self.check_grads = check_grads
        Scheduling.__init__(self, schedulers, scheduler_interval, monitor)  # checked: see schedulers.py
        self.scaler: torch.amp.GradScaler | None = None
        self.loop: Run | None = None
        self.optimizers: Optimizers | None = None
        NonFinite.__init__(self)  # the poisoned window, the device path's flags
        Windows.__init__(self, accumulate)  # the training stage's length, its last window
        self._scaler_used = False
        self._plain = False  # set at configure: a step needs no window, unscaling, clipping or scheduler
        self._scales = False  # set at configure: backward scales the loss (accumulation or AMP)
        self._bare = False  # backward needs only the finiteness check (kept by _set_fast_paths)
        self._bare_device = False  # the same on the device path: only the window's flag
        self._unwatch: Callable[[], None] | None = None  # ends the plugin manager's listening
        Watch.__init__(self)  # for steps that bypass loop.optimizers
        self._autocast: tuple[str, torch.dtype] | None = None  # (device type, dtype) when mixed
        # the device path of the non-finite check (see the class docstring, "On an accelerator")
        self.defer = defer
        self.fuse = fuse  # on the device path, torch's optimizers may run their fused kernel

    # -- events ---------------------------------------------------------------------------
    @hookimpl
    def configure(self, loop: Run) -> None:
        # loop.optimizers is replaced here, not at fit_start, so that every plugin sees the
        # managed optimizers from fit_start on, whatever the order (the spec says so)
        self.loop = loop
        optimizers = _named(loop.optimizers, "optimizers")
        for name, opt in optimizers.items():
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"optim: optimizer {name!r} is a {type(opt).__name__}, not a torch.optim.Optimizer")
        schedulers = self._assign(loop, optimizers)  # each optimizer's, checked (none in a validation)
        self.optimizers = Optimizers(
            {n: ManagedOptimizer(self, n, o, schedulers[n]) for n, o in optimizers.items()}
        )
        self._autocast = None
        if self.precision != "32":
            device = _device_type(loop.model)
            self._autocast = (device, torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16)
            loop.wrap_step(self._under_autocast)
        if isinstance(self.amp, torch.amp.GradScaler):
            self.scaler = self.amp
        elif self.amp or self.precision == "16-mixed":
            self.scaler = torch.amp.GradScaler(
                self._autocast[0] if self._autocast else ("cuda" if torch.cuda.is_available() else "cpu"))
        loop.optimizers = self.optimizers
        self._plain = (
            self.accumulate == 1 and self.scaler is None and self.clip_norm is None
            and self.clip_value is None and not (self.check_grads and self.nonfinite is not None)
            and not any(m._per_step for m in self.optimizers.values())
        )
        self._scales = self.accumulate > 1 or self.scaler is not None
        self._bad, self._bad_stepped, self._pending, self._due = None, [], [], None
        self._flags = Flags()
        self._deferring = self.nonfinite is not None and (
            self.defer is True or (self.defer is None and _device_type(loop.model, None) not in (None, "cpu")))
        self._poison(False)
        self._watched = self._bypass_seen = self._backward_bypassed = self._unstepped_said = False
        self._first_stage = False
        self._unwatch = loop.pm.on_change(self._set_fast_paths)
        if self.accumulate > 1 or self.scaler is not None:
            # a per-batch hook only where a batch can close a window or update a loss scale;
            # a plain run's batches cost optim nothing outside the step function
            loop.pm.register(_BatchEnd(self), name="optim.batch_end")

    @hookimpl
    def backward(self, loop: Run, loss: torch.Tensor) -> bool:
        if self._bare:  # no scaling, no hook around it, no poisoned window: the common case
            if self.nonfinite is not None:  # _finite(loss), its CPU case inlined
                if loss.is_cpu:
                    try:  # one number: read at once (item() refuses any other count)
                        finite = math.isfinite(loss.item())
                    except RuntimeError:
                        finite = _finite(loss)
                    if not finite:
                        return self._nonfinite_loss(loop, loss)
                elif self.defer is None:  # the first loss on an accelerator
                    self._deferring = True
                    self._set_fast_paths()
                    return self._backward(loop, loss)
                elif not _finite(loss):
                    return self._nonfinite_loss(loop, loss)
            try:
                loss.backward()  # type: ignore[no-untyped-call]  # Tensor.backward is unannotated in torch
            except RuntimeError as error:
                note_toggles(self, error)  # a toggle froze what the loss needed: say so
                raise
            return True
        if self._bare_device:  # the device path's common case: a new window's flag, then backward
            state = loop.state
            if self._due is None and (self._bad is None or state.step != self._bad_at):
                if self._bad is not None:  # the previous batch's window: no batch_end closed it
                    pending = self._pending  # (_close_deferred, inlined)
                    pending.append((self._bad, self._bad_where, self._bad_stepped))
                    self._bad, self._bad_stepped = None, []
                    if len(pending) >= READ_EVERY:
                        self._read_deferred()
                self._bad, self._bad_at = self._flags.check(loss), state.step
                self._bad_where = (state.epoch, state.batch_idx, state.batch_idx)
                try:
                    loss.backward()  # type: ignore[no-untyped-call]  # Tensor.backward is unannotated in torch
                except RuntimeError as error:
                    note_toggles(self, error)
                    raise
                return True
        if self._autocast is not None:  # the backward pass outside autocast, as PyTorch advises
            with torch.autocast(self._autocast[0], enabled=False):
                return self._backward(loop, loss)
        return self._backward(loop, loss)

    def _backward(self, loop: Run, loss: torch.Tensor) -> bool:
        """``backward`` past its common case: poisoned windows, scaling, hooks around it."""
        if self._poisoned:
            self._expire_poison()
        if self.nonfinite is not None:
            if self.defer or (self.defer is None and not loss.is_cpu):
                self._flag_on_device(loop, loss)
            elif not _finite(loss):
                return self._nonfinite_loss(loop, loss)
        if (call := loop.hooks.before_backward) is not None:
            call(loop, loss)
        scaled = loss
        if self._scales:
            if self.accumulate > 1:
                divisor = self._divisor(loop)
                if divisor > 1:
                    scaled = loss / divisor
            if self.scaler is not None:
                scaled = self.scaler.scale(scaled)
        try:
            scaled.backward()  # type: ignore[no-untyped-call]  # Tensor.backward is unannotated in torch
        except RuntimeError as error:
            note_toggles(self, error)
            raise
        if (call := loop.hooks.after_backward) is not None:
            call(loop, loss)
        return True

    @hookimpl
    def metrics_update(self, loop: Run) -> None:
        """The publication rate is a host read anyway: read the device-side flags too, the
        running batch's window included once its steps are done (it closes at this batch)."""
        if self._bad is not None and loop.training and self._window_closes():
            self._close_deferred()
        if self._pending:
            self._read_deferred()
        self._raise_due()

    def _batch_end(self) -> None:
        if self._scaler_used and self.scaler is not None:  # (used: there is one)
            self.scaler.update()  # once per batch, after every optimizer of the batch stepped
            self._scaler_used = False
        if self._window_closes():
            self._close_window()

    @hookimpl
    def stage_start(self, loop: Run, stage: str) -> None:
        if stage == "train":
            self._measure(loop.train_data)
            if not self._watched and self.optimizers is not None:
                self._watched = self._first_stage = True  # the run's first training stage only: see _watch
                self._watch(True)

    @hookimpl(tryfirst=True)  # finishes the stage's work before plugins report on it (metrics)
    def stage_end(self, loop: Run, stage: str) -> None:
        self._stage_ended(loop, stage)  # a ReduceLROnPlateau steps on this stage's metrics
        if stage != "train" or self.optimizers is None:
            return
        for managed in self.optimizers.values():  # the last, partial window of the epoch
            if managed._deferred:
                managed._step()
                managed._clear()
        self._close_window()
        if self._scaler_used and self.scaler is not None:  # (used: there is one)
            self.scaler.update()
            self._scaler_used = False
        if self._pending:
            self._read_deferred()
        self._raise_due()
        if self._first_stage:  # (its watch may have ended earlier: WATCHED_PASSES)
            self._first_stage = False
            self._check_stepped(self._passes)
            self._watch(False)

    @hookimpl
    def results(self, loop: Run) -> dict[str, Any] | None:
        """What ``fit()`` returns of the optimizer steps: ``skipped_steps``, how many were skipped
        for non-finite values (the optimizers' counts, over the whole run), and ``first_skip``,
        where the first of this ``fit()`` was (``None`` without one); nothing in a run that
        does not train."""
        if self._skipped_total is None:
            return None
        return {"skipped_steps": self._skipped_total, "first_skip": self._first_skip}

    @hookimpl
    def fit_end(self, loop: Run) -> None:
        self._skipped_total = None
        try:
            self._end_of_run(loop)
        finally:
            self._release_run()

    def _end_of_run(self, loop: Run) -> None:
        """The last read of the device-side flags (the open window's too: no step follows):
        a run that completed raises under ``nonfinite="raise"`` as it would have on the CPU
        (``max_steps`` or a rule can end it before any stage end read them); one interrupted
        or failed warns. Then the run's total of skipped steps."""
        if self.optimizers is not None:
            self._close_deferred(bounded=False)
            final = loop.state.status != "completed"
            if self._due is not None and final:
                warnings.warn(f"{self._due}, found at the end of the run", OptimWarning, stacklevel=3)
                self._due = None
            if self._pending:
                self._read_deferred(final=final)
            self._raise_due()
            skipped = self._skipped_total = sum(m.skipped for m in self.optimizers.values())
            if skipped > 1:
                warnings.warn(
                    f"optim: {skipped} optimizer steps were skipped in this run because of "
                    f"non-finite values (first: {self._first_skip})",
                    OptimWarning,
                    stacklevel=2,
                )

    def _release_run(self) -> None:
        """What ``fit_end`` undoes whatever happened: the watch, the listener, the run."""
        if self._watching:
            self._watch(False)
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        self.loop = None

    # -- mixed precision ------------------------------------------------------------------------
    def _under_autocast(self, step: Step) -> Step:
        """``step`` run under ``torch.autocast`` (given to ``loop.wrap_step``): the step's
        forward computes in the lower precision; ``backward`` leaves autocast again."""
        assert self._autocast is not None  # set at configure, before it calls loop.wrap_step
        device, dtype = self._autocast

        def step_under_autocast(loop: Run, batch: Any) -> Any:
            with torch.autocast(device, dtype=dtype):
                return step(loop, batch)

        return step_under_autocast

    # -- the fast paths ---------------------------------------------------------------------
    def _set_fast_paths(self) -> None:
        """Decide whether ``backward`` and ``step()`` may skip everything but the work itself;
        run when a window is poisoned or closed, and whenever the run's plugins change (a
        plugin that implements ``before_optimizer_step``... turns them off)."""
        assert self.loop is not None and self.optimizers is not None  # set at configure, before any call
        hooks = self.loop.hooks
        stepped = hooks.before_optimizer_step is not None or hooks.after_optimizer_step is not None
        backward = hooks.before_backward is not None or hooks.after_backward is not None
        clean = not self._poisoned
        fast = self._plain and clean and not stepped and not self._deferring
        for managed in self.optimizers.values():
            # while watching for steps that bypass optim, the fast path marks optim's own
            # (_fast_watched); the plain fast path itself has nothing more to do, then or after
            managed._fast = fast and not self._watching
            managed._fast_watched = fast and self._watching
        self._bare = (not self._scales and clean and not backward and self._autocast is None
                      and not self._deferring)
        # the device path's: one window a batch, nothing around backward or the step
        self._bare_device = (not self._scales and clean and not backward and self._autocast is None
                             and self._deferring and self.accumulate == 1)
        for managed in self.optimizers.values():
            managed._fast_device = self._bare_device and self._plain and not stepped and not self._watching

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every optimizer, scheduler and counter, and the gradient scaler; inside an open
        accumulation window also the gradients accumulated so far, so a run resumed mid-window
        steps with the same gradients as an uninterrupted one."""
        assert self.optimizers is not None
        loop = self.loop  # (None after the run, when no flag is open)
        if self._bad is not None and (
                self.accumulate == 1 or (loop is not None and loop.training and self._window_closes())):
            self._close_deferred()  # this batch's steps are done
        if self._pending:  # the counters as they are, the steps skipped on the device counted
            self._read_deferred(hold=True)  # (an error is raised at optim's next step or read)
        window_open = self.accumulate > 1 and any(m._deferred for m in self.optimizers.values())
        poisoned = self._poisoned or (window_open and self._bad is not None and bool(self._bad))
        return {
            "optimizers": {n: m.state_dict() for n, m in self.optimizers.items()},
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "window": {
                "poisoned": poisoned,
                "deferred": [n for n, m in self.optimizers.items() if m._deferred],
                "grads": {n: [None if p.grad is None else p.grad.detach().clone() for p in m._params]
                          for n, m in self.optimizers.items()},
            } if window_open else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; refused, before anything is restored, when
        it does not fit this run's optimizers (their names, classes, parameter groups)."""
        assert self.optimizers is not None
        saved, here = set(state["optimizers"]), set(self.optimizers)
        if saved != here:
            raise ValueError(f"optim: the checkpoint has optimizers {sorted(saved)}, this run {sorted(here)}")
        for name, managed in self.optimizers.items():
            managed.check_state(state["optimizers"][name])
        for name, managed in self.optimizers.items():
            managed.load_state_dict(state["optimizers"][name])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        window = state.get("window")
        if window is not None:
            self._poison(window["poisoned"])
            for name, managed in self.optimizers.items():
                managed._deferred = name in window["deferred"]
                for p, grad in zip(managed._params, window["grads"][name]):
                    p.grad = None if grad is None else grad.to(p.device).clone()

    @hookimpl
    def save_state(self) -> dict[str, Any] | None:
        return self.state_dict() if self.optimizers is not None else None

    @hookimpl
    def load_state(self, loop: Run, state: Mapping[str, Any]) -> None:
        if loop.mode != "fit":
            return  # a run that does not train (Loop.validate()) needs no optimizer state, nor optimizers
        self.load_state_dict(state)


class _BatchEnd:
    """optim's per-batch part, registered only when a batch can close an accumulation window
    or must update the AMP loss scale."""

    def __init__(self, owner: Optim) -> None:
        self.owner = owner

    @hookimpl
    def batch_end(self, loop: Run) -> None:
        if loop.training:
            self.owner._batch_end()


PRECISIONS = ("32", "bf16-mixed", "16-mixed")


_GUESS = object()


def _device_type(model: Any, default: Any = _GUESS) -> Any:
    """Where the model computes (``"cuda"``, ``"cpu"``...): its first parameter's device;
    if there is none, ``default`` when given, else ``"cuda"`` if CUDA is available, else
    ``"cpu"``."""
    for root in modules(model):
        for parameter in root.parameters():
            return parameter.device.type
    if default is not _GUESS:
        return default
    return "cuda" if torch.cuda.is_available() else "cpu"


def _named(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, Optimizers):
        return {n: m.optimizer for n, m in value.items()}
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, (list, tuple)):
        raise TypeError(f"optim: give several {what} as a dict of names, not a {type(value).__name__}")
    return {"default": value}
