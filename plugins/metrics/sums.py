"""Sums: ``Metrics(sums=("nll_sum", "ntok"))`` aggregates the step outputs under those keys as
sums over the stage's batches instead of batch-size-weighted means. :class:`Sums` is that part
of the metrics plugin: the option, checked at construction, and the checks of what a step
returns under such a key.

A summed key's epoch value is the sum of its values over the stage's batches (every process's
with several), its running value the sum so far, its last value the last batch's; derived
metrics see the sums (``derived={"ppl": lambda m: math.exp(m["nll_sum"] / m["ntok"])}`` is
the corpus perplexity). The weighting costs nothing per batch: a batch's value is kept with its
batch size as any other, and a sum leaves the size out when the values are folded.

* A name is summed in every stage, and with several validation sets in each set
  (``"noisy/nll_sum"``); a ``"<set>/<name>"`` entry sums that set's key alone.
* What a step returns under a summed key must be one real number a batch (a number, a tensor of
  one element): a vector (the per-token losses), text, ``None`` are a ``TypeError`` at the batch
  that returns it, naming the step function and the key; a metric object a ``ValueError`` (it
  aggregates itself: torchmetrics' ``SumMetric`` is a sum already).
* A checkpoint inside the training stage records the names: resumed with other ``sums``, the keys
  that epoch aggregates otherwise are said in one :class:`hookfit.HookfitWarning`.
* A name no step returns is said in one :class:`hookfit.HookfitWarning` a run, once every stage
  the run has (training, and validation where there is a validation step) has ended once, as a
  name may belong to one stage's step only.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from hookfit.errors import HookfitWarning, user_level
from hookfit.plugins.metrics.aggregate import as_real, is_metric, reserved
from hookfit.plugins.support import option_error
from hookfit.stopping import qualname

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

__all__ = ["Sums"]


class Sums:
    """The keys of ``Metrics(sums=...)``, checked at construction with errors naming ``plugin``
    and the option."""

    def __init__(self, sums: Collection[str] | None, *, plugin: str = "metrics") -> None:
        self.plugin = plugin
        if sums is None:
            sums = ()
        if isinstance(sums, str) or not isinstance(sums, (list, tuple, set, frozenset)):
            raise option_error(plugin, "sums", sums, "be a list of the names of step outputs to add up over the "
                               "stage's batches (sums=('nll_sum', 'ntok'), even for one name: ('nll_sum',)), or None",
                               TypeError)
        for name in sums:
            if not isinstance(name, str) or not name.strip() or name.startswith("/") or name.endswith("/"):
                kind = ValueError if isinstance(name, str) else TypeError
                raise option_error(plugin, "sums", name, "hold the names of step outputs ('nll_sum')", kind,
                                   shown=f"the entry {name!r}")
            if name == "batch_size":
                raise option_error(plugin, "sums", name, "name metrics: 'batch_size' is what a batch counts, never "
                                   "aggregated (the console's samples= adds it up)", shown=repr(name))
            if (why := reserved(name)) is not None:
                raise option_error(plugin, "sums", name, f"name no field of the history: {why}", shown=repr(name))
        self.names: tuple[str, ...] = tuple(dict.fromkeys(sums))
        self._seen: set[str] = set()  # names a step returned in this run
        self._keys: set[str] = set()  # every key a stage of this run aggregated, for the warning
        self._ended: set[str] = set()  # stages of this run that ended
        self._said = False

    def __bool__(self) -> bool:
        return bool(self.names)

    def keys(self, sets: object = None) -> frozenset[str]:
        """The keys summed in a stage: the names, and with several validation sets (``sets``, the
        ``val_data`` mapping) each set's ``"<set>/<name>"``."""
        if not self.names:
            return frozenset()
        named = [f"{prefix}/{name}" for prefix in sets for name in self.names] if isinstance(sets, Mapping) else []
        return frozenset((*self.names, *named))

    def check(self, key: str, value: Any, step: object) -> None:
        """Refuse ``value``, returned under the summed ``key`` by ``step``, unless it is one real
        number."""
        if is_metric(value):
            raise ValueError(
                f"step function {qualname(step)!r} returned a metric object ({type(value).__name__}) under {key!r}, "
                f"which {self.plugin}: sums adds up: a metric object aggregates itself (torchmetrics' SumMetric is "
                f"a sum already); leave {key!r} out of sums, or return the batch's number")
        if isinstance(value, torch.Tensor):
            if value.numel() == 1 and not value.is_complex():
                return
            what = f"a tensor of shape {tuple(value.shape)}"
        elif as_real(value) is not None:
            return
        else:
            what = f"{type(value).__name__} {value!r}"[:120]
        raise TypeError(
            f"step function {qualname(step)!r} returned {what} under {key!r}, which {self.plugin}: sums adds up "
            f"over the stage's batches: a sum takes one real number a batch (a number, a tensor of one element: "
            f"the batch's sum, nll.sum())")

    def stage_end(self, loop: Run, stage: str, keys: Iterable[str]) -> None:
        """Note the keys ``stage`` aggregated; once every stage of the run ended, warn (once a
        run) of the names no step returned."""
        if not self.names or self._said:
            return
        keys = set(keys)
        self._keys |= keys
        self._seen.update(name for name in self.names
                          if name in keys or any(key.endswith(f"/{name}") for key in keys))
        self._ended.add(stage)
        stages = {"train"} if loop.mode == "fit" else set()
        if loop.val_step is not None and loop.val_data is not None:
            stages.add("valid")
        missing = [name for name in self.names if name not in self._seen]
        if missing and stages <= self._ended:
            self._said = True
            warnings.warn(f"{self.plugin}: sums names {', '.join(map(repr, missing))}, which no step returned "
                          f"({' and '.join(sorted(self._ended))} ended; the steps returned "
                          f"{', '.join(map(repr, sorted(self._keys))) or 'no metrics'}): nothing is summed under "
                          f"it", HookfitWarning, stacklevel=user_level())

    def resumed(self, series: Iterable[str], saved: Iterable[str]) -> None:
        """Warn of the keys that the checkpoint's training stage in progress (``series``, its keys)
        aggregated otherwise than this run does (``saved``: the run's ``sums``): that epoch's value
        of each mixes a mean and a sum."""
        saved = set(saved)
        differ = sorted(key for key in series if (key in saved) != (key in self.names))
        if differ:
            how = ", ".join(f"{key!r} as a " + ("sum" if key in saved else "mean") for key in differ)
            warnings.warn(f"{self.plugin}: the checkpoint's training epoch in progress aggregated {how}, and "
                          f"this run's sums={self.names!r} does otherwise: that epoch's value of each mixes a mean "
                          f"and a sum; resume with the sums the run was saved with", HookfitWarning,
                          stacklevel=user_level())

    def reset(self) -> None:
        """A new run: its names are looked for again."""
        self._seen, self._keys, self._ended, self._said = set(), set(), set(), False
