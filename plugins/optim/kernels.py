"""Which optimizers can skip a step on the device, and torch's fused kernels that can.

On the device path (see :class:`~hookfit.plugins.optim.Optim`) a step that must be skipped
because of a non-finite loss is skipped without a host read only by a kernel that takes
torch's ``found_inf`` (the contract ``GradScaler`` uses): torch's ``fused=True`` SGD, Adam,
AdamW and Adagrad. This module says whether an optimizer has such a kernel, switches one of
torch's optimizers to its fused kernel where the user left the choice of kernel to torch, and
says whether a step skipped inside the kernel leaves the optimizer a valid state."""

from __future__ import annotations

from typing import Any

import torch

try:  # torch's own rule for "the fused kernel takes these parameters" (type, device, dtype)
    from torch.optim.optimizer import _default_to_fused_or_foreach
except ImportError:  # pragma: no cover - a torch without it: no optimizer is switched
    _default_to_fused_or_foreach = None


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` honours ``found_inf``: it set torch's
    ``_step_supports_amp_scaling`` (built with ``fused=True``), or every parameter group runs
    the fused kernel (a group loaded from a checkpoint of a fused run: the flag is then set,
    as torch's constructor would have)."""
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        return True
    if _torch_fusable_class(optimizer) and all(group.get("fused") for group in optimizer.param_groups):
        optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]
        return True
    return False


def can_fuse(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is one of torch's optimizers with a fused kernel, whose kernel the
    user left to torch (``fused`` and ``foreach`` unset in every group, not
    ``differentiable``), and whose parameters that have gradients the fused kernel takes
    (floating point, of a supported type and device, no sparse gradient)."""
    if _default_to_fused_or_foreach is None or not _torch_fusable_class(optimizer):
        return False
    params = []
    for group in optimizer.param_groups:
        if group.get("fused") is not None or group.get("foreach") is not None or group.get("differentiable"):
            return False
        for param in group["params"]:
            if param.grad is not None:
                if param.grad.is_sparse:
                    return False
                params.append(param)
    return bool(params) and _default_to_fused_or_foreach(params, False, use_fused=True)[0]


def fuse(optimizer: torch.optim.Optimizer) -> None:
    """Switch ``optimizer`` (:func:`can_fuse`) to its fused kernel, as if it had been built
    with ``fused=True``: every group and the defaults (for groups added later), torch's
    flags, and the state it already has, re-loaded so that torch places each ``step``
    counter where the fused kernel keeps it (on the parameter's device)."""
    for group in optimizer.param_groups:
        group["fused"] = True
    optimizer.defaults["fused"] = True
    optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]
    optimizer._need_device_dtype_check_for_fused = True  # type: ignore[attr-defined]
    if any(optimizer.state.values()):
        optimizer.load_state_dict(optimizer.state_dict())


def skip_keeps_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a step skipped inside the kernel (by ``found_inf``) leaves ``optimizer`` a valid
    state. Once it has state, yes. Before: yes for torch's Adam, AdamW and Adagrad (their
    state is initialised before the kernel runs) and for SGD without momentum (it keeps none);
    no for SGD with momentum (torch's fused SGD makes its first momentum buffers with
    ``empty_like`` and, skipped, leaves them uninitialised for the next step to use) and for
    any other class (not known)."""
    if any(optimizer.state.values()):
        return True
    kind = type(optimizer)
    if kind in (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad):
        return True
    if kind is torch.optim.SGD:
        return all(group["momentum"] == 0 for group in optimizer.param_groups)
    return False


def _torch_fusable_class(optimizer: Any) -> bool:
    """One of torch's own optimizers that has a ``fused`` option (SGD, Adam, AdamW, Adagrad in
    torch 2.13); a subclass defined elsewhere may step otherwise, so it is not switched."""
    return type(optimizer).__module__.startswith("torch.optim.") and "fused" in optimizer.defaults
