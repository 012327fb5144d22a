"""The objects that travel between plugins, owned by the core.

A plugin that publishes metrics and a plugin that draws them may come from different packages;
what one hands the other is defined here, not in either of them, and hook specifications in
:mod:`hookfit.hookspecs` are typed with these classes. This module imports neither torch nor
any plugin, so a renderer or logger can be written, and tested, against it alone.

* :class:`MetricsSnapshot` with its :class:`Value` entries: what ``metrics_update`` and
  ``epoch_metrics`` carry.
* :class:`StopRequest`: a request for a graceful stop, with who asked (``stop_requested``,
  ``agree_stop``).
* :class:`ResumeInfo`: where a resumed run continues from (``resumed``).
* :class:`ModelSummary` with its :class:`ModuleRow` entries: the size of the run's model, as
  :func:`hookfit.plugins.support.summary.summarize` counts it (what the console and the dashboard show at the
  start).
* :class:`TimeSplit`: where a stage's time went, waiting for data, in the step function or in
  plugins (``loop.state.time_split``, measured by the loop itself).

Epochs in these objects count from 0, as ``loop.state.epoch`` does; what is printed or written
for a person to read (the console, the dashboard, ``metrics.jsonl``, checkpoint names, the
``str()`` of these objects) counts them from 1.

Every class here is immutable: a payload may be handed to another thread as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple

from hookfit.timing import BOTTLENECK_SECONDS as BOTTLENECK_SECONDS
from hookfit.timing import DATA_BOTTLENECK as DATA_BOTTLENECK
from hookfit.timing import TimeSplit
from hookfit.units import MB, count, size

__all__ = ["MetricsSnapshot", "ModelSummary", "ModuleRow", "ResumeInfo", "StopRequest", "TimeSplit", "Value"]


class Value(NamedTuple):
    """One metric in a :class:`MetricsSnapshot`, as three means of the values a step returned
    under one key, each weighted by the number of samples of its batch (the publisher counts
    them; the built-in ``metrics`` takes an output's ``batch_size`` key, else the first
    dimension of the batch's first tensor, else 1).

    Fields:

    * ``last``: the value of the latest batch.
    * ``running``: the mean over a recent window of batches (the publisher chooses the window).
    * ``epoch``: the mean over every batch of the stage so far; final in ``epoch_metrics``.

    A number a plugin publishes with the metrics (the metrics role's ``metrics_values``) is a gauge,
    not a mean: its value at the publication in all three fields.
    """

    last: float
    running: float
    epoch: float


@dataclass(frozen=True)
class MetricsSnapshot:
    """Aggregated metrics of the running stage, as a metrics plugin publishes them in
    ``metrics_update`` (while the stage runs) and ``epoch_metrics`` (once it is complete).

    Built fresh for every publication and never changed afterwards. Fields:

    * ``stage``: ``"train"`` or ``"valid"``.
    * ``epoch``: the epoch, counted from 0 (as ``loop.state.epoch``).
    * ``max_epochs``: the run's ``max_epochs``.
    * ``step``: the global step when the snapshot was taken (``loop.state.step``).
    * ``batches``: batches done in this stage of this epoch.
    * ``total``: batches in this stage, when the data has a length; else ``None``.
    * ``samples``: samples done in this stage (over every process of the run).
    * ``elapsed``: seconds the stage ran since it started, without the validations run inside it
      (``val_every_n_steps``): ``samples_per_s`` and ``eta`` are the stage's own pace.
    * ``values``: metric name -> :class:`Value` (a read-only mapping).
    * ``lr``: ``<name>/<group>`` -> learning rate of each parameter group of optimizer ``<name>``: a group's
      ``"name"`` entry, else its index, an unnamed first group as ``<name>`` (read-only): the rate the latest
      step used (a batch's row shows its own step's, not the next one's its scheduler set; an epoch's, its last
      step's; with an epoch-wise scheduler or a plateau, the epoch's, in its validation too), where the optimizer
      role keeps it (``used_lrs``: the built-in's, with schedulers), else the group's ``"lr"`` at the snapshot.
    * ``final``: ``True`` for the stage's last snapshot (``epoch_metrics``).
    * ``history``: for a final snapshot, one read-only mapping per completed epoch of this
      stage, oldest first: ``{"epoch": ..., "step": ..., <metric>: <epoch mean>, ...}``;
      empty otherwise.
    * ``best``: metric name, bare as in ``values`` (``"acc"``, not ``"valid/acc"``: the
      snapshot's ``stage`` says which) -> ``"min"`` (lower is better) or ``"max"`` (higher is
      better), for the metrics of ``values`` whose direction is known: configured by the user
      (``Metrics(best=...)``), never guessed from a name (read-only; empty when none is).
      Renderers and loggers mark a best value only for these.

    Derived: :attr:`samples_per_s`, :attr:`batches_per_s`, :attr:`step_time`, :attr:`eta`,
    and :meth:`row` (a flat, JSON-ready view).
    """

    stage: str
    epoch: int
    max_epochs: int
    step: int
    batches: int
    total: int | None
    samples: int
    elapsed: float
    values: Mapping[str, Value]
    lr: Mapping[str, float] = field(default_factory=dict)
    final: bool = False
    history: tuple[Mapping[str, Any], ...] = ()
    best: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # read-only views, so that no receiver can change what another one sees
        for name in ("values", "lr", "best"):
            if not isinstance(getattr(self, name), MappingProxyType):
                object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
        wrong = {k: v for k, v in self.best.items() if v not in ("min", "max")}
        if wrong:
            raise ValueError(f"MetricsSnapshot.best: directions must be 'min' or 'max', got {wrong}")

    @property
    def samples_per_s(self) -> float:
        """Samples per second in this stage."""
        return self.samples / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def batches_per_s(self) -> float:
        """Batches per second in this stage."""
        return self.batches / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def step_time(self) -> float:
        """Mean seconds per batch in this stage."""
        return self.elapsed / self.batches if self.batches else 0.0

    @property
    def eta(self) -> float | None:
        """Seconds left in this stage, when its length is known."""
        if self.total is None or not self.batches:
            return None
        return max(self.total - self.batches, 0) * self.step_time

    def row(self) -> dict[str, Any]:
        """A flat, JSON-ready view for a person or a log: progress fields (``epoch`` counted
        from 1, as everything written for people), ``{metric: epoch mean}`` and
        ``{"lr_<optimizer>": learning rate}``. A metric whose name is taken by a field of the
        row (``step``, ``time``, ``event``, ``total``, ``lr_...``) is ``metric.<name>``, so that
        it never overwrites the field nor is read as it."""
        out: dict[str, Any] = {
            "stage": self.stage, "epoch": self.epoch + 1, "step": self.step, "batches": self.batches,
            "samples": self.samples, "time": round(self.elapsed, 6),
            "samples_per_s": round(self.samples_per_s, 3),
        }
        taken = {*out, "event", "total"}
        out.update({(f"metric.{k}" if k in taken or k.startswith("lr_") else k): v.epoch
                    for k, v in self.values.items()})
        out.update({f"lr_{k}": v for k, v in self.lr.items()})
        return out


@dataclass(frozen=True)
class StopRequest:
    """A request for a graceful stop: why, and who asked.

    * ``reason``: human-readable, shown to the user (``"SIGINT"``, ``"q pressed in the
      dashboard"``, ``"valid/loss did not improve for 3 epochs"``).
    * ``by``: who asked: the name of the plugin, ``"step function 'name'"``, or what the caller
      of ``loop.request_stop(reason, by=...)`` said; ``None`` when nobody could be named.
      Several askers (plugins answering ``should_stop`` together, or different plugins on
      different processes) are named once each, joined by ``", "``.
    * ``complete``: the run reached its end by the asker's rule (early stopping, a target
      reached), so it ends ``completed``; ``False`` (the default) for an interruption (a
      signal, ``q``, an error elsewhere), which ends ``interrupted``.
    * ``ranks``: with several processes, the ranks whose request the processes agreed on
      (sorted; ``agree_stop``'s answer), ``None`` for a request of this process alone. ``by``
      stays the asker's name on every process (``"time_budget"``, never one per rank), and the
      agreed ``reason`` names the ranks for a person to read (``"stop requested on ranks 0, 1:
      time budget spent"``), so the console's and ``metrics.jsonl``'s end lines show both.
    * ``ends_process``: the asker ends the process once the run is over (a job scheduler's
      SIGTERM): nothing at the run's end waits for a person (a persistent dashboard does not
      hold the screen). With several processes, true if any rank's request says so.

    The run ends with ``loop.state.stop_reason == reason`` and ``loop.state.stopped_by == by``;
    with several processes ``loop.stop_requested`` is the agreed request (``ranks`` set) once
    the processes stopped.
    """

    reason: str
    by: str | None = None
    complete: bool = False
    ranks: tuple[int, ...] | None = None
    ends_process: bool = False

    def __str__(self) -> str:
        return self.reason if self.by is None else f"{self.reason} (asked by {self.by})"


@dataclass(frozen=True)
class ResumeInfo:
    """Where a resumed run continues: what the ``resumed`` event carries and
    ``loop.state.resumed_from`` keeps.

    * ``source``: what the run resumed from (the checkpoint file).
    * ``epoch``: the epoch it continues in, from 0 (as ``loop.state.epoch``).
    * ``step``: the global step already done.
    * ``batch``: the training batches of ``epoch`` already done (the loop skips them), those of
      one process: the dashboard and ``hookfit show`` say it so, as they count progress; the
      console counts the whole job's, ``batch * world_size``, as its progress lines do.
    * ``stage``: ``"train"``, or ``"valid"`` when that epoch's training stage was complete.

    ``str()`` says it for a person: ``"<source> (epoch 3, after 7 training batches, step 47)"``.
    """

    source: str
    epoch: int
    step: int
    batch: int
    stage: str

    def __str__(self) -> str:
        where = "at its validation" if self.stage == "valid" else f"after {self.batch} training batches"
        return f"{self.source} (epoch {self.epoch + 1}, {where}, step {self.step})"


class ModuleRow(NamedTuple):
    """One top-level module in a :class:`ModelSummary`.

    Fields:

    * ``name``: the child's attribute name in the model (``"encoder"``, ``"0"`` in a
      ``Sequential``); the key (or index) of a model in a dict (or list) of models, dotted for
      nested ones (``"gan.generator"``); ``"(direct)"`` for the tensors the model holds itself,
      outside any child.
    * ``type``: the module's class name (``"Sequential"``), after unwrapping
      ``DistributedDataParallel``, ``DataParallel`` and ``torch.compile``.
    * ``parameters``: elements in its parameters, each parameter counted once.
    * ``trainable``: elements in those of its parameters that have ``requires_grad``.
    * ``bytes``: memory of its parameters and buffers.
    * ``uninitialised``: its parameters and buffers that a lazy module has not initialised yet
      (``torch.nn.parameter.UninitializedParameter``/``UninitializedBuffer``): their sizes are
      unknown until the first forward pass, and left out of every other field.
    * ``tied``: the names of earlier rows holding tensors this module shares with them (a tied
      weight: ``head.weight = tok.weight`` gives the ``head`` row ``("tok",)``); those tensors are
      counted in the first row that holds them, not here.
    """

    name: str
    type: str
    parameters: int
    trainable: int
    bytes: int
    uninitialised: int = 0
    tied: tuple[str, ...] = ()

    @property
    def size_mb(self) -> float:
        """``bytes`` in MB (of 2**20 bytes)."""
        return self.bytes / MB


@dataclass(frozen=True)
class ModelSummary:
    """The size of a model: what :func:`hookfit.plugins.support.summary.summarize` counts in ``loop.model``
    (a module, or a dict or list of them; a ``DistributedDataParallel``, ``DataParallel`` or
    ``torch.compile`` wrapper is looked through).

    A parameter or buffer shared by several modules (tied weights) is counted once in the
    totals. Fields:

    * ``parameters``: elements in the model's parameters (``sum(p.numel())`` over
      ``model.parameters()``, each parameter once).
    * ``trainable``: those in parameters with ``requires_grad`` (the rest are frozen).
    * ``parameter_bytes``: memory of the parameters (``numel() * elementsize()``).
    * ``buffer_bytes``: memory of the buffers (running statistics of a BatchNorm, ...).
    * ``modules``: one :class:`ModuleRow` per top-level module, in definition order: the
      children of a single model (plus a ``"(direct)"`` row when the model holds parameters
      itself), or one row per model of a dict or list of models. A tensor shared by two rows is
      counted in the first (the later one names it in ``tied``), so rows never add up to more
      than the totals.
    * ``uninitialised``: parameters and buffers of lazy modules not initialised yet (before the
      first forward pass): their sizes are unknown, and they are left out of every count.
    * ``type``: the class name of the model (``"dict"`` or ``"list"`` for several); ``""`` for
      no model.

    Derived: :attr:`bytes` (parameters and buffers), :attr:`size_mb`, :attr:`frozen`.
    ``str()`` says it for a person: ``"1.23M params (1.2M trainable), 4.71 MB"``.
    """

    parameters: int
    trainable: int
    parameter_bytes: int
    buffer_bytes: int
    modules: tuple[ModuleRow, ...] = ()
    uninitialised: int = 0
    type: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.modules, tuple):
            object.__setattr__(self, "modules", tuple(self.modules))

    @property
    def bytes(self) -> int:
        """Memory of the parameters and buffers."""
        return self.parameter_bytes + self.buffer_bytes

    @property
    def size_mb(self) -> float:
        """:attr:`bytes` in MB (of 2**20 bytes)."""
        return self.bytes / MB

    @property
    def frozen(self) -> int:
        """Elements in parameters without ``requires_grad``."""
        return self.parameters - self.trainable

    def __str__(self) -> str:
        text = f"{count(self.parameters)} params ({count(self.trainable)} trainable), {size(self.bytes)}"
        if self.uninitialised:
            text += f", {self.uninitialised} tensors not initialised yet (lazy)"
        return text
