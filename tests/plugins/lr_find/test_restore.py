"""lr_find puts back everything the sweep changed, beyond ``model=``: parameters only an
optimizer holds, and the optimizer plugin's non-finite policy after a sweep whose loss stopped
being finite. The training after the sweep is bitwise the run without it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hookfit
from hookfit.plugins.lr_find import LRFinder
from hookfit.plugins.optim import Optim


def train(finder: LRFinder | None, model: str, defer: bool = False) -> tuple[list[torch.Tensor], hookfit.State]:
    """Two epochs of SGD with momentum on a linear model and a free weight the optimizer steps,
    with ``model=`` the linear model (``"linear"``), a module without parameters (``"relu"``)
    or nothing (``"none"``), ``defer``: optim's device path of the non-finite check (on the
    CPU too); the final values of every stepped parameter, and the state."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 1)
    scale = torch.nn.Parameter(torch.randn(4))  # in no module: only the optimizer holds it
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)) for _ in range(4)]
    params = [*linear.parameters(), scale]
    optimizer = torch.optim.SGD(params, lr=1e-2, momentum=0.9)

    def step(loop: hookfit.Run, batch: Any) -> dict[str, Any]:
        x, y = batch
        loss = torch.nn.functional.mse_loss(linear(x * scale), y)
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    held = {"linear": linear, "relu": torch.nn.ReLU(), "none": None}[model]
    plugins: list[Any] = [Optim(defer=defer)] + ([finder] if finder is not None else [])
    loop = hookfit.Loop(step, data, model=held, optimizers=optimizer, max_epochs=2, plugins=plugins, run_dir="run",
                        disable=["checkpoint"])
    state = loop.fit()
    return [p.detach().clone() for p in params], state


@pytest.mark.parametrize("model", ["linear", "relu", "none"])
def test_parameters_only_the_optimizer_holds_are_put_back(model: str) -> None:
    plain, _ = train(None, model)
    finder = LRFinder(start_lr=1e-5, end_lr=1.0, num_steps=10, diverge=None)
    swept, state = train(finder, model)
    assert len(finder.rates) == 10 and state.status == "completed"
    assert all(torch.equal(a, b) for a, b in zip(plain, swept))


@pytest.mark.parametrize("model, defer", [("linear", False), ("none", False), ("linear", True)])
def test_a_sweep_whose_loss_turns_non_finite_leaves_no_skipped_step(model: str, defer: bool) -> None:
    plain, state = train(None, model, defer)
    finder = LRFinder(start_lr=1e3, end_lr=1e9, num_steps=10, diverge=None)  # SGD blows up to inf, then NaN
    with pytest.warns(hookfit.HookfitWarning):  # optim skips the sweep's last step, lr_find suggests nothing
        swept, swept_state = train(finder, model, defer)
    assert finder.diverged and len(finder.rates) < 10  # stopped at the first non-finite loss
    assert swept_state.results["skipped_steps"] == state.results["skipped_steps"] == 0
    assert swept_state.results["first_skip"] is state.results["first_skip"] is None
    assert all(torch.equal(a, b) for a, b in zip(plain, swept))


@pytest.mark.bad_input
def test_an_optimizer_it_could_not_put_back_is_refused_before_the_sweep() -> None:
    weight = torch.nn.Parameter(torch.zeros(2))

    class Bare:
        """Steps, with rates in param_groups, and has no state_dict to be put back with."""

        param_groups = [{"params": [weight], "lr": 0.1}]

        def step(self) -> None:
            with torch.no_grad():
                weight -= 0.1 * weight.grad

    def step(loop: hookfit.Run, batch: Any) -> torch.Tensor:
        loss = (weight * batch).sum() ** 2
        loss.backward()
        loop.optimizers.step()
        return loss

    with pytest.raises(TypeError, match=r"lr_find: the run's optimizer Bare has no state_dict, load_state_dict: the "
                                        r"sweep could not put it back"):
        hookfit.Loop(step, [torch.ones(2)] * 3, optimizers=Bare(), max_epochs=1, plugins=[LRFinder(num_steps=3)],
                     disable=["checkpoint"]).fit()
    assert torch.equal(weight, torch.zeros(2))  # refused before any sweep step
