"""Gradients watched for a while, without a cost left behind once the watch ends
(:class:`GradientWatch`; also importable from :mod:`hookfit.plugins.support`), whether those that arrived were
accumulated into ``.grad`` (:class:`Accumulation`), what they tell of the order a step function
backpropagates, steps and clears them in (:class:`StepOrder`), and whether it changes those an accumulation window
holds between its passes (:class:`Untouched`)."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["Accumulation", "GradientWatch", "StepOrder", "Untouched", "changed_in_window"]


class GradientWatch:
    """Calls ``arrived(...)`` whenever a gradient for one of ``params`` (leaf tensors that
    require one) is computed, until :meth:`remove`. A plain tensor or ``Parameter`` gets a
    tensor hook (``register_hook``: ``arrived`` is given the gradient, and its return value, to
    be ``None``, is ignored). A tensor subclass (a DTensor that FSDP2 shards, whose gradient FSDP2
    sets after its reduce-scatter and then runs the post-accumulate-grad hooks of) gets a
    post-accumulate-grad hook (``arrived`` is given the tensor).

    :meth:`remove` leaves nothing behind on a plain tensor: torch keeps a tensor's hook
    dictionary attached to its autograd metadata once made, and a ``RemovableHandle`` only
    empties it, so every later backward pass would still take the GIL and walk an empty
    dictionary for each parameter (measured at about 1 µs a parameter, a pass, on a CPU). A
    dictionary this watch made is dropped when nothing else was put in it, which drops torch's
    hook with it. (Torch has no such way for post-accumulate-grad hooks; autograd never
    accumulates into a sharded DTensor, so those cost nothing once removed.)"""

    def __init__(self, params: Iterable[torch.Tensor], arrived: Callable[[torch.Tensor], None]) -> None:
        self._handles: list[Any] = []
        self._made: list[torch.Tensor] = []  # plain tensors whose hook dictionary this watch made
        for param in params:
            if type(param) is torch.Tensor or type(param) is torch.nn.Parameter:
                if param._backward_hooks is None:
                    self._made.append(param)
                self._handles.append(param.register_hook(arrived))  # type: ignore[no-untyped-call]  # unannotated in torch
            else:
                self._handles.append(param.register_post_accumulate_grad_hook(arrived))  # type: ignore[no-untyped-call]  # unannotated in torch

    def __len__(self) -> int:
        """How many tensors are watched (none after :meth:`remove`)."""
        return len(self._handles)

    def remove(self) -> None:
        """Remove every hook, and the hook dictionaries this watch made that nothing else uses."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        made, self._made = self._made, []
        for param in made:
            if not param._backward_hooks:  # no one else's hook came since
                param._backward_hooks = None  # torch clears the tensor's hooks with it


class Accumulation:
    """Whether the autograd call a gradient of ``params`` arrived in accumulated one into their ``.grad``:
    ``backward()`` does, ``torch.autograd.grad`` (a gradient penalty, MAML's inner step) hands back the gradients it
    computes and accumulates none, though a tensor hook sees them arrive alike. Call :meth:`arrived` with what a hook
    of :class:`GradientWatch` on ``params`` is given; ``accumulated()`` is then called at the end of that autograd
    call (torch's final callback of its graph task) where a plain tensor's ``.grad`` was set, replaced or added onto
    in place since the call's first arrival, and at once for a tensor subclass (its hook runs after accumulating).
    A call that fails runs no final callback, and is told nothing."""

    def __init__(self, params: Iterable[torch.Tensor], accumulated: Callable[[], None]) -> None:
        params = list(params)
        self._plain = [p for p in params if type(p) in _PLAIN]
        self._others = {id(p) for p in params if type(p) not in _PLAIN}  # (given to their hooks themselves)
        self._accumulated = accumulated
        self._before: dict[int, list[tuple[torch.Tensor | None, int]]] = {}
        """By autograd call (graph task) not ended yet: the gradients of ``params`` as it began."""

    def arrived(self, tensor: torch.Tensor) -> None:
        """A gradient of ``params`` arrived (``tensor``: the gradient, or a tensor subclass's parameter)."""
        if id(tensor) in self._others:
            self._accumulated()
            return
        call = torch._C._current_graph_task_id()
        if call not in self._before:  # the call's first arrival: it accumulated into none of params yet
            self._before[call] = [(p.grad, p.grad._version if p.grad is not None else 0) for p in self._plain]
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._ended, call))

    def _ended(self, call: int) -> None:
        if any(p.grad is not grad or (grad is not None and grad._version != version)
               for p, (grad, version) in zip(self._plain, self._before.pop(call))):
            self._accumulated()


class StepOrder:
    """What backward passes and optimizer steps tell of the order a step function calls them in, while watched: a
    pass that adds onto gradients an optimizer stepped on and nothing cleared since (``None``, another tensor or all
    zeros: ``zero_grad()`` of either kind), which its next step then takes again (a forgotten ``zero_grad()``), and an
    optimizer stepped twice with no pass between on the same gradients (a gradient its previous step took, neither
    cleared nor all zeros: a step on gradients cleared since, with no pass between, takes none of them again). Call
    :meth:`passing` as each backward pass begins, before it accumulates a gradient into ``params`` (a tensor hook of
    :class:`GradientWatch` on each runs before its accumulation), and :meth:`stepping` as each step begins (torch's
    step pre-hook). The gradients of ``params`` alone are judged, of plain tensors (a tensor subclass's may be set
    apart from autograd's accumulation), and held weakly."""

    def __init__(self, params: Iterable[torch.Tensor] = ()) -> None:
        self._judged = {id(p) for p in params if type(p) in _PLAIN}
        self._left: dict[int, dict[int, tuple[torch.Tensor, weakref.ref[torch.Tensor], bool]]] = {}
        """By optimizer, by parameter: the parameter, its gradient at the optimizer's latest step, whether a pass
        has added onto it since."""
        self._passes = 0
        self._at: dict[int, int] = {}  # by optimizer: the passes begun before its latest step

    def passing(self, judge: bool = True) -> None:
        """A backward pass begins: gradients left from a step and not cleared are noted as added onto (``judge``
        false: told after a pass that accumulated into none of ``params``, which counts it alone)."""
        self._passes += 1
        for left in self._left.values() if judge else ():
            for key, (param, grad, _) in list(left.items()):
                if param.grad is None or param.grad is not grad() or not bool(param.grad.any()):
                    del left[key]  # cleared since that step
                else:
                    left[key] = (param, grad, True)

    def stepping(self, optimizer: torch.optim.Optimizer) -> tuple[bool, bool]:
        """``optimizer`` steps: whether it takes gradients of its previous step that a pass added onto, and whether
        it takes again, with no pass begun since its previous step, a gradient that step took, not cleared since."""
        key, passes = id(optimizer), self._passes
        left = [(p.grad, grad, added) for p, grad, added in self._left.get(key, {}).values() if p.grad is not None]
        piled = any(added and now is grad() for now, grad, added in left)
        twice = self._at.get(key) == passes and any(now is grad() and bool(now.any()) for now, grad, _ in left)
        self._at[key] = passes
        self._left[key] = {id(p): (p, weakref.ref(p.grad), False) for group in optimizer.param_groups
                           for p in group["params"] if p.grad is not None and id(p) in self._judged}
        return piled, twice


class Untouched:
    """Whether the gradients of ``params`` that a backward pass left inside an accumulation window are still those the
    window's next pass adds onto: a step function that clips them (``clip_grad_norm_``, ``clip_grad_value_``), scales
    them or clears them between its passes changes a partial sum. Call :meth:`passing` as each pass begins, before it
    accumulates into any of ``params`` (a tensor hook of :class:`GradientWatch` runs before its gradient is accumulated;
    a pass that reaches none of them need not), and :meth:`passed` as each ends, with the parameters of each optimizer
    whose window holds gradients after it: it notes them and tells, once, what the next pass found as it began (it
    reads the device there, not in autograd's thread). A gradient replaced or set in place is judged by its norm and
    its count of non-zero elements (each compared exactly: a ``clip_grad_norm_`` under its bound multiplies by one and
    changes none): ``"changed"`` where it holds other values, ``"cleared"`` where every gradient of one optimizer is
    now ``None`` or zeros and one of them was not. A fixed mask (``grad[rows] = 0``, ``p.grad = None`` or
    ``.zero_()`` on some of an optimizer's parameters, a frozen part) only zeroes elements, which lowers the count and
    the norm alone: masking at each pass is masking once a window, and is not told (a clip or a scaling keeps the
    count and changes the norm). The gradients judged are the dense ones of plain tensors (a tensor subclass's may be
    set apart from autograd's accumulation), held weakly."""

    def __init__(self, params: Iterable[torch.Tensor] = ()) -> None:
        self._judged = {id(p) for p in params if type(p) in _PLAIN}
        self._left: list[list[tuple[torch.Tensor, weakref.ref[torch.Tensor], int, torch.Tensor, torch.Tensor]]] = []
        """By optimizer, each gradient a pass left open (its parameter, the tensor, its version, its norm and its count
        of non-zero elements), until the next pass."""
        self._found: list[torch.Tensor] = []  # by optimizer: whether its gradients were changed, cleared (not read yet)

    def passing(self) -> None:
        """A pass begins, before it accumulates: the gradients noted, compared with those held now."""
        left, self._left = self._left, []
        for noted in left:
            changed: list[torch.Tensor] = []  # by gradient: holds values other than some of its own zeroed
            zeros: list[torch.Tensor] = []  # by gradient not None: all zeros now
            removed: list[torch.Tensor] = []  # by gradient set in place or replaced: all zeros now, not before
            device, none = noted[0][3].device, False  # a gradient is None now
            for param, then, version, norm, count in noted:
                if (grad := param.grad) is None:
                    none = True
                elif grad is not then() or grad._version != version:  # (set: its values tell)
                    now, nonzero = (s.to(norm.device) for s in _stats(grad))
                    differs = torch.isclose(now, norm, rtol=0, atol=0, equal_nan=True).logical_not_()
                    changed.append(((nonzero > count) | (now > norm) | (nonzero == count) & differs).to(device))
                    zeros.append((nonzero == 0).to(device))
                    removed.append(((nonzero == 0) & (count > 0)).to(device))
                else:
                    zeros.append((count == 0).to(device))
            if changed or none:
                no = torch.zeros((), dtype=torch.bool, device=device)
                cleared = torch.stack(zeros).all() if zeros else ~no
                gone = torch.stack([no | none, *removed]).any()
                self._found.append(torch.stack([torch.stack([no, *changed]).any(), cleared & gone]))

    def passed(self, held: Iterable[Iterable[torch.Tensor]]) -> str | None:
        """A pass ended; ``held``: the parameters of each optimizer whose window stays open after the pass's batch and
        holds its gradients, which are noted: whether the gradients were ``"cleared"`` or ``"changed"`` as it began."""
        if self._left:  # a pass that reached none of params: they are as it began
            self.passing()
        found, self._found = [f.tolist() for f in self._found], []
        grads = [[(p, p.grad) for p in params if id(p) in self._judged and p.grad is not None
                  and p.grad.layout == torch.strided] for params in held]
        self._left = [[(p, weakref.ref(g), g._version, *_stats(g)) for p, g in each] for each in grads if each]
        how = "cleared" if any(c for _, c in found) else "changed" if any(c for c, _ in found) else None
        if how is not None:  # told once: nothing is judged after
            self._judged, self._left = set(), []
        return how


def _stats(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A gradient's norm, in float32 at least (a float16 one's could overflow where its values differ), and its count
    of non-zero elements, on its device."""
    grad = grad.detach()
    norm: torch.Tensor = torch.linalg.vector_norm(grad, dtype=torch.promote_types(grad.dtype, torch.float32))
    return norm, torch.count_nonzero(grad)


def changed_in_window(plugin: str, step: str, how: str, accumulate: int, where: str) -> str:
    """The message of optim's watch where :class:`Untouched` found the gradients of an accumulation window
    ``"changed"`` or ``"cleared"`` (``how``) by the step function ``step`` between its passes, ``where``."""
    head = (f"{plugin}: step function {step!r} {how} the gradients accumulated inside a window of accumulate="
            f"{accumulate} between two of its backward passes{where}")
    if how == "cleared":
        return (f"{head} (a zero_grad() of the model or of a torch optimizer, not loop.optimizers'): each window's "
                f"step then takes its last batches' gradients alone. Call loop.optimizers.zero_grad() instead, which "
                f"clears them only after the window's step")
    return (f"{head}: a clip (torch.nn.utils.clip_grad_norm_ or clip_grad_value_) or a p.grad.mul_() there runs at "
            f"every batch, on a partial sum, where a plain loop clips once a window, on its summed gradients, before "
            f"optimizer.step(): the run trains another model. Give Optim(clip_norm=<max norm>, clip_scope='model') "
            f"(one norm over every optimizer's parameters, as clip_grad_norm_(model.parameters(), ...) takes; or "
            f"clip_value=) and take the clip out of the step function, or clip only where the gradients are the "
            f"step's: if loop.optimizers.unscale_(): torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)")


_PLAIN = (torch.Tensor, torch.nn.Parameter)
