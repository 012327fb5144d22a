"""optim's watch and ``torch.autograd.grad``: a gradient penalty (WGAN-GP's, on the critic's inputs or on its
parameters) and MAML's inner step take gradients through the model's parameters without accumulating them into
``.grad``. Such a run is told nothing and trains what the same loop written in plain PyTorch trains, bit for bit,
with accumulation too; a ``loss.backward()`` in the same step is still told (an error under accumulation), and so
is a forgotten ``zero_grad()``."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import hookfit
from hookfit.errors import HookfitWarning
from hookfit.plugins.optim import Optim, OptimWarning

EPOCHS, BATCHES = 2, 6  # 12 passes a stage for the GAN: its first stage is watched whole


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def told(recwarn: pytest.WarningsRecorder) -> list[str]:
    return [str(w.message) for w in recwarn if issubclass(w.category, HookfitWarning)]


def window(accumulate: int) -> Callable[[int], tuple[int, bool]]:
    """For batch ``i``: what its loss is divided by and whether its window closes (``BATCHES`` fill each window)."""
    assert BATCHES % accumulate == 0
    return lambda i: (accumulate, (i + 1) % accumulate == 0)


def backward(loss: torch.Tensor, accumulate: int) -> None:
    """``loop.backward``'s pass, by hand: the loss divided by its window's batches (not at all without one)."""
    (loss if accumulate == 1 else loss / accumulate).backward()


# -- a GAN with a gradient penalty ------------------------------------------------------------------------------------


def gan_data() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Real samples, the generator's noise and the penalty's mixing weights, drawn once."""
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g), torch.rand(8, 1, generator=g))
            for _ in range(BATCHES)]


def gan() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(3)
    return (torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)),
            torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))


def critic_loss(gen: torch.nn.Module, critic: torch.nn.Module, batch: Any, penalty: str) -> torch.Tensor:
    """WGAN-GP's critic loss: the penalty on the gradient at points between real and generated samples; with
    ``penalty="parameters"`` also the squared norm of the loss's gradient on the critic's parameters."""
    real, noise, mix = batch
    fake = gen(noise).detach()
    between = (mix * real + (1 - mix) * fake).requires_grad_(True)
    grad, = torch.autograd.grad(critic(between).sum(), between, create_graph=True)
    loss = critic(fake).mean() - critic(real).mean() + 10 * ((grad.norm(2, dim=1) - 1) ** 2).mean()
    if penalty == "parameters":
        grads = torch.autograd.grad(loss, list(critic.parameters()), create_graph=True)
        loss = loss + 0.1 * sum(g.pow(2).sum() for g in grads)
    return loss


def gan_by_hand(penalty: str, accumulate: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    gen, critic = gan()
    opt_g, opt_c = torch.optim.Adam(gen.parameters(), lr=1e-3), torch.optim.Adam(critic.parameters(), lr=1e-3)
    at = window(accumulate)
    for _ in range(EPOCHS):
        for i, batch in enumerate(gan_data()):
            _, closes = at(i)
            gen.requires_grad_(False)  # what loop.optimizers.toggle("critic") does
            backward(critic_loss(gen, critic, batch, penalty), accumulate)
            gen.requires_grad_(True)
            if closes:
                opt_c.step()
                opt_c.zero_grad()
            critic.requires_grad_(False)
            backward(-critic(gen(batch[1])).mean(), accumulate)
            critic.requires_grad_(True)
            if closes:
                opt_g.step()
                opt_g.zero_grad()
    return gen, critic


def gan_step(penalty: str) -> Callable[..., Any]:
    def train_step(loop, batch):
        gen, critic = loop.model["gen"], loop.model["critic"]
        with loop.optimizers.toggle("critic"):
            loss_c = critic_loss(gen, critic, batch, penalty)
            loop.backward(loss_c)
        loop.optimizers["critic"].step()
        loop.optimizers["critic"].zero_grad()
        with loop.optimizers.toggle("gen"):
            loss_g = -critic(gen(batch[1])).mean()
            loop.backward(loss_g)
        loop.optimizers["gen"].step()
        loop.optimizers["gen"].zero_grad()
        return {"critic": loss_c, "gen": loss_g}
    return train_step


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("penalty", ["inputs", "parameters"])
def test_a_gan_s_gradient_penalty_is_told_nothing_and_trains_as_plain_pytorch(
        penalty: str, accumulate: int, recwarn: pytest.WarningsRecorder) -> None:
    gen, critic = gan()
    loop = hookfit.Loop(gan_step(penalty), gan_data(), model={"gen": gen, "critic": critic}, max_epochs=EPOCHS,
                        optimizers={"gen": torch.optim.Adam(gen.parameters(), lr=1e-3),
                                    "critic": torch.optim.Adam(critic.parameters(), lr=1e-3)},
                        plugins=[Optim(accumulate=accumulate)])
    assert loop.fit().status == "completed"
    assert told(recwarn) == []
    by_hand = gan_by_hand(penalty, accumulate)
    assert same(gen, by_hand[0]) and same(critic, by_hand[1])
    assert not same(gen, gan()[0])  # (it trained)


# -- MAML's inner step ------------------------------------------------------------------------------------------------


def tasks() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A task a batch: its first 4 samples adapt the model, its last 4 judge the adapted model."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(BATCHES)]


def learner() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def adapted_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """MAML's outer loss: the loss after one inner step on the task's first samples, differentiable through it."""
    x, y = batch
    params = dict(model.named_parameters())
    inner = torch.nn.functional.mse_loss(torch.func.functional_call(model, params, (x[:4],)), y[:4])
    grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
    fast = {name: p - 0.1 * g for (name, p), g in zip(params.items(), grads, strict=True)}
    return torch.nn.functional.mse_loss(torch.func.functional_call(model, fast, (x[4:],)), y[4:])


def maml_by_hand(accumulate: int) -> torch.nn.Module:
    model = learner()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    at = window(accumulate)
    for _ in range(EPOCHS):
        for i, batch in enumerate(tasks()):
            backward(adapted_loss(model, batch), accumulate)
            if at(i)[1]:
                opt.step()
                opt.zero_grad()
    return model


def maml(model: torch.nn.Module, step: Callable[..., Any], accumulate: int = 1) -> hookfit.Loop:
    return hookfit.Loop(step, tasks(), model=model, max_epochs=EPOCHS, plugins=[Optim(accumulate=accumulate)],
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))


def maml_step(loop, batch):
    loss = adapted_loss(loop.model, batch)
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    return loss


@pytest.mark.parametrize("accumulate", [1, 2])
def test_maml_s_inner_gradients_are_told_nothing_and_train_as_plain_pytorch(
        accumulate: int, recwarn: pytest.WarningsRecorder) -> None:
    model = learner()
    assert maml(model, maml_step, accumulate).fit().status == "completed"
    assert told(recwarn) == []
    assert same(model, maml_by_hand(accumulate)) and not same(model, learner())


def bypassing_step(loop, batch):
    loss = adapted_loss(loop.model, batch)
    loss.backward()  # instead of loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    return loss


@pytest.mark.bad_input
def test_a_loss_backward_after_an_inner_step_is_still_told_at_its_line() -> None:
    with pytest.warns(OptimWarning, match=r"calls loss.backward\(\) itself") as caught:
        assert maml(learner(), bypassing_step).fit().status == "completed"
    found = [w for w in caught if "outside loop.backward" in str(w.message)]
    assert len(found) == 1 and "(epoch 1, batch 1)" in str(found[0].message)
    assert found[0].filename == __file__ and "loss.backward()" in open(__file__).read().splitlines()[
        found[0].lineno - 1]


@pytest.mark.bad_input
def test_a_loss_backward_after_an_inner_step_fails_under_accumulation_before_any_step() -> None:
    model = learner()
    with pytest.raises(RuntimeError, match=r"handling of accumulate=2 .*the run would train another model"):
        maml(model, bypassing_step, accumulate=2).fit()
    assert same(model, learner())  # no optimizer step


@pytest.mark.bad_input
def test_a_forgotten_zero_grad_after_an_inner_step_is_still_told(recwarn: pytest.WarningsRecorder) -> None:
    def train_step(loop, batch):
        loss = adapted_loss(loop.model, batch)
        loop.backward(loss)
        loop.optimizers.step()  # and no zero_grad()
        return loss

    assert maml(learner(), train_step).fit().status == "completed"
    said = told(recwarn)
    assert len(said) == 1 and "previous step, never cleared" in said[0], said
