"""What a trial of the run's own training changes (lr_find's sweep: the run's step on some batches),
taken before it and put back after it (:class:`Rollback`)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hookfit.modes import modules
from hookfit.position import rng_state, set_rng_state
from hookfit.states import stateful

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

__all__ = ["Rollback"]


class Rollback:
    """What a trial of the run's training (lr_find's sweep) changes, taken before it and put back
    after (:meth:`restore`), so that the run goes on as if it never happened: the model's modules
    (parameters, buffers, gradients, training flags), every tensor an optimizer steps (in
    ``model=`` or not), the optimizers' own states, every plugin's state, the random state,
    ``loop.carry`` and the data's own state."""

    def __init__(self, loop: Run, plugin: str, trial: str = "the trial") -> None:
        """``plugin`` names the plugin in errors, ``trial`` what changes the run (``"the sweep"``)."""
        import torch

        self.modules = modules(loop.model)
        self.params = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in self.modules]
        self.flags = [[sub.training for sub in m.modules()] for m in self.modules]
        optimizers = loop.optimizers
        self.optimizers = list(optimizers.values()) if isinstance(optimizers, Mapping) else [optimizers]
        for optimizer in self.optimizers:
            missing = [a for a in ("param_groups", "state_dict", "load_state_dict") if not hasattr(optimizer, a)]
            if missing:
                raise TypeError(f"{plugin}: the run's optimizer {type(optimizer).__name__} has no "
                                f"{', '.join(missing)}: {trial} could not put it back afterwards; give a "
                                f"torch.optim.Optimizer")
        self.optimizer_states = [copy.deepcopy(o.state_dict()) for o in self.optimizers]
        # every tensor the trial may change through an optimizer or the model, once each
        tensors: dict[int, Any] = {}
        for m in self.modules:
            for p in m.parameters():
                tensors.setdefault(id(p), p)
        for o in self.optimizers:
            for group in o.param_groups:
                for p in group["params"]:
                    tensors.setdefault(id(p), p)
        self.tensors = [(p, p.detach().clone(), None if p.grad is None else p.grad.detach().clone())
                        for p in tensors.values()]
        self.plugins = copy.deepcopy(loop.plugin_states(check=False))  # (kept in memory, never written)
        data = loop.train_data
        self.rng = rng_state(data)  # with the data's own generators, which the sweep's passes draw from
        self.data = copy.deepcopy(data.state_dict()) if stateful(data) else None
        self.carry, self.training = dict(loop.carry), loop.training
        self._no_grad = torch.no_grad

    def restore(self, loop: Run) -> None:
        with self._no_grad():
            for module, params, flags in zip(self.modules, self.params, self.flags):
                module.load_state_dict(params)
                for sub, flag in zip(module.modules(), flags):
                    sub.training = flag
            for tensor, value, grad in self.tensors:
                tensor.copy_(value)
                tensor.grad = grad
        for optimizer, state in zip(self.optimizers, self.optimizer_states):
            optimizer.load_state_dict(copy.deepcopy(state))
        loop.load_plugin_states(self.plugins, strict=False)
        data = loop.train_data
        if self.data is not None and stateful(data):
            data.load_state_dict(self.data)
        loop.carry.clear()
        loop.carry.update(self.carry)
        loop.training = self.training
        set_rng_state(self.rng, data)
