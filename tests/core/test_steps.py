"""hookfit.steps: a step function that cannot be called as step(loop, batch) is refused when the
Loop is made, naming it, not at the first batch."""

from __future__ import annotations

import pytest
import torch

import hookfit


@pytest.mark.bad_input
@pytest.mark.parametrize("step, match", [
    (lambda batch: None, r"train_step '<lambda>' is called as step\(loop, batch\), and its signature \(batch\) "),
    (lambda loop, batch, extra: None, r"its signature \(loop, batch, extra\) does not take those two arguments"),
    (type("Scorer", (), {"__call__": lambda self, batch: None})(), r"train_step '<.*Scorer object at .*>' is called as "
                                                                   r"step\(loop, batch\), and its signature \(batch\)"),
    (type("LitModel", (), {"training_step": lambda self, batch, batch_idx: None})().training_step,
     r"signature \(batch, batch_idx\) takes \(batch, batch_idx\), as a LightningModule's does: write \(loop, batch\) "
     r"and read the batch's index as loop.state.batch_idx"),
    (lambda batch, loop: None, r"train_step '<lambda>' is called as step\(loop, batch\), and its signature \(batch, "
                               r"loop\) names them the other way round: write \(loop, batch\)"),
])
def test_a_step_function_that_cannot_take_loop_and_batch_is_refused_when_the_loop_is_made(step, match) -> None:
    """``def step(batch)`` fails at Loop(), naming the step and its signature, not at the first
    batch with Python's bare "takes 1 positional argument but 2 were given"; steps that do take
    two positional arguments (defaults, ``*args``, a bound method, a partial) are accepted."""
    with pytest.raises(TypeError, match=match):
        hookfit.Loop(step, [1])
    with pytest.raises(TypeError, match=match.replace("train_step", "val_step")):
        hookfit.Loop(lambda loop, b: None, [1], val_step=step, val_data=[1])
    import functools

    class Task:
        def step(self, loop, batch):
            return None

    def supplying(function):  # a decorator that gives the step an argument of its own (as mock.patch does)
        @functools.wraps(function)
        def wrapper(loop, batch):
            return function(loop, batch, "config")
        return wrapper

    @supplying
    def configured(loop, batch, config):
        return None

    for fine in (lambda loop, batch, extra=1: None, lambda *args: None, Task().step,
                 functools.partial(lambda scale, loop, batch: None, 2.0), print, configured):
        hookfit.Loop(fine, [1])


@pytest.mark.bad_input
def test_what_is_not_a_step_function_is_named_briefly() -> None:
    """A dataset given where the step goes (the arguments swapped) is named by its type and
    the start of its repr, not by a repr of every tensor in it."""
    data = [(torch.randn(64, 8), torch.randn(64, 1)) for _ in range(8)]
    with pytest.raises(TypeError) as caught:
        hookfit.Loop(data, lambda loop, batch: None)
    assert str(caught.value).startswith("train_step must be a function step(loop, batch), got list [(tensor(")
    assert len(str(caught.value)) < 200, len(str(caught.value))


class LitModel(torch.nn.Module):
    """A model whose step Lightning's habit would put in it: its ``forward`` takes the input alone."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def forward(self, x):
        return self.layer(x)


@pytest.mark.bad_input
@pytest.mark.parametrize("given, kind, where", [
    ("model", "the model LitModel", ", model=model"),
    ("optimizer", "an optimizer SGD", ", model=model, optimizers=optimizer"),
    ("loader", "the data DataLoader", ""),
    ("dataset", "the data TensorDataset", ""),
])
def test_a_model_the_data_or_an_optimizer_given_as_the_step_is_refused_saying_where_it_goes(given, kind, where) -> None:
    """Lightning's ``trainer.fit(model, data)`` ported as ``Loop(model, data)``: a module is callable with any
    arguments, so it failed only at the first batch with "forward() takes 2 positional arguments but 3 were
    given"; it fails at Loop() (and at predict()), naming the argument and where the model goes."""
    model = LitModel()
    dataset = torch.utils.data.TensorDataset(torch.ones(4, 2))
    value = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
             "loader": torch.utils.data.DataLoader(dataset), "dataset": dataset}[given]
    for what, fix, make in [
        ("train_step", f"Loop(train_step, train_data{where})", lambda: hookfit.Loop(value, [torch.ones(2)], model=model)),
        ("val_step", f"Loop(..., val_step=val_step, val_data=val_data{where})",
         lambda: hookfit.Loop(lambda loop, b: None, [1], val_step=value, val_data=[1], model=model)),
        ("predict()'s step", f"Loop(...{where}).predict(data, step)",
         lambda: hookfit.Loop(lambda loop, b: None, [1], model=model).predict([1], value)),
    ]:
        with pytest.raises(TypeError) as caught:
            make()
        assert str(caught.value) == f"{what} must be a function step(loop, batch), got {kind}, which goes in {fix}"


def test_a_model_whose_forward_takes_the_loop_and_the_batch_is_a_step_and_named_on_one_line() -> None:
    """A module written as the step (``forward(self, loop, batch)``) is accepted; an error it raises is
    noted with the module's repr on one line, cut short, not its lines with literal ``\\n`` in them."""

    class Stepper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(4)])

        def forward(self, loop, batch):
            raise RuntimeError("refused by the step")

    stepper = Stepper()
    with pytest.raises(RuntimeError, match="refused by the step") as caught:
        hookfit.Loop(stepper, [torch.ones(2)], model=stepper, plugins=[], disable=["checkpoint"]).fit()
    note = next(n for n in caught.value.__notes__ if "raised in step function" in n)
    assert "\n" not in note and "\\n" not in note and "'Stepper( (layers): Sequential( (0): Linear(" in note, note
    assert len(note) < 160, note


class Stepper(torch.nn.Module):
    """A module written as the step, its ``forward`` taking the run under a name of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.batches = 0

    def forward(self, run, batch):
        self.batches += 1
        return self.layer(batch).sum()


class DecoratedStepper(Stepper):
    """The same step, its ``forward`` under a decorator (``functools.wraps``: the wrapper takes ``*args, **kwargs``)."""

    @torch.compiler.disable
    def forward(self, loop, batch):
        return super().forward(loop, batch)


class DecoratedModel(LitModel):
    """A model whose ``forward(x)`` is under a decorator: still a model, not a step."""

    @torch.compiler.disable
    def forward(self, x):
        return super().forward(x)


@pytest.mark.parametrize("stepper", [Stepper, DecoratedStepper])
def test_a_module_is_a_step_by_its_forwards_signature_not_its_parameters_names(stepper) -> None:
    """A module is a step when its ``forward`` takes two positional arguments, as any step function: under
    whatever names (``forward(self, run, batch)``) and under a decorator, whose signature points at it."""
    step = stepper()
    state = hookfit.Loop(step, [torch.ones(2)] * 3, model=step, max_epochs=1, plugins=[]).fit()
    assert state.status == "completed" and step.batches == 3, (state.status, step.batches)


@pytest.mark.bad_input
@pytest.mark.parametrize("model, kind", [
    (DecoratedModel, "the model DecoratedModel"),
    (lambda: torch.nn.ModuleList([torch.nn.Linear(2, 1)]), "the model ModuleList"),
])
def test_a_module_whose_forward_takes_no_loop_and_batch_is_refused_as_the_model(model, kind) -> None:
    """A model whose ``forward(x)`` is under a decorator (whose own ``*args, **kwargs`` would take anything),
    and a module without a ``forward`` of its own, are models given as the step: refused, saying where they go."""
    with pytest.raises(TypeError) as caught:
        hookfit.Loop(model(), [torch.ones(2)])
    assert str(caught.value) == (f"train_step must be a function step(loop, batch), got {kind}, which goes in "
                                 f"Loop(train_step, train_data, model=model)")
