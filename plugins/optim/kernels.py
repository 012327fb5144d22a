"""torch's kernels that skip a step on the device, and optim's use of them.

On the device path (:mod:`~hookfit.plugins.optim.nonfinite`) a step is skipped without a host
read only by a kernel that takes torch's ``found_inf`` (``GradScaler``'s contract): torch's
``fused=True`` optimizers. This module says whether an optimizer has one, switches groups of
torch's Adam, AdamW and SGD whose kernel was left to torch to it where it is as robust as the
default one, steps on a flag, and joins a flag to a ``GradScaler``'s. Switched:

* Adam and AdamW: they make each parameter's state before the kernel runs, and take every
  parameter type their other kernels do (DTensor included);
* SGD on plain tensors of the run's model (no DTensor sharding rule) with no sparse gradient
  (none of a module with ``sparse=True``; one outside the model cannot be told beforehand), and
  with momentum only without dampening where every parameter requires a gradient: torch's
  fused SGD makes its momentum buffers at its first step with ``empty_like`` (a step skipped
  then would leave them uninitialised), so a switched group gets zero buffers, with which its
  update is torch's first step exactly (``momentum * 0 + grad``);
* Adagrad and the others are left as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hookfit.modes import modules

FusedRule = Callable[[list[torch.Tensor], bool, bool], tuple[bool, bool]]
"""torch's ``_default_to_fused_or_foreach(params, differentiable, use_fused)``: whether its
fused (and foreach) kernel takes these parameters (their type, device and dtype)."""

try:  # torch's own rule for "the fused kernel takes these parameters" (type, device, dtype)
    from torch.optim.optimizer import _default_to_fused_or_foreach as _torch_rule

    _default_to_fused_or_foreach: FusedRule | None = _torch_rule
except ImportError:  # pragma: no cover - a torch without it: no optimizer is switched
    _default_to_fused_or_foreach = None

FUSED_CLASSES = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)
"""torch's optimizers that have a fused kernel (in torch 2.13)."""
SWITCHED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
"""Those whose groups optim may switch to it (see the module docstring)."""


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` honours ``found_inf`` in every parameter group: for torch's
    optimizers with a fused kernel, every group runs it (built with ``fused=True``, switched,
    or loaded from a checkpoint of such a run); for another class, it set torch's
    ``_step_supports_amp_scaling``. torch's flag is kept true exactly when every group is fused,
    as ``GradScaler`` reads it to hand ``found_inf`` over."""
    if type(optimizer) not in FUSED_CLASSES:
        return bool(getattr(optimizer, "_step_supports_amp_scaling", False))
    fused = all(group.get("fused") for group in optimizer.param_groups)
    # torch's private attributes of an optimizer (read by GradScaler and the fused kernels) are
    # not in its declared type: set by name, here and below
    setattr(optimizer, "_step_supports_amp_scaling", fused)
    return fused


def fuse(optimizer: torch.optim.Optimizer, model: Any = None) -> None:
    """Switch every parameter group of ``optimizer`` that can take it (see the module
    docstring; ``model``: where modules with ``sparse=True`` are looked for) to torch's fused
    kernel, as if the optimizer had been built with ``fused=True``: the group's flag, the
    ``step`` counters it already has moved where the fused kernel keeps them (on the
    parameter's device), SGD's momentum buffers made."""
    if _default_to_fused_or_foreach is None or type(optimizer) not in SWITCHED:
        return
    dense = _dense_parameters(model) if type(optimizer) is torch.optim.SGD else set()
    for group in optimizer.param_groups:
        if not _switchable(optimizer, group, dense):
            continue
        group["fused"] = True
        setattr(optimizer, "_need_device_dtype_check_for_fused", True)
        for param in group["params"]:
            state = optimizer.state[param]
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].to(device=param.device, dtype=torch.float32)
            if group.get("momentum") and state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def skip_keeps_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a step skipped inside the kernel (by ``found_inf``) now leaves ``optimizer`` a
    valid state: yes for torch's Adam, AdamW and Adagrad (their state is made before the kernel
    runs) and for SGD where every parameter with a gradient has its momentum buffer (or there
    is no momentum); for another class, once it has any state (not known before)."""
    kind = type(optimizer)
    if kind in (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad):
        return True
    if kind is torch.optim.SGD:
        return all(
            param.grad is None or optimizer.state.get(param, {}).get("momentum_buffer") is not None
            for group in optimizer.param_groups if group["momentum"]
            for param in group["params"]
        )
    return any(optimizer.state.values())


def _switchable(optimizer: torch.optim.Optimizer, group: dict[str, Any], dense: set[int]) -> bool:
    """Whether ``group`` may be switched: its kernel left to torch, not differentiable, its
    parameters ones torch's fused kernel takes (``_default_to_fused_or_foreach``), and for SGD
    the conditions of the module docstring (``dense``: the model's parameters that no module
    makes sparse gradients for)."""
    if group.get("fused") is not None or group.get("foreach") is not None or group.get("differentiable"):
        return False
    params = group["params"]
    rule = _default_to_fused_or_foreach
    if not params or rule is None or not rule(params, False, True)[0]:  # (use_fused=True)
        return False
    if type(optimizer) is torch.optim.SGD:
        if any(type(p) not in (torch.Tensor, torch.nn.Parameter) or id(p) not in dense
               or (p.grad is not None and p.grad.is_sparse) for p in params):
            return False
        if group["momentum"] and (group["dampening"] or not all(p.requires_grad for p in params)):
            return False
    return True


def _dense_parameters(model: Any) -> set[int]:
    """The ids of ``model``'s parameters, but those of its modules that make sparse gradients
    (``Embedding``/``EmbeddingBag`` with ``sparse=True``)."""
    return {id(p) for root in modules(model) for module in root.modules()
            if getattr(module, "sparse", False) is not True for p in module.parameters(recurse=False)}


def step_on_flag(optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> None:
    """Step ``optimizer``'s fused kernel with ``flag`` (a float32 1.0 or 0.0 on the device, see
    :class:`~hookfit.plugins.optim.checks.Flags`) as its ``found_inf``: the kernel leaves
    parameters and state as they are where it is 1.0. That is GradScaler's contract with the
    fused kernels: attributes of the optimizer that its declared type lacks, so set by name."""
    setattr(optimizer, "found_inf", flag)
    setattr(optimizer, "grad_scale", None)
    try:
        optimizer.step()
    finally:
        delattr(optimizer, "found_inf")
        delattr(optimizer, "grad_scale")


def scaler_reads(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """``scaler.step(optimizer)`` through the scaler's own host read of ``found_inf`` rather
    than the optimizer's kernel, for a fused optimizer whose state a step skipped inside the
    kernel would leave invalid (torch's fused SGD with momentum before its first step)."""
    # (torch's private flag, which GradScaler reads: not in the optimizer's declared type)
    setattr(optimizer, "_step_supports_amp_scaling", False)
    try:
        scaler.step(optimizer)
    finally:
        setattr(optimizer, "_step_supports_amp_scaling", True)


def into_found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, bad: torch.Tensor) -> bool:
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
