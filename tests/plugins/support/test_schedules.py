"""torch's schedulers read without stepping them (``hookfit.plugins.support.schedules``); how optim warns with
it, in real runs: tests/plugins/optim/test_schedulers.py."""

from __future__ import annotations

import torch

from hookfit.plugins.support.schedules import passing

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
