"""hookfit.testing: the pytest plugin plugin authors test with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hookfit
from conftest import Recorder


def test_hookfit_run_fixture_trains_with_exactly_the_given_plugins(hookfit_run, hookfit_recorder) -> None:
    from hookfit.plugins.optim import Optim

    loop = hookfit_run(Optim(), hookfit_recorder)
    assert loop.state.status == "completed"
    assert [n for n, _ in loop.run.pm.list_name_plugin()] == ["optim", "recorder"]
    assert hookfit_recorder.names().count("after_optimizer_step") == 4


def test_the_recorder_records_every_event_with_its_arguments_and_can_stop() -> None:
    recorder = Recorder(stop_after=2)
    state = hookfit.Loop(lambda l, b: {"b": b}, [1, 2, 3], plugins=[recorder]).fit()
    assert state.status == "interrupted" and state.step == 2 and state.stopped_by == "recorder"
    assert recorder.events[:4] == [("configure", {}), ("fit_start", {}), ("epoch_start", {"epoch": 0}),
                                   ("stage_start", {"stage": "train"})]
    assert ("batch_end", {"output": {"b": 2}, "batch": 2, "batch_idx": 1}) in recorder.events
    assert ("batch_start", "train", True) in recorder.seen
    assert "agree_stop" not in recorder.names()  # asked at every boundary only with agree=True
    agreeing = Recorder(agree=True)
    hookfit.Loop(lambda l, b: None, [1], plugins=[agreeing]).fit()
    # asked at the start, after epoch_start, stage_start, the batch, stage_end and epoch_end
    assert agreeing.names().count("agree_stop") == 6


def test_hookfit_isolated_loads_no_discovered_plugin(hookfit_isolated: None) -> None:
    loop = hookfit.Loop(lambda l, b: None, [torch.ones(1)])
    loop.fit()
    assert loop.run.pm.list_name_plugin() == []
    assert {info.name for info in loop.run.pm.infos.values()} >= {"optim", "metrics"}  # known, not loaded


def test_a_recorder_failing_is_a_participant_failure(hookfit_run) -> None:
    """The recorder takes part (it is not an observer): its errors fail the run, as a plugin
    under test should see."""
    class Broken(Recorder):
        def __init__(self) -> None:
            super().__init__()

            def batch_end(loop, output, batch, batch_idx):
                raise RuntimeError("recorder broke")

            self.batch_end = hookfit.hookimpl(batch_end)

    with pytest.raises(RuntimeError, match="recorder broke"):
        hookfit_run(Broken())


def test_hookfit_isolated_keeps_run_folders_out_of_the_project(hookfit_isolated: None, tmp_path) -> None:
    """A test's loop writes its run folder in the test's temporary folder, not where pytest
    was started (the project, whose runs/ would fill up with one folder a test)."""
    from hookfit.plugins.metrics import Metrics
    from hookfit.plugins.metrics_log import MetricsLog

    state = hookfit.Loop(lambda l, b: {"loss": torch.tensor(1.0)}, [torch.ones(1)],
                         plugins=[Metrics(), MetricsLog()]).fit()
    assert state.status == "completed"
    written = list(tmp_path.glob("runs/*/*/metrics.jsonl"))
    assert len(written) == 1 and Path.cwd() == tmp_path, written


def test_hookfit_run_drives_any_plugin_that_owns_the_backward_pass(hookfit_run, hookfit_recorder) -> None:
    """The default step is role-neutral: a replacement optimizer plugin under any name gets
    ``loop.backward`` calls, and the Loop's own keyword names work as the fixture's."""
    calls = []

    class Mine:
        name = "zsam"  # not "optim"

        @hookfit.hookimpl
        def backward(self, loop, loss):
            calls.append(loop.state.batch_idx)
            torch.autograd.backward(loss)
            return True

    loop = hookfit_run(Mine(), hookfit_recorder, train_data=[(torch.ones(2, 3), torch.zeros(2, 1))] * 3)
    assert loop.state.status == "completed" and calls == [0, 1, 2]
    seen = []
    hookfit_run(train_step=lambda l, b: seen.append(b))
    assert len(seen) == 4  # the fixture's own data, with the step given by the Loop's name


@pytest.mark.fault
def test_hookfit_run_fails_the_test_when_a_plugin_was_switched_off(hookfit_run) -> None:
    """An observer under test that raised was a warning the test never saw: `status == "completed"` passed.
    hookfit_run fails the test naming it, unless the test says it expects that."""

    class Buggy:
        name = "buggy"
        observer = True

        @hookfit.hookimpl
        def epoch_end(self):
            raise ZeroDivisionError("bug in my logger")

    with pytest.warns(hookfit.ObserverWarning), pytest.raises(pytest.fail.Exception,
                                                               match=r"plugin 'buggy'.*switched off.*epoch_end.*"
                                                                     r"ZeroDivisionError: bug in my logger"):
        hookfit_run(Buggy(), max_epochs=2)
    with pytest.warns(hookfit.ObserverWarning):
        loop = hookfit_run(Buggy(), max_epochs=2, expect_silenced=True)
    assert [s.plugin for s in loop.state.silenced] == ["buggy"]
