"""optim's non-finite policy (:class:`Policy`), the check of each loss chosen at ``configure`` (:class:`Check`)
and the device path (:class:`Deferred`; its flags: :mod:`~hookfit.plugins.support.flags`): README.md, "Non-finite
values"."""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Callable, Literal

import torch

from hookfit import HookfitWarning
from hookfit.errors import user_level
from hookfit.plugins.support.flags import Flags, loss_flag
from hookfit.plugins.support.ranks import ranks_where

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.plugins.optim.managed import ManagedOptimizer
    from hookfit.run import Run


class OptimWarning(HookfitWarning):
    """A step skipped for a non-finite value, or a managed optimizer stepped outside ``loop.optimizers``."""


READ_EVERY = 1024
"""The device path reads the flags of this many closed windows at the latest."""

Stepped = list[tuple["ManagedOptimizer", torch.Tensor, "torch.Tensor | None"]]  # (optimizer, flag, grads' flag)


def at(loop: Run) -> str:
    """Where the run is, as optim's messages name it: ``epoch 2, batch 7`` (epochs and batches from 1, as the
    console and the error notes count them; ``loop.state.batch_idx`` counts from 0)."""
    return f"epoch {loop.state.epoch + 1}, batch {loop.state.batch_idx + 1}"


def window_at(epoch: int, first: int, last: int) -> str:
    """Where a window's losses were, from its ``loop.state`` counters (``first`` and ``last`` batch indices, from
    0): ``epoch 1, batches 5-8`` (``batch 5`` for one batch), counted from 1 as :func:`at` counts them."""
    return f"epoch {epoch + 1}, " + (f"batch {first + 1}" if first == last else f"batches {first + 1}-{last + 1}")


class Policy:
    """What a non-finite value does: the poisoned window and the skipped steps' count."""

    def __init__(self, mode: Literal["skip", "raise"] | None, on_poison: Callable[[], None]) -> None:
        self.mode, self._on_poison = mode, on_poison  # (called when poisoned changes)
        self.poisoned = False  # a non-finite loss in the current window: its steps are skipped
        self.loss_at: str | None = None  # where the window's first non-finite loss was, where known (its skips')
        self.first_skip: str | None = None  # where the run's first skip was (results)
        self.loop: Run | None = None

    def start(self, loop: Run) -> None:
        self.loop, self.first_skip = loop, None
        self.poison(False)

    def poison(self, poisoned: bool, where: str | None = None) -> None:
        """Mark the current window as having (or not) a non-finite loss (``where``: its batch, or batches)."""
        self.loss_at = (self.loss_at or where) if poisoned else None
        if poisoned != self.poisoned:
            self.poisoned = poisoned
            self._on_poison()

    def nonfinite_loss(self, loop: Run, loss: torch.Tensor, on: str = "") -> None:
        """A non-finite loss read on the host (``on`` which ranks, :class:`Agreed`): not back-propagated, poisoned."""
        self.poison(True, at(loop))
        if self.mode == "raise":
            raise FloatingPointError(f"optim: non-finite loss {on or loss.detach().flatten()[:4].tolist()} at {at(loop)}")

    def skip(self, managed: ManagedOptimizer, what: str) -> None:
        """Count a skipped step; warn about the first, or raise under ``nonfinite="raise"``."""
        assert self.loop is not None  # by a step, during the run
        where = f"{what} at {self.loss_at or at(self.loop)}"  # (a window's skips: the loss, not its last batch)
        self.count(managed, where, quiet=self.mode == "raise")
        if self.mode == "raise":
            raise FloatingPointError(f"optim: {where}")

    def count(self, managed: ManagedOptimizer, where: str, quiet: bool = False) -> None:
        """Count a skipped step; unless ``quiet`` (an error names it), announce it and warn about the first."""
        managed.skipped += 1
        loop = self.loop
        assert loop is not None  # skips are counted during the run
        if not quiet and (call := loop.hooks.step_skipped) is not None:
            call(loop, managed.name, where, loop.state.step)
        if self.first_skip is None:
            self.first_skip = where
            if not quiet:
                warnings.warn(f"optim: skipped the step of optimizer {managed.name!r}: {where}; further skips "
                              f"are counted and reported at the end of the run", OptimWarning, stacklevel=user_level())


class Check:
    """Asked by ``Optim.backward`` for every loss; this one, ``nonfinite=None``'s, admits every loss."""

    def admits(self, loop: Run, loss: torch.Tensor) -> bool:
        """Whether ``loss`` is back-propagated (``False``: it poisoned its window)."""
        return True


class Deferred(Check):
    """The device path (README.md): every loss admitted, its finiteness folded into its window's flag, kept unread."""

    def __init__(self, policy: Policy) -> None:
        self._policy = policy
        self._where = (0, 0, 0)  # (epoch, first batch, last batch) of the flag's losses
        self._at = -1  # the global step of the flag's last loss
        self.start(1, False)  # _size: windows of this many batches; _scaled: a GradScaler's run

    def start(self, size: int, scaled: bool) -> None:
        """A run begins: windows of ``size`` batches, a ``GradScaler`` or not (``scaled``), flags made afresh."""
        self.discard()
        self._flags, self._size, self._scaled = Flags(), size, scaled

    def discard(self) -> None:
        """Forget every flag kept (a restored state replaces the run they came from)."""
        self.bad: torch.Tensor | None = None  # the open window's flag: 1.0 once a loss in it was not finite
        self._stepped: Stepped = []
        self._pending: list[tuple[torch.Tensor, tuple[int, int, int], Stepped]] = []
        self._due: FloatingPointError | None = None

    def admits(self, loop: Run, loss: torch.Tensor) -> bool:
        """Fold the finiteness of ``loss`` into the window's flag, on the loss's device; back-propagated."""
        self.raise_due()
        state = loop.state
        if self.bad is not None and self._size == 1 and state.step != self._at:
            self.close()  # the previous batch's window: no batch_end closed it
        if self.bad is None:  # a window's first loss: one kernel
            self.bad = self._flags.check(loss)
            self._where = (state.epoch, state.batch_idx, state.batch_idx)
        else:  # a new tensor: a step that skipped on the flag so far keeps the value it saw
            self.bad = torch.maximum(self.bad, loss_flag(loss).to(self.bad.device))
            self._where = (*self._where[:2], state.batch_idx)
        self._at = state.step
        return True

    def flag_for(self, managed: ManagedOptimizer) -> torch.Tensor | None:
        """The flag ``managed``'s step skips on, or ``None``: none, or read now (``managed`` cannot skip on it)."""
        self.raise_due()
        if self.bad is None:
            return None
        if managed.skips_on_device() or self._scaled:  # (the kernel decided first: it may be fused)
            return self.bad
        self.read_flag()
        return None

    def read_flag(self) -> bool:
        """Read the window's flag now, with every flag kept; a non-finite window is poisoned."""
        epoch, first, last = self._where
        self.close(bounded=False)
        if bad := self.read()[-1]:
            self._policy.poison(True, window_at(epoch, first, last))
        return bad

    def stepped_on(self, managed: ManagedOptimizer, bad: torch.Tensor, grad_bad: torch.Tensor | None) -> None:
        """``managed`` stepped on ``bad`` (and its gradients' flag): counted at the next read if either was set."""
        self._stepped.append((managed, bad, grad_bad))

    def close(self, bounded: bool = True) -> None:
        """Keep the window's flag, unread, with the steps that skipped on it; read at ``READ_EVERY`` (``bounded``)."""
        if self.bad is not None:
            self._pending.append((self.bad, self._where, self._stepped))
            self.bad, self._stepped = None, []
            if bounded and len(self._pending) >= READ_EVERY:
                self.read()

    def finish(self, final: bool) -> None:
        """The run's last read; under "raise" a run that did not complete (``final``) warns instead."""
        self.close(bounded=False)
        if self._due is not None and final:
            warnings.warn(f"{self._due}, found at the end of the run", OptimWarning, stacklevel=user_level())
            self._due = None
        self.read(final=final)
        self.raise_due()

    def read(self, final: bool = False, hold: bool = False) -> list[bool]:
        """Read the flags kept, in one transfer, and count the steps skipped on them; whether each window had a
        non-finite loss. Under "raise" the error comes once all are counted: ``hold`` keeps it, ``final`` warns."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        device = pending[0][0].device
        tensors = [t.to(device) for flag, _, stepped in pending
                   for t in (flag, *(x for _, loss, grad in stepped for x in (loss, grad) if x is not None))]
        values = iter(torch.stack(tensors).tolist())
        policy, raising = self._policy, self._policy.mode == "raise"
        assert policy.loop is not None  # flags are kept and read during the run only
        read = f"read on the host at {at(policy.loop)}"
        windows, error = [], None
        for _, (epoch, first, last), stepped in pending:
            windows.append(bad := bool(next(values)))
            loss_where = f"non-finite loss at {window_at(epoch, first, last)}"
            skips = []  # where each step that skipped on the device was
            for managed, _, grad in stepped:
                loss_bad, grad_bad = bool(next(values)), grad is not None and bool(next(values))
                if loss_bad or grad_bad:
                    skips.append(loss_where if loss_bad else f"non-finite gradient at {window_at(epoch, last, last)}")
                    managed.steps -= 1
                    policy.count(managed, f"{skips[-1]} (skipped on the device; {read})", quiet=raising and not final)
            if raising and final and bad and not skips:
                warnings.warn(f"optim: {loss_where}, found at the end of the run ({read})", OptimWarning,
                              stacklevel=user_level())
            elif raising and not final and (bad or skips) and error is None:
                were = ("its steps were " if bad else "its step was ") + "skipped on the device; " if skips else ""
                error = FloatingPointError(f"optim: {loss_where if bad else skips[0]} ({were}{read})")
        if error is not None:
            self._due = self._due or error
            if not hold:
                self.raise_due()
        return windows

    def raise_due(self) -> None:
        """Raise the error a read under ``nonfinite="raise"`` held (see :meth:`read`)."""
        if self._due is not None:
            error, self._due = self._due, None
            raise error


class HostCheck(Check):
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


class Agreed(HostCheck):
    """Several processes agree on each loss's check (:func:`~hookfit.plugins.support.ranks.ranks_where`): README.md."""

    def admits(self, loop: Run, loss: torch.Tensor) -> bool:
        if (bad := ranks_where(loop, not bool(torch.isfinite(loss).all()))) is not None:
            self._policy.nonfinite_loss(loop, loss, f"on {bad}")  # on every rank: its backward pass and step skipped
        return bad is None
