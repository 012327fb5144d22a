"""Several validation sets, ``Loop(val_data={name: data, ...})``: they run one after the other
in one validation stage (:class:`ValSets`), and what the step reports is named per set
(:func:`per_set`), so every plugin sees one validation stage an epoch and each set's
metrics apart (``noisy/loss``)."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import Any, Callable

import torch

from hookfit.data import stage_length
from hookfit.state import State

__all__ = ["SizedValSets", "ValSets", "per_set"]

Step = Callable[[Any, Any], Any]


class ValSets:
    """Several validation sets run as one stage, one set after the other; ``state.val_set``
    names the set whose batches are coming. Sized when every set is."""

    def __new__(cls, sets: Mapping[str, Any], state: State) -> ValSets:
        sized = stage_length(sets) is not None
        return super().__new__(SizedValSets if sized and cls is ValSets else cls)

    def __init__(self, sets: Mapping[str, Any], state: State) -> None:
        self.sets, self.state = sets, state

    def __iter__(self) -> Iterator[Any]:
        try:
            for name, data in self.sets.items():
                self.state.val_set = name
                yield from data
        finally:
            self.state.val_set = None


class SizedValSets(ValSets):
    """:class:`ValSets` of sets that all have a length: the sum of theirs."""

    def __len__(self) -> int:
        return sum(len(data) for data in self.sets.values())


def per_set(step: Step, state: State) -> Step:
    """``step`` whose reported names carry the validation set's: ``loss`` of set ``noisy`` is
    ``noisy/loss`` (``batch_size`` stays as it is: it says how many samples, not a metric)."""

    @functools.wraps(step)
    def step_of_a_set(loop: Any, batch: Any) -> Any:
        output = step(loop, batch)
        if output is None:
            return None
        if isinstance(output, torch.Tensor):
            output = {"loss": output}
        if not isinstance(output, Mapping):
            return output  # the loop names what is wrong with it
        prefix = f"{state.val_set}/"
        return {key if key == "batch_size" or not isinstance(key, str) else prefix + key: value
                for key, value in output.items()}

    return step_of_a_set
