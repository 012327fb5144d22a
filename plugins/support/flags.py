"""Flags of non-finite values made on the tensors' device, never read there: 1.0 where a value is not finite, as
the fused optimizer kernels take ``found_inf`` (optim's device path: README.md, "Non-finite values")."""

from __future__ import annotations

import torch

__all__ = ["Flags", "SLOTS", "loss_flag"]

SLOTS = 1024
"""How many zeroed flags :class:`Flags` makes in one go (one kernel, then a kernel a window)."""


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
