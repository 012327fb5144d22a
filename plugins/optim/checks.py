"""The non-finite checks of a run's losses, one chosen when the run is configured:
:class:`HostCheck` reads the loss (on the CPU, no synchronisation), :class:`DeviceCheck` keeps
its finiteness in a flag on the device (:class:`~hookfit.plugins.optim.nonfinite.Deferred`),
:class:`NoCheck` checks nothing (``nonfinite=None``). ``Optim.backward`` asks the check whether
to back-propagate a loss. :class:`Flags` makes the device path's flags."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Protocol

import torch

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.plugins.optim.nonfinite import Deferred, Policy
    from hookfit.run import Run

SLOTS = 1024
"""How many zeroed flags :class:`Flags` makes in one go (one kernel, then a kernel a window)."""


class Check(Protocol):
    """The non-finite check of a run's losses, one of the classes below."""

    def admits(self, loop: Run, loss: torch.Tensor) -> bool:
        """Whether ``loss`` is back-propagated (``False``: it poisoned its window)."""


class NoCheck:
    """``nonfinite=None``: every loss is back-propagated, every step taken."""

    def admits(self, loop: Run, loss: torch.Tensor) -> bool:
        return True


class HostCheck:
    """The loss read on the host: on the CPU that is no synchronisation, and the cheapest
    check. ``to_device`` (``defer=None``) is called instead for the first loss that is not on
    the CPU, and chooses the device path for the rest of the run."""

    def __init__(self, policy: Policy, to_device: Callable[[Run, torch.Tensor], bool] | None) -> None:
        self._policy = policy
        self._to_device = to_device

    def admits(self, loop: Run, loss: torch.Tensor) -> bool:
        if loss.is_cpu:
            try:  # one number: read at once (item() refuses any other count)
                finite = math.isfinite(loss.item())
            except RuntimeError:
                finite = bool(torch.isfinite(loss).all())
        elif self._to_device is not None:
            return self._to_device(loop, loss)
        else:  # defer=False on an accelerator: one synchronisation
            finite = bool(torch.isfinite(loss).all())
        if not finite:
            self._policy.nonfinite_loss(loop, loss)
        return finite


class DeviceCheck:
    """The device path: every loss is back-propagated and its finiteness folded into the
    window's flag on the device (:class:`~hookfit.plugins.optim.nonfinite.Deferred`)."""

    def __init__(self, deferred: Deferred) -> None:
        self._deferred = deferred

    def admits(self, loop: Run, loss: torch.Tensor) -> bool:
        self._deferred.fold(loop, loss)
        return True


class Flags:
    """The flags of the device path's windows, each a float32 zero made ahead of time, ``SLOTS``
    at once in one kernel: a window's first loss is checked into a flag of its own with one more
    kernel, torch's ``_amp_foreach_non_finite_check_and_unscale_`` (GradScaler's check), which sets
    the flag to 1.0 where a value is not finite and multiplies the values by 1.0, an exact no-op,
    written through ``loss.data``: autograd's version counter of the loss does not move, so its
    graph stays usable. Where that kernel does not take the loss (a subclass such as a DTensor, a
    dtype or device it refuses), :func:`loss_flag` makes the flag with two."""

    def __init__(self) -> None:
        self._slots: tuple[torch.Tensor, ...] = ()
        self._next = 0
        self._one = torch.ones(())  # the check's scale: 1.0 on the slots' device (made with them)
        self._works = True  # the one-kernel check took a loss, or has not been tried

    def check(self, loss: torch.Tensor) -> torch.Tensor:
        """A new flag for ``loss``: 1.0 if any of its values is not finite, else 0.0."""
        if type(loss) is torch.Tensor and self._next < len(self._slots):
            slot = self._slots[self._next]
            try:
                torch._amp_foreach_non_finite_check_and_unscale_([loss.data], slot, self._one)
            except RuntimeError:  # another device than the slots', or a loss it refuses
                return self._anew(loss)
            self._next += 1
            return slot
        return self._anew(loss)

    def _anew(self, loss: torch.Tensor) -> torch.Tensor:
        """:meth:`check` past its common case: zeros made (on the loss's device), or the
        two-kernel flag for a loss the one-kernel check refuses."""
        if self._works and type(loss) is torch.Tensor:
            self._make(loss.device)
            slot = self._slots[0]
            try:
                torch._amp_foreach_non_finite_check_and_unscale_([loss.data], slot, self._one)
            except RuntimeError:
                self._works, self._slots = False, ()  # from now on, two kernels
            else:
                self._next = 1
                return slot
        return loss_flag(loss)

    def _make(self, device: torch.device) -> None:
        zeros = torch.zeros(SLOTS, device=device)
        self._slots, self._next = zeros.unbind(), 0
        self._one = torch.ones((), device=device)


def loss_flag(loss: torch.Tensor) -> torch.Tensor:
    """A window's flag from ``loss``, on its device, without a host read: a float32 ``1.0`` if
    any value is not finite, else ``0.0`` (the ``found_inf`` of torch's fused kernels). Two
    kernels for a float32 loss, ``x * 0 != 0`` (infinity and NaN times zero are NaN), where
    ``isfinite`` and a negation take five: on an accelerator each is a launch a step."""
    bad = loss.detach().mul(0).ne_(0)  # (ne_ keeps the loss's dtype: 1.0 where not finite)
    if bad.dim():
        bad = bad.amax()
    return bad if bad.dtype == torch.float32 else bad.float()
