"""profile: real torch.profiler runs on a tiny model; the trace holds the schedule's active steps
and nothing else, the printed table names real operators, the end of any run is reported, the
plugin costs nothing unless configured, and a trace that cannot be written does not stop training."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit import hookimpl
from hookfit.config import ConfigError
from hookfit.files import FileWarning
from hookfit.errors import ObserverWarning
from hookfit.plugins.interrupter import Interrupter
from hookfit.plugins.optim import Optim
from hookfit.plugins.profile import Profile

from conftest import StopAfter, mse_step

BATCHES = 8  # training batches per epoch


def make_loop(*plugins: Any, run_dir: Any = "run", batches: int = BATCHES, step: Any = mse_step,
              **kwargs: Any) -> hookfit.Loop:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=generator), torch.randn(4, 1, generator=generator)) for _ in range(batches)]
    kwargs.setdefault("max_epochs", 1)
    return hookfit.Loop(step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                        run_dir=run_dir, plugins=[Optim(), *plugins], **kwargs)


def trace_events(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text())["traceEvents"]


def profiler_steps(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The ``ProfilerStep#N`` spans of a trace, by N."""
    steps = {}
    for event in events:
        found = re.fullmatch(r"ProfilerStep#(\d+)", str(event.get("name", "")))
        if found and event.get("ph") == "X":
            assert int(found.group(1)) not in steps, f"two spans for {event['name']}"
            steps[int(found.group(1))] = event
    return steps


def operators(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("cat") == "cpu_op" and e.get("ph") == "X"]


def within(event: dict[str, Any], span: dict[str, Any]) -> bool:
    return span["ts"] <= event["ts"] and event["ts"] + event["dur"] <= span["ts"] + span["dur"]


def table_rows(text: str) -> dict[str, list[str]]:
    """The rows of the printed table: operator name -> its other columns."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("Name "))
    rows = {}
    for line in lines[start + 2:]:
        if line.startswith("---"):
            break
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = cells[1:]
    return rows


def report_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("hookfit profile ")]


# -- a real run -----------------------------------------------------------------------------


def test_a_short_run_traces_the_active_steps_only_and_prints_the_slowest_operators(
        capsys: pytest.CaptureFixture[str]) -> None:
    profile = Profile(wait=1, warmup=1, active=3)
    loop = make_loop(profile)
    state = loop.fit()
    assert (state.status, state.step) == ("completed", BATCHES)

    folder = (loop.run.run_dir / "profile").absolute()
    (trace,) = profile.traces
    assert trace.parent == folder and trace.name.endswith(".pt.trace.json") and trace.is_file()
    assert sorted(p.name for p in folder.iterdir()) == [trace.name]  # nothing partial, nothing else
    events = trace_events(trace)  # valid JSON, as TensorBoard, Perfetto and chrome://tracing read it
    steps = profiler_steps(events)
    assert sorted(steps) == [2, 3, 4]  # wait 1 (batch 0), warmup 1 (batch 1), active 3
    ops = operators(events)
    assert {"aten::addmm", "aten::linear", "aten::mse_loss"} <= {e["name"] for e in ops}
    first, last = steps[2], steps[4]
    assert all(first["ts"] <= e["ts"] and e["ts"] + e["dur"] <= last["ts"] + last["dur"] for e in ops), \
        "operators recorded outside the active steps"
    assert all(any(within(e, span) for span in steps.values()) for e in ops if e["name"] == "aten::addmm")

    out = capsys.readouterr().out
    lines = report_lines(out)
    assert lines[0] == f"hookfit profile steps=3-5 profiler_steps=2-4 trace={trace}"
    assert lines[1].startswith(f'hookfit profile tensorboard="tensorboard --logdir {folder.parent} ')
    assert "chrome://tracing" in lines[1]
    assert lines[2] == "hookfit profile slowest sort_by=self_cpu_time_total rows=10 recorded_steps=3"
    table = out[out.index(lines[2]) + len(lines[2]):]
    rows = table_rows(table)
    assert len(rows) == 10 and "aten::addmm" in rows
    assert rows["ProfilerStep*"][-1] == "3"  # # of Calls: the three recorded steps
    assert rows["aten::addmm"][-1] == "6"  # two linear layers forward, three steps
    self_cpu = [float(re.sub(r"[a-z]+$", "", cells[1])) * {"us": 1, "ms": 1e3, "s": 1e6}[
        re.search(r"[a-z]+$", cells[1]).group()] for cells in rows.values()]
    assert self_cpu == sorted(self_cpu, reverse=True)  # slowest first


def test_cycles_repeat_each_with_its_trace_and_the_table_adds_them_up() -> None:
    out = io.StringIO()
    profile = Profile(wait=1, warmup=1, active=2, repeat=2, sort_by="cpu_time_total", row_limit=40, stream=out)
    make_loop(profile, batches=10).fit()
    assert [sorted(profiler_steps(trace_events(t))) for t in profile.traces] == [[2, 3], [6, 7]]
    lines = report_lines(out.getvalue())
    assert [re.sub(r" trace=.*", "", line) for line in lines[:2]] == [
        "hookfit profile steps=3-4 profiler_steps=2-3", "hookfit profile steps=7-8 profiler_steps=6-7"]
    assert "recorded_steps=4" in lines[3] and "sort_by=cpu_time_total" in lines[3]
    rows = table_rows(out.getvalue())
    assert rows["ProfilerStep*"][-1] == "4" and rows["aten::linear"][-1] == "8"


def test_validation_does_not_step_the_schedule_and_is_recorded_inside_the_step_it_runs_in() -> None:
    def val_step(loop: Any, batch: Any) -> dict[str, Any]:
        return {"loss": loop.model(batch[0]).cumsum(0).mean()}  # cumsum: an operator only validation runs

    profile = Profile(wait=1, warmup=1, active=3, stream=io.StringIO())
    loop = make_loop(profile, val_step=val_step, val_data=[(torch.randn(4, 8), None)] * 2, val_every_n_steps=4)
    assert loop.fit().status == "completed"
    events = trace_events(profile.traces[0])
    steps = profiler_steps(events)
    assert sorted(steps) == [2, 3, 4]  # training batches 2-4: the nested validation stepped nothing
    validation = [e for e in operators(events) if e["name"] == "aten::cumsum"]
    assert len(validation) == 2  # the validation after step 4 (two batches), inside ProfilerStep#4
    assert all(within(e, steps[4]) for e in validation)


def test_validate_steps_the_schedule_on_validation_batches() -> None:
    out = io.StringIO()
    profile = Profile(wait=0, warmup=1, active=2, stream=out)
    loop = make_loop(profile, val_step=lambda l, b: {"loss": l.model(b[0]).mean()},
                     val_data=[(torch.randn(4, 8), None)] * 5)
    assert loop.validate().status == "completed"
    assert sorted(profiler_steps(trace_events(profile.traces[0]))) == [1, 2]
    assert report_lines(out.getvalue())[0].startswith("hookfit profile steps=2-3 profiler_steps=1-2 trace=")


def test_a_run_that_ends_before_the_active_steps_says_so_and_writes_nothing() -> None:
    out = io.StringIO()
    profile = Profile(wait=2, warmup=1, active=3, stream=out)
    loop = make_loop(profile, batches=3)
    assert loop.fit().status == "completed"
    assert profile.traces == [] and not (loop.run.run_dir / "profile").exists()
    assert out.getvalue() == (
        'hookfit profile nothing_recorded reason="the run ended after 3 training step(s) of this fit(), before '
        'the first active step of the schedule (its training step 4: skip_first=0, wait=2, warmup=1)"\n')


class Raise:
    """The step raises at training batch ``n`` (from 0), or sends this process a SIGINT there."""

    def __init__(self, n: int, signal_instead: bool = False) -> None:
        self.n, self.signal_instead = n, signal_instead

    def __call__(self, loop: Any, batch: Any) -> Any:
        if loop.state.batch_idx == self.n:
            if self.signal_instead:
                signal.raise_signal(signal.SIGINT)  # the interrupter asks for a stop after this batch
            else:
                loop.model(batch[0])  # the forward pass runs, then the step fails
                raise RuntimeError("the step failed")
        return mse_step(loop, batch)


@pytest.mark.parametrize("how", [
    "stop",
    pytest.param("sigint", marks=pytest.mark.fault),
    pytest.param("failure", marks=pytest.mark.fault),
])
def test_a_run_cut_short_in_the_active_steps_still_writes_its_trace_and_prints(how: str) -> None:
    """Batches 0-3 run (4 with a failure, which fails inside it): the active steps are 2-4."""
    out = io.StringIO()
    profile = Profile(wait=1, warmup=1, active=3, stream=out)
    if how == "stop":
        loop = make_loop(profile, StopAfter(4))
    elif how == "sigint":
        loop = make_loop(profile, Interrupter(exit=False), step=Raise(3, signal_instead=True))
    else:
        loop = make_loop(profile, step=Raise(4))
    if how == "failure":
        with pytest.raises(RuntimeError, match="the step failed"):
            loop.fit()
    else:
        loop.fit()
    assert (loop.state.status, loop.state.step) == ({"failure": "failed"}.get(how, "interrupted"), 4)
    assert not torch.autograd._profiler_enabled()  # stopped, whatever happened
    (trace,) = profile.traces
    steps = profiler_steps(trace_events(trace))
    # the steps recorded, and the one the run ended in: the failed batch, or what ran after the last
    assert sorted(steps) == [2, 3, 4]
    names = {e["name"] for e in operators(trace_events(trace)) if within(e, steps[4])}
    assert ("aten::addmm" in names) is (how == "failure")  # the failed batch ran its forward pass
    lines = report_lines(out.getvalue())
    assert lines[0] == (f'hookfit profile steps=3-4 profiler_steps=2-3 cut_short="the run ended after 2 of the 3 '
                        f'active steps; ProfilerStep#4 holds the rest of the run" trace={trace}')
    assert "aten::addmm" in table_rows(out.getvalue())


# -- inert unless configured ------------------------------------------------------------------


class Costs:
    """What the run resolved once it started: is the plugin there, does any hook of it run?"""

    name = "costs"

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    @hookimpl
    def fit_start(self, loop: Any) -> None:
        plugin = self.seen["plugin"] = loop.pm.infos["profile"].plugin
        self.seen.update(registered=loop.pm.get_plugin("profile") is not None,
                         hooks=sorted(n for n, c in vars(loop.pm.hook).items()
                                      if any(i.plugin is plugin for i in c.get_hookimpls())),
                         batch_end=loop.hooks.batch_end)


def test_discovered_without_options_it_unregisters_itself_and_costs_nothing(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HOOKFIT_PLUGINS", "profile")
    costs = Costs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # inert: not a word
        loop = make_loop(costs)
        loop.fit()
    assert isinstance(costs.seen["plugin"], Profile)
    assert costs.seen["registered"] is False and costs.seen["hooks"] == []
    assert costs.seen["batch_end"] is None  # optim implements none: no call per batch at all
    assert not (loop.run.run_dir / "profile").exists() and "profile" not in capsys.readouterr().out

    # the same probe sees one given to Loop, with the defaults
    costs = Costs()
    make_loop(Profile(stream=io.StringIO()), costs).fit()
    assert costs.seen["registered"] is True
    assert {"configure", "stage_start", "batch_end", "fit_end"} <= set(costs.seen["hooks"])


@pytest.mark.parametrize("table, active", [("", 3), ("active = 2\nwait = 0\n", 2)])
def test_a_table_in_the_configuration_file_switches_it_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                           table: str, active: int) -> None:
    """An empty ``[plugins.profile]`` table reaches the plugin as no options at all: it is on too."""
    (tmp_path / "run.toml").write_text(f"[plugins.profile]\n{table}")
    monkeypatch.setenv("HOOKFIT_CONFIG", str(tmp_path / "run.toml"))
    monkeypatch.setenv("HOOKFIT_PLUGINS", "profile")
    loop = make_loop()
    loop.fit()
    plugin = loop.run.pm.infos["profile"].plugin
    assert loop.run.pm.get_plugin("profile") is plugin and plugin.active == active
    assert len(profiler_steps(trace_events(plugin.traces[0]))) == active


def test_only_the_main_process_profiles() -> None:
    class Rank1:
        name = "rank1"

        @hookimpl(tryfirst=True)
        def configure(self, loop: Any) -> None:
            loop.state.rank, loop.state.world_size = 1, 2

    profile = Profile(stream=io.StringIO())
    loop = make_loop(profile, Rank1(), run_dir=None)
    loop.fit()
    assert loop.run.pm.get_plugin("profile") is None and profile.traces == [] and profile.stream.getvalue() == ""


# -- bad options -----------------------------------------------------------------------------


@pytest.mark.bad_input
@pytest.mark.parametrize("options, message", [
    ({"wait": -1}, r"profile: wait must be an integer >= 0 \(training steps skipped .*\), got -1"),
    ({"warmup": 1.5}, r"profile: warmup must be an integer >= 0 .*got 1.5"),
    ({"active": 0}, r"profile: active must be an integer >= 1 \(training steps recorded in each cycle\), got 0"),
    ({"repeat": True}, r"profile: repeat must be an integer >= 0 .*got True"),
    ({"skip_first": "2"}, r"profile: skip_first must be an integer >= 0 .*got '2'"),
    ({"record_shapes": 1}, r"profile: record_shapes must be True or False, got 1"),
    ({"profile_memory": "yes"}, r"profile: profile_memory must be True or False, got 'yes'"),
    ({"with_stack": None}, r"profile: with_stack must be True or False, got None"),
    ({"sort_by": "cpu_time_totl"}, r"profile: sort_by must be one of self_cpu_time_total, .*got 'cpu_time_totl'"),
    ({"row_limit": 0}, r"profile: row_limit must be an integer >= 1 \(rows of the table .*\), got 0"),
    ({"stream": "out.txt"}, r"profile: stream must be a text stream \(with write\(\)\), .*got str"),
])
def test_bad_options_are_refused_at_construction_naming_the_option(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Profile(**options)


@pytest.mark.bad_input
def test_a_bad_option_in_the_configuration_file_names_the_file_and_the_option(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text("[plugins.profile]\nactive = 0\n")
    monkeypatch.setenv("HOOKFIT_CONFIG", str(tmp_path / "run.toml"))
    monkeypatch.setenv("HOOKFIT_PLUGINS", "profile")
    with pytest.raises(ConfigError, match=r"run.toml \[plugins.profile\]: profile: active must be an integer >= 1"):
        make_loop().fit()


# -- faults ----------------------------------------------------------------------------------


@pytest.mark.fault
def test_a_read_only_run_folder_warns_once_and_training_goes_on(read_only_folder: Path) -> None:
    out = io.StringIO()
    profile = Profile(wait=0, warmup=1, active=1, repeat=2, stream=out)  # two cycles: two traces to write
    with pytest.warns(FileWarning) as caught:
        state = make_loop(profile, run_dir=read_only_folder).fit()
    assert (state.status, state.step) == ("completed", BATCHES)
    (mine,) = [w for w in caught if str(w.message).startswith("profile: ")]  # once, for two cycles
    message = str(mine.message)
    assert re.match(rf"profile: could not write {re.escape(str(read_only_folder))}/profile/\S+\.pt\.trace\.json "
                    r"\(\w+Error: .*(Read-only|Permission denied)", message), message
    assert message.endswith("training goes on without this trace")
    assert profile.traces == [] and list(read_only_folder.iterdir()) == []
    lines = report_lines(out.getvalue())
    assert lines[0].startswith("hookfit profile steps=2 profiler_steps=1 trace_not_written=")
    assert 'trace_not_written="not tried after an earlier trace could not be written"' in lines[1]
    assert "aten::addmm" in table_rows(out.getvalue())  # the operators are counted all the same


@pytest.fixture
def full_folder(tmp_path: Path):
    """A folder on a small tmpfs filled to the last byte: every write fails with ENOSPC."""
    folder = tmp_path / "run" / "profile"
    folder.mkdir(parents=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        with open(folder / "filler", "wb", buffering=0) as filler:
            with pytest.raises(OSError, match="No space left"):
                while True:
                    filler.write(b"\0" * 4096)
        yield folder
    finally:
        subprocess.run(["umount", str(folder)])


@pytest.mark.fault
def test_a_full_disk_warns_leaves_no_partial_trace_and_training_goes_on(full_folder: Path) -> None:
    out = io.StringIO()
    profile = Profile(stream=out)
    with pytest.warns(FileWarning, match=r"profile: could not write .*\.pt\.trace\.json \(OSError: \[Errno 28\] "
                                         r"No space left on device") as caught:
        state = make_loop(profile, run_dir=full_folder.parent).fit()
    assert state.status == "completed" and len([w for w in caught if w.category is FileWarning]) == 1
    assert sorted(p.name for p in full_folder.iterdir()) == ["filler"]  # no torn trace left behind
    assert "trace_not_written=" in report_lines(out.getvalue())[0]


@pytest.mark.fault
def test_if_it_fails_it_is_switched_off_the_profiler_stopped_and_training_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    step = torch.profiler.profile.step

    def broken(self: Any) -> None:
        if self.step_num == 3:  # while it records
            raise RuntimeError("the profiler broke")
        step(self)

    monkeypatch.setattr(torch.profiler.profile, "step", broken)
    profile = Profile(stream=io.StringIO())
    with pytest.warns(ObserverWarning, match=r"observer plugin 'profile' .* failed in hook 'batch_end'.*"
                                             r"the profiler broke"):
        state = make_loop(profile).fit()
    assert (state.status, state.step) == ("completed", BATCHES)
    assert [s.plugin for s in state.silenced] == ["profile"]
    assert not torch.autograd._profiler_enabled()
    with torch.profiler.profile():  # nothing of it is left running: another profiler starts
        torch.ones(1).add_(1)
