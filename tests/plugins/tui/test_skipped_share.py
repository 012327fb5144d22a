"""The dashboard's share of skipped steps (``N of M steps skipped``, ``mostly skipped``) is the
console's ``hookfit skipped`` line's: the optimizer with the largest share of its own steps skipped,
over the steps it attempted (:mod:`hookfit.plugins.support.skips`), not the run's batches. Built on
the dashboard's model alone (no terminal): :class:`Feed` hands it, from a real run, the messages the
renderer sends about skipped steps."""

from __future__ import annotations

import io
import re
import warnings
from typing import Any

import pytest
import torch

import hookfit
from hookfit.plugins.console import Console
from hookfit.plugins.optim import Optim
from hookfit.plugins.support import skips
from hookfit.plugins.tui.model import DashboardModel
from hookfit.plugins.tui.text import summary


def model() -> DashboardModel:
    return DashboardModel(1, None, on_stop=lambda: None, on_leave=lambda: None)


class Feed:
    """What the renderer tells its model of a run's skipped steps: each optimizer's steps attempted at
    ``fit_start`` and at ``fit_end`` (after optim's), every ``step_skipped``, and the end; with the
    console's ``hookfit skipped`` line and the run's state, for its summary."""

    def __init__(self) -> None:
        self.model, self.state, self.console = model(), None, io.StringIO()

    @hookfit.hookimpl
    def fit_start(self, loop: Any) -> None:
        self.model.receive("attempted", skips.attempted(loop.optimizers), True)

    @hookfit.hookimpl
    def step_skipped(self, optimizer: str, reason: str, step: int) -> None:
        self.model.receive("skipped", step, optimizer, reason)

    @hookfit.hookimpl(trylast=True)
    def fit_end(self, loop: Any) -> None:
        self.state = state = loop.state
        self.model.receive("attempted", skips.attempted(loop.optimizers))
        self.model.receive("end", state.status, state.stop_reason, False, None, state.elapsed, state.step, state.epoch)

    def said(self) -> tuple[str, str, tuple[int, int]]:
        """The console's ``hookfit skipped`` line, the dashboard's summary and ``(N, M)`` of ``N of M steps``
        in its end banner."""
        line = next(line for line in self.console.getvalue().splitlines() if line.startswith("hookfit skipped "))
        banner = self.model.banner()
        found = re.search(r"(\d+) of (\d+) steps", banner[1]) if banner is not None else None
        assert found is not None, banner
        return line, "\n".join(summary(self.model, self.state, width=200)), (int(found[1]), int(found[2]))


def run(bad: set[int], n: int, accumulate: int = 1, every: dict[str, int] | None = None) -> Feed:
    """One epoch of ``n`` batches whose loss is NaN at the batch indices ``bad``: one optimizer, or (``every``) one
    per parameter of a linear model, each stepped at the batches its number divides (``{"weight": 1, "bias": 2}``:
    the bias at every second batch)."""
    net = torch.nn.Linear(2, 1)
    steps = every or {"default": 1}
    opts: Any = ({name: torch.optim.SGD([getattr(net, name)], lr=0.1) for name in steps} if every
                 else torch.optim.SGD(net.parameters(), lr=0.1))

    def step(loop: Any, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        i = loop.state.batch_idx
        loss = net(batch).mean() * (float("nan") if i in bad else 1.0)
        loop.backward(loss)
        for name, each in steps.items():
            if (i + 1) % each == 0:
                loop.optimizers[name].step()
        for name in steps:
            loop.optimizers[name].zero_grad()
        return {"loss": loss}

    feed = Feed()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # optim's warning about the first skip
        hookfit.Loop(step, [torch.ones(2, 2)] * n, model=net, optimizers=opts, max_epochs=1, run_dir=None,
                     plugins=[Optim(accumulate=accumulate), Console(stream=feed.console), feed]).fit()
    return feed


@pytest.mark.fault
def test_two_optimizers_show_the_share_of_the_one_that_skipped_most_of_its_own_steps() -> None:
    """The weight stepped at each of 20 batches, the bias at every second (10 steps); NaN losses at 3 batches both
    step at: the weight skipped 3 of its 20 steps, the bias 3 of its 10 (30 %), which the dashboard names, as the
    console does, and not 3 of the run's 20 steps; 30 % is not "mostly skipped"."""
    feed = run({1, 5, 9}, 20, every={"weight": 1, "bias": 2})
    line, text, counts = feed.said()
    d = feed.model
    assert "steps=6 share=30% optimizer=bias" in line, line
    assert counts == (3, 10)
    assert "  3 of 10 steps of optimizer 'bias' skipped (non-finite loss)\n" in text, text
    assert not d.mostly_skipped and d.state_word() == "completed"


@pytest.mark.fault
def test_accumulation_windows_are_the_steps_and_most_of_them_skipped_is_mostly_skipped() -> None:
    """accumulate=8 over 40 batches, NaN losses in 3 of the 5 windows: 3 of 5 steps skipped (60 %), the
    console's share, and the run is "mostly skipped"; not 3 of 40 batches."""
    feed = run({2, 10, 20}, 40, accumulate=8)
    line, text, counts = feed.said()
    d = feed.model
    assert "steps=3 share=60%" in line and "most steps were skipped" in line, line
    assert counts == (3, 5)
    assert "  3 of 5 steps skipped (non-finite loss); most of the run did not train" in text, text
    assert d.mostly_skipped and d.state_word() == "completed · mostly skipped"


def test_the_live_share_follows_the_steps_attempted_since_the_run_started_or_resumed() -> None:
    """While the run goes on, the share is of the steps each optimizer attempted by the latest count the
    renderer read: 2 skipped of 3 attempted is most, of 10 it is not; the steps a resumed run's optimizer
    counted before it resumed are not its own. Without any count (a replayed log), the run's steps."""
    d = model()
    d.receive("attempted", {"default": 0}, True)
    d.receive("attempted", {"default": 20}, True)  # resumed: 20 steps of the runs it continues
    d.receive("tick", "train", 0, 22, 22, 0.0)
    d.receive("skipped", 21, "default", "non-finite loss at epoch 1, batch 22")
    d.receive("skipped", 22, "default", "non-finite loss at epoch 1, batch 23")
    d.receive("attempted", {"default": 23})
    assert (d.skipped_text(), d.mostly_skipped) == ("2 of 3 steps skipped (non-finite loss)", True)
    d.receive("attempted", {"default": 30})
    assert (d.skipped_text(), d.mostly_skipped) == ("2 of 10 steps skipped (non-finite loss)", False)
    replayed = model()
    replayed.receive("skipped_total", 3)
    replayed.receive("end", "completed", "max_epochs=1 reached", True, None, 1.0, 5, 0)
    assert (replayed.skipped_text(), replayed.mostly_skipped) == ("3 of 5 steps skipped", True)
