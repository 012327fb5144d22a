"""torch's kernels that skip a step on ``found_inf`` (``GradScaler``'s contract with its ``fused=True``
optimizers), for a plugin that steps optimizers on a device flag: which optimizers honour it, switching them to the
fused kernel, stepping them on a flag or a ``GradScaler``'s record, and unscaling each once a step whoever asks first.
How the built-in optim uses them: ``plugins/optim/README.md``, "torch's kernels that skip a step on the device"."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.optim.optimizer import _default_to_fused_or_foreach  # torch's rule: whether its fused kernel takes them

from hookfit.modes import modules

SWITCHED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)  # switched to their fused kernel by fuse()


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` honours ``found_inf`` in every parameter group (``plugins/optim/README.md``)."""
    if type(optimizer) not in (*SWITCHED, torch.optim.Adagrad):  # the classes with a fused kernel (in torch 2.13)
        return bool(getattr(optimizer, "_step_supports_amp_scaling", False))
    fused = all(group.get("fused") for group in optimizer.param_groups)
    setattr(optimizer, "_step_supports_amp_scaling", fused)  # torch's (GradScaler's), not in the declared type
    return fused


def fuse(optimizer: torch.optim.Optimizer, model: Any = None) -> None:
    """Switch the groups of ``optimizer`` that can take it to torch's fused kernel (``model``: its sparse modules)."""
    if type(optimizer) not in SWITCHED:
        return
    dense = {id(p) for root in modules(model) for module in root.modules()  # SGD's rule: no sparse=True module
             if getattr(module, "sparse", False) is not True for p in module.parameters(recurse=False)
             } if type(optimizer) is torch.optim.SGD else set()
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
    """Whether a step skipped inside the kernel now leaves ``optimizer`` a valid state (``plugins/optim/README.md``)."""
    kind = type(optimizer)
    if kind in (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad):
        return True
    if kind is torch.optim.SGD:
        return all(param.grad is None or optimizer.state.get(param, {}).get("momentum_buffer") is not None
                   for group in optimizer.param_groups if group["momentum"] for param in group["params"])
    return any(optimizer.state.values())


def _switchable(optimizer: torch.optim.Optimizer, group: dict[str, Any], dense: set[int]) -> bool:
    """Whether ``group`` may be switched (``dense``: the ids of the model's parameters without sparse gradients)."""
    if group.get("fused") is not None or group.get("foreach") is not None or group.get("differentiable"):
        return False
    params = group["params"]
    if not params or not _default_to_fused_or_foreach(params, False, True)[0]:  # (use_fused=True)
        return False
    if type(optimizer) is torch.optim.SGD:
        if any(type(p) not in (torch.Tensor, torch.nn.Parameter) or id(p) not in dense
               or (p.grad is not None and p.grad.is_sparse) for p in params):
            return False
        if group["momentum"] and (group["dampening"] or not all(p.requires_grad for p in params)):
            return False
    return True


def step_on_flag(optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> None:
    """Step ``optimizer``'s fused kernel with ``flag`` (float32 1.0: skip, or 0.0) as its ``found_inf``."""
    setattr(optimizer, "found_inf", flag)
    setattr(optimizer, "grad_scale", None)
    try:
        optimizer.step()
    finally:
        delattr(optimizer, "found_inf")
        delattr(optimizer, "grad_scale")


def scaler_step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer,
                keeps_state: Callable[[], bool], update: bool = False) -> None:
    """``scaler.step(optimizer)``, by the scaler's host read where a skip in the kernel would not ``keeps_state()``;
    ``update``: then ``scaler.update()`` (a step that no batch's end updates the scale after)."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False) or keeps_state():
        scaler.step(optimizer)
    else:
        setattr(optimizer, "_step_supports_amp_scaling", False)
        try:
            scaler.step(optimizer)
        finally:
            setattr(optimizer, "_step_supports_amp_scaling", True)
    if update:
        scaler.update()


def into_found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, bad: torch.Tensor) -> bool:
    """Add ``bad`` to what ``scaler`` found at ``unscale_`` (it then skips); ``False``: no such record found."""
    record = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer), {})
    found = record.get("found_inf_per_device", {}).get(bad.device)
    if not isinstance(found, torch.Tensor):
        return False
    found.add_(bad).clamp_(max=1.0)  # fused kernels skip only where found_inf is exactly 1
    return True


def unscale(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """``scaler.unscale_(optimizer)`` unless done or stepped since the scaler's last ``update()`` (its per-optimizer
    record, torch's: a second call raises there), so that a step function's and the stepping plugin's both may."""
    record = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer))
    if record is None or record.get("stage") is torch.amp.grad_scaler.OptState.READY:
        scaler.unscale_(optimizer)


def note_unscaled(error: BaseException | None, plugin: str, accumulate: int) -> None:
    """Add a note to torch's error for a ``GradScaler.unscale_(optimizer)`` called twice before the scaler's
    ``update()`` (a step function's ``scaler.unscale_(opt)`` kept under a plugin that scales the loss): what to call
    instead."""
    if not (isinstance(error, RuntimeError) and "unscale_() has already been called" in str(error)):
        return
    window = (f" With accumulate={accumulate} the optimizers step only after a window's last batch: a scaler.unscale_"
              f"(opt) at each batch unscales gradients the next batch adds scaled ones onto, and torch refuses the "
              f"second." if accumulate > 1 else "")
    error.add_note(f"{plugin}: the run's GradScaler (amp= or precision='16-mixed') is {plugin}'s, which unscales each "
                   f"optimizer's gradients once a step before stepping it; the step function's scaler.unscale_(opt) "
                   f"called it again before the scaler's update().{window} Call loop.optimizers.unscale_() instead "
                   f"of scaler.unscale_(opt): once a step, a no-op without loss scaling, False inside an accumulation "
                   f"window (clip there only where it returns True), and {plugin}'s step then does not unscale again")
