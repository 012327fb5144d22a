"""optim's watch of the gradients an accumulation window holds between its passes, in real runs: a step function that
clips them (``clip_grad_norm_``, ``clip_grad_value_``), scales them or clears them at every batch, as a plain script
that steps every batch does, changes partial sums and trains another model than the plain loop that clips once a
window; it gets one ``OptimWarning`` naming the step function and the fix. The forms that are meant (no clip, optim's
clip, the hand clip on the window's gradients, a clip without accumulation, ``torch.autograd.grad``, frozen or sparse
parameters, two optimizers, loss scaling) get none."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch

import hookfit
from hookfit.plugins.optim import Optim, OptimWarning

N = 4  # the window
CHANGED = "the gradients accumulated inside a window"


def data(n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 4, generator=g), 5 * torch.randn(8, 1, generator=g)) for _ in range(n)]


def model(seed: int = 1) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def loss_of(m: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(m(x), y)


def plain_loop(m: torch.nn.Module, batches: list[Any], lr: float = 0.1) -> list[torch.Tensor]:
    """A plain torch accumulation loop that clips once a window, before ``optimizer.step()``: its parameters."""
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    for i, batch in enumerate(batches):
        (loss_of(m, batch) / N).backward()
        if (i + 1) % N == 0:
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in m.parameters()]


def fit(step: Callable[..., Any], m: torch.nn.Module, optimizers: Any, epochs: int = 1, batches: Any = None,
        **options: Any) -> list[str]:
    """The messages of the run's OptimWarnings that tell of a window's gradients changed, after fitting."""
    loop = hookfit.Loop(step, data() if batches is None else batches, model=m, optimizers=optimizers,
                        max_epochs=epochs, plugins=[Optim(**options)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop.fit()
    assert loop.state.status == "completed"
    found = [w for w in caught if issubclass(w.category, OptimWarning) and CHANGED in str(w.message)]
    assert all(w.filename == __file__ for w in found), [(w.filename, w.lineno) for w in found]  # the step's line
    others = [str(w.message) for w in caught if issubclass(w.category, OptimWarning) and w not in found]
    assert others == [], others
    return [str(w.message) for w in found]


def same(a: list[torch.Tensor], b: Any) -> bool:
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b))


# -- a step function that changes the window's gradients ---------------------------------------------------------------


@pytest.mark.bad_input
def test_a_clip_at_every_batch_of_a_window_trains_otherwise_and_warns_once_naming_the_step_function_and_the_fix() -> None:
    expected = plain_loop(model(), data())
    m = model()

    def train_step(loop, batch):
        loss = loss_of(m, batch)
        loop.backward(loss)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)  # kept from a plain script that steps every batch
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    said = fit(train_step, m, torch.optim.SGD(m.parameters(), lr=0.1), accumulate=N)
    assert not same(expected, m.parameters())  # the partial sums were clipped: another model than the plain loop's
    assert said == [
        "optim: step function 'test_a_clip_at_every_batch_of_a_window_trains_otherwise_and_warns_once_naming_the_step_"
        "function_and_the_fix.<locals>.train_step' changed the gradients accumulated inside a window of accumulate=4 "
        "between two of its backward passes (epoch 1, batch 2): a clip (torch.nn.utils.clip_grad_norm_ or "
        "clip_grad_value_) or a p.grad.mul_() there runs at every batch, on a partial sum, where a plain loop clips "
        "once a window, on its summed gradients, before optimizer.step(): the run trains another model. Give Optim("
        "clip_norm=<max norm>, clip_scope='model') (one norm over every optimizer's parameters, as clip_grad_norm_("
        "model.parameters(), ...) takes; or clip_value=) and take the clip out of the step function, or clip only "
        "where the gradients are the step's: if loop.optimizers.unscale_(): torch.nn.utils.clip_grad_norm_("
        "model.parameters(), 1.0)"]


@pytest.mark.bad_input
@pytest.mark.parametrize("change", ["clip_grad_value_", "mul_"])
def test_a_value_clip_or_a_scaling_at_every_batch_of_a_window_warn_once(change: str) -> None:
    m = model()

    def train_step(loop, batch):
        loop.backward(loss_of(m, batch))
        if change == "clip_grad_value_":
            torch.nn.utils.clip_grad_value_(m.parameters(), 0.1)
        elif change == "mul_":
            for p in m.parameters():
                p.grad.mul_(0.5)
        loop.optimizers.step()
        loop.optimizers.zero_grad()

    said = fit(train_step, m, torch.optim.SGD(m.parameters(), lr=0.1), epochs=2, accumulate=N)
    assert len(said) == 1, said  # once a run
    assert "changed the gradients accumulated inside a window of accumulate=4 between two of its backward passes " \
           "(epoch 1, batch 2)" in said[0], said
    assert "Give Optim(clip_norm=<max norm>, clip_scope='model')" in said[0]


@pytest.mark.bad_input
@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_zero_grad_of_the_model_inside_a_window_is_told_as_clearing_its_gradients(set_to_none: bool) -> None:
    m = model()

    def train_step(loop, batch):
        m.zero_grad(set_to_none=set_to_none)  # torch's, not loop.optimizers': the window keeps its last batch's alone
        loop.backward(loss_of(m, batch))
        loop.optimizers.step()

    said = fit(train_step, m, torch.optim.SGD(m.parameters(), lr=0.1), accumulate=N)
    assert len(said) == 1, said
    assert said[0].endswith(
        "cleared the gradients accumulated inside a window of accumulate=4 between two of its backward passes (epoch "
        "1, batch 2) (a zero_grad() of the model or of a torch optimizer, not loop.optimizers'): each window's step "
        "then takes its last batches' gradients alone. Call loop.optimizers.zero_grad() instead, which clears them "
        "only after the window's step"), said


@pytest.mark.bad_input
def test_a_clip_under_loss_scaling_at_every_batch_of_a_window_warns() -> None:
    m = model()

    def train_step(loop, batch):
        loop.backward(loss_of(m, batch))
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)  # on scaled partial sums
        loop.optimizers.step()
        loop.optimizers.zero_grad()

    said = fit(train_step, m, torch.optim.SGD(m.parameters(), lr=0.1), accumulate=2, precision="16-mixed")
    assert len(said) == 1 and "accumulate=2" in said[0], said


# -- what is meant says nothing ----------------------------------------------------------------------------------------


def test_the_hand_clip_on_the_windows_gradients_says_nothing_and_trains_as_the_plain_loop() -> None:
    expected = plain_loop(model(), data())
    m = model()

    def train_step(loop, batch):
        loop.backward(loss_of(m, batch))
        if loop.optimizers.unscale_():  # the window's last batch: its summed gradients
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        loop.optimizers.step()
        loop.optimizers.zero_grad()

    assert fit(train_step, m, torch.optim.SGD(m.parameters(), lr=0.1), accumulate=N) == []
    assert same(expected, m.parameters())


def test_optims_own_clip_says_nothing_and_trains_as_the_plain_loop() -> None:
    expected = plain_loop(model(), data())
    m = model()

    def train_step(loop, batch):
        loop.backward(loss_of(m, batch))
        loop.optimizers.step()
        loop.optimizers.zero_grad()

    assert fit(train_step, m, torch.optim.SGD(m.parameters(), lr=0.1), accumulate=N, clip_norm=1.0,
               clip_scope="model") == []
    assert same(expected, m.parameters())


@pytest.mark.parametrize("how", ["clip without accumulation", "no clip", "a norm read by a clip that takes none",
                                 "autograd.grad", "frozen", "16-mixed"])
def test_steps_that_leave_the_windows_gradients_say_nothing(how: str) -> None:
    m = model()
    if how == "frozen":
        m[0].requires_grad_(False)

    def train_step(loop, batch):
        x, y = batch
        if how == "autograd.grad":  # a penalty on the gradient of the input: no .grad is set by it
            x = x.clone().requires_grad_(True)
            (g,) = torch.autograd.grad(m(x).sum(), x, create_graph=True)
            loss = torch.nn.functional.mse_loss(m(x), y) + 0.1 * g.square().mean()
        else:
            loss = torch.nn.functional.mse_loss(m(x), y)
        loop.backward(loss)
        out = {"loss": loss}
        if how == "clip without accumulation":
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)  # every batch is a step's
        elif how == "a norm read by a clip that takes none":
            out["grad_norm"] = torch.nn.utils.clip_grad_norm_(m.parameters(), float("inf"))  # multiplies by one
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return out

    options = {"precision": "16-mixed"} if how == "16-mixed" else {}
    accumulate = 1 if how == "clip without accumulation" else N
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
    assert fit(train_step, m, opt, epochs=2, accumulate=accumulate, **options) == []


def test_sparse_gradients_and_two_optimizers_in_a_window_say_nothing() -> None:
    torch.manual_seed(0)
    embedding, head = torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1)
    both = torch.nn.ModuleList([embedding, head])
    batches = [(torch.randint(0, 10, (8,)), torch.randn(8, 1)) for _ in range(8)]

    def train_step(loop, batch):
        x, y = batch
        loss = torch.nn.functional.mse_loss(head(embedding(x)), y)
        loop.backward(loss)
        for name in ("embedding", "head"):
            loop.optimizers[name].step()
            loop.optimizers[name].zero_grad()

    optimizers = {"embedding": torch.optim.SGD(embedding.parameters(), lr=0.1),
                  "head": torch.optim.SGD(head.parameters(), lr=0.1)}
    assert fit(train_step, both, optimizers, epochs=2, batches=batches, accumulate=N) == []


def gan_step(gp: bool = False, torch_zero_grad: bool = False) -> Callable[..., Any]:
    """A GAN's step (``examples/gan.py``): each optimizer's ``zero_grad()`` before its own pass, which, where the
    window closed at the batch before, clears gradients its step took (not the window's); ``gp``: a WGAN-GP penalty
    (``torch.autograd.grad`` on interpolates); ``torch_zero_grad``: the discriminator's cleared by torch's optimizer."""
    bce = torch.nn.functional.binary_cross_entropy_with_logits

    def train_step(loop, real):
        g, d, opts = loop.model["gen"], loop.model["disc"], loop.optimizers
        fake = g(torch.randn(len(real), 8))
        with opts.toggle("disc"):
            d_real, d_fake = d(real), d(fake.detach())
            d_loss = bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake))
            if gp:
                a = torch.rand(len(real), 1)
                x = (a * real + (1 - a) * fake.detach()).requires_grad_(True)
                (grad,) = torch.autograd.grad(d(x).sum(), x, create_graph=True)
                d_loss = d_loss + 10 * ((grad.norm(dim=1) - 1) ** 2).mean()
            (opts["disc"].optimizer if torch_zero_grad else opts["disc"]).zero_grad()
            loop.backward(d_loss)
            opts["disc"].step()
        with opts.toggle("gen"):
            d_fake = d(fake)
            g_loss = bce(d_fake, torch.ones_like(d_fake))
            opts["gen"].zero_grad()
            loop.backward(g_loss)
            opts["gen"].step()
        return {"loss": g_loss}

    return train_step


def fit_gan(accumulate: int, **kinds: bool) -> list[str]:
    torch.manual_seed(0)
    gen = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    disc = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    batches = [torch.randn(16, 2, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    optimizers = {"gen": torch.optim.Adam(gen.parameters(), 1e-3), "disc": torch.optim.Adam(disc.parameters(), 1e-3)}
    return fit(gan_step(**kinds), torch.nn.ModuleDict({"gen": gen, "disc": disc}), optimizers, batches=batches,
               accumulate=accumulate)


@pytest.mark.parametrize("gp", [False, True], ids=["gan", "wgan-gp"])
@pytest.mark.parametrize("accumulate", [2, 3])
def test_a_gan_that_clears_each_optimizers_gradients_before_its_pass_says_nothing(gp: bool, accumulate: int) -> None:
    """loop.optimizers["gen"].zero_grad() at a batch that opens a window clears the gradients of the window that
    stepped (the discriminator's pass came between): no window's gradients are lost."""
    assert fit_gan(accumulate, gp=gp) == []


@pytest.mark.bad_input
def test_a_gan_that_clears_an_optimizers_gradients_with_torch_s_zero_grad_inside_a_window_is_told() -> None:
    said = fit_gan(2, torch_zero_grad=True)
    assert len(said) == 1 and "cleared the gradients accumulated inside a window of accumulate=2 between two of its " \
        "backward passes (epoch 1, batch 2)" in said[0], said


def mask_step(m: torch.nn.ModuleDict, mask: str) -> Callable[..., Any]:
    """A step that trains part of a model by a fixed mask on the gradients after each pass: an embedding's new rows
    only, or a head frozen by hand (zeros, or no gradient)."""
    def train_step(loop, batch):
        x, y = batch
        loop.backward(torch.nn.functional.mse_loss(m["head"](m["emb"](x)), y))
        emb, head = m["emb"].weight, m["head"]
        if mask == "rows":  # the first ten rows are the pretrained tokens'
            emb.grad[:10] = 0
        elif mask == "zeros":
            head.weight.grad.zero_()
            head.bias.grad.zero_()
        elif mask == "none":
            head.weight.grad = head.bias.grad = None
        loop.optimizers.step()
        loop.optimizers.zero_grad()

    return train_step


@pytest.mark.parametrize("mask", ["rows", "zeros", "none"])
def test_a_fixed_mask_on_the_gradients_after_each_pass_says_nothing_and_trains_as_masking_once_a_window(
        mask: str) -> None:
    """Masking at each pass of a window is masking its sum once: the plain loop that masks before each step."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 20, (8,), generator=g), torch.randn(8, 1, generator=g)) for _ in range(8)]

    def made() -> torch.nn.ModuleDict:
        torch.manual_seed(0)
        return torch.nn.ModuleDict({"emb": torch.nn.Embedding(20, 4), "head": torch.nn.Linear(4, 1)})

    plain = made()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for i, (x, y) in enumerate(batches):
        (torch.nn.functional.mse_loss(plain["head"](plain["emb"](x)), y) / N).backward()
        if (i + 1) % N == 0:
            if mask == "rows":
                plain["emb"].weight.grad[:10] = 0
            else:
                plain["head"].zero_grad()
            opt.step()
            opt.zero_grad()
    m = made()
    assert fit(mask_step(m, mask), m, torch.optim.SGD(m.parameters(), lr=0.1), batches=batches, accumulate=N) == []
    assert same([p.detach() for p in plain.parameters()], m.parameters())
    assert not same([p.detach() for p in made().parameters()], m.parameters())  # it trained
