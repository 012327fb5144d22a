"""Faults stay inside observers; plugins that take part in training still fail the run."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

import hookfit
from hookfit.plugins.console import Console
from hookfit.plugins.metrics import Metrics




def make_observer(fail_in: str):
    class Flaky:
        name = "flaky"
        observer = True

        def __init__(self) -> None:
            self.calls = 0

        @hookfit.hookimpl
        def batch_end(self, batch_idx):
            self.calls += 1
            if fail_in == "batch_end":
                raise ValueError(f"cannot draw batch {batch_idx}")

        @hookfit.hookimpl
        def fit_end(self):
            if fail_in == "fit_end":
                raise OSError("disk full while writing the summary")

    return Flaky()


def test_an_observer_failing_every_batch_warns_once_and_the_run_completes() -> None:
    observer = make_observer("batch_end")
    out = io.StringIO()
    with pytest.warns(hookfit.ObserverWarning) as caught:
        loop = hookfit.Loop(lambda l, b: {"loss": torch.tensor(1.0)}, range(1000),
                            plugins=[observer, Metrics(log=False), Console(stream=out)])
        state = loop.fit()
    assert state.status == "completed" and state.step == 1000
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "observer plugin 'flaky'" in message and "hook 'batch_end'" in message
    assert "ValueError: cannot draw batch 0" in message
    assert observer.calls == 1  # switched off after the first failure
    assert [(s.plugin, s.hook) for s in state.silenced] == [("flaky", "batch_end")]
    assert 'hookfit silenced plugin=flaky hook=batch_end error="ValueError: cannot draw batch 0"' in out.getvalue()


def test_an_observer_failing_in_fit_end_does_not_fail_the_run() -> None:
    with pytest.warns(hookfit.ObserverWarning, match=r"'flaky'.*'fit_end'.*disk full"):
        state = hookfit.Loop(lambda l, b: None, [1, 2], plugins=[make_observer("fit_end")]).fit()
    assert state.status == "completed" and state.silenced[0].hook == "fit_end"


def test_a_plugin_that_takes_part_still_fails_the_run() -> None:
    class Participant:
        name = "participant"

        @hookfit.hookimpl
        def batch_end(self):
            raise ValueError("participant broke")

    with warnings.catch_warnings():
        warnings.simplefilter("error", hookfit.ObserverWarning)
        with pytest.raises(ValueError, match="participant broke") as info:
            hookfit.Loop(lambda l, b: None, [1], plugins=[Participant()]).fit()
    assert "plugin 'participant'" in " ".join(info.value.__notes__)


def test_builtin_renderers_are_observers() -> None:
    from hookfit.plugins.tui import TuiRenderer

    assert Console.observer is True and TuiRenderer.observer is True
    from hookfit.plugins.optim import Optim

    assert getattr(Optim, "observer", False) is False and getattr(Metrics, "observer", False) is False


def test_isolation_also_holds_on_pluggys_call_path() -> None:
    class Logger:
        name = "logger"
        observer = True
        epochs = 0

        @hookfit.hookimpl
        def epoch_end(self, epoch):
            Logger.epochs += 1
            raise RuntimeError("log server unreachable")

    with pytest.warns(hookfit.ObserverWarning, match="'logger'.*'epoch_end'.*log server unreachable"):
        state = hookfit.Loop(lambda l, b: None, [1], max_epochs=3, plugins=[Logger()]).fit()
    assert state.status == "completed" and Logger.epochs == 1
