"""optim's watch for ``loss.backward()`` called instead of ``loop.backward(loss)``: a warning
naming the step function where the run still trains the same model, an error before the first
optimizer step where it would not (accumulation, loss scaling, several processes), nothing for
a correct script, and no hook left after the first training stage."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import hookfit
from hookfit.plugins.optim import Optim, OptimWarning


def data(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def hooks_left(m: torch.nn.Module) -> int:
    """The gradient hooks on the parameters, of either kind (GradientWatch's)."""
    return sum(len(p._backward_hooks or {}) + len(p._post_accumulate_grad_hooks or {}) for p in m.parameters())


class Probe:
    """Records, at each training batch's end, the gradient hooks on the parameters and whether
    optim registered a plugin of its own (it never does)."""

    name = "probe"

    def __init__(self, m: torch.nn.Module) -> None:
        self.m, self.seen = m, []

    @hookfit.hookimpl
    def batch_end(self, loop) -> None:
        if loop.training:
            self.seen.append((loop.state.epoch, hooks_left(self.m), helpers(loop)))


def helpers(loop) -> bool:
    """Whether a plugin optim registered for itself is in the run (``optim.<part>``)."""
    return any(name.startswith("optim.") for name, _ in loop.pm.list_name_plugin())


def direct_step(m):
    def train_step(loop, batch):
        x, y = batch
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()  # instead of loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return loss
    return train_step


@pytest.mark.bad_input
def test_loss_backward_warns_once_naming_the_step_function_and_loop_backward() -> None:
    m = model()
    probe = Probe(m)
    with pytest.warns(OptimWarning) as caught:
        hookfit.Loop(direct_step(m), data(3), model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
                     max_epochs=2, plugins=[Optim(), probe]).fit()
    found = [w for w in caught if "loop.backward" in str(w.message)]
    assert len(found) == 1, [str(w.message) for w in caught]
    message = str(found[0].message)
    assert "outside loop.backward (epoch 1, batch 1)" in message
    assert "step function 'direct_step.<locals>.train_step' calls loss.backward() itself" in message
    assert "Call loop.backward(loss) in 'direct_step.<locals>.train_step' instead" in message
    assert found[0].filename == __file__  # the step function's line
    # watched during the first training stage only: then no hook and no wrapper are left
    assert probe.seen == [(0, 4, False)] * 3 + [(1, 0, False)] * 3


@pytest.mark.bad_input
@pytest.mark.parametrize("kwargs, why", [
    ({"accumulate": 4}, r"accumulate=4 \(each loss must be divided by the window\)"),
    ({"precision": "16-mixed"}, r"loss scaling \(precision='16-mixed'"),
])
def test_loss_backward_with_accumulation_or_scaling_fails_before_the_first_optimizer_step(kwargs, why) -> None:
    m = model()
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(RuntimeError, match=r"step function 'direct_step.<locals>.train_step' calls "
                                           r"loss.backward\(\) itself, which bypasses optim's handling of "
                                           + why + r".*Call loop.backward\(loss\)"):
        hookfit.Loop(direct_step(m), data(8), model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
                     plugins=[Optim(**kwargs)]).fit()
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))  # no optimizer step
    assert hooks_left(m) == 0


@pytest.mark.bad_input
def test_loss_backward_on_several_processes_fails() -> None:
    class TwoProcesses:  # what a distributed plugin tells the run
        name = "two"

        @hookfit.hookimpl
        def fit_start(self, loop) -> None:
            loop.state.world_size = 2

    m = model()
    with pytest.raises(RuntimeError, match="bypasses optim's handling of 2 processes"):
        hookfit.Loop(direct_step(m), data(2), model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
                     plugins=[Optim(), TwoProcesses()]).fit()


@pytest.mark.parametrize("kwargs", [{}, {"accumulate": 3}, {"precision": "16-mixed"}, {"clip_norm": 1.0}])
def test_a_correct_script_never_hears_of_it(kwargs) -> None:
    m = model()
    probe = Probe(m)

    def train_step(loop, batch):
        x, y = batch
        loss = torch.nn.functional.mse_loss(m(x), y)
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return loss

    with warnings.catch_warnings():
        warnings.simplefilter("error", OptimWarning)
        hookfit.Loop(train_step, data(3), model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
                     max_epochs=2, plugins=[Optim(**kwargs), probe]).fit()
    assert probe.seen[-1] == (1, 0, False) and hooks_left(m) == 0


def test_a_backward_implementation_taking_over_is_loop_backward_too() -> None:
    """A plugin that implements ``backward`` first (tryfirst) is what ``loop.backward`` runs:
    its gradients are not a bypass."""
    class OwnBackward:
        name = "own_backward"

        @hookfit.hookimpl(tryfirst=True)
        def backward(self, loop, loss):
            (loss * 0.5).backward()
            return True

    m = model()

    def train_step(loop, batch):
        x, y = batch
        loop.backward(torch.nn.functional.mse_loss(m(x), y))
        loop.optimizers.step()
        loop.optimizers.zero_grad()

    with warnings.catch_warnings():
        warnings.simplefilter("error", OptimWarning)
        hookfit.Loop(train_step, data(2), model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
                     plugins=[Optim(accumulate=2), OwnBackward()]).fit()


TORCHRUN_SCRIPT = '''
import torch, hookfit

torch.manual_seed(1)
model = torch.nn.Linear(4, 1)
data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(8)]

def train_step(loop, batch):
    x, y = batch
    loss = torch.nn.functional.mse_loss(loop.model(x), y)
    loss.backward()  # instead of loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()

hookfit.Loop(train_step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1)).fit()
'''


@pytest.mark.bad_input
@pytest.mark.slow
def test_loss_backward_under_torchrun_fails(tmp_path) -> None:
    """Two real processes (torchrun, gloo): the error names the processes and loop.backward."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    launcher = Path(sys.executable).with_name("torchrun")
    command = [str(launcher)] if launcher.exists() else [sys.executable, "-m", "torch.distributed.run"]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HOOKFIT_DISABLE_PLUGINS")}
    env.update(OMP_NUM_THREADS="1", HOOKFIT_PLUGINS="optim,distributed")
    done = subprocess.run([*command, "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                           "localhost:0", "--tee", "3", str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode != 0
    output = done.stdout + done.stderr
    # the first process to fail ends the job (torchrun stops the other): its error is the one
    error = re.compile(r"\[default\d\]:(\[rank\d\]: )?RuntimeError: optim:")
    lines = [text for text in output.splitlines() if error.match(text)]
    assert lines and "bypasses optim's handling of 2 processes" in lines[0], output[-3000:]
    assert "Call loop.backward(loss) in 'train_step' instead" in lines[0]


def test_the_watch_ends_after_a_few_passes_through_loop_backward() -> None:
    """The watch for loss.backward() costs about 2 µs a pass: it ends after WATCHED_PASSES
    passes through loop.backward, before the end of a long first epoch, and the watch for
    steps that bypass loop.optimizers (a step pre-hook on each optimizer) ends with it: the
    rest of the epoch pays nothing for it, and optim registers no plugin of its own for it."""
    import hookfit
    from hookfit.plugins.optim import Optim
    from hookfit.plugins.optim.watch import WATCHED_PASSES

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []

    def step(loop, batch):
        loss = model(batch).sum()
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        seen.append((hooks_left(model), helpers(loop), len(opt._optimizer_step_pre_hooks)))
        return {"loss": loss}

    optim = Optim()
    hookfit.Loop(step, [torch.ones(1, 2)] * (WATCHED_PASSES + 4), model=model,
                 optimizers=opt, plugins=[optim]).fit()
    assert seen[0] == (2, False, 1) and seen[WATCHED_PASSES - 2] == (2, False, 1)  # watched at first
    assert seen[WATCHED_PASSES - 1:] == [(0, False, 0)] * 5  # then nothing is left
    # not even torch's own hook around the emptied dictionaries, which every backward pass
    # would still walk, for each parameter (GradientWatch's test shows they are no longer read)
    assert all(p._backward_hooks is None and p._post_accumulate_grad_hooks is None for p in model.parameters())


@pytest.mark.bad_input
def test_a_step_function_that_never_steps_the_optimizers_is_told_the_model_does_not_train() -> None:
    """``loop.backward(loss)`` without ``loop.optimizers.step()``: optim steps when asked, so the
    parameters never change; the first training epoch's end says so, once a run."""
    m = model()
    before = [p.detach().clone() for p in m.parameters()]

    def train_step(loop, batch):
        x, y = batch
        loop.backward(torch.nn.functional.mse_loss(m(x), y))

    with pytest.warns(OptimWarning) as caught:
        hookfit.Loop(train_step, data(20), model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
                     max_epochs=2, plugins=[Optim()]).fit()
    said = [str(w.message) for w in caught if "no optimizer stepped" in str(w.message)]
    assert said == ["optim: step function 'test_a_step_function_that_never_steps_the_optimizers_is_told_the_model_"
                    "does_not_train.<locals>.train_step' called loop.backward(loss) in the first training epoch and "
                    "no optimizer stepped in all of it: the parameters do not change. optim steps when the step "
                    "function asks: call loop.optimizers.step() and loop.optimizers.zero_grad() after "
                    "loop.backward(loss)"]
    assert [w.filename for w in caught if "no optimizer stepped" in str(w.message)] == [__file__]  # the fit() line
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


@pytest.mark.bad_input
def test_a_step_that_only_returns_its_loss_is_told_the_model_does_not_train() -> None:
    """A LightningModule's habit: the step returns the loss and expects the framework to step. optim
    steps when asked; the first training epoch's end says the parameters do not change."""
    m = model()
    before = [p.detach().clone() for p in m.parameters()]

    def train_step(loop, batch):
        return torch.nn.functional.mse_loss(m(batch[0]), batch[1])

    with pytest.warns(OptimWarning) as caught:
        hookfit.Loop(train_step, data(4), model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
                     max_epochs=2, plugins=[Optim()]).fit()
    said = [str(w.message) for w in caught if "no optimizer stepped" in str(w.message)]
    assert len(said) == 1 and "'test_a_step_that_only_returns_its_loss_is_told_the_model_does_not_train.<locals>." \
        "train_step' made no loop.backward(loss) (a loss returned is reported) in the first training epoch and no " \
        "optimizer stepped in all of it: the parameters do not change" in said[0], said
    assert [w.filename for w in caught if "no optimizer stepped" in str(w.message)] == [__file__]  # the fit() line
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


@pytest.mark.bad_input
def test_a_step_that_calls_loss_backward_itself_and_never_steps_is_told_the_model_does_not_train() -> None:
    """Lightning's automatic optimization carried over: ``loss.backward()`` and no step. Beside the warning that
    the pass bypasses optim, the first training epoch's end says the parameters do not change, once a run."""
    m = model()
    before = [p.detach().clone() for p in m.parameters()]

    def train_step(loop, batch):
        loss = torch.nn.functional.mse_loss(m(batch[0]), batch[1])
        loss.backward()
        return loss

    with pytest.warns(OptimWarning) as caught:
        hookfit.Loop(train_step, data(4), model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
                     max_epochs=2, plugins=[Optim()]).fit()
    said = [str(w.message) for w in caught if "no optimizer stepped" in str(w.message)]
    assert len(said) == 1 and "train_step' called loss.backward() itself in the first training epoch and no " \
        "optimizer stepped in all of it: the parameters do not change" in said[0], said
    assert any("calls loss.backward() itself, which bypasses optim's" in str(w.message) for w in caught)
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


def test_a_run_without_optimizers_is_told_to_give_one_only_when_it_makes_backward_passes() -> None:
    """No ``Loop(optimizers=...)``: a step that trains by other means (an update under ``no_grad``, k-means)
    was told that no optimizer stepped and to call ``loop.optimizers.step()``; it hears nothing now. One that
    calls ``loop.backward(loss)`` is told to give the run an optimizer."""
    m = model()

    def by_hand(loop, batch):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.1)
        return {"loss": sum(p.sum() for p in m.parameters())}

    def backward_only(loop, batch):
        loop.backward(torch.nn.functional.mse_loss(m(batch[0]), batch[1]))

    said = []
    for step in (by_hand, backward_only):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hookfit.Loop(step, data(4), model=m, max_epochs=2, plugins=[Optim()]).fit()
        said.append([str(w.message).split(": the parameters do not change. ")[-1] for w in caught
                     if "no optimizer stepped" in str(w.message)])
    assert said == [[], ["The run has no optimizer: give Loop(optimizers=...)"]], said


def test_a_backward_pass_another_plugin_runs_is_not_taken_for_none() -> None:
    """A plugin that takes loop.backward over (tryfirst) runs the passes optim would have counted: the
    first epoch's end does not say the step made no loop.backward."""
    class OwnBackward:
        name = "own_backward"

        @hookfit.hookimpl(tryfirst=True)
        def backward(self, loop, loss):
            loss.backward()
            return True

    m = model()

    def train_step(loop, batch):
        loop.backward(torch.nn.functional.mse_loss(m(batch[0]), batch[1]))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hookfit.Loop(train_step, data(4), model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
                     max_epochs=1, plugins=[Optim(), OwnBackward()]).fit()
    assert not [w for w in caught if "made no loop.backward" in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.bad_input
@pytest.mark.parametrize("slip", ["no backward", "another module's optimizer", "zero_grad before step"])
def test_optimizers_that_step_without_any_gradient_are_told_the_model_does_not_train(slip: str) -> None:
    """The optimizers step, and none of their parameters ever has a gradient when they do: the
    step never calls ``loop.backward``, the optimizer holds another module's parameters, or
    ``zero_grad()`` comes between the backward pass and the step. The run completes and nothing
    trains; the first training epoch's end says so, once a run."""
    m, other = model(), model()
    before = [p.detach().clone() for p in m.parameters()]

    def train_step(loop, batch):
        x, y = batch
        loss = torch.nn.functional.mse_loss(m(x), y)
        if slip != "no backward":
            loop.backward(loss)
        if slip == "zero_grad before step":
            loop.optimizers.zero_grad()
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return loss

    held = other if slip == "another module's optimizer" else m
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop = hookfit.Loop(train_step, data(4), model=m, optimizers=torch.optim.SGD(held.parameters(), lr=0.1),
                            max_epochs=2, plugins=[Optim()])
        loop.fit()
    said = [str(w.message) for w in caught if "without a gradient" in str(w.message)]
    assert said == ["optim: the optimizers stepped without a gradient on any of their parameters in the first epoch: "
                    "call loop.backward(loss) in 'test_optimizers_that_step_without_any_gradient_are_told_the_model_"
                    "does_not_train.<locals>.train_step' on a loss of the model they hold (the parameters do not "
                    "change)"], said
    assert [w.filename for w in caught if "without a gradient" in str(w.message)] == [__file__]  # the fit() line
    assert loop.state.status == "completed" and all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


def test_a_step_given_a_closure_that_makes_its_gradient_is_not_told_it_has_none() -> None:
    """A full-batch LBFGS steps with a closure that runs ``loop.backward``: no gradient exists
    when its step begins, and the parameters do change; only the step taken outside
    ``loop.optimizers`` is warned about, not a step without a gradient."""
    m = model()
    before = [p.detach().clone() for p in m.parameters()]
    opt = torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=3)

    def train_step(loop, batch):
        x, y = batch

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y)
            loop.backward(loss)
            return loss

        opt.step(closure)
        opt.zero_grad()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hookfit.Loop(train_step, data(1), model=m, optimizers=opt, max_epochs=2, plugins=[Optim()]).fit()
    assert not [w for w in caught if "without a gradient" in str(w.message)], [str(w.message) for w in caught]
    assert [w for w in caught if "was stepped directly" in str(w.message)]
    assert not all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


def test_a_step_every_few_batches_is_no_step_never_taken() -> None:
    m = model()

    def train_step(loop, batch):
        x, y = batch
        loop.backward(torch.nn.functional.mse_loss(m(x), y))
        if loop.state.batch_idx % 8 == 7:  # accumulated by hand over 8 batches
            loop.optimizers.step()
            loop.optimizers.zero_grad()

    with warnings.catch_warnings():
        warnings.simplefilter("error", OptimWarning)
        hookfit.Loop(train_step, data(20), model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
                     plugins=[Optim()]).fit()
