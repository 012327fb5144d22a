"""distributed's check that the processes train one model: once a run, after the first optimizer step, every
rank's trainable parameters are compared (a checksum of each, gathered once). Under data parallelism every
process holds the same values after every step; a module the step trains without synchronising its gradients
(not wrapped in ``DistributedDataParallel``, with ``Distributed(wrap_model=False)``) trains apart on each rank,
and the run fails here naming it, instead of ending with each rank's own model and a checkpoint of rank 0's.
What is checked is the outcome, not the wrapping: gradients a step all-reduces itself pass. Sharded parameters
(FSDP2's ``DTensor``, FSDP1's ``FlatParameter`` and the parameters of an FSDP1 module, a ``ShardedTensor``) differ
by design and are left out, and so is a parameter some ranks do not have (each rank a stage of a pipeline). The
check is skipped when ``ddp_options`` gives DDP a ``process_group`` of fewer ranks than the world (the replicas are
within each group), and ``Distributed(check_replicas=False)`` turns it off (sharded parameters of another kind,
tensor parallelism with plain tensors). :class:`ReplicaCheck` is that part of the plugin's class."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from hookfit.plugins.support import unwrap_model

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from torch.distributed import ProcessGroup
    from torch.utils.hooks import RemovableHandle

    from hookfit.run import Run

__all__ = ["ReplicaCheck", "checksums", "differing"]

SHOWN = 6  # parameter names a message lists for each module, then how many more


class ReplicaCheck:
    """The check that the ranks' parameters agree after the first optimizer step, a part of
    :class:`~hookfit.plugins.distributed.Distributed`'s class. Costs nothing per batch once done: the
    step hooks are removed, and the flag ``agree_stop`` all-reduces anyway carries whether a rank
    stepped, so every rank takes the check's collective at the same agreement."""

    world_size: int
    check_replicas: bool
    ddp_options: dict[str, Any]
    _control: ProcessGroup | None

    def _reset_replicas(self) -> None:
        self._replicas_due = False  # the check is still to come in this run
        self._stepped = False  # an optimizer of this rank stepped (or, without any, a training batch ran)
        self._step_hooks: list[RemovableHandle] = []

    def _watch_steps(self, loop: Run) -> None:
        """Watch the ``Loop``'s optimizers for their first step; without any, a training batch counts."""
        from hookfit.plugins.distributed.wrapping import torch_optimizers

        import torch.distributed as dist

        group = self.ddp_options.get("process_group")
        if not self.check_replicas or (group is not None and dist.get_world_size(group) != self.world_size):
            return  # off, or DDP over sub-groups: the ranks of different groups hold different replicas
        self._replicas_due = True
        self._step_hooks = [optimizer.register_step_post_hook(self._saw_step)
                            for optimizer in torch_optimizers(loop.optimizers)]

    def _saw_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._stepped = True

    def _unwatch_steps(self) -> None:
        hooks, self._step_hooks = self._step_hooks, []
        for hook in hooks:
            hook.remove()

    def _check_replicas(self, loop: Run) -> None:
        """Compare every rank's parameters (one gather, every rank at once); raise when some differ."""
        import torch.distributed as dist

        self._replicas_due = False
        self._unwatch_steps()
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, checksums(loop.model), group=self._control)
        if (message := differing(everyone)) is not None:
            raise RuntimeError(message)


def _named(model: Any, prefix: str = "") -> Iterator[tuple[str, torch.nn.Module]]:
    """The root modules of ``Loop(model=...)`` with their names in it (``"gen"`` for a mapping's, ``""`` for
    the one module)."""
    if isinstance(model, torch.nn.Module):
        yield prefix, unwrap_model(model)
    elif isinstance(model, Mapping):
        for key, value in model.items():
            yield from _named(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(model, (list, tuple)):
        for index, value in enumerate(model):
            yield from _named(value, f"{prefix}.{index}" if prefix else str(index))


def checksums(model: Any) -> dict[tuple[str, str], int]:
    """A checksum of each trainable parameter of ``model`` that is not sharded (see the module's doc), by its
    root module's name (:func:`_named`) and its own: the sum of its bytes read as integers, exact and independent of the order of summation (equal values, equal sums)."""
    # sharded parameter classes (each exists only once its module is imported: none is imported here)
    sharded = tuple(getattr(sys.modules.get(module), kind, None) or type(None) for module, kind in (
        ("torch.distributed.tensor", "DTensor"), ("torch.distributed.fsdp._flat_param", "FlatParameter"),
        ("torch.distributed._shard.sharded_tensor.api", "ShardedTensor")))
    fsdp1 = getattr(sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel"),
                    "FullyShardedDataParallel", None)
    names: list[tuple[str, str]] = []
    sums: list[torch.Tensor] = []
    seen: set[int] = set()
    for prefix, module in _named(model):
        if fsdp1 is not None:  # FSDP1's use_orig_params=True: its module's parameters are views of shards
            seen.update(id(p) for m in module.modules() if isinstance(m, fsdp1) for p in m.parameters())
        for name, parameter in module.named_parameters():
            if (not parameter.requires_grad or isinstance(parameter, sharded) or id(parameter) in seen
                    or parameter.device.type == "meta"):
                continue
            seen.add(id(parameter))
            data = parameter.detach().contiguous().reshape(-1).view(torch.uint8)
            if data.storage_offset() % 4:  # a view into a buffer at an odd offset: read as words, copied
                data = data.clone()
            width = next(w for w, kind in ((4, torch.int32), (2, torch.int16), (1, torch.uint8))
                         if data.numel() % w == 0)
            words = data.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[width])
            names.append((prefix, name))
            sums.append(words.sum(dtype=torch.int64))
    if not sums:
        return {}
    values = torch.stack([s.to("cpu") for s in sums]).tolist()  # one copy to the CPU per device
    return dict(zip(names, values))


def differing(everyone: list[dict[tuple[str, str], int]]) -> str | None:
    """The error for parameters whose checksums differ between the ranks (each rank's :func:`checksums`), or
    ``None`` when every parameter all the ranks hold is the same on all of them."""
    common = [name for name in everyone[0] if all(name in rank for rank in everyone)]
    apart = [name for name in common if any(rank[name] != everyone[0][name] for rank in everyone)]
    if not apart:
        return None
    modules: dict[str, list[str]] = {}
    for root, name in apart:
        modules.setdefault(root, []).append(name)
    listed = "; ".join(
        (f"{module!r}: " if module else "") + ", ".join(names[:SHOWN])
        + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
        for module, names in modules.items())
    return (f"distributed: after the first optimizer step the processes hold different values of {len(apart)} of "
            f"their {len(common)} trainable parameter tensors ({listed}): each process trained its own copy, because their "
            f"gradients were not synchronised. Under torchrun every module the optimizers step must be wrapped in "
            f"torch.nn.parallel.DistributedDataParallel (Distributed(wrap_model=False) leaves loop.model as given: "
            f"wrap each module yourself, and call the wrappers in the step), or the step must all-reduce (average) "
            f"the gradients itself before each optimizer step. Where the ranks' parameters differ by design (sharded "
            f"ones that are no DTensor), Distributed(check_replicas=False) turns this check off")
