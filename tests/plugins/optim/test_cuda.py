"""On a CUDA device: an epoch of the default stack makes no host-device synchronisation.

These tests need a GPU and are skipped without one (this project's CI machine has none; the
CPU side of the same claim, counted through the same code path, is tests/test_optim_device.py).
``torch.cuda.set_sync_debug_mode("error")`` makes every synchronising CUDA call raise, the
ones made in C++ included, so a read that the CPU counter cannot see fails here too."""

from __future__ import annotations

from io import StringIO

import pytest
import torch

import hookfit
from hookfit.plugins.console import Console
from hookfit.plugins.interrupter import Interrupter
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim, OptimWarning
from test_optim_device import nan_at as step_with_nan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class NoSyncInTraining:
    """Sets the sync debug mode to ``"error"`` from the first training batch's start until the
    training stage ends (before any plugin's ``stage_end``: the epoch summary reads by design),
    and records how many training batches ran under it."""

    def __init__(self) -> None:
        self.batches = 0

    @hookfit.hookimpl(trylast=True)
    def batch_start(self, loop) -> None:
        if loop.training:
            if not self.batches:  # what was queued before the epoch is not the epoch's
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            self.batches += 1

    @hookfit.hookimpl(wrapper=True)
    def stage_end(self, stage):
        torch.cuda.set_sync_debug_mode("default")
        return (yield)


def default_stack(opt_factory, nan_at: set[int] = frozenset(), n: int = 32, **optim):
    """An epoch of optim, metrics (no publication inside the epoch: a publication is a host
    read by design), console and interrupter on a small model on the GPU, with batches made
    there beforehand (copying a pageable CPU batch to the device synchronises)."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    batches = [(torch.randn(64, 32, generator=g).to(device), torch.randn(64, 1, generator=g).to(device))
               for _ in range(n)]
    opt = opt_factory(m)
    watch = NoSyncInTraining()
    try:
        state = hookfit.Loop(step_with_nan(m, set(nan_at)), batches, model=m, optimizers=opt, max_epochs=1,
                             plugins=[Optim(**optim), Metrics(interval=3600.0),
                                      Console(stream=StringIO()), Interrupter(signals=False), watch]).fit()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return state, watch, m, opt


@pytest.mark.parametrize("factory", [
    pytest.param(lambda m: torch.optim.SGD(m.parameters(), lr=0.01), id="sgd"),
    pytest.param(lambda m: torch.optim.Adam(m.parameters(), lr=1e-3), id="adam"),
    pytest.param(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), id="adamw"),
])
def test_an_epoch_of_the_default_stack_makes_no_host_device_sync(factory) -> None:
    state, watch, m, opt = default_stack(factory)
    assert state.status == "completed", state.stop_reason
    assert watch.batches == 32
    assert all(group["fused"] for group in opt.param_groups)  # optim ran torch's fused kernel


def test_clipping_by_norm_adds_no_sync() -> None:
    """The gradient check that clipping makes is a device flag joined to found_inf."""
    state, watch, m, opt = default_stack(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), clip_norm=1.0)
    assert state.status == "completed" and watch.batches == 32


def test_a_nonfinite_loss_is_skipped_on_the_device_and_reported_after_the_epoch() -> None:
    with pytest.warns(OptimWarning, match=r"non-finite loss at epoch 1, batch 6 \(skipped on the device"):
        state, watch, m, opt = default_stack(lambda m: torch.optim.Adam(m.parameters(), lr=1e-3), nan_at={5})
    assert state.status == "completed" and watch.batches == 32
    assert all(torch.isfinite(p).all() for p in m.parameters())
