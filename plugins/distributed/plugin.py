"""distributed plugin: the run's use of the process group, agreement on stopping,
``all_reduce`` and the end of the run. The other parts have a module each: the process group's
life (made once per job, kept for later runs) in :mod:`hookfit.plugins.distributed.group`; the
model's wrapping (DDP) or sharding (FSDP2), and the gradient synchronisation of each pass, in
:mod:`hookfit.plugins.distributed.wrapping`, a part of the plugin's class; each rank's part of
the data in :mod:`hookfit.plugins.distributed.sharding`; what a failing rank says, and how
its peers learn who failed first, in :mod:`hookfit.plugins.distributed.failures`; where streams run out,
in :mod:`hookfit.plugins.distributed.streams`."""

from __future__ import annotations

import datetime
import gc
import os
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch

from hookfit import HookfitWarning, StopRequest, hookimpl
from hookfit.config import records_options
from hookfit.errors import user_level
from hookfit.modes import modules
from hookfit.plugins.support import Every, check, choice, flag, integer, positive_number, text, unwrap_model
from hookfit.plugins.distributed import group, hookspecs
from hookfit.plugins.distributed.group import ENV_TIMEOUT, timeout_seconds, timeout_text
from hookfit.plugins.distributed.agreement import ValidationStop, agreed, check_plugins
from hookfit.plugins.distributed.failures import failure_store, report
from hookfit.plugins.distributed.replicas import ReplicaCheck
from hookfit.plugins.distributed.sharding import length, shard
from hookfit.plugins.distributed.streams import StreamEnds
from hookfit.plugins.distributed.wrapping import ModelWrap

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from torch._C._distributed_c10d import Store
    from torch.distributed import ProcessGroup
    from torch.utils.data import DistributedSampler

    from hookfit.run import Run

__all__ = ["ENV_TIMEOUT", "STRATEGIES", "Distributed", "launched"]

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE")


def launched() -> bool:
    """Whether this process was started by ``torchrun`` (or another launcher that sets the
    ``env://`` variables ``RANK`` and ``WORLD_SIZE``)."""
    return all(os.environ.get(name) for name in LAUNCH_VARIABLES)


def _dist() -> Any:
    import torch.distributed as dist

    return dist


STRATEGIES = ("ddp", "fsdp")


@records_options
class Distributed(ModelWrap, ReplicaCheck, StreamEnds):
    """Data-parallel training with ``torch.distributed`` under ``torchrun``: DDP (every rank
    holds the whole model) or FSDP2 (``strategy="fsdp"``: parameters, gradients and optimizer
    states sharded over the ranks).

    Options (give ``Loop(plugins=[Distributed(...)])`` to change them):

    * ``strategy``: ``"ddp"`` (the default) or ``"fsdp"``, PyTorch's
      ``torch.distributed.fsdp.fully_shard``: applied to every submodule that ``shard_policy``
      picks (by default every direct child of the model that holds parameters), deepest
      first, then to the model itself. The optimizers given to the ``Loop`` are pointed at the
      sharded parameters (they must not have stepped yet). The step function does not change.
    * ``shard_policy``: ``module -> bool``, which submodules get their own ``fully_shard``
      (``strategy="fsdp"``).
    * ``fsdp_options``: keyword arguments of every ``fully_shard`` call, such as
      ``mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)``,
      ``offload_policy=CPUOffloadPolicy()``, ``reshard_after_forward`` or ``mesh``.

    * ``backend``: ``"gloo"``, ``"nccl"``...; ``None`` picks ``nccl`` for a model on a GPU,
      ``gloo`` otherwise. Used only when this plugin initialises the process group.
    * ``timeout``: seconds a collective operation waits for the other ranks before failing
      (``HOOKFIT_DIST_TIMEOUT`` overrides it). Long enough for rank 0 to write a checkpoint
      while the others wait; a rank that *raises* makes the others fail at once anyway.
    * ``stop_check_every``: batches between two agreements on stopping: in training one tiny
      all-reduce each, on the CPU; in a validation, a lookup in the job's store each on every
      rank without a request (the all-reduce then only once a stop is decided there).
    * ``find_unused_parameters``, ``ddp_options``: passed to ``DistributedDataParallel``.
    * ``wrap_model=False``: leave ``loop.model`` alone (wrap your modules in DDP yourself;
      accumulation windows then skip the all-reduce of every DDP module in ``loop.model``).
    * ``shard_data=False``: leave the data alone (shard it yourself; every rank must have the
      same number of batches: checked at configure, or for streams where they run out, in
      :mod:`~hookfit.plugins.distributed.streams`).
    * ``seed``: the shuffling seed of the ``DistributedSampler`` of a rebuilt DataLoader.
    * ``check_replicas=False``: skip the check that every rank holds the same parameters after
      the first optimizer step (:mod:`~hookfit.plugins.distributed.replicas`).
    """

    name = "distributed"
    hookspecs = hookspecs  # the events it declares, added to every run (core/hooks.md)

    def __init__(
        self,
        backend: str | None = None,
        strategy: Literal["ddp", "fsdp"] = "ddp",
        shard_policy: Callable[[torch.nn.Module], bool] | None = None,
        fsdp_options: Mapping[str, Any] | None = None,
        timeout: float = 300.0,
        stop_check_every: int = 1,
        find_unused_parameters: bool = False,
        ddp_options: Mapping[str, Any] | None = None,
        wrap_model: bool = True,
        shard_data: bool = True,
        seed: int = 0,
        check_replicas: bool = True,
    ) -> None:
        name = self.name  # every option checked now, naming it (hookfit.plugins.support)
        backend = text(name, "backend", backend, none=True, what="the name of a torch.distributed backend",
                       meaning="'gloo', 'nccl'...")
        strategy = choice(name, "strategy", strategy, STRATEGIES)
        timeout = positive_number(name, "timeout", timeout, meaning="seconds")
        self._stop_checks = Every(stop_check_every, plugin=name, option="stop_check_every", none=False,
                                  meaning="batches")
        for option, switch in (("find_unused_parameters", find_unused_parameters), ("wrap_model", wrap_model),
                               ("shard_data", shard_data), ("check_replicas", check_replicas)):
            flag(name, option, switch)
        for option, options in (("fsdp_options", fsdp_options), ("ddp_options", ddp_options)):
            check(name, option, options, lambda v: v is None or isinstance(v, Mapping),
                  "be a mapping of keyword arguments, or None")
        seed = integer(name, "seed", seed, meaning="the shuffling seed of the data's DistributedSampler")
        check(name, "shard_policy", shard_policy, lambda p: p is None or callable(p),
              "be a function module -> bool, or None", TypeError)
        if strategy == "ddp" and (shard_policy is not None or fsdp_options):
            raise ValueError("distributed: shard_policy and fsdp_options are options of strategy='fsdp'")
        self.strategy = strategy
        self.shard_policy = shard_policy
        self.fsdp_options = dict(fsdp_options or {})
        self.backend = backend
        self.timeout = timeout
        self.stop_check_every = stop_check_every
        self.find_unused_parameters = find_unused_parameters
        self.ddp_options = dict(ddp_options or {})
        self.wrap_model = wrap_model
        self.shard_data = shard_data
        self.seed = seed
        self.check_replicas = check_replicas
        self._reset()

    def _reset(self) -> None:
        self.rank = 0
        self.world_size = 1
        self.created = False  # the run's process group is hookfit's (group.owned()), not the script's
        self._control: ProcessGroup | None = None  # the CPU (gloo) group for flags and all_reduce
        self._flag: torch.Tensor | None = None
        self._samplers: list[DistributedSampler[Any]] = []
        self._batches = 0
        self._agreed = False
        self._validations = 0  # validations begun in the run: the same count on every rank
        self._validation: ValidationStop | None = None  # where the running one stops, if it does
        self._window_warned = False
        self._groups: list[ProcessGroup] = []
        self._store: Store | None = None  # where the first failing rank says so (failures.first_failure)
        self._reset_model()  # no model wrapped or sharded yet (ModelWrap)
        self._reset_replicas()  # (ReplicaCheck)
        self._reset_streams()  # (StreamEnds)

    # -- set-up --------------------------------------------------------------------------
    def inert(self, chosen: bool) -> str | None:
        """What ``hookfit plugins`` says of it (:func:`hookfit.discovery.inert`): off in one process."""
        dist = _dist()
        if launched() or (dist.is_available() and dist.is_initialized()):
            return None
        return "started by torchrun (RANK and WORLD_SIZE set), or in a process that initialised torch.distributed"

    @hookimpl(tryfirst=True)
    def configure(self, loop: Run) -> None:
        self._reset()
        dist = _dist()
        if self.inert(True) is not None:  # given in one process: none of the hooks below costs anything
            loop.pm.unregister(self)
            return
        if not dist.is_available():
            raise RuntimeError(
                "distributed: this process was started by torchrun, but this build of torch has "
                "no torch.distributed; install a build with it, or disable the plugin with "
                "HOOKFIT_DISABLE_PLUGINS=distributed"
            )
        self.rank = int(os.environ.get("RANK", "0"))  # for messages until the group says
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        device = self._device(loop.model)
        timeout = datetime.timedelta(seconds=timeout_seconds(self.timeout))
        if not dist.is_initialized():
            backend = self.backend or ("nccl" if device.type == "cuda" else "gloo")
            if device.type == "cuda":
                torch.cuda.set_device(device)
            group.init(backend, timeout)  # kept for the job's later runs (see group)
        self.created = group.owned()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._groups = [dist.group.WORLD]  # see _release
        self._store = failure_store(dist)
        loop.state.rank, loop.state.world_size = self.rank, self.world_size
        # flags and metric sums are small CPU tensors: keep them off the accelerator's stream
        if dist.get_backend() == "gloo":
            self._control = None  # the default group
        else:
            self._control = dist.new_group(backend="gloo", timeout=timeout)
            self._groups.append(self._control)
        self._flag = torch.zeros(1, dtype=torch.int32)
        if self.rank != 0:  # only rank 0 renders and logs, but for observers that ask for every rank
            for _, plugin in list(loop.pm.list_name_plugin()):
                if (plugin is not None and getattr(plugin, "observer", False) is True
                        and getattr(plugin, "every_rank", False) is not True):
                    loop.pm.unregister(plugin)
        check_plugins(loop, dist, self.world_size, self._control)
        if self.strategy == "fsdp":
            self._shard_model(loop, device)
        else:
            self._wrap(loop, device)
        if self.shard_data:
            loop.train_data = self._sharded(loop.train_data, "train_data", even=True)
            if loop.val_data is not None:
                loop.val_data = self._sharded(loop.val_data, "val_data", even=False)
        self._check_lengths(loop)
        self._watch_streams(loop)
        self._watch_passes(loop)
        self._watch_steps(loop)

    def _device(self, model: Any) -> torch.device:
        """The device the model lives on: ``cuda:LOCAL_RANK`` for a model on any GPU."""
        params = [p for m in modules(model) for p in m.parameters()]
        if params and params[0].device.type == "cuda":
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return params[0].device if params else torch.device("cpu")

    def _sharded(self, data: Any, what: str, even: bool) -> Any:
        """This rank's part of ``data``; a training ``DistributedSampler`` is kept to be told the epoch
        (a validation one never is, as the loop tells validation data no epoch: the same part each time).
        Several validation sets (a mapping) are each sharded. Training data is sharded
        ``even`` (the same batches on every rank), validation data exactly (every sample once)."""
        if isinstance(data, Mapping):
            return {name: self._sharded(part, f"{what}[{name!r}]", even) for name, part in data.items()}
        data, sampler = shard(data, what, self.rank, self.world_size, self.seed, even)
        if sampler is not None and even:
            self._samplers.append(sampler)
        return data

    def _check_lengths(self, loop: Run) -> None:
        """Every rank must run as many training batches as the others (in a fit: an evaluation,
        ``Loop.validate()``, reads none), and at least one validation batch (one collective,
        once). Validation parts may differ by a batch: the loop runs no collective per validation
        batch."""
        dist = _dist()
        lengths = [length(loop.train_data), length(loop.val_data) if loop.val_data is not None else -1]
        mine = torch.tensor(lengths, dtype=torch.int64)
        everyone = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine, group=self._control)
        rows = [t.tolist() for t in everyone]
        empty = [rank for rank, row in enumerate(rows) if row[1] == 0]
        if empty:
            raise ValueError(f"distributed: val_data has no batch for rank(s) {empty}; every process needs at "
                             f"least one validation batch (give more validation samples than processes)")
        counts = [row[0] for row in rows]
        if len(set(counts)) > 1 and loop.mode == "fit":
            listed = ", ".join(f"rank {r}: {n if n >= 0 else 'unknown'}" for r, n in enumerate(counts))
            raise ValueError(
                f"distributed: the processes have different numbers of train_data batches per "
                f"epoch ({listed}); every rank must run the same batches, or their collective "
                f"operations would not match"
            )

    # -- every epoch and batch -------------------------------------------------------------
    @hookimpl
    def epoch_start(self, epoch: int) -> None:
        for sampler in self._samplers:
            sampler.set_epoch(epoch)

    @hookimpl
    def agree_stop(self, loop: Run, request: StopRequest | None, boundary: str) -> StopRequest | Literal[False]:
        """Every ``stop_check_every`` batches, and at every stage and epoch boundary, the ranks
        agree on stopping with one all-reduce of a flag; a request between two checks waits. Inside a
        validation, whose parts may differ by a batch, only once the ranks decided it stops (:class:`ValidationStop`)."""
        if boundary == "batch" and loop.training:
            if not self._forward_checked and self._grad_seen:
                self._forward_checked = True  # the first backward pass went through DDP
                self._remove_grad_hooks()
            if self._replicas_due and not self._step_hooks:
                self._stepped = True  # no optimizer given to the Loop: the first training batch counts
            self._batches += 1
            if not self._stop_checks.due(self._batches):
                return False
        elif not loop.training and boundary in ("batch", "batches_end"):
            if self._validation is None or not self._validation.stops(request, boundary == "batches_end"):
                return False
        elif boundary == "stage_start" and not loop.training and self._store is not None:
            self._validations += 1
            self._validation = ValidationStop(self._store, self._validations, self.stop_check_every)
        flag = self._flag
        assert flag is not None  # made at configure, which registers this plugin for the run
        # one number: the ranks asking to stop, plus world_size + 1 for each rank that stepped (ReplicaCheck)
        flag.fill_((request is not None) + (self.world_size + 1) * (self._stepped and self._replicas_due))
        dist = _dist()
        dist.all_reduce(flag, op=dist.ReduceOp.SUM, group=self._control)
        stepped, asking = divmod(int(flag.item()), self.world_size + 1)
        if stepped:  # some rank stepped: every rank checks the parameters now, once
            self._check_replicas(loop)
        if not asking:
            return False
        asked: list[Any] = [None] * self.world_size
        dist.all_gather_object(asked, request, group=self._control)
        self._agreed = True
        return agreed(asked)

    @hookimpl
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist = _dist()
        if tensor.device.type != "cpu" and self._control is not None:
            out = tensor.detach().clone()  # on the accelerator's own backend (nccl)
            dist.all_reduce(out, op=dist.ReduceOp.SUM)
            return out
        out = tensor.detach().to("cpu", copy=True)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self._control)
        return out.to(tensor.device)

    @hookimpl
    def save_state(self) -> None:
        """No state of its own; says when a checkpoint cannot be exact: inside an accumulation window
        each rank's gradients are its own until the window's last batch (DDP: a checkpoint holds rank
        0's state alone; FSDP2 keeps them unsharded inside the model, where no state reaches)."""
        if self._window_open and not self._window_warned and self.rank == 0:  # one process says it
            self._window_warned = True
            held = ("FSDP2 keeps them unsharded inside the model" if self.strategy == "fsdp" else
                    "each rank's are its own until the window's last batch, and a checkpoint holds rank 0's")
            warnings.warn(
                f"distributed: a checkpoint taken inside a gradient-accumulation window does not hold every "
                f"rank's gradients of the window ({held}): a run resumed from it ends that window with other "
                f"gradients than an uninterrupted run. Checkpoints at window ends (every_n_steps a multiple of "
                f"the window, epochs) are exact", HookfitWarning, stacklevel=user_level())  # the script's line

    # -- ending ------------------------------------------------------------------------------
    @hookimpl
    def exception(self, loop: Run, error: BaseException) -> None:
        """Say on stderr which rank failed, or that this one stopped because another failed
        first, with a note on ``error`` (:func:`~hookfit.plugins.distributed.failures.report`);
        then destroy the process group if hookfit made it (a script's own stays open)."""
        apart = not self.shard_data and length(loop.train_data) < 0  # a stream each process reads: uneven?
        report(error, self.rank, self.world_size, self._store, lambda: timeout_text(self.timeout), apart)
        group.destroy()  # hookfit's group: the peers' next collective fails now instead of at the timeout

    @hookimpl(trylast=True)
    def fit_end(self, loop: Run) -> None:
        """Give the run's model back, and keep the process group for the job's next run (a
        ``Loop`` after a ``Loop``): it is destroyed at the job's end or by
        :func:`~hookfit.plugins.distributed.shutdown` (see :mod:`~hookfit.plugins.distributed.group`)."""
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        self._remove_grad_hooks()
        self._unwatch_passes()
        self._unwatch_steps()
        state = loop.state
        dist = _dist()
        if dist.is_initialized():
            if self.created and (state.status == "completed" or self._agreed):
                dist.barrier(group=self._control)  # the ranks leave the run together
            if self._control is not None:  # (a failed run's went with the default group)
                dist.destroy_process_group(self._control)  # this run's own gloo group, made at configure
        self._control = None
        wrapped = self._wrapped
        if wrapped is not None and loop.model is wrapped:  # the run's model is the user's again
            loop.model = unwrap_model(wrapped, compiled=False)  # (compiled, if it was given so)
        self._ddps, self._samplers, self._fsdp, self._wrapped = [], [], None, None
        self._store = None
        self._release()
        if wrapped is not None:
            # The wrapper this plugin made holds the process group in reference cycles: left
            # to the garbage collector, the group (destroyed at the job's end) could live on
            # until the interpreter finalizes, where a gloo worker thread that frees a
            # collective's tensor aborts the process ("terminate called without an active
            # exception", SIGABRT after a completed run). Free it now: once per run.
            del wrapped
            gc.collect()

    def _release(self) -> None:
        """Drop this plugin's references to the process groups.

        A gloo group's destructor waits for its worker threads, which may need the GIL to
        free the tensors of a collective operation that has just finished. When the last
        reference to the group is a Python one, the destructor releases the GIL while it
        waits; when it is the one held by DDP's reducer (the wrapper freed right after a
        collective, for instance while an error unwinds), it does not, and the process hangs
        for ever. So the group is never left to the reducer: the wrapper carries one more
        reference, set after its reducer and therefore dropped after it
        (``_hookfit_process_groups``), and this plugin keeps its own until ``fit_end``."""
        groups, self._groups = self._groups, []
        del groups
