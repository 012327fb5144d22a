"""optim: a model-wide gradient norm (``Optim(clip_scope="model")``) and a clip by hand on unscaled gradients
(``loop.optimizers.unscale_()``) match hand-written PyTorch bit for bit, under a ``GradScaler`` (CPU autocast in
float16, the CPU's scaler) and without one, with accumulation and optimizers stepped apart."""

from __future__ import annotations

import warnings

import pytest
import torch

import hookfit
from hookfit.plugins.optim import Optim, OptimWarning
from test_optim import assert_bitwise, data, model, mse, params

MAX = 0.05  # below every batch's gradient norm here: each step is clipped


def two() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    """The model, and an optimizer on each of its layers (of other classes, so that each steps its own way)."""
    m = model()
    return m, torch.optim.Adam(m[0].parameters(), lr=0.01), torch.optim.SGD(m[2].parameters(), lr=0.1, momentum=0.9)


def raw(batches, accumulate: int = 1, scaled: bool = True) -> tuple[list[torch.Tensor], list[float], float]:
    """torch's recipe: every optimizer unscaled, one ``clip_grad_norm_`` over all parameters, each stepped, one update;
    the parameters, the norms clipped, the scale at the end."""
    m, a, b = two()
    scaler = torch.amp.GradScaler("cpu", enabled=scaled)
    norms = []
    for i, batch in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.float16, enabled=scaled):
            loss = mse(m, batch)
        scaler.scale(loss / accumulate if accumulate > 1 else loss).backward()
        if (i + 1) % accumulate:
            continue
        scaler.unscale_(a)
        scaler.unscale_(b)
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(m.parameters()), MAX)))
        scaler.step(a)
        scaler.step(b)
        scaler.update()
        a.zero_grad()
        b.zero_grad()
    return params(m), norms, scaler.get_scale() if scaled else 1.0


def run(batches, by_hand: bool = False, **options) -> tuple[list[torch.Tensor], float]:
    """The same with optim: its clip (``options``), or ``by_hand`` in the step after ``unscale_()``."""
    m, a, b = two()

    def step(loop, batch):
        loss = mse(m, batch)
        loop.backward(loss)
        if by_hand and loop.optimizers.unscale_():
            torch.nn.utils.clip_grad_norm_(list(m.parameters()), MAX)
        loop.optimizers["a"].step()
        loop.optimizers["b"].step()
        loop.optimizers["a"].zero_grad()
        loop.optimizers["b"].zero_grad()
        return loss

    optim = Optim(**options)
    hookfit.Loop(step, batches, model=m, optimizers={"a": a, "b": b}, max_epochs=1, plugins=[optim]).fit()
    return params(m), optim.scaler.get_scale() if optim.scaler is not None else 1.0


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("precision", ["16-mixed", "32"])
def test_a_model_wide_norm_is_torch_s_unscale_each_then_one_clip_over_all(precision: str, accumulate: int) -> None:
    batches = data(6)
    expected, norms, scale = raw(batches, accumulate, scaled=precision == "16-mixed")
    assert min(norms) > MAX  # every step clipped, none skipped (the scale never backed off)
    assert scale == (2.0 ** 16 if precision == "16-mixed" else 1.0)
    got, got_scale = run(batches, precision=precision, accumulate=accumulate, clip_norm=MAX, clip_scope="model")
    assert_bitwise(got, expected)
    assert got_scale == scale
    each, _ = run(batches, precision=precision, accumulate=accumulate, clip_norm=MAX)  # each optimizer its own norm
    assert not all(torch.equal(x, y) for x, y in zip(each, expected))


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("precision", ["16-mixed", "32"])
def test_a_clip_by_hand_after_unscale_is_torch_s(precision: str, accumulate: int) -> None:
    """``unscale_()`` is the scaler's for each optimizer, not repeated at optim's step; inside an accumulation window
    it does nothing and says so (``False``); without a scaler it only says whether the window closes."""
    batches = data(6)
    expected, _, scale = raw(batches, accumulate, scaled=precision == "16-mixed")
    got, got_scale = run(batches, by_hand=True, precision=precision, accumulate=accumulate)
    assert_bitwise(got, expected)
    assert got_scale == scale


@pytest.mark.parametrize("precision", ["16-mixed", "32"])
def test_with_one_optimizer_every_way_of_clipping_is_the_same(precision: str) -> None:
    """One optimizer (``loop.optimizers`` is it): its own norm, the model's and a clip by hand after ``unscale_()``
    (unscaled gradients: norms of about 1, not 65,536 times that) step alike."""
    batches = data(6)

    def one(by_hand: bool = False, **options) -> tuple[list[torch.Tensor], list[float]]:
        m, norms = model(), []
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

        def step(loop, batch):
            loop.backward(mse(m, batch))
            if by_hand and loop.optimizers.unscale_():
                norms.append(float(torch.nn.utils.clip_grad_norm_(list(m.parameters()), MAX)))
            loop.optimizers.step()
            loop.optimizers.zero_grad()

        hookfit.Loop(step, batches, model=m, optimizers=opt, max_epochs=1,
                     plugins=[Optim(precision=precision, **options)]).fit()
        return params(m), norms

    expected, _ = one(clip_norm=MAX)
    assert_bitwise(one(clip_norm=MAX, clip_scope="model")[0], expected)
    by_hand, norms = one(by_hand=True)
    assert_bitwise(by_hand, expected)
    assert len(norms) == 6 and MAX < min(norms) and max(norms) < 100


def test_one_optimizer_unscales_its_own_and_twice_is_once() -> None:
    """``loop.optimizers["a"].unscale_()`` unscales ``a`` alone; a second call, and optim's step, leave it."""
    m, a, b = two()
    seen = []

    def step(loop, batch):
        loop.backward(mse(m, batch))
        scaled = m[2].weight.grad.clone()
        assert loop.optimizers["a"].unscale_() and loop.optimizers["a"].unscale_()
        seen.append((float(m[0].weight.grad.norm()), torch.equal(m[2].weight.grad, scaled)))
        loop.optimizers["b"].unscale_()
        assert torch.equal(m[2].weight.grad * 2.0 ** 16, scaled)  # (a power of two: exact)
        for name in ("a", "b"):
            loop.optimizers[name].step()
            loop.optimizers[name].zero_grad()

    hookfit.Loop(step, data(2), model=m, optimizers={"a": a, "b": b}, max_epochs=1,
                 plugins=[Optim(precision="16-mixed")]).fit()
    assert [still for _, still in seen] == [True, True] and max(n for n, _ in seen) < 100  # unscaled: not ~1e4


def test_optimizers_stepped_after_passes_of_their_own_take_a_norm_each() -> None:
    """A batch that steps ``b`` after one backward pass, then ``a`` after another (a GAN's discriminator, then its
    generator): the norm before ``b``'s step is over every optimizer's gradients, the one before ``a``'s over those of
    the optimizers not stepped in the batch (``a``'s), as ``clip_grad_norm_`` written before each step over those."""
    batches = data(4)
    m, a, b = two()
    for batch in batches:
        for opt, clipped in ((b, m.parameters()), (a, m[0].parameters())):
            mse(m, batch).backward()
            torch.nn.utils.clip_grad_norm_(list(clipped), MAX)
            opt.step()
            a.zero_grad()
            b.zero_grad()
    expected = params(m)
    m, a, b = two()

    def step(loop, batch):
        for name in ("b", "a"):
            loop.backward(mse(m, batch))
            loop.optimizers[name].step()
            loop.optimizers["a"].zero_grad()
            loop.optimizers["b"].zero_grad()

    hookfit.Loop(step, batches, model=m, optimizers={"a": a, "b": b}, max_epochs=1,
                 plugins=[Optim(clip_norm=MAX, clip_scope="model")]).fit()
    assert_bitwise(params(m), expected)


@pytest.mark.parametrize("defer", [None, True], ids=["host", "device-path"])
@pytest.mark.parametrize("precision", ["16-mixed", "32"])
def test_a_non_finite_gradient_skips_every_optimizer_the_norm_took(precision: str, defer: bool | None) -> None:
    """One optimizer's infinite gradient makes the norm infinite, which would zero the other's gradients (``max / inf``,
    and torch's recipe then steps it): both steps are skipped, by the scaler (its scale backs off) or by optim's check
    (counted, the first warned about)."""
    m, a, b = two()
    before = params(m)

    def step(loop, batch):
        loop.backward(mse(m, batch))
        m[2].bias.grad.fill_(float("inf"))
        for name in ("a", "b"):
            loop.optimizers[name].step()
            loop.optimizers[name].zero_grad()

    optim = Optim(precision=precision, clip_norm=MAX, clip_scope="model", defer=defer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = hookfit.Loop(step, data(1), model=m, optimizers={"a": a, "b": b}, max_epochs=1, plugins=[optim]).fit()
    assert_bitwise(params(m), before)
    skips = [str(w.message) for w in caught if issubclass(w.category, OptimWarning)
             and "skipped the step" in str(w.message)]
    if precision == "16-mixed":  # the scaler's skips: the AMP way, not counted
        assert optim.scaler is not None and optim.scaler.get_scale() == 2.0 ** 15 and skips == []
    else:
        assert state.results["skipped_steps"] == 2 and len(skips) == 1 and "non-finite gradient" in skips[0]


@pytest.mark.bad_input
@pytest.mark.parametrize("options, match", [
    ({"clip_norm": 1.0, "clip_scope": "global"}, r"optim: clip_scope must be 'optimizer' or 'model', got 'global'"),
    ({"clip_scope": "model"}, r"optim: clip_scope='model' is the scope of clip_norm's norm, which is not given"),
])
def test_a_bad_clip_scope_is_refused_naming_the_option(options, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Optim(**options)


@pytest.mark.fault
def test_a_scaler_unscale_kept_by_hand_is_torch_s_at_each_step_and_told_to_use_loop_optimizers_unscale() -> None:
    """The AMP recipe's ``scaler.unscale_(opt)`` kept in the step with ``Optim(amp=scaler)``: where the optimizers
    step after each batch it is torch's recipe bit for bit (optim's step does not unscale again); at each batch of an
    accumulation window torch refuses the second call, and its error gets a note naming loop.optimizers.unscale_()
    (it had a note naming the step function only)."""
    batches = data(6)

    def fit(accumulate: int) -> tuple[list[torch.Tensor], float]:
        m, a, b = two()
        scaler = torch.amp.GradScaler("cpu")

        def step(loop, batch):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = mse(m, batch)
            loop.backward(loss)
            scaler.unscale_(a)
            scaler.unscale_(b)
            torch.nn.utils.clip_grad_norm_(list(m.parameters()), MAX)
            for name in ("a", "b"):
                loop.optimizers[name].step()
                loop.optimizers[name].zero_grad()

        hookfit.Loop(step, batches, model=m, optimizers={"a": a, "b": b}, max_epochs=1,
                     plugins=[Optim(amp=scaler, accumulate=accumulate)]).fit()
        return params(m), scaler.get_scale()

    expected, _, scale = raw(batches)
    got, got_scale = fit(1)
    assert_bitwise(got, expected)
    assert got_scale == scale
    with pytest.raises(RuntimeError, match="unscale_") as raised:
        fit(2)
    note = raised.value.__notes__[-1]
    assert note.startswith("optim: the run's GradScaler") and "accumulate=2" in note, raised.value.__notes__
    assert "Call loop.optimizers.unscale_() instead of scaler.unscale_(opt)" in note
