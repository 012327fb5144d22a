"""Where the time goes: each stage's seconds split into waiting for data, the step function
and plugins (:class:`TimeSplit`, public as ``hookfit.payloads.TimeSplit``), measured by the loop
with clock reads only, never a device sync, and kept in ``state.time_split``. Imports neither
torch nor any plugin, as :mod:`hookfit.payloads` does not."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

__all__ = ["BOTTLENECK_SECONDS", "DATA_BOTTLENECK", "INTERVAL", "TimeSplit", "store_split"]

INTERVAL = 0.5
"""The most seconds ``state.time_split`` lags behind a running stage (it is stored at most
this often while a stage runs, and always at the stage's end)."""

DATA_BOTTLENECK = 0.2
"""The share of a stage's time spent waiting for data above which the data loader is called
the bottleneck (:attr:`TimeSplit.data_bound`): what the console's end summary and a dashboard
warn about."""
BOTTLENECK_SECONDS = 0.1
"""A stage shorter than this never names a bottleneck: its split is the noise of a few batches."""


@dataclass(frozen=True)
class TimeSplit:
    """Where the wall-clock time of one stage (``"train"`` or ``"valid"``) went, over every
    epoch of the current ``fit()`` so far: what ``loop.state.time_split[stage]`` holds. The
    loop measures it itself, with a few ``time.perf_counter()`` reads a batch and no device
    synchronisation (no tensor is ever read). Fields, in seconds:

    * ``data``: waiting for the next batch: ``iter(data)`` (a ``DataLoader`` starts its
      workers there) and every ``next()`` on it, the last one that ends the stage included.
      A resumed stage's start, which passes the batches done before the checkpoint, is in
      no part (it is the resume's time, not the stage's).
    * ``step``: inside the step function, with everything it calls: the forward pass,
      ``loop.backward(loss)`` and ``loop.optimizers.step()`` (so what an optimizer plugin
      does inside the step counts as step, not as plugins). On an accelerator this is the time
      to *enqueue* the work, plus whatever synchronisations the step's own code makes
      (``.item()``, printing a tensor, copying to the host): kernels still running when the
      step returns are waited for by the next operation that synchronises, wherever it is,
      so a step that never synchronises can look cheaper than it is and the wait shows up
      elsewhere (often in ``data`` or ``plugins``).
    * ``plugins``: the rest of the stage: the per-batch events (``batch_start``,
      ``step_output``, ``batch_end``, ``should_stop`` and stop agreement), the stage's own
      ``stage_start``/``stage_end`` events and the loop's bookkeeping between them (a few
      microseconds a batch). A validation that runs inside the training stage
      (``val_every_n_steps``) is counted in ``"valid"``, not here.
    * ``batches``: batches of this stage drawn so far in this ``fit()``.

    Derived: :attr:`total`, :attr:`shares` (fractions of :attr:`total`), :attr:`data_bound`
    (waiting for data is more than :data:`DATA_BOTTLENECK` of the time), :meth:`as_dict` (the
    JSON form written to ``run.jsonl``), :meth:`row` (flat, with rounded shares) and
    ``str()``: ``"data=12% step=80% plugins=8%"``. Two splits of one stage add up with ``+``.
    """

    stage: str
    data: float = 0.0
    step: float = 0.0
    plugins: float = 0.0
    batches: int = 0

    PARTS = ("data", "step", "plugins")
    """The three parts of a stage's time, in the order they are shown."""

    @property
    def total(self) -> float:
        """Seconds measured in the stage: ``data + step + plugins``."""
        return self.data + self.step + self.plugins

    @property
    def shares(self) -> dict[str, float]:
        """``{"data": ..., "step": ..., "plugins": ...}`` as fractions of :attr:`total`
        (all 0 before anything was measured)."""
        total = self.total
        if total <= 0:
            return dict.fromkeys(self.PARTS, 0.0)
        return {"data": self.data / total, "step": self.step / total, "plugins": self.plugins / total}

    @property
    def data_bound(self) -> bool:
        """Whether waiting for data is more than :data:`DATA_BOTTLENECK` of the stage's time,
        of :data:`BOTTLENECK_SECONDS` at least: the data loader is the bottleneck."""
        return self.total >= BOTTLENECK_SECONDS and self.shares["data"] > DATA_BOTTLENECK

    def __add__(self, other: TimeSplit) -> TimeSplit:
        if not isinstance(other, TimeSplit):
            return NotImplemented
        if other.stage != self.stage:
            raise ValueError(f"cannot add the time split of stage {other.stage!r} to that of {self.stage!r}")
        return TimeSplit(self.stage, self.data + other.data, self.step + other.step,
                         self.plugins + other.plugins, self.batches + other.batches)

    def as_dict(self) -> dict[str, Any]:
        """``{"data": s, "step": s, "plugins": s, "batches": n}``, seconds rounded to the
        microsecond: the form ``run.jsonl`` keeps per stage."""
        return {"data": round(self.data, 6), "step": round(self.step, 6), "plugins": round(self.plugins, 6),
                "batches": self.batches}

    def row(self) -> dict[str, Any]:
        """A flat, JSON-ready view: ``stage``, :meth:`as_dict`'s fields, ``time`` (the total)
        and ``data_share``/``step_share``/``plugins_share`` (fractions, 3 decimals)."""
        out: dict[str, Any] = {"stage": self.stage, **self.as_dict(), "time": round(self.total, 6)}
        out.update({f"{part}_share": round(share, 3) for part, share in self.shares.items()})
        return out

    def __str__(self) -> str:
        return " ".join(f"{part}={share:.0%}" for part, share in self.shares.items())


def store_split(state: Any, stage: str, past: TimeSplit | None, elapsed: float, waited: float,
                stepping: float, batches: int) -> None:
    """Store the time split of ``stage`` in ``state.time_split``: ``past`` (its earlier
    epochs) plus this one's, whose ``elapsed`` seconds were ``waited`` in ``next()``,
    ``stepping`` in the step and the rest in plugins. A new read-only mapping each time (a
    renderer on another thread may keep the one it read)."""
    if batches <= 0 and past is None:
        return  # the stage drew no batch: nothing to say about it
    split = TimeSplit(stage, waited, stepping, max(elapsed - waited - stepping, 0.0), max(batches, 0))
    if past is not None:
        split = past + split
    state.time_split = MappingProxyType({**state.time_split, stage: split})
