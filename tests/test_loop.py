"""hookfit.loop: the configuration is checked when the Loop is made, a Loop runs once, and a
run never changes it."""

from __future__ import annotations

import pytest
import torch

import hookfit


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"max_epochs": 0}, ValueError, "max_epochs must be a positive integer, got 0"),
        ({"max_epochs": -2}, ValueError, "max_epochs must be a positive integer, got -2"),
        ({"max_steps": 0}, ValueError, "max_steps must be a positive integer"),
        ({"val_step": lambda l, b: None}, ValueError, "val_step .* without val_data"),
        ({"val_data": [1]}, ValueError, "val_data was given without a val_step"),
        ({"val_grad_mode": "off"}, ValueError, "val_grad_mode"),
        ({"model": "resnet"}, TypeError, "model must be a torch.nn.Module"),
    ],
)
@pytest.mark.bad_input
def test_bad_arguments_are_named(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        hookfit.Loop(lambda l, b: None, [1], **kwargs)


@pytest.mark.bad_input
def test_train_data_not_iterable() -> None:
    with pytest.raises(TypeError, match="train_data must be an iterable of batches.*got int"):
        hookfit.Loop(lambda l, b: None, 5)

def test_a_loop_runs_once() -> None:
    loop = hookfit.Loop(lambda loop, b: None, [1])
    loop.fit()
    with pytest.raises(RuntimeError, match="already run"):
        loop.fit()


def test_a_run_never_changes_the_loops_configuration() -> None:
    """What plugins replace for a run (the model wrapped, the data sharded, managed
    optimizers) is the run's own: the Loop keeps what the user gave it."""
    model, data = torch.nn.Linear(1, 1), [torch.ones(1)] * 4
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []

    class Replacer:
        name = "replacer"

        @hookfit.hookimpl(tryfirst=True)
        def configure(self, loop):
            loop.model = torch.nn.Sequential(loop.model)
            loop.train_data = loop.train_data[:2]

        @hookfit.hookimpl
        def fit_start(self, loop):
            loop.optimizers = {"wrapped": loop.optimizers}

    def step(loop, batch):
        seen.append((type(loop.model).__name__, type(loop.optimizers).__name__, loop is loop_.run))

    loop_ = hookfit.Loop(step, data, model=model, optimizers=opt, plugins=[Replacer()])
    state = loop_.fit()
    assert seen == [("Sequential", "dict", True)] * 2 and state.step == 2
    assert loop_.model is model and loop_.train_data is data and loop_.optimizers is opt
    run = loop_.run
    assert isinstance(run, hookfit.Run) and run.state is state is loop_.state
    assert run.pm is not None and [n for n, _ in run.pm.list_name_plugin()] == ["replacer"]
    assert "backward" not in vars(run)  # the bound backward went with the run's end

@pytest.mark.bad_input
def test_loop_request_stop_outside_a_run_is_an_error() -> None:
    loop = hookfit.Loop(lambda l, b: None, [1])
    with pytest.raises(RuntimeError, match="needs a running loop"):
        loop.request_stop("too early")
    loop.fit()
    with pytest.raises(RuntimeError, match="needs a running loop"):
        loop.request_stop("too late")
