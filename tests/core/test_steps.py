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
