"""torch's schedulers read without stepping them (``hookfit.plugins.support.schedules``); how optim warns with
it, in real runs: tests/plugins/optim/test_schedulers.py."""

from __future__ import annotations

import pytest
import torch

from hookfit.plugins.support.schedules import (MULTIPLIED_STEPS, held, horizons, lambda_end, multiplied, optimizer_steps,
                                               passing)

lr_scheduler = torch.optim.lr_scheduler


def optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)


def test_passing_names_the_scheduler_whose_schedule_the_steps_pass_a_sequential_one_from_its_milestone() -> None:
    cosine = lr_scheduler.CosineAnnealingLR(optimizer(), T_max=5)
    assert passing(cosine, 6) is cosine and passing(cosine, 5) is None
    opt = optimizer()
    decay = lr_scheduler.ExponentialLR(opt, gamma=0.3)  # below a thousandth after 6 steps (0.3 ** 6), not 5
    sequential = lr_scheduler.SequentialLR(opt, [lr_scheduler.LinearLR(opt, 0.5, total_iters=2), decay], [2])
    assert passing(sequential, 8) is decay and passing(sequential, 7) is None
    assert passing(lr_scheduler.OneCycleLR(optimizer(), max_lr=0.1, total_steps=3), 10) is None  # not judged


def test_horizons_are_each_schedule_s_length_a_chain_s_from_the_step_each_starts_at() -> None:
    opt = optimizer()
    chained = lr_scheduler.ChainedScheduler([lr_scheduler.CosineAnnealingLR(opt, T_max=5),
                                             lr_scheduler.ConstantLR(opt, 0.5, total_iters=3)])
    sequential = lr_scheduler.SequentialLR(opt, [lr_scheduler.LinearLR(opt, 0.1, total_iters=2), chained], [2])
    assert list(horizons(sequential)) == [
        ("SequentialLR's LinearLR", "total_iters", 2, 0),
        ("SequentialLR's ChainedScheduler's CosineAnnealingLR", "T_max", 5, 2),
        ("SequentialLR's ChainedScheduler's ConstantLR", "total_iters", 3, 2)]
    assert list(horizons(lr_scheduler.OneCycleLR(optimizer(), max_lr=0.1, total_steps=7))) == [
        ("OneCycleLR", "total_steps", 7, 0)]
    assert list(horizons(lr_scheduler.StepLR(optimizer(), 3))) == []  # no length: it decays for ever


def test_optimizer_steps_count_each_epoch_s_partial_window_and_not_one_the_run_s_end_cuts() -> None:
    assert optimizer_steps(30, 10, 4) == 9  # windows of 4, 4 and 2 in each of 3 epochs
    assert optimizer_steps(26, 10, 4) == 7  # then 6 batches of a third: one whole window
    assert optimizer_steps(9, 9, 4) == 3 and optimizer_steps(8, 9, 4) == 2
    assert optimizer_steps(20, None, 4) == 5 and optimizer_steps(30, 10, 1) == 30


def test_lambda_end_is_the_factor_a_lambda_reaches_at_the_steps_and_not_before_and_not_lower_after() -> None:
    def linear(total: int):
        return lambda s: (s + 1) / 4 if s < 4 else max(0.0, (total - s) / (total - 4))
    opt = optimizer()
    assert lambda_end(lr_scheduler.LambdaLR(opt, linear(40)), 40, 10) == 0.0
    assert lambda_end(lr_scheduler.LambdaLR(opt, linear(10)), 40, 10) is None  # ended at the 10 steps taken
    assert lambda_end(lr_scheduler.LambdaLR(opt, linear(40)), 40, 39) == 0.0
    two = torch.optim.SGD([{"params": [torch.zeros(1)]}, {"params": [torch.zeros(1)]}], lr=0.1)
    assert lambda_end(lr_scheduler.LambdaLR(two, [lambda s: 1.0, linear(40)]), 40, 10) == 0.0  # either group's
    for f in [lambda s: 1.0, lambda s: min(1.0, (s + 1) / 4), lambda s: 0.9 ** s, lambda s: [1.0][s],
              lambda s: float("nan") if s > 40 else max(0.0, 1 - s / 40)]:
        assert lambda_end(lr_scheduler.LambdaLR(opt, f), 40, 10) is None



def test_lambda_end_of_a_multiplicative_lambda_is_the_product_of_its_factors_judged_as_a_lambda_is() -> None:
    """A MultiplicativeLR multiplies the rate by its lambda at each step: the product over the steps up to a step is
    its schedule's factor there, judged as a LambdaLR's lambda."""
    opt = optimizer()

    def multiplicative(f):
        return lr_scheduler.MultiplicativeLR(opt, f)

    assert lambda_end(multiplicative(lambda s: 0.0 if s >= 40 else 1.0), 40, 10) == 0.0  # no rate from step 40
    assert lambda_end(multiplicative(lambda s: 0.01 ** (1 / 40) if s <= 40 else 1.0), 40, 10) == pytest.approx(0.01)
    assert lambda_end(multiplicative(lambda s: (40 - s) / (41 - s) if s <= 40 else 1.0), 40, 10) == 0.0  # linear
    for f in [lambda s: 1.0, lambda s: 0.95, lambda s: 0.01 ** (1 / 10) if s <= 10 else 1.0,  # ended at the taken
              lambda s: 0.9 if s <= 40 else 0.99, lambda s: torch.tensor(0.9), lambda s: 1 / 0 if s > 40 else 0.9]:
        assert lambda_end(multiplicative(f), 40, 10) is None
    assert multiplied(lambda s: 0.5, [0, 1, 3]) == {0: 1.0, 1: 0.5, 3: 0.125}
    calls = []
    assert multiplied(lambda s: calls.append(s) or 2.0, [2, 1]) == {1: 2.0, 2: 4.0} and calls == [1, 2]  # in order


def test_a_multiplicative_lambda_of_a_long_schedule_is_not_walked_over_each_of_its_steps() -> None:
    """Judging a MultiplicativeLR's lambda calls it at each step up to twice the schedule's length: past
    MULTIPLIED_STEPS steps it is not judged, and the run's start stays cheap (a million steps took about a second)."""
    calls = []
    opt = optimizer()

    def linear(steps):
        return lambda s: calls.append(s) or ((steps - s) / (steps + 1 - s) if s <= steps else 1.0)

    assert lambda_end(lr_scheduler.MultiplicativeLR(opt, linear(MULTIPLIED_STEPS)), MULTIPLIED_STEPS, 10) == 0.0
    assert len(calls) == 2 * MULTIPLIED_STEPS  # each step from 1 to 2 * steps, once
    calls.clear()
    assert lambda_end(lr_scheduler.MultiplicativeLR(opt, linear(10**6)), 10**6, 10) is None
    assert calls == []


def test_held_names_a_chain_s_schedulers_with_the_step_each_starts_at() -> None:
    opt = optimizer()
    inner = lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    sequential = lr_scheduler.SequentialLR(opt, [lr_scheduler.LinearLR(opt, 0.1, total_iters=2), inner], [2])
    assert [(n, s is inner, b) for n, s, b in held(sequential)] == [
        ("SequentialLR", False, 0), ("SequentialLR's LinearLR", False, 0), ("SequentialLR's LambdaLR", True, 2)]
