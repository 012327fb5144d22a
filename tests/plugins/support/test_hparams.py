"""support.hparams: the optimizer settings a resume puts back over those given, and only those."""

from __future__ import annotations

import warnings

import pytest
import torch

from hookfit.plugins.support.hparams import replaced_settings, settings, warn_replaced


def adam_group(**given) -> dict:
    group = {"params": [0, 1], "lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0,
             "amsgrad": False, "foreach": None, "fused": None, "capturable": False, "differentiable": False}
    return {**group, **given}


def test_settings_keep_what_the_user_chose_as_plain_values_a_checkpoint_reads_back() -> None:
    kept = settings([adam_group(lr=torch.tensor(0.01), betas=[0.9, 0.99], param_names=["a"], custom=object())])
    assert kept == [{"lr": pytest.approx(0.01), "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0, "amsgrad": False}]
    assert all(type(v) in (float, int, bool, tuple) for v in kept[0].values())


def test_each_changed_setting_comes_with_its_group_and_both_values() -> None:
    saved = settings([adam_group(lr=0.01), adam_group()])
    given = settings([adam_group(lr=0.001, weight_decay=0.1), adam_group(eps=1e-6)])
    assert replaced_settings(saved, given) == [
        (0, "lr", 0.01, 0.001), (0, "weight_decay", 0, 0.1), (1, "eps", 1e-8, 1e-6)]


def test_the_same_settings_however_held_and_how_the_optimizer_runs_are_not_changes() -> None:
    saved = settings([adam_group(lr=torch.tensor(0.01), fused=True, foreach=False, params=[0, 1])])
    given = settings([adam_group(lr=0.01, betas=[0.9, 0.999], params=["other"], fused=None, foreach=True)])
    assert replaced_settings(saved, given) == []
    assert replaced_settings(settings([adam_group(lr=torch.tensor(0.01))]),
                             settings([adam_group(lr=torch.tensor(0.02))])) == [
        (0, "lr", pytest.approx(0.01), pytest.approx(0.02))]


def test_a_setting_only_one_side_has_is_left_out() -> None:
    assert replaced_settings(settings([adam_group(decoupled_weight_decay=False)]), settings([adam_group()])) == []
    assert replaced_settings(settings([adam_group()]), settings([adam_group(maximize=True)])) == []


def test_what_training_moves_is_never_compared_only_what_each_run_was_given() -> None:
    """Both sides are the settings as built: a scheduler, OneCycleLR's cycled momentum or the training code's
    own schedule (nanoGPT sets lr every step) move the groups after that, in both runs alike."""
    first = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    built = settings(first.param_groups)
    torch.optim.lr_scheduler.OneCycleLR(first, max_lr=0.5, total_steps=10).step()
    first.param_groups[0]["lr"] = 0.123  # the training code's own rate
    again = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    assert replaced_settings(built, settings(again.param_groups)) == []
    assert replaced_settings(built, settings(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1,
                                                             momentum=0.8).param_groups)) == [
        (0, "momentum", 0.9, 0.8)]


def test_the_warning_names_the_optimizer_the_group_both_values_and_what_to_do() -> None:
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=0.001, weight_decay=0.1)
    saved = settings([adam_group(lr=0.01, weight_decay=0)])
    with pytest.warns(UserWarning) as caught:
        warn_replaced("optim", "g", optimizer, settings(optimizer.param_groups), saved, UserWarning)
    assert len(caught) == 1 and caught[0].filename == __file__
    message = str(caught[0].message)
    assert message.startswith("optim: optimizer 'g' (Adam) resumed with the settings of the checkpoint"), message
    assert ("parameter group 0: the checkpoint's lr=0.01 replaces lr=0.001 given, the checkpoint's "
            "weight_decay=0 replaces weight_decay=0.1 given") in message, message
    assert "Loop(run_dir=...) or Loop(name=...), or no resume" in message, message
    assert "resumed(loop, info) hook: loop.optimizers['g'].param_groups[0]['lr'] = 0.001" in message, message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        built = settings(optimizer.param_groups)
        warn_replaced("optim", "g", optimizer, built, built, UserWarning)
        warn_replaced("optim", "g", optimizer, built, None, UserWarning)  # a checkpoint that does not say


@pytest.mark.bad_input
def test_with_a_scheduler_the_warning_names_the_rates_given_and_that_the_schedule_must_change_too() -> None:
    """A warmup scheduler moves lr as it is built: the warning named those moved rates (0.0015 for 0.003 given)
    and advised setting the group's lr, which the restored scheduler overwrote at its next step."""
    def built(lr: float) -> list:
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
        return optimizer, settings(optimizer.param_groups)

    optimizer, given = built(0.001)
    with pytest.warns(UserWarning) as caught:
        warn_replaced("optim", "g", optimizer, given, built(0.003)[1], UserWarning)
    message = str(caught[0].message)
    assert "parameter group 0: the checkpoint's lr=0.003 replaces lr=0.001 given." in message, message
    assert "0.0015" not in message and "initial_lr" not in message, message
    assert "with a scheduler, whose saved state sets the rate at its next step, change the schedule as well" in message
