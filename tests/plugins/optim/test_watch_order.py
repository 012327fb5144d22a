"""optim's watch of the order a step function calls backward, step and zero_grad in, in real runs: a forgotten
``zero_grad()`` (gradients piled up across batches) and ``step()`` written twice (the optimizer and its schedulers
stepped twice on the same gradients) each get one ``OptimWarning`` naming the optimizer and the step function; the
orders that are meant (either place of ``zero_grad``, accumulation windows, a window kept by hand, a GAN, a
discriminator trained k times a batch, SAM's two passes) get none."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch

import hookfit
from hookfit.plugins.optim import Optim, OptimWarning


def data(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def model(seed: int = 1) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def loss_of(m: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(m(x), y)


class Steps:
    """The real steps of each optimizer at each epoch's end (``steps``: the latest)."""

    name = "steps"

    def __init__(self) -> None:
        self.steps: dict[str, int] = {}

    @hookfit.hookimpl
    def epoch_end(self, loop) -> None:
        self.steps = {name: managed.steps for name, managed in loop.optimizers.items()}


def fit(step: Callable[..., Any], m: torch.nn.Module, optimizers: Any, n: int = 6, epochs: int = 1,
        **options: Any) -> tuple[list[Any], Any]:
    """The run's OptimWarnings and its optimizers' real steps, after fitting."""
    steps = Steps()
    loop = hookfit.Loop(step, data(n), model=m, optimizers=optimizers, max_epochs=epochs,
                        plugins=[Optim(**options), steps])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop.fit()
    assert loop.state.status == "completed"
    return [w for w in caught if issubclass(w.category, OptimWarning)], steps.steps


def order(said: list[Any]) -> list[str]:
    """The warnings of the step function's order among ``said``, told at the step function's line (this file)."""
    found = [w for w in said if "previous step, never cleared" in str(w.message) or "stepped twice" in str(w.message)]
    assert all(w.filename == __file__ for w in found), [(w.filename, w.lineno) for w in found]
    return [str(w.message) for w in found]


# -- a forgotten zero_grad() -----------------------------------------------------------------------------------------


@pytest.mark.bad_input
def test_a_forgotten_zero_grad_warns_once_naming_the_optimizer_the_step_function_and_the_fix() -> None:
    m = model()

    def train_step(loop, batch):
        loss = loss_of(m, batch)
        loop.backward(loss)
        loop.optimizers.step()  # and no zero_grad(): the gradients pile up
        return {"loss": loss}

    said, _ = fit(train_step, m, torch.optim.SGD(m.parameters(), lr=0.01), epochs=2)
    assert order(said) == [
        "optim: optimizer 'default' (SGD) stepped (epoch 1, batch 2) on gradients added onto those of its previous "
        "step, never cleared: step function 'test_a_forgotten_zero_grad_warns_once_naming_the_optimizer_the_step_"
        "function_and_the_fix.<locals>.train_step' calls no loop.optimizers.zero_grad(), so the gradients add up "
        "across batches. Call loop.optimizers.zero_grad() in 'test_a_forgotten_zero_grad_warns_once_naming_the_"
        "optimizer_the_step_function_and_the_fix.<locals>.train_step' after loop.optimizers.step() (or before "
        "loop.backward(loss))"]


@pytest.mark.bad_input
def test_a_forgotten_zero_grad_is_told_at_the_step_functions_line_under_accumulation_and_of_a_named_optimizer() -> None:
    m, n = model(), model(2)

    def train_step(loop, batch):
        loop.backward(loss_of(m, batch) + loss_of(n, batch))
        loop.optimizers["a"].step()
        loop.optimizers["a"].zero_grad()
        loop.optimizers["b"].step()  # "b" is never cleared

    said, _ = fit(train_step, torch.nn.ModuleList([m, n]), {"a": torch.optim.SGD(m.parameters(), lr=0.01),
                                                           "b": torch.optim.Adam(n.parameters(), lr=0.01)},
                  n=8, accumulate=2)
    found = order(said)
    assert len(found) == 1, found
    assert found[0].startswith("optim: optimizer 'b' (Adam) stepped (epoch 1, batch 4) on gradients"), found
    assert "Call loop.optimizers['b'].zero_grad() in" in found[0]


def test_the_orders_of_zero_grad_that_clear_accumulation_and_a_window_kept_by_hand_say_nothing() -> None:
    def step_of(m: torch.nn.Module, how: str, k: int = 3) -> Callable[..., Any]:
        def train_step(loop, batch):
            opt = loop.optimizers
            if how == "before":
                opt.zero_grad()
            elif how == "zeros":
                opt.zero_grad(set_to_none=False)
            elif how == "model":
                m.zero_grad()
            loop.backward(loss_of(m, batch))
            if how == "by hand" and (loop.state.batch_idx + 1) % k:
                return None  # the window kept by hand: step every k batches, zero after stepping
            opt.step()
            if how in ("after", "accumulate", "by hand"):
                opt.zero_grad()
        return train_step

    for how in ("before", "after", "zeros", "model", "accumulate", "by hand"):
        m = model()
        said, steps = fit(step_of(m, how), m, torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9), n=9, epochs=2,
                         **({"accumulate": 3} if how == "accumulate" else {}))
        assert [str(w.message) for w in said] == [], how
        assert steps == {"default": 18 if how not in ("accumulate", "by hand") else 6}, how


# -- step() written twice --------------------------------------------------------------------------------------------


@pytest.mark.bad_input
def test_step_written_twice_warns_once_naming_the_optimizer_and_the_step_function() -> None:
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1000)

    def train_step(loop, batch):
        loop.optimizers.zero_grad()
        loop.backward(loss_of(m, batch))
        loop.optimizers.step()
        loop.optimizers.step()  # twice: its scheduler steps twice a batch too

    said, steps = fit(train_step, m, opt, schedulers=scheduler)
    assert scheduler.last_epoch == 12  # (what the warning is about: 6 batches)
    assert order(said) == [
        "optim: optimizer 'default' (SGD) stepped twice (epoch 1, batch 1) with no backward pass between: step "
        "function 'test_step_written_twice_warns_once_naming_the_optimizer_and_the_step_function.<locals>."
        "train_step' calls loop.optimizers.step() twice on the same gradients, which steps its per-step schedulers "
        "twice too. Call loop.optimizers.step() once after each loop.backward(loss)"]


@pytest.mark.parametrize("to_none", [True, False])
def test_a_batch_with_no_backward_pass_whose_step_and_zero_grad_still_run_says_nothing(to_none: bool) -> None:
    """A conditional loss (a batch with no valid targets) skips loop.backward, but its step function steps and clears
    every batch: the step after a skipped pass takes none of the previous step's gradients (cleared), so it is no
    second step on them, whether zero_grad() leaves None or zeros."""
    m = model()
    seen: list[bool] = []  # whether each step had a gradient to take

    def train_step(loop, batch):
        if loop.state.step % 2 == 0:
            loop.backward(loss_of(m, batch))
        seen.append(any(p.grad is not None and bool(p.grad.any()) for p in m.parameters()))
        loop.optimizers.step()
        loop.optimizers.zero_grad(set_to_none=to_none)

    said, steps = fit(train_step, m, torch.optim.SGD(m.parameters(), lr=0.01))
    assert seen == [True, False] * 3  # (what the check is about: steps with no pass since the previous one)
    assert order(said) == [] and steps == {"default": 6}


def test_a_gan_a_discriminator_trained_k_times_and_sams_two_passes_say_nothing() -> None:
    g, d = torch.nn.Linear(4, 4), model(2)  # g: a generator of the inputs d tells from real ones

    def gan(loop, batch):
        x, y = batch
        opts = loop.optimizers
        for _ in range(3):  # the discriminator k times a batch, a backward pass before each step
            opts["d"].zero_grad()
            loop.backward(torch.nn.functional.mse_loss(d(x), y) + d(g(x).detach()).pow(2).mean())
            opts["d"].step()
        opts["g"].zero_grad()
        loop.backward((d(g(x)) - 1).pow(2).mean())  # into d's gradients too, cleared before its next step
        opts["g"].step()

    said, steps = fit(gan, torch.nn.ModuleList([g, d]), {"g": torch.optim.Adam(g.parameters(), lr=1e-3),
                                                        "d": torch.optim.Adam(d.parameters(), lr=1e-3)})
    assert order(said) == [] and steps == {"g": 6, "d": 18}

    m = model()

    def sam(loop, batch):  # two backward passes then one step (the second at the perturbed weights)
        opt = loop.optimizers
        opt.zero_grad()
        loop.backward(loss_of(m, batch))
        with torch.no_grad():
            shifts = [0.05 * p.grad / (p.grad.norm() + 1e-12) for p in m.parameters()]
            for p, e in zip(m.parameters(), shifts):
                p.add_(e)
        opt.zero_grad()
        loop.backward(loss_of(m, batch))
        with torch.no_grad():
            for p, e in zip(m.parameters(), shifts):
                p.sub_(e)
        opt.step()

    said, steps = fit(sam, m, torch.optim.SGD(m.parameters(), lr=0.01))
    assert order(said) == [] and steps == {"default": 6}


@pytest.mark.parametrize("to_none", [True, False])
def test_passes_that_reach_no_watched_parameter_count_as_passes(to_none: bool) -> None:
    """The watch hooks the parameters that require a gradient when the stage starts; a model unfrozen by the step
    function (a backbone's schedule) is back-propagated through parameters it did not hook: each step after its
    pass is one step a pass, and gradients it cleared to zeros are not taken for gradients left."""
    m = model()
    m.requires_grad_(False)

    def train_step(loop, batch):
        m.requires_grad_(True)
        loop.optimizers.zero_grad(set_to_none=to_none)
        loop.backward(loss_of(m, batch))
        loop.optimizers.step()

    said, steps = fit(train_step, m, torch.optim.SGD(m.parameters(), lr=0.01))
    assert order(said) == [] and steps == {"default": 6}
