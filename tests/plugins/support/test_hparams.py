"""support.hparams: the optimizer settings a resume puts back over those given, and only those."""

from __future__ import annotations

import warnings

import pytest
import torch

from hookfit.plugins.support.hparams import replaced_settings, warn_replaced


def adam_group(**settings) -> dict:
    group = {"params": [0, 1], "lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0,
             "amsgrad": False, "foreach": None, "fused": None, "capturable": False, "differentiable": False}
    return {**group, **settings}


def test_each_changed_setting_comes_with_its_group_and_both_values() -> None:
    saved = [adam_group(lr=0.01), adam_group()]
    given = [adam_group(lr=0.001, weight_decay=0.1), adam_group(eps=1e-6)]
    assert replaced_settings(saved, given, scheduled=False) == [
        (0, "lr", 0.01, 0.001), (0, "weight_decay", 0, 0.1), (1, "eps", 1e-8, 1e-6)]


def test_the_same_settings_however_held_and_how_the_optimizer_runs_are_not_changes() -> None:
    saved = [adam_group(lr=torch.tensor(0.01), fused=True, foreach=False, params=[0, 1], param_names=["a", "b"])]
    given = [adam_group(lr=0.01, betas=[0.9, 0.999], params=["other", "tensors"], capturable=True, param_names=["c"])]
    assert replaced_settings(saved, given, scheduled=False) == []
    assert replaced_settings([adam_group(lr=torch.tensor(0.01))], [adam_group(lr=torch.tensor(0.02))],
                             scheduled=False) == [(0, "lr", pytest.approx(0.01), pytest.approx(0.02))]


def test_a_setting_only_one_side_has_is_left_out() -> None:
    saved = [adam_group(decoupled_weight_decay=False)]
    assert replaced_settings(saved, [adam_group()], scheduled=False) == []
    assert replaced_settings([adam_group()], [adam_group(maximize=True)], scheduled=False) == []


def test_with_a_scheduler_the_rate_it_started_from_is_compared_not_the_rate_it_moved() -> None:
    saved = [adam_group(lr=0.0005, initial_lr=0.001)]
    assert replaced_settings(saved, [adam_group(lr=0.001, initial_lr=0.001)], scheduled=True) == []
    assert replaced_settings(saved, [adam_group(lr=0.001, initial_lr=0.001)], scheduled=False) == []  # stepped by hand
    assert replaced_settings(saved, [adam_group(lr=0.01, initial_lr=0.01)], scheduled=True) == [
        (0, "initial_lr", 0.001, 0.01)]
    # ReduceLROnPlateau lowers lr and keeps no initial_lr
    assert replaced_settings([adam_group(lr=0.0005)], [adam_group(lr=0.001)], scheduled=True) == []
    assert replaced_settings([adam_group(lr=0.0005)], [adam_group(lr=0.001)], scheduled=False) == [
        (0, "lr", 0.0005, 0.001)]


def test_momentum_a_scheduler_cycles_is_left_out_and_its_bounds_are_compared() -> None:
    cycled = {"max_momentum": 0.95, "base_momentum": 0.85, "max_lr": 1.0, "initial_lr": 0.04}
    saved = [adam_group(lr=0.3, betas=(0.88, 0.999), **cycled)]
    assert replaced_settings(saved, [adam_group(lr=0.04, betas=(0.95, 0.999), **cycled)], scheduled=True) == []
    given = [adam_group(lr=0.08, betas=(0.95, 0.999), **{**cycled, "max_lr": 2.0, "initial_lr": 0.08})]
    assert replaced_settings(saved, given, scheduled=True) == [(0, "max_lr", 1.0, 2.0), (0, "initial_lr", 0.04, 0.08)]
    sgd = {"momentum": 0.9, "dampening": 0, "nesterov": False}
    assert replaced_settings([{**sgd, "momentum": 0.8, "max_momentum": 0.9, "base_momentum": 0.8}],
                             [{**sgd, "max_momentum": 0.9, "base_momentum": 0.8}], scheduled=True) == []
    assert replaced_settings([{**sgd, "momentum": 0.8}], [sgd], scheduled=True) == [(0, "momentum", 0.8, 0.9)]


def test_the_warning_names_the_optimizer_the_group_both_values_and_what_to_do() -> None:
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=0.001, weight_decay=0.1)
    saved = optimizer.state_dict()
    saved["param_groups"][0].update(lr=0.01, weight_decay=0)
    with pytest.warns(UserWarning) as caught:
        warn_replaced("optim", "g", optimizer, saved, scheduled=False, category=UserWarning)
    assert len(caught) == 1 and caught[0].filename == __file__
    message = str(caught[0].message)
    assert message.startswith("optim: optimizer 'g' (Adam) resumed with the settings of the checkpoint"), message
    assert ("parameter group 0: the checkpoint's lr=0.01 replaces lr=0.001 given, the checkpoint's "
            "weight_decay=0 replaces weight_decay=0.1 given") in message, message
    assert "Loop(run_dir=...) or Loop(name=...), or no resume" in message, message
    assert "resumed(loop, info) hook: loop.optimizers['g'].param_groups[0]['lr'] = 0.001" in message, message
    assert "A rate the training code sets itself" in message, message  # lr itself compared: it may be the code's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_replaced("optim", "g", optimizer, optimizer.state_dict(), scheduled=False, category=UserWarning)


def test_with_a_scheduler_the_warning_names_the_rate_it_started_from_and_its_saved_state() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.2)
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    saved = optimizer.state_dict()
    saved["param_groups"][0].update(lr=0.05, initial_lr=0.1)
    with pytest.warns(UserWarning) as caught:
        warn_replaced("optim", "default", optimizer, saved, scheduled=True, category=UserWarning)
    message = str(caught[0].message)
    assert "parameter group 0: the checkpoint's initial_lr=0.1 replaces initial_lr=0.2 given." in message, message
    assert "and its scheduler resumes from its own saved state" in message, message
    assert "loop.optimizers['default'].param_groups[0]['lr'] = 0.2" in message, message
    assert "A rate the training code sets itself" not in message, message
