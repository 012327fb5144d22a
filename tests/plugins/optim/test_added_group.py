"""optim with a parameter group added to an optimizer during the run (a backbone unfrozen at an epoch's start):
clipping, gradient checks, checkpoints of an open window and toggles take its parameters as the others'."""

from __future__ import annotations

import pytest
import torch

import hookfit
from hookfit.plugins.optim import Optim, OptimWarning
from conftest import StopAt
from conftest import mse_step as step


def data(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def model() -> torch.nn.Sequential:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


class Unfreeze:
    """Adds the first layer as a group at epoch ``at`` (or at load_state, before optim's, where it was added)."""

    name = "unfreeze"

    def __init__(self, at: int = 1, hook=None) -> None:
        self.at, self.hook = at, hook

    def add(self, loop) -> None:
        opt = loop.config.optimizers
        if len(opt.param_groups) == 1:
            opt.add_param_group({"params": list(loop.model[0].parameters()), "lr": 0.05})
            if self.hook is not None:
                loop.model[0].weight.register_hook(lambda g: self.hook(loop, g))

    @hookfit.hookimpl
    def epoch_start(self, loop, epoch):
        if epoch >= self.at:
            self.add(loop)

    @hookfit.hookimpl
    def save_state(self, loop):
        return {"added": len(loop.config.optimizers.param_groups) > 1}

    @hookfit.hookimpl(tryfirst=True)
    def load_state(self, loop, state):
        if state["added"]:
            self.add(loop)


def run(*plugins, epochs=2, run_dir=None, resume=None, **options):
    m = model()
    opt = torch.optim.SGD([{"params": m[2].parameters(), "lr": 0.05}], momentum=0.9)
    return m, hookfit.Loop(step, data(), model=m, optimizers=opt, max_epochs=epochs, disable=["console"],
                           run_dir=run_dir, resume=resume, plugins=[Optim(**options), *plugins])


def test_clip_norm_clips_a_group_added_during_the_run() -> None:
    norms = []

    class Norm:
        name = "norm"

        @hookfit.hookimpl
        def before_optimizer_step(self, loop, optimizer):
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            norms.append((len(optimizer.param_groups), float(torch.nn.utils.get_total_norm(grads))))

    _, loop = run(Unfreeze(), Norm(), clip_norm=0.01)
    loop.fit()
    assert [groups for groups, _ in norms] == [1] * 6 + [2] * 6
    assert all(norm <= 0.01 * (1 + 1e-5) for _, norm in norms)


def test_a_nonfinite_gradient_of_a_group_added_during_the_run_skips_the_step() -> None:
    nan_at = lambda loop, g: torch.full_like(g, float("nan")) if loop.state.step == 8 else g  # noqa: E731
    m, loop = run(Unfreeze(hook=nan_at), check_grads=True)
    state = loop.fit()
    assert state.results["skipped_steps"] == 1 and "non-finite gradient" in state.results["first_skip"]
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_an_open_window_s_gradients_of_an_added_group_are_saved_and_resumed(tmp_path) -> None:
    from hookfit.plugins.checkpoint import Checkpoint

    whole, loop = run(Unfreeze(), epochs=3, accumulate=4)
    loop.fit()
    for resume, extra in ((None, [StopAt(8)]), ("latest", [])):  # stopped inside the second epoch's first window
        m, loop = run(Unfreeze(), Checkpoint(background=False), *extra, epochs=3, accumulate=4, run_dir=tmp_path,
                      resume=resume)
        loop.fit()
    assert all(torch.equal(p, q) for p, q in zip(whole.parameters(), m.parameters()))


@pytest.mark.filterwarnings("ignore:optim. step function")  # (it steps no optimizer)
def test_toggle_freezes_a_group_added_to_another_optimizer() -> None:
    m = model()
    gen, disc = torch.optim.SGD(m[2].parameters(), lr=0.1), torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    seen = []

    def toggled(loop, batch):
        gen.add_param_group({"params": list(m[0].parameters())})
        with loop.optimizers.toggle("disc"):
            seen.append([p.requires_grad for p in m.parameters()])
        return None

    hookfit.Loop(toggled, data(1), model=m, optimizers={"gen": gen, "disc": disc}, max_epochs=1,
                 disable=["console"], plugins=[Optim()]).fit()
    assert seen == [[False] * 4]


def test_loop_optimizers_adds_a_group_to_the_optimizer_it_wraps() -> None:
    class Add:
        name = "add"

        @hookfit.hookimpl
        def epoch_start(self, loop, epoch):
            if epoch == 1:
                loop.optimizers.add_param_group({"params": list(loop.model[0].parameters()), "lr": 0.05})

    m, loop = run(Add())
    first = [p.detach().clone() for p in m[0].parameters()]
    loop.fit()
    assert not any(torch.equal(p, q) for p, q in zip(first, m[0].parameters()))  # stepped from epoch 2 on


@pytest.mark.bad_input
def test_adding_a_group_without_a_name_among_several_optimizers_asks_for_one() -> None:
    from hookfit.plugins.optim.managed import NoSingleOptimizer

    m = model()
    gen, disc = torch.optim.SGD(m[2].parameters(), lr=0.1), torch.optim.SGD(m[0].parameters(), lr=0.1)
    caught = []

    def add(loop, batch):
        with pytest.raises(NoSingleOptimizer, match=r"name one: loop\.optimizers\[name\]\.add_param_group") as error:
            loop.optimizers.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
        caught.append(error.value)
        loop.optimizers["disc"].add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
        return None

    with pytest.warns(OptimWarning):  # (it steps no optimizer)
        hookfit.Loop(add, data(1), model=m, optimizers={"gen": gen, "disc": disc}, max_epochs=1,
                     disable=["console"], plugins=[Optim()]).fit()
    assert len(caught) == 1 and len(disc.param_groups) == 2
