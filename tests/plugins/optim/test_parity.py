"""Parity with a hand-written PyTorch loop, with the default plugin stack as discovered.

Same seed, same data, CPU: the parameters after training are bitwise equal to the raw loop's,
and the validation losses hookfit reports are the ones computed by hand.
"""

from __future__ import annotations

import pytest
import torch

import hookfit
from hookfit.plugins.optim import Optim


@pytest.fixture(autouse=True)
def default_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HOOKFIT_PLUGINS", raising=False)  # every installed plugin, as users get it


def batches(n: int, seed: int, size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 6, generator=g), torch.randn(size, 1, generator=g)) for _ in range(n)]


def net(seed: int = 7) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))


def loss_of(m: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(m(x), y)


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


class ValidLosses:
    name = "valid_losses"

    def __init__(self) -> None:
        self.values: list[float] = []

    @hookfit.hookimpl
    def epoch_metrics(self, stage, metrics):
        if stage == "valid":
            self.values.append(metrics.values["loss"].epoch)


def by_hand_valid(m: torch.nn.Module, valid) -> float:
    m.eval()
    with torch.inference_mode():
        total = sum(loss_of(m, b).item() * len(b[0]) for b in valid)
    m.train()
    return total / sum(len(b[0]) for b in valid)


@pytest.mark.parametrize("case", ["sgd", "adam_clip", "accumulate_4"])
def test_single_optimizer_runs_match_raw_bitwise(case: str) -> None:
    train, valid = batches(10, 0), batches(3, 1, size=5)
    epochs, accumulate = 3, 4 if case == "accumulate_4" else 1
    clip = 0.5 if case == "adam_clip" else None

    def optimizer(m):
        return torch.optim.Adam(m.parameters(), lr=1e-2) if case == "adam_clip" else torch.optim.SGD(m.parameters(), lr=0.05)

    raw = net()
    opt = optimizer(raw)
    expected_valid = []
    for _ in range(epochs):
        for i, b in enumerate(train):
            first = i - i % accumulate  # the window's first batch: the last window holds what is left
            (loss_of(raw, b) / min(accumulate, len(train) - first)).backward()
            if (i + 1) % accumulate == 0 or i == len(train) - 1:
                if clip:
                    torch.nn.utils.clip_grad_norm_(list(raw.parameters()), clip)
                opt.step()
                opt.zero_grad()
        expected_valid.append(by_hand_valid(raw, valid))

    m = net()

    def step(loop, b):
        loss = loss_of(m, b)
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return loss

    reported = ValidLosses()
    loop = hookfit.Loop(step, train, val_step=lambda loop, b: loss_of(m, b), val_data=valid, model=m,
                        optimizers=optimizer(m), max_epochs=epochs,
                        plugins=[Optim(accumulate=accumulate, clip_norm=clip), reported])
    loop.fit()
    assert {"optim", "metrics", "console", "interrupter"} <= {n for n, _ in loop.run.pm.list_name_plugin()}
    assert same(m, raw)
    assert reported.values == expected_valid  # exactly the numbers computed by hand


def test_alternating_gan_optimizers_match_raw_bitwise() -> None:
    def pair():
        torch.manual_seed(11)
        return torch.nn.Linear(4, 2), torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    noise = [torch.randn(8, 4, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    real = [torch.randn(8, 2, generator=torch.Generator().manual_seed(100 + i)) for i in range(8)]
    data = list(zip(noise, real))
    sp = torch.nn.functional.softplus

    g, d = pair()
    og, od = torch.optim.Adam(g.parameters(), 1e-3), torch.optim.Adam(d.parameters(), 1e-3)
    for _ in range(2):
        for z, x in data:
            d_loss = sp(d(g(z).detach())).mean() + sp(-d(x)).mean()
            od.zero_grad(); d_loss.backward(); od.step()
            for p in d.parameters():
                p.requires_grad_(False)
            g_loss = sp(-d(g(z))).mean()
            og.zero_grad(); g_loss.backward(); og.step()
            for p in d.parameters():
                p.requires_grad_(True)

    G, D = pair()

    def step(loop, batch):
        z, x = batch
        opts = loop.optimizers
        d_loss = sp(D(G(z).detach())).mean() + sp(-D(x)).mean()
        opts["d"].zero_grad(); loop.backward(d_loss); opts["d"].step()
        with opts.toggle("g"):
            g_loss = sp(-D(G(z))).mean()
            opts["g"].zero_grad(); loop.backward(g_loss); opts["g"].step()
        return {"d_loss": d_loss, "g_loss": g_loss}

    state = hookfit.Loop(step, data, model={"g": G, "d": D}, max_epochs=2, optimizers={
        "g": torch.optim.Adam(G.parameters(), 1e-3), "d": torch.optim.Adam(D.parameters(), 1e-3)}).fit()
    assert state.status == "completed"
    assert same(G, g) and same(D, d)


def test_the_built_in_plugins_give_the_same_run_in_any_registration_order(tmp_path, monkeypatch) -> None:
    """No built-in relies on names that sort well: given under names of no entry point (so the
    order given is the order registered), optim, metrics, checkpoint, console and a plugin that
    stops the run in epoch_end give bitwise the same parameters, the same published metrics
    (learning rates included), the same console results and the same checkpoints whether they
    are registered in one order or the reverse."""
    import io

    from hookfit.plugins.checkpoint import Checkpoint, read
    from hookfit.plugins.console import Console
    from hookfit.plugins.metrics import Metrics

    monkeypatch.setenv("HOOKFIT_PLUGINS", "")
    train, valid = batches(10, 0), batches(3, 1, size=5)

    class Stop:
        @hookfit.hookimpl
        def epoch_end(self, loop, epoch):
            if epoch == 2:
                loop.request_stop("enough")

    def run(reverse: bool, folder):
        m = net()
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
        out, seen = io.StringIO(), []

        class Seen:
            @hookfit.hookimpl
            def epoch_metrics(self, stage, metrics):
                seen.append((stage, metrics.epoch, dict(metrics.lr), {k: v.epoch for k, v in metrics.values.items()}))

        plugins = [Optim(accumulate=3, schedulers=schedule), Metrics(interval=0.0), Console(stream=out, interval=0),
                   Checkpoint(every_n_steps=4, keep_last=2, monitor="valid/loss", background=False), Stop(), Seen()]
        for i, plugin in enumerate(plugins):
            plugin.name = f"p{i}"

        def step(loop, b):
            loss = loss_of(m, b)
            loop.backward(loss)
            loop.optimizers.step()
            loop.optimizers.zero_grad()
            return loss

        state = hookfit.Loop(step, train, val_step=lambda loop, b: loss_of(m, b), val_data=valid, model=m,
                             optimizers=opt, max_epochs=5, run_dir=folder,
                             plugins=plugins[::-1] if reverse else plugins).fit()
        results = [line for line in out.getvalue().splitlines() if line.startswith(("hookfit result", "hookfit end"))]
        results = [line.split(" duration=")[0] for line in results]
        saved = {p.name: read(p)["model"] for p in sorted((folder / "checkpoints").glob("*.pt"))}
        return state, m, seen, results, saved

    one, other = run(False, tmp_path / "forward"), run(True, tmp_path / "reverse")
    assert (one[0].status, one[0].step, one[0].stop_reason) == ("interrupted", 30, "enough")
    assert (other[0].status, other[0].step, other[0].stop_reason) == ("interrupted", 30, "enough")
    assert same(one[1], other[1])
    assert one[2] == other[2] and len(one[2]) == 6 and one[2][0][2] != one[2][-1][2]  # lr changed
    assert one[3] == other[3] and any("metric=loss" in line for line in one[3])
    assert one[4].keys() == other[4].keys() and len(one[4]) == 3  # the last two (keep_last=2) and the best
    for name in one[4]:
        assert all(torch.equal(one[4][name][k], other[4][name][k]) for k in one[4][name])
