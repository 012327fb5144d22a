"""Stochastic weight averaging: an equal-weight average of the model's weights after each training
stage, validated with. It changes the model for the validation stage as ``core/hooks.md`` says
(the stated orders, "Changing the model for a stage"): in after the ``yield`` of a wrapper
``stage_start``, back before the ``yield`` of wrapper ``stage_end`` and ``fit_end``, and in
``exception``; so it nests with the built-in ``ema`` whatever the order of their names."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch
from torch.optim.swa_utils import AveragedModel

import hookfit


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class AvgSwap:
    """The average is ``self.average`` (an ``AveragedModel`` of ``loop.model``, buffers averaged too)."""

    def __init__(self) -> None:
        self.average: AveragedModel | None = None
        self._kept: dict[str, torch.Tensor] | None = None

    @hookfit.hookimpl
    def fit_start(self, loop: Any) -> None:
        self.average = AveragedModel(loop.model, use_buffers=True)

    @hookfit.hookimpl(wrapper=True)
    def stage_start(self, loop: Any, stage: str) -> Generator[None, object, object]:
        result = yield
        if stage == "valid" and self.average is not None and int(self.average.n_averaged) > 0:
            with torch.inference_mode(False), torch.no_grad():
                self._kept = _weights(loop.model)
                loop.model.load_state_dict(self.average.module.state_dict())
        return result

    @hookfit.hookimpl(wrapper=True)
    def stage_end(self, loop: Any, stage: str) -> Generator[None, object, object]:
        if stage == "valid":
            self._restore(loop)
        elif stage == "train" and self.average is not None:
            self.average.update_parameters(loop.model)
        return (yield)

    @hookfit.hookimpl(wrapper=True)
    def fit_end(self, loop: Any) -> Generator[None, object, object]:
        self._restore(loop)
        return (yield)

    @hookfit.hookimpl
    def exception(self, loop: Any) -> None:
        self._restore(loop)

    def _restore(self, loop: Any) -> None:
        kept, self._kept = self._kept, None
        if kept is not None:
            with torch.inference_mode(False), torch.no_grad():
                loop.model.load_state_dict(kept)

    @hookfit.hookimpl
    def save_state(self, loop: Any) -> dict[str, torch.Tensor] | None:
        return None if self.average is None else _weights(self.average)

    @hookfit.hookimpl
    def load_state(self, loop: Any, state: dict[str, torch.Tensor]) -> None:
        if self.average is None or not isinstance(state, dict) or "n_averaged" not in state:
            raise ValueError(f"avg_swap: the saved state is not this plugin's average: {type(state).__name__}")
        self.average.load_state_dict(state)
