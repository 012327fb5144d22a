"""optim: the epoch's last, partial accumulation window is weighted by the batches it holds.

With ``accumulate=4`` and 9 batches the windows are 4, 4 and 1 batches: each window's update
must be the update of its batches taken as one large batch with a mean loss. The references
below train exactly that: each window concatenated into one batch.

Those comparisons use ``torch.testing.assert_close``, not bitwise equality: accumulation sums
per-batch gradients, the large batch sums the same terms inside one matmul, in another order,
so the last bits differ. The models and data are float64, where that rounding is ~1e-16, so
the tolerance stays tight (1e-12) while the under-weighting these tests catch changes the
parameters by ~1e-2. A second reference, which accumulates ``loss / k`` per batch exactly as
optim does, is compared bitwise.
"""

from __future__ import annotations

import pytest
import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.optim import Optim, OptimWarning
from conftest import mse_step
from test_optim import Skips, assert_bitwise, data, model, mse, params

TIGHT = dict(rtol=1e-12, atol=1e-12)


def batches64(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x.double(), y.double()) for x, y in data(n)]


def model64() -> torch.nn.Module:
    return model().double()


def windows(n: int, accumulate: int) -> list[range]:
    """The accumulation windows of an epoch of ``n`` batches, aligned to batch indices."""
    return [range(start, min(start + accumulate, n)) for start in range(0, n, accumulate)]


def large_batches(batches, accumulate: int, make_opt=None, epochs: int = 1, last: int | None = None) -> list[torch.Tensor]:
    """A raw loop that trains each window as one concatenated batch with a mean loss (the
    first ``last`` windows of the last epoch only, when given)."""
    raw = model64()
    opt = (make_opt or (lambda p: torch.optim.SGD(p, lr=0.1)))(raw.parameters())
    for epoch in range(epochs):
        spans = windows(len(batches), accumulate)
        if last is not None and epoch == epochs - 1:
            spans = spans[:last]
        for span in spans:
            x = torch.cat([batches[i][0] for i in span])
            y = torch.cat([batches[i][1] for i in span])
            torch.nn.functional.mse_loss(raw(x), y).backward()
            opt.step()
            opt.zero_grad()
    return params(raw)


def accumulated(batches, accumulate: int, divisor, make_opt=None) -> list[torch.Tensor]:
    """A raw loop that accumulates ``loss / divisor(window)`` per batch over each window."""
    raw = model64()
    opt = (make_opt or (lambda p: torch.optim.SGD(p, lr=0.1)))(raw.parameters())
    for span in windows(len(batches), accumulate):
        for i in span:
            x, y = batches[i]
            (torch.nn.functional.mse_loss(raw(x), y) / divisor(span)).backward()
        opt.step()
        opt.zero_grad()
    return params(raw)


def train(data, accumulate: int = 4, opt=None, epochs: int = 1, **kwargs) -> list[torch.Tensor]:
    m = model64()
    optimizer = (opt or (lambda p: torch.optim.SGD(p, lr=0.1)))(m.parameters())
    hookfit.Loop(mse_step, data, model=m, optimizers=optimizer, max_epochs=epochs,
                 plugins=[Optim(accumulate=accumulate, **kwargs)]).fit()
    return params(m)


@pytest.mark.parametrize("n", [9, 10], ids=["windows-4-4-1", "windows-4-4-2"])
def test_a_partial_last_window_updates_as_its_batches_taken_as_one_large_batch(n: int) -> None:
    batches = batches64(n)
    got = train(batches)
    torch.testing.assert_close(got, large_batches(batches, 4), **TIGHT)
    assert_bitwise(got, accumulated(batches, 4, len))


def test_every_epoch_s_last_window_is_weighted_with_adam_and_momentum() -> None:
    """Two epochs, so the second starts with the window boundaries from batch 0 again, and
    optimizers whose state carries the weighting on (Adam's moments, SGD's momentum)."""
    batches = batches64(10)
    for make in (lambda p: torch.optim.Adam(p, lr=0.01), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)):
        torch.testing.assert_close(train(batches, opt=make, epochs=2),
                                   large_batches(batches, 4, make, epochs=2), **TIGHT)


class Unsized:
    """Re-iterable batches from a generator, with no ``__len__``: the epoch's length is unknown."""

    def __init__(self, batches) -> None:
        self.batches = batches

    def __iter__(self):
        return (b for b in self.batches)


class Stream(torch.utils.data.IterableDataset):
    """Rows of ``batches`` one by one: ``len()`` of a DataLoader over it raises TypeError."""

    def __init__(self, batches) -> None:
        self.batches = batches

    def __iter__(self):
        for x, y in self.batches:
            yield from zip(x, y)


@pytest.mark.parametrize("wrap", ["generator", "iterable-dataset"])
def test_data_of_unknown_length_keeps_dividing_by_accumulate(wrap: str) -> None:
    """The last window cannot be told in advance: every loss is divided by ``accumulate``,
    the partial window's too (as documented), and a DataLoader whose ``len()`` raises is
    such data, not an error."""
    batches = batches64(9)
    given = Unsized(batches) if wrap == "generator" else torch.utils.data.DataLoader(Stream(batches), batch_size=8)
    assert_bitwise(train(given), accumulated(batches, 4, lambda span: 4))


@pytest.mark.parametrize("kwargs", [dict(defer=True), dict(defer=True, amp=True), dict(amp=True)],
                         ids=["defer", "defer-grad-scaler", "grad-scaler"])
def test_the_device_path_and_a_grad_scaler_weight_the_partial_window_too(kwargs) -> None:
    """defer=True takes the device path on the CPU (torch's SGD is run fused there); a
    GradScaler scales by a power of two, exactly: each matches the per-batch ``loss / k``
    reference bit for bit, and the large-batch one closely."""
    batches = batches64(10)
    got = train(batches, **kwargs)
    torch.testing.assert_close(got, large_batches(batches, 4), **TIGHT)
    assert_bitwise(got, accumulated(batches, 4, len))


def test_the_partial_window_s_scaling_reads_nothing_on_the_device_path() -> None:
    """``loss / k`` is a division by a Python int: on the device path the batches of the
    partial window read the host no more than the others (none, with torch's SGD run fused)."""
    from test_optim_device import default_stack

    counter = default_stack("default", model(), data(10), accumulate=4)  # windows 4, 4, 2
    assert counter.per_batch() == [0] * 9, counter.calls()  # batch 8 is in the partial window


def test_max_steps_inside_the_last_window_leaves_it_to_the_resumed_run(tmp_path) -> None:
    """max_steps=9 with 10 batches and windows of 4: the run ends after batch 8, inside the
    window 8-9, which is not stepped (the run's end cut it, not the data); the checkpoint keeps
    batch 8's gradient, weighted for the window of 2 the data makes. The run resumed there
    starts mid-epoch at batch 9, in the same window, and ends with the parameters of an
    uninterrupted epoch."""
    batches = batches64(10)
    m = model64()

    def run(**options):
        return hookfit.Loop(mse_step, batches, model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
                            max_epochs=1, run_dir=tmp_path, plugins=[Optim(accumulate=4), Checkpoint(background=False)],
                            **options).fit()

    state = run(max_steps=9)
    assert (state.status, state.step) == ("completed", 9)
    torch.testing.assert_close(params(m), large_batches(batches, 4, last=2), **TIGHT)  # windows 0-3 and 4-7
    m = model64()  # the resumed run's own model, which the checkpoint fills
    state = run(resume="latest")
    assert (state.status, state.step) == ("completed", 10)
    torch.testing.assert_close(params(m), large_batches(batches, 4), **TIGHT)
    assert_bitwise(params(m), accumulated(batches, 4, len))


@pytest.mark.parametrize("clear_first", [False, True], ids=["zero_grad-after-step", "zero_grad-at-window-start"])
def test_a_window_the_step_function_keeps_by_hand_resumes_with_its_gradients(tmp_path, clear_first: bool) -> None:
    """Accumulation written in the step function, as scripts port it (``loop.backward(loss / 3)``
    each batch, the optimizers stepped every third batch), with ``Optim()`` accumulating nothing:
    a run that ends inside a window (max_steps=5: batches 3 and 4 of the window 3-5
    back-propagated, not stepped) keeps their gradients in its checkpoint, and the run resumed
    there ends with the parameters of an uninterrupted run, bit for bit. Without them the
    resumed window steps on batch 5's gradient alone."""
    batches = batches64(9)

    def hand_step(loop, batch):
        first = loop.state.batch_idx % 3 == 0
        if clear_first and first:
            loop.optimizers.zero_grad()
        loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
        loop.backward(loss / 3)
        if loop.state.batch_idx % 3 == 2:
            loop.optimizers.step()
            if not clear_first:
                loop.optimizers.zero_grad()
        return {"loss": loss}

    def run(m, **options):
        return hookfit.Loop(hand_step, batches, model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
                            max_epochs=1, run_dir=tmp_path, plugins=[Optim(), Checkpoint(background=False)],
                            **options).fit()

    assert run(model64(), max_steps=5).step == 5
    resumed = model64()  # the resumed run's own model, which the checkpoint fills
    assert run(resumed, resume="latest").step == 9
    assert_bitwise(params(resumed), accumulated(batches, 3, lambda span: 3))


def test_a_failed_batch_s_gradients_are_no_window_the_failed_checkpoint_redoes_it(tmp_path) -> None:
    """A step that fails after ``loop.backward`` and before its step (no accumulation at all): the
    ``failed-*.pt`` checkpoint holds no gradients (they are the failed batch's, not a window's), and
    the run resumed from it redoes the batch and ends as an uninterrupted one, bit for bit."""
    batches = batches64(6)
    fail = {"at": None}

    def failing_step(loop, batch):
        loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
        loop.backward(loss)
        if loop.state.step == fail["at"]:
            fail["at"] = None
            raise RuntimeError("between backward and step")
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    def run(m, folder, **options):
        return hookfit.Loop(failing_step, batches, model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
                            max_epochs=1, run_dir=folder, plugins=[Optim(), Checkpoint(on_failure=True, background=False)],
                            **options).fit()

    uninterrupted = model64()
    run(uninterrupted, tmp_path / "whole")
    fail["at"] = 3
    with pytest.raises(RuntimeError, match="between backward and step"):
        run(model64(), tmp_path / "failed")
    failed = next((tmp_path / "failed" / "checkpoints").glob("failed-*.pt"))
    assert torch.load(failed, weights_only=True)["plugins"]["optim"]["window"] is None
    resumed = model64()
    run(resumed, tmp_path / "failed", resume=str(failed))
    assert_bitwise(params(resumed), params(uninterrupted))


def test_the_epochs_last_partial_window_steps_in_its_last_batch_where_the_step_asks_for_it() -> None:
    """With several optimizers stepped in turn (a GAN's discriminator, then its generator on the
    updated discriminator), the last, partial window must step where the step function steps it,
    as a hand-written loop does, not after the epoch: the generator's loss of batch 4 of 5 is
    computed on the discriminator batch 4 just updated."""
    torch.manual_seed(0)
    d_net, g_net = torch.nn.Linear(3, 1).double(), torch.nn.Linear(2, 3).double()
    noise = [torch.randn(4, 2, dtype=torch.float64) for _ in range(5)]
    real = [torch.randn(4, 3, dtype=torch.float64) for _ in range(5)]
    start = [t.clone() for t in (*d_net.parameters(), *g_net.parameters())]

    def train(hooked: bool) -> list[float]:
        with torch.no_grad():
            for p, s in zip((*d_net.parameters(), *g_net.parameters()), start):
                p.copy_(s)
        opts = {"d": torch.optim.SGD(d_net.parameters(), lr=0.5), "g": torch.optim.SGD(g_net.parameters(), lr=0.5)}
        g_losses: list[float] = []

        def parts(batch: int, step_d, step_g) -> None:
            fake = g_net(noise[batch])
            d_loss = d_net(real[batch]).mean() - d_net(fake.detach()).mean()
            step_d(d_loss, batch)
            g_loss = d_net(fake).mean()
            g_losses.append(g_loss.item())
            step_g(g_loss, batch)

        if hooked:
            def step(loop, batch):
                def stepper(name):
                    def go(loss, b):
                        with loop.optimizers.toggle(name):
                            loop.backward(loss)
                        loop.optimizers[name].step()
                        loop.optimizers[name].zero_grad()
                    return go
                parts(batch, stepper("d"), stepper("g"))
            hookfit.Loop(step, list(range(5)), optimizers=opts, plugins=[Optim(accumulate=2)]).fit()
        else:  # by hand: windows [0, 1], [2, 3], [4], each optimizer its own gradients
            def by_hand(name, net, other):
                def go(loss, b):
                    for p in other.parameters():
                        p.requires_grad_(False)
                    (loss / (1 if b == 4 else 2)).backward()
                    for p in other.parameters():
                        p.requires_grad_(True)
                    if b % 2 == 1 or b == 4:
                        opts[name].step()
                        opts[name].zero_grad()
                return go
            for b in range(5):
                parts(b, by_hand("d", d_net, g_net), by_hand("g", g_net, d_net))
        return g_losses

    assert train(hooked=True) == train(hooked=False)


@pytest.mark.fault
@pytest.mark.parametrize("bad", [(5,), (5, 6)])
def test_a_windows_skip_names_the_batch_whose_loss_was_not_finite_not_the_windows_last(bad) -> None:
    """accumulate=4 on the CPU check: a NaN loss at batch_idx 5 skips the window of batch_idx 4-7, and the warning,
    the skip's event and ``first_skip`` name its batch, counted from 1 as every message counts them: batch 6 (the
    first such batch of the window), where the step was asked at batch_idx 7."""
    m, skips = model(), Skips()

    def step(loop, batch):
        loss = mse(m, batch) * (float("nan") if loop.state.batch_idx in bad else 1.0)
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return loss

    with pytest.warns(OptimWarning) as caught:
        state = hookfit.Loop(step, data(10), model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
                             run_dir=None, plugins=[Optim(accumulate=4), skips]).fit()
    assert state.results["first_skip"] == "non-finite loss at epoch 1, batch 6"
    assert skips.seen == [("default", "non-finite loss at epoch 1, batch 6", 7)]
    assert any("non-finite loss at epoch 1, batch 6;" in str(w.message) for w in caught)
