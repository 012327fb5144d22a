"""distributed's model: wrapped in ``DistributedDataParallel`` (``strategy="ddp"``), with the
check that the step functions call the wrapper (``loop.model``), or sharded in place by FSDP2's
``fully_shard`` (``strategy="fsdp"``), the ``Loop``'s optimizers pointed at the shards; and the
gradient synchronisation of every training forward pass, decided by ``should_sync_gradients``.
See the package documentation; :class:`ModelWrap` is that part of the plugin's class."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch

from hookfit.modes import modules
from hookfit.plugins.support import GradientWatch

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from torch.distributed import ProcessGroup
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.hooks import RemovableHandle

    from hookfit.run import Run


class ModelWrap:
    """The model's wrapping (DDP) or sharding (FSDP2) of
    :class:`~hookfit.plugins.distributed.Distributed` (a part of its class)."""

    # the plugin's options and process groups, read here
    wrap_model: bool
    find_unused_parameters: bool
    ddp_options: dict[str, Any]
    shard_policy: Callable[[torch.nn.Module], bool] | None
    fsdp_options: dict[str, Any]
    created: bool
    _groups: list[ProcessGroup]

    def _reset_model(self) -> None:
        """No model wrapped or sharded, nothing watched (before each run)."""
        self._ddps: list[DistributedDataParallel] = []
        self._fsdp: FSDPModule | None = None  # the root FSDP module (strategy="fsdp")
        self._forward_seen = True
        self._forward_checked = True
        self._forward_hook: RemovableHandle | None = None
        self._grad_seen = True
        self._grad_hooks = GradientWatch((), self._saw_grad)
        self._wrapped: DistributedDataParallel | None = None  # the wrapper this plugin made of the model
        self._pass_hooks: list[RemovableHandle] = []  # should_sync_gradients before every training pass
        self._unsynced: set[int] = set()  # DDP modules whose running pass this plugin made unsynchronised
        self._window_open = False  # the last training pass left its gradients unsynchronised (a window is open)

    def _wrap(self, loop: Run, device: torch.device) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = loop.model
        if not self.wrap_model:
            self._ddps = [m for m in modules(model) if isinstance(m, DDP)]
            return
        if isinstance(model, DDP):
            self._ddps = [model]
            return
        if not isinstance(model, torch.nn.Module):
            got = "no model" if model is None else f"a {type(model).__name__}"
            raise TypeError(
                f"distributed: Loop(model=...) must be the one torch.nn.Module the step functions "
                f"call, to be wrapped in DistributedDataParallel; got {got}. Pass the model, and "
                f"call it as loop.model(x) in the step. With several models, wrap each in "
                f"DistributedDataParallel yourself and give Distributed(wrap_model=False)."
            )
        if device.type == "cuda" and any(p.device != device for p in model.parameters()):
            model.to(device)  # the parameters stay the same objects: optimizers keep them
        options = dict(self.ddp_options)
        options.setdefault("find_unused_parameters", self.find_unused_parameters)
        if device.type == "cuda":
            options.setdefault("device_ids", [device.index])
        try:
            wrapped = DDP(model, **options)
        except Exception as exc:
            exc.add_note("hookfit distributed: wrapping Loop(model=...) in DistributedDataParallel failed")
            raise
        if self.created:  # see Distributed._release
            # (an attribute of this plugin's own on the wrapper: set by name, which Module's
            # declared __setattr__, for tensors and modules, does not cover)
            setattr(wrapped, "_hookfit_process_groups", tuple(self._groups))
        loop.model, self._ddps, self._wrapped = wrapped, [wrapped], wrapped
        self._forward_seen = self._forward_checked = self._grad_seen = False
        self._forward_hook = wrapped.register_forward_pre_hook(self._saw_forward)
        self._grad_hooks = GradientWatch([p for p in model.parameters() if p.requires_grad], self._saw_grad)

    def _shard_model(self, loop: Run, device: torch.device) -> None:
        """``strategy="fsdp"``: ``fully_shard`` the picked submodules, deepest first, then the
        model; point the ``Loop``'s optimizers at the sharded parameters. The module stays
        ``loop.model`` (FSDP2 changes it in place), and stays sharded after the run."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        model = loop.model
        if not isinstance(model, torch.nn.Module):
            got = "no model" if model is None else f"a {type(model).__name__}"
            raise TypeError(f"distributed: strategy='fsdp' shards Loop(model=...), which must be one "
                            f"torch.nn.Module; got {got}")
        if isinstance(model, FSDPModule):  # sharded already (an earlier run of this model)
            self._fsdp = model
            return
        if device.type == "cuda" and any(p.device != device for p in model.parameters()):
            model.to(device)
        before = {id(p): name for name, p in model.named_parameters()}
        optimizers = list(torch_optimizers(loop.optimizers))
        for index, optimizer in enumerate(optimizers):
            if any(id(p) in before for p in optimizer.state):
                raise ValueError(
                    f"distributed: strategy='fsdp': optimizer {index} ({type(optimizer).__name__}) has stepped "
                    f"already; its state cannot follow the parameters into their shards. Create the "
                    f"optimizer fresh, before Loop.fit()")
        picked = self.shard_policy or _holds_parameters
        children = [m for _, m in model.named_modules() if m is not model]
        if self.shard_policy is None:
            children = list(model.children())
        try:
            for module in reversed(children):  # children before their parents
                if picked(module) and not isinstance(module, FSDPModule):
                    fully_shard(module, **self.fsdp_options)
            fully_shard(model, **self.fsdp_options)
        except Exception as exc:
            exc.add_note("hookfit distributed: fully_shard of Loop(model=...) failed (strategy='fsdp')")
            raise
        after = dict(model.named_parameters())
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [after[before[id(p)]] if id(p) in before else p for p in group["params"]]
        self._fsdp = cast("FSDPModule", model)  # fully_shard made it one, in place

    # -- gradient synchronisation, decided per pass -----------------------------------------
    def _watch_passes(self, loop: Run) -> None:
        """Ask ``should_sync_gradients`` before every training forward pass of each
        data-parallel module (a forward pre-hook on it), so an optimizer plugin decides pass by
        pass (several passes in one batch: Sharpness-Aware Minimization's closure). Nothing
        is added when the run has no such module."""
        for ddp in self._ddps:
            self._pass_hooks += [ddp.register_forward_pre_hook(self._ddp_pass(loop, ddp)),
                                 ddp.register_forward_hook(self._ddp_passed(ddp), always_call=True)]
        if self._fsdp is not None:
            fsdp = cast("torch.nn.Module", self._fsdp)
            self._pass_hooks.append(fsdp.register_forward_pre_hook(self._fsdp_pass(loop)))

    def _ddp_pass(self, loop: Run, ddp: DistributedDataParallel) -> Callable[..., None]:
        """DDP decides in its forward whether the backward of that pass all-reduces: the pass
        runs as under ``ddp.no_sync()`` when the answer is ``False`` (and as the flag says
        otherwise: a step's own ``no_sync()`` still holds); :meth:`_ddp_passed` restores it."""

        def before_pass(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            if loop.training and torch.is_grad_enabled() and (ask := loop.hooks.should_sync_gradients) is not None:
                self._window_open = ask(loop) is False  # this pass's gradients stay this rank's own
                if self._window_open and ddp.require_backward_grad_sync:
                    ddp.require_backward_grad_sync = False
                    self._unsynced.add(id(ddp))

        return before_pass

    def _ddp_passed(self, ddp: DistributedDataParallel) -> Callable[..., None]:
        def after_pass(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if id(ddp) in self._unsynced:  # this pass was decided unsynchronised: the next one asks again
                self._unsynced.discard(id(ddp))
                ddp.require_backward_grad_sync = True

        return after_pass

    def _fsdp_pass(self, loop: Run) -> Callable[..., None]:
        """FSDP2 reads its flag in the backward pass: set before each training pass, it holds
        until the next one; inside a window FSDP2 keeps the gradients unsharded in the model."""

        def before_pass(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            if loop.training and torch.is_grad_enabled():
                ask = loop.hooks.should_sync_gradients
                sync = ask is None or ask(loop) is not False
                if sync == self._window_open:  # changed: FSDP2 walks every sharded module to set it
                    assert self._fsdp is not None  # (the hook is registered on it)
                    self._fsdp.set_requires_gradient_sync(sync)
                    self._window_open = not sync

        return before_pass

    def _unwatch_passes(self) -> None:
        """Remove the pass hooks and leave every module synchronising (the run's end)."""
        hooks, self._pass_hooks = self._pass_hooks, []
        for hook in hooks:
            hook.remove()
        for ddp in self._ddps:
            ddp.require_backward_grad_sync = True
        self._unsynced = set()
        if self._fsdp is not None:
            self._fsdp.set_requires_gradient_sync(True)
        self._window_open = False

    def _saw_forward(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        self._forward_seen = True
        if self._forward_hook is not None:  # (set with the hook)
            self._forward_hook.remove()  # once is enough: later calls take torch's fast path
        self._forward_hook = None

    def _saw_grad(self, tensor: torch.Tensor) -> None:
        """The first gradient of the run: was the forward pass DDP's? (Removed after the
        first training batch, by ``agree_stop``.)"""
        if self._grad_seen:
            return
        self._grad_seen = True
        if not self._forward_seen:
            raise RuntimeError(
                "distributed: the step computed gradients without calling the model through "
                "loop.model, so DistributedDataParallel could not synchronise them and the "
                "processes would train apart. Under torchrun loop.model is the model wrapped in "
                "DistributedDataParallel: call loop.model(x) in the step functions instead of "
                "the model variable of the script."
            )

    def _remove_grad_hooks(self) -> None:
        self._grad_hooks.remove()


def _holds_parameters(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters())


def torch_optimizers(optimizers: Any) -> Iterator[torch.optim.Optimizer]:
    """The ``torch.optim.Optimizer`` objects in ``Loop(optimizers=...)``: one, or those of a
    mapping or a list."""
    if isinstance(optimizers, torch.optim.Optimizer):
        yield optimizers
    elif isinstance(optimizers, Mapping):
        for value in optimizers.values():
            if value is not optimizers:  # (a collection of one that is its own item)
                yield from torch_optimizers(value)
    elif isinstance(optimizers, (list, tuple)):
        for value in optimizers:
            yield from torch_optimizers(value)
