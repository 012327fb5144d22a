"""The non-finite check of a run's losses, chosen at ``configure``, and the device path's flags (README.md)."""

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
    """Asked by ``Optim.backward`` for every loss."""

    def admits(self, loop: Run, loss: torch.Tensor) -> bool:
        """Whether ``loss`` is back-propagated (``False``: it poisoned its window)."""


class NoCheck:
    """``nonfinite=None``: every loss is back-propagated, every step taken."""

    def admits(self, loop: Run, loss: torch.Tensor) -> bool:
        return True


class HostCheck:
    """The loss read on the host; ``to_device`` (``defer=None``) takes the first loss not on the CPU."""

    def __init__(self, policy: Policy, to_device: Callable[[Run, torch.Tensor], bool] | None) -> None:
        self._policy, self._to_device = policy, to_device

    def admits(self, loop: Run, loss: torch.Tensor) -> bool:
        if loss.is_cpu:
            try:  # one number: read at once (item() refuses any other count; no numel() call a batch)
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
    """The device path: every loss is back-propagated, its finiteness folded into its window's flag."""

    def __init__(self, deferred: Deferred) -> None:
        self._deferred = deferred

    def admits(self, loop: Run, loss: torch.Tensor) -> bool:
        self._deferred.fold(loop, loss)
        return True


class Flags:
    """The device path's window flags: float32 zeros made ``SLOTS`` at once, each set by one kernel."""

    def __init__(self) -> None:
        self._slots: tuple[torch.Tensor, ...] = ()
        self._next, self._one = 0, torch.ones(())  # _one: the check's scale, 1.0 on the slots' device (made with them)
        self._works = True  # the one-kernel check took a loss, or has not been tried

    def check(self, loss: torch.Tensor) -> torch.Tensor:
        """A new flag for ``loss``: 1.0 if any of its values is not finite, else 0.0."""
        if type(loss) is torch.Tensor and self._works:
            for fresh in (self._next >= len(self._slots), True):  # then zeros on the loss's device
                if fresh:
                    self._slots, self._next = torch.zeros(SLOTS, device=loss.device).unbind(), 0
                    self._one = torch.ones((), device=loss.device)
                slot = self._slots[self._next]
                try:
                    torch._amp_foreach_non_finite_check_and_unscale_([loss.data], slot, self._one)
                except RuntimeError:  # another device than the slots', or a loss it refuses
                    continue
                self._next += 1
                return slot
            self._works, self._slots = False, ()  # from now on, two kernels
        return loss_flag(loss)


def loss_flag(loss: torch.Tensor) -> torch.Tensor:
    """A flag from ``loss`` on its device, in two kernels for a float32 loss: ``x * 0 != 0``."""
    bad = loss.detach().mul(0).ne_(0)  # (ne_ keeps the loss's dtype: 1.0 where not finite)
    if bad.dim():
        bad = bad.amax()
    return bad if bad.dtype == torch.float32 else bad.float()
