"""optim's non-finite policy: a non-finite loss poisons its accumulation window, whose steps
are skipped (``nonfinite="skip"``: counted, the first warned about at once, the total at the
end of the run) or fail the run (``"raise"``); a step whose gradients are non-finite is
skipped alone. On the CPU the check reads the loss; on the device path (an accelerator, or
``defer=True``) it never waits for the device: the window's flag stays there, a step skips on
it where its kernel can, and the flags are read on the host later, in one transfer (see
:class:`~hookfit.plugins.optim.Optim`, "On an accelerator").

:class:`NonFinite` is that part of the plugin's class; :class:`OptimWarning` is what optim
warns with."""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Literal

import torch

from hookfit import HookfitWarning

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.plugins.optim.managed import ManagedOptimizer, Optimizers
    from hookfit.run import Run


class OptimWarning(HookfitWarning):
    """A step was skipped because of a non-finite loss or gradient, or a managed optimizer was
    stepped directly instead of through ``loop.optimizers``."""


READ_EVERY = 1024
"""On the device path, the flags of this many closed windows are read on the host at the
latest, so a run that publishes no metrics keeps a bounded number of them."""

SLOTS = 1024
"""How many zeroed flags :class:`Flags` makes in one go (one kernel, then a kernel a window)."""


class NonFinite:
    """The non-finite policy of :class:`~hookfit.plugins.optim.Optim` (a part of its class):
    the poisoned window, the device path's flags and their host reads, the skipped steps'
    count and warnings."""

    # the plugin's, read here
    loop: Run | None
    optimizers: Optimizers | None
    accumulate: int
    nonfinite: Literal["skip", "raise"] | None

    def __init__(self) -> None:
        self._poisoned = False  # a non-finite loss in the current window: its steps are skipped
        self._poisoned_at = 0  # the global step of the batch that poisoned it
        self._first_skip: str | None = None
        self._skipped_total: int | None = None  # the run's skipped steps, at its end (results)
        # the device path of the non-finite check (see Optim's docstring, "On an accelerator")
        self._deferring = False  # losses are checked on the device: set at configure or first seen
        self._bad: torch.Tensor | None = None  # the open window's flag: a non-finite loss in it
        self._bad_where = (0, 0, 0)  # (epoch, first batch, last batch) of the flag's losses
        self._bad_at = -1  # the global step of the flag's last loss
        # the window's steps that skip on the device: (optimizer, the window's flag as it was
        # at the step, its gradients' own flag where they are checked)
        self._bad_stepped: list[tuple[ManagedOptimizer, torch.Tensor, torch.Tensor | None]] = []
        self._pending: list[tuple[torch.Tensor, tuple[int, int, int],
                                  list[tuple[ManagedOptimizer, torch.Tensor, torch.Tensor | None]]]] = []
        self._due: FloatingPointError | None = None  # held by a read for the next (nonfinite="raise")
        self._flags = Flags()  # the windows' flags, made zero ahead of time

    def _set_fast_paths(self) -> None:
        """The plugin's (``Optim._set_fast_paths``): a poisoned window turns the fast paths off."""
        raise NotImplementedError

    # -- the check on the CPU, and the poisoned window ---------------------------------------
    def _nonfinite_loss(self, loop: Run, loss: torch.Tensor) -> bool:
        """A non-finite loss: not back-propagated, and its window's steps skipped."""
        self._poison(True)
        self._poisoned_at = loop.state.step
        if self.nonfinite == "raise":
            raise FloatingPointError(
                f"optim: non-finite loss {loss.detach().flatten()[:4].tolist()} at epoch "
                f"{loop.state.epoch}, batch {loop.state.batch_idx}"
            )
        return True

    def _close_window(self) -> None:
        if self._bad is not None:
            self._close_deferred()
        if self._poisoned:
            self._skip_window()
        self._poison(False)

    def _poison(self, poisoned: bool) -> None:
        """Mark the current window as having (or not) a non-finite loss: its steps are
        skipped, so the fast paths are off meanwhile."""
        self._poisoned = poisoned
        self._set_fast_paths()

    def _expire_poison(self) -> None:
        """Close a poisoned window that a batch_end did not: without accumulation or AMP
        optim has no per-batch hook, so the next batch's first backward or step does it."""
        if self.accumulate == 1:
            assert self.loop is not None  # by a step, during the run
            if self.loop.state.step != self._poisoned_at:
                self._close_window()

    def _skip_window(self) -> None:
        """A poisoned window closed: drop the gradients of optimizers that did not step."""
        assert self.optimizers is not None  # a window closes during the run
        for managed in self.optimizers.values():
            if managed._deferred:
                managed._deferred = False
                managed._skip("non-finite loss")
            else:
                managed._clear()

    def _nonfinite(self, what: str, managed: ManagedOptimizer) -> None:
        """Count a skipped step; warn about the first, or raise under ``nonfinite="raise"``."""
        assert self.loop is not None  # by a step, during the run
        state = self.loop.state
        where = f"{what} at epoch {state.epoch}, batch {state.batch_idx}"
        if self.nonfinite == "raise":
            managed.skipped += 1
            raise FloatingPointError(f"optim: {where}")
        self._count_skip(managed, where)

    def _count_skip(self, managed: ManagedOptimizer, where: str) -> None:
        """Count a skipped step of ``managed``; warn about the run's first; tell the plugins
        that listen (``step_skipped``)."""
        managed.skipped += 1
        loop = self.loop
        assert loop is not None  # skips are counted during the run
        if (call := loop.hooks.step_skipped) is not None:
            call(loop, managed.name, where, loop.state.step)
        if self._first_skip is None:
            self._first_skip = where
            warnings.warn(
                f"optim: skipped the step of optimizer {managed.name!r}: {where}; further skips "
                f"are counted and reported at the end of the run",
                OptimWarning,
                stacklevel=4,
            )

    # -- the device path of the check (see Optim's docstring, "On an accelerator") ----------
    def _flag_on_device(self, loop: Run, loss: torch.Tensor) -> None:
        """Fold the finiteness of ``loss`` into the window's flag, on the loss's device."""
        if not self._deferring:  # the first loss seen there (a run without a model, say)
            self._deferring = True
            self._set_fast_paths()
        if self._due is not None:
            self._raise_due()
        state = loop.state
        if self._bad is not None and self.accumulate == 1 and state.step != self._bad_at:
            self._close_deferred()  # the previous batch's window: no batch_end closed it
        if self._bad is None:  # a window's first loss: one kernel
            self._bad = self._flags.check(loss)
            self._bad_where = (state.epoch, state.batch_idx, state.batch_idx)
        else:  # a new tensor: a step that skipped on the flag so far keeps the value it saw
            self._bad = torch.maximum(self._bad, _flag(loss).to(self._bad.device))
            self._bad_where = (*self._bad_where[:2], state.batch_idx)
        self._bad_at = state.step

    def _window_flag(self) -> torch.Tensor | None:
        """The flag of the window a step belongs to (``None``: no loss checked on the device
        in it), for ``ManagedOptimizer._step``. A step before its batch's backward steps on
        the gradients of the window before, so on that window's flag (the next backward
        closes it)."""
        if self._due is not None:
            self._raise_due()
        return self._bad

    def _read_flag(self) -> bool:
        """Read the window's flag on the host now, for an optimizer that cannot skip on the
        device, in one transfer with every flag kept (so steps of other optimizers that
        skipped on the device are counted as at any read): a non-finite window is then
        poisoned as on the CPU path."""
        self._close_deferred(bounded=False)
        if not self._read_deferred()[-1]:
            return False
        self._poison(True)
        assert self.loop is not None  # called by a step, during the run
        self._poisoned_at = self.loop.state.step
        return True

    def _close_deferred(self, bounded: bool = True) -> None:
        """The window's flag is kept, unread, with the steps that skipped on the device; at
        most ``READ_EVERY`` of them (``bounded``), then they are read."""
        if self._bad is not None:
            self._pending.append((self._bad, self._bad_where, self._bad_stepped))
            self._bad, self._bad_stepped = None, []
            if bounded and len(self._pending) >= READ_EVERY:
                self._read_deferred()

    def _read_deferred(self, final: bool = False, hold: bool = False) -> list[bool]:
        """The host read of the flags kept since the last one (one transfer for them all):
        count the steps skipped on the device, each by the flags it stepped on (its window's
        loss flag as it was at the step, and its gradients' own), and warn about them; return
        whether each window read had a non-finite loss. Under ``nonfinite="raise"`` the first
        non-finite value is raised for once every window read is counted; ``hold`` keeps the
        error for optim's next step or read (a checkpoint's read must not fail the save), and
        ``final`` (a run that ends interrupted or failed) warns instead."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        device = pending[0][0].device
        tensors = []
        for flag, _, stepped in pending:
            tensors.append(flag.to(device))
            for _, loss, grad in stepped:
                tensors.append(loss.to(device))
                if grad is not None:
                    tensors.append(grad.to(device))
        values = iter(torch.stack(tensors).tolist())
        assert self.loop is not None  # flags are kept and read during the run only
        state = self.loop.state
        read = f"read on the host at epoch {state.epoch}, batch {state.batch_idx}"
        windows, error = [], None
        for _, (epoch, first, last), stepped in pending:
            bad = bool(next(values))
            windows.append(bad)
            loss_where = f"non-finite loss at epoch {epoch}, {_batches(first, last)}"
            skips = []
            for managed, _, grad in stepped:
                loss_bad = bool(next(values))
                grad_bad = bool(next(values)) if grad is not None else False
                if loss_bad:
                    skips.append((managed, loss_where))
                elif grad_bad:
                    skips.append((managed, f"non-finite gradient at epoch {epoch}, batch {last}"))
            for managed, where in skips:
                managed.steps -= 1
                if self.nonfinite == "raise" and not final:  # counted (the error names it)
                    managed.skipped += 1
                    self._first_skip = self._first_skip or f"{where} (skipped on the device; {read})"
                else:
                    self._count_skip(managed, f"{where} (skipped on the device; {read})")
            if self.nonfinite == "raise" and (bad or skips):
                if final:
                    if not skips:
                        warnings.warn(f"optim: {loss_where}, found at the end of the run ({read})",
                                      OptimWarning, stacklevel=3)
                elif error is None:
                    where = loss_where if bad else skips[0][1]
                    were = ("its steps were " if bad else "its step was ") + "skipped on the device; " if skips else ""
                    error = FloatingPointError(f"optim: {where} ({were}{read})")
        if error is not None:
            self._due = self._due or error
            if not hold:
                self._raise_due()
        return windows

    def _raise_due(self) -> None:
        """Raise the error a read under ``nonfinite="raise"`` held (see ``_read_deferred``)."""
        if self._due is not None:
            error, self._due = self._due, None
            raise error


class Flags:
    """The flags of the device path's windows, each a float32 zero made ahead of time, ``SLOTS``
    at once in one kernel: a window's first loss is checked into a flag of its own with one more
    kernel, torch's ``_amp_foreach_non_finite_check_and_unscale_`` (GradScaler's check), which sets
    the flag to 1.0 where a value is not finite and multiplies the values by 1.0, an exact no-op,
    written through ``loss.data``: autograd's version counter of the loss does not move, so its
    graph stays usable. Where that kernel does not take the loss (a subclass such as a DTensor, a
    dtype or device it refuses), :func:`_flag` makes the flag with two."""

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
        return _flag(loss)

    def _make(self, device: torch.device) -> None:
        zeros = torch.zeros(SLOTS, device=device)
        self._slots, self._next = zeros.unbind(), 0
        self._one = torch.ones((), device=device)


def _flag(loss: torch.Tensor) -> torch.Tensor:
    """A window's flag from ``loss``, on its device, without a host read: a float32 ``1.0`` if
    any value is not finite, else ``0.0`` (the ``found_inf`` of torch's fused kernels). Two
    kernels for a float32 loss, ``x * 0 != 0`` (infinity and NaN times zero are NaN), where
    ``isfinite`` and a negation take five: on an accelerator each is a launch a step."""
    bad = loss.detach().mul(0).ne_(0)  # (ne_ keeps the loss's dtype: 1.0 where not finite)
    if bad.dim():
        bad = bad.amax()
    return bad if bad.dtype == torch.float32 else bad.float()


def _finite(loss: torch.Tensor) -> bool:
    """Whether every value of ``loss`` is finite. A CPU scalar is read with ``item()`` (no
    synchronisation there, the cheapest check; ``Optim.backward`` inlines this case); on an
    accelerator this synchronises once."""
    if loss.is_cpu and loss.numel() == 1:
        return math.isfinite(loss.item())
    return bool(torch.isfinite(loss).all())


def _batches(first: int, last: int) -> str:
    """``batch 3``, or ``batches 2-3`` for an accumulation window's losses."""
    return f"batch {first}" if first == last else f"batches {first}-{last}"
