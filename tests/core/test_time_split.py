"""Where the time goes: the loop splits each stage's time into waiting for data, the step and
plugins (``loop.state.time_split``), the console says it at the end, and ``run.jsonl`` keeps it.

Slow parts sleep for a known time (``time.sleep`` never returns early), so the slow part's
seconds have a floor; shares are compared with wide margins, for a loaded machine."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import socket
import time
import warnings
from pathlib import Path

import pytest
import torch

import hookfit
from hookfit.files import FileWarning
from hookfit.payloads import TimeSplit
from hookfit.plugins.console import Console
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.metrics_log import MetricsLog
from hookfit.plugins.support import faster_data
from hookfit.run import Run

from conftest import StopAfter
from conftest import resumable_run

NAP = 0.02  # seconds a slow part sleeps, once a batch
N = 6  # batches a stage


class SlowData:
    """Re-iterable data whose iterator's ``__next__`` sleeps ``nap`` seconds before each of its
    ``n`` batches, and before saying there are no more (a data loader that cannot keep up)."""

    def __init__(self, n: int = N, nap: float = NAP) -> None:
        self.n, self.nap = n, nap

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> SlowData._Iter:
        return SlowData._Iter(self.n, self.nap)

    class _Iter:
        def __init__(self, n: int, nap: float) -> None:
            self.left, self.nap = n, nap

        def __iter__(self) -> SlowData._Iter:
            return self

        def __next__(self) -> torch.Tensor:
            time.sleep(self.nap)
            if not self.left:
                raise StopIteration
            self.left -= 1
            return torch.zeros(2)


def quick(loop, batch):
    return None


def slow_step(loop, batch):
    time.sleep(NAP)
    return {"loss": torch.tensor(1.0)}


def slow_event(event: str) -> object:
    """A plugin that sleeps in one per-batch event."""

    def nap(self) -> None:
        time.sleep(NAP)

    return type(f"Slow_{event}", (), {"name": "slow_event", event: hookfit.hookimpl(nap)})()


class Seen:
    """Records ``loop.state.time_split`` at ``batch_end`` (the live view), ``stage_end`` and
    ``fit_end``."""

    name = "seen"

    def __init__(self) -> None:
        self.live: list[TimeSplit | None] = []
        self.at_stage_end: list[tuple[str, TimeSplit]] = []
        self.at_fit_end = None

    @hookfit.hookimpl
    def batch_end(self, loop):
        self.live.append(loop.state.time_split.get(loop.state.stage))

    @hookfit.hookimpl
    def stage_end(self, loop, stage):
        self.at_stage_end.append((stage, loop.state.time_split[stage]))

    @hookfit.hookimpl
    def fit_end(self, loop):
        self.at_fit_end = loop.state.time_split


def split_of(state: hookfit.State, stage: str = "train") -> TimeSplit:
    return state.time_split[stage]


# -- the split itself -------------------------------------------------------------------------

def test_a_data_loader_that_sleeps_in_next_makes_data_the_largest_share() -> None:
    state = hookfit.Loop(quick, SlowData()).fit()
    split = split_of(state)
    assert split.batches == N
    # every nap was waited for in next(), the one of the call that ended the stage included
    assert split.data >= 0.95 * (N + 1) * NAP
    assert split.shares["data"] > 0.5 and split.data > 5 * split.step
    assert list(state.time_split) == ["train"]  # no validation: no entry for it


def test_a_slow_step_makes_step_the_largest_share() -> None:
    state = hookfit.Loop(slow_step, [torch.zeros(2)] * N, plugins=[Metrics()]).fit()
    split = split_of(state)
    assert split.step >= 0.95 * N * NAP
    assert split.shares["step"] > 0.5 and split.step > 5 * split.data


@pytest.mark.parametrize("event", ["batch_start", "step_output", "batch_end"])
def test_a_slow_per_batch_plugin_makes_plugins_the_largest_share(event: str) -> None:
    state = hookfit.Loop(lambda l, b: {"loss": 1.0}, [torch.zeros(2)] * N, plugins=[slow_event(event)]).fit()
    split = split_of(state)
    assert split.plugins >= 0.95 * N * NAP
    # batch_start runs after next() and before the step: neither data nor step
    assert split.shares["plugins"] > 0.5 and split.plugins > 5 * (split.data + split.step)


def test_the_optimizers_work_inside_the_step_counts_as_step() -> None:
    """Stepping through the optim plugin (loop.backward, loop.optimizers.step) happens inside
    the step function: it is the step's time, not the plugins'."""
    from hookfit.plugins.optim import Optim

    class SlowSGD(torch.optim.SGD):
        def step(self, closure=None):
            time.sleep(NAP)
            return super().step(closure)

    model = torch.nn.Linear(2, 1)

    def step(loop, batch):
        loss = loop.model(batch).sum()
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return loss

    state = hookfit.Loop(step, [torch.zeros(2)] * N, model=model, optimizers=SlowSGD(model.parameters(), lr=0.1),
                         plugins=[Optim()]).fit()
    split = split_of(state)
    assert split.step >= 0.95 * N * NAP and split.shares["step"] > 0.5


def test_validation_is_a_stage_of_its_own_and_epochs_add_up() -> None:
    seen = Seen()
    state = hookfit.Loop(quick, [torch.zeros(2)] * 3, val_step=quick, val_data=SlowData(2), max_epochs=2,
                         plugins=[seen]).fit()
    train, valid = split_of(state, "train"), split_of(state, "valid")
    assert (train.batches, valid.batches) == (6, 4)  # summed over both epochs
    assert valid.data >= 0.95 * 4 * NAP and valid.shares["data"] > 0.5
    assert train.total < valid.data / 2  # the slow validation data is not the training stage's
    # stage_end sees its stage's batches counted, the earlier epochs' included
    assert [(stage, split.batches) for stage, split in seen.at_stage_end] == [
        ("train", 3), ("valid", 2), ("train", 6), ("valid", 4)]
    assert seen.at_fit_end is state.time_split


def test_a_validation_inside_the_training_stage_is_not_counted_as_training() -> None:
    state = hookfit.Loop(quick, [torch.zeros(2)] * 4, val_step=slow_step, val_data=[torch.zeros(2)] * 2,
                         val_every_n_steps=2, val_every_n_epochs=None).fit()
    train, valid = split_of(state, "train"), split_of(state, "valid")
    assert (train.batches, valid.batches) == (4, 4)  # validated after steps 2 and 4
    assert valid.step >= 0.95 * 4 * NAP
    assert train.total < valid.step / 2


def test_the_split_is_kept_when_a_stage_is_cut_short_by_a_stop_or_max_steps() -> None:
    seen = Seen()
    state = hookfit.Loop(quick, SlowData(), max_epochs=3, plugins=[StopAfter(4), seen]).fit()
    assert state.status == "interrupted" and split_of(state).batches == 4
    assert seen.at_fit_end["train"].data >= 0.95 * 4 * NAP
    state = hookfit.Loop(quick, SlowData(), max_epochs=3, max_steps=N + 2).fit()
    assert state.status == "completed" and split_of(state).batches == N + 2


@pytest.mark.fault
def test_a_failing_step_leaves_the_split_of_what_ran(tmp_path: Path) -> None:
    def step(loop, batch):
        if loop.state.batch_idx == 3:
            raise RuntimeError("boom")
        time.sleep(NAP)

    with pytest.raises(RuntimeError, match="boom"):
        hookfit.Loop(step, [torch.zeros(2)] * N, run_dir=tmp_path, plugins=[Metrics(), MetricsLog()]).fit()
    end = records(tmp_path)[-1]
    assert (end["event"], end["status"]) == ("end", "failed") and end["reason"] == "RuntimeError: boom"
    train = end["time_split"]["train"]
    assert train["batches"] == 4 and train["step"] >= 0.95 * 3 * NAP


@pytest.mark.fault
def test_the_time_of_a_step_that_raises_is_the_steps(tmp_path: Path) -> None:
    """A step that works a while and then raises (a misnamed optimizer after the backward pass) is
    counted as step, not as plugins, in the split its failed run keeps."""
    def step(loop, batch):
        time.sleep(3 * NAP)
        raise KeyError("dsic")

    with pytest.raises(KeyError):
        hookfit.Loop(step, [torch.zeros(2)] * N, run_dir=tmp_path, plugins=[Metrics(), MetricsLog()]).fit()
    train = records(tmp_path)[-1]["time_split"]["train"]
    assert train["step"] >= 0.95 * 3 * NAP and train["plugins"] < train["step"] / 2


@pytest.mark.fault
def test_a_failing_fit_end_is_the_status_the_end_record_keeps(tmp_path: Path) -> None:
    class Broken:
        @hookfit.hookimpl
        def fit_end(self):
            raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        hookfit.Loop(quick, [torch.zeros(2)] * 2, run_dir=tmp_path,
                     plugins=[Metrics(), MetricsLog(), Broken()]).fit()
    end = records(tmp_path)[-1]
    assert (end["event"], end["status"], end["reason"]) == ("end", "failed", "OSError: disk gone")
    assert end["time_split"]["train"]["batches"] == 2


def test_the_live_split_is_a_new_read_only_mapping_each_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a dashboard reads while a stage runs: published after each batch when the
    interval is 0; a mapping already read never changes."""
    monkeypatch.setattr(Run, "TIME_SPLIT_INTERVAL", 0.0)
    seen, kept = Seen(), []

    class Keep:
        @hookfit.hookimpl
        def batch_end(self, loop):
            kept.append(loop.state.time_split)

    state = hookfit.Loop(quick, SlowData(4), plugins=[seen, Keep()]).fit()
    # at batch k's batch_end the batches before it are counted (none yet for the first)
    assert [s and s.batches for s in seen.live] == [None, 1, 2, 3]
    assert [len(m) for m in kept] == [0, 1, 1, 1]  # each mapping as it was when read
    assert seen.live[3].data >= 0.95 * 3 * NAP
    with pytest.raises(TypeError):
        state.time_split["train"] = TimeSplit("train")  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.time_split["train"].data = 0.0  # type: ignore[misc]


def test_without_the_interval_passing_the_split_waits_for_the_stage_end() -> None:
    """The default interval (0.5 s) is not reached by a short stage: nothing is stored per batch."""
    seen = Seen()
    hookfit.Loop(quick, [torch.zeros(2)] * 4, plugins=[seen]).fit()
    assert seen.live == [None] * 4 and seen.at_stage_end[0][1].batches == 4


# -- the payload ---------------------------------------------------------------------------

def test_shares_rows_sums_and_text() -> None:
    split = TimeSplit("train", data=1.0, step=2.5, plugins=0.5, batches=8)
    assert split.total == 4.0 and split.shares == {"data": 0.25, "step": 0.625, "plugins": 0.125}
    assert str(split) == "data=25% step=62% plugins=12%"
    assert split.as_dict() == {"data": 1.0, "step": 2.5, "plugins": 0.5, "batches": 8}
    assert split.row() == {"stage": "train", "data": 1.0, "step": 2.5, "plugins": 0.5, "batches": 8, "time": 4.0,
                           "data_share": 0.25, "step_share": 0.625, "plugins_share": 0.125}
    json.dumps(split.row())
    assert split + split == TimeSplit("train", 2.0, 5.0, 1.0, 16)
    assert TimeSplit("valid").shares == {"data": 0.0, "step": 0.0, "plugins": 0.0}  # nothing measured yet
    assert split.data_bound and not TimeSplit("train", 0.2, 0.8).data_bound and not TimeSplit("valid").data_bound
    # a stage of a few milliseconds names no bottleneck, whatever its shares: they are noise
    assert not TimeSplit("valid", 0.008, 0.002, 0.0, 4).data_bound and TimeSplit("valid", 0.08, 0.02).data_bound


@pytest.mark.bad_input
def test_splits_of_two_stages_do_not_add_up() -> None:
    with pytest.raises(ValueError, match="'valid'.*'train'"):
        TimeSplit("train", 1.0) + TimeSplit("valid", 1.0)


# -- the console's end summary ----------------------------------------------------------------

def console_lines(step, data, **loop) -> list[str]:
    out = io.StringIO()
    hookfit.Loop(step, data, plugins=[Console(stream=out), Metrics()], **loop).fit()
    return out.getvalue().splitlines()


def fields(line: str) -> dict[str, str]:
    return dict(field.split("=", 1) for field in line.split()[2:] if "=" in field)


def test_the_console_ends_with_the_split_and_names_a_slow_data_loader() -> None:
    lines = console_lines(quick, SlowData(), val_step=quick, val_data=[torch.zeros(2)] * 2)
    end = next(i for i, line in enumerate(lines) if line.startswith("hookfit end "))
    times = [line for line in lines if line.startswith("hookfit time ")]
    assert [fields(line)["stage"] for line in times] == ["train", "valid"]
    assert all(lines.index(line) > end for line in times)  # after the end line, which is unchanged
    train = fields(times[0])
    assert train["batches"] == str(N) and int(train["data"].rstrip("%")) > 50
    assert sum(int(train[p].rstrip("%")) for p in ("data", "step", "plugins")) in (99, 100, 101)
    (warning,) = [line for line in lines if line.startswith("hookfit bottleneck ")]
    assert lines[-1] == warning
    assert 'stage=train part=data' in warning
    share = fields(warning)["share"]
    assert f'message="data loading is {share} of training time: the data loader is the bottleneck' in warning


class SlowItems(torch.utils.data.Dataset):
    """A map-style dataset whose items take ``NAP`` seconds each to make."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(NAP)
        return torch.zeros(2)


def test_the_bottleneck_advice_fits_how_the_data_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """More workers for a DataLoader that has some, not "try num_workers"; workers kept between epochs
    where they start every epoch; a DataLoader where the data is none; ``pin_memory`` only with an
    accelerator, and no more workers than cores."""
    from torch.utils.data import DataLoader

    lines = console_lines(quick, DataLoader(SlowItems(), batch_size=None, num_workers=1), max_epochs=2)
    (warning,) = [line for line in lines if line.startswith("hookfit bottleneck ")]
    assert ("the data loader is the bottleneck (try more workers than 1, a larger prefetch_factor, "
            "persistent_workers=True (its workers start every epoch))") in warning
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)  # a CPU-only machine
    assert faster_data(DataLoader(SlowItems())) == "try DataLoader num_workers"  # (pinning copies to nothing)
    assert faster_data(SlowData()) == "try a torch DataLoader with num_workers"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(2)))  # two cores
    assert faster_data(DataLoader(SlowItems(), num_workers=2, persistent_workers=True)) == (
        "its 2 workers have the 2 cores already: try cheaper items (decode or augment less per item), "
        "a larger prefetch_factor")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)  # a machine with a GPU, 8 cores
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert faster_data(DataLoader(SlowItems(), num_workers=2, persistent_workers=True)) == (
        "try more workers than 2, a larger prefetch_factor")
    assert faster_data(DataLoader(SlowItems())) == "try DataLoader num_workers, pin_memory"
    assert faster_data(SlowData()) == "try a torch DataLoader with num_workers, pin_memory"


def test_the_console_does_not_blame_the_data_loader_of_a_slow_step() -> None:
    lines = console_lines(slow_step, [torch.zeros(2)] * N)
    (line,) = [line for line in lines if line.startswith("hookfit time ")]
    assert int(fields(line)["step"].rstrip("%")) > 50
    assert not [line for line in lines if line.startswith("hookfit bottleneck")]


# -- the run folder ---------------------------------------------------------------------------

def records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "run.jsonl").read_text().splitlines()]


def test_run_jsonl_gets_an_end_record_with_the_split(tmp_path: Path) -> None:
    state = hookfit.Loop(quick, SlowData(), val_step=quick, val_data=[torch.zeros(2)] * 2, max_epochs=2,
                         run_dir=tmp_path, plugins=[Metrics(), MetricsLog()]).fit()
    start, end = records(tmp_path)
    assert start["event"] == "run" and start["pid"] == os.getpid() and start["host"] == socket.gethostname()
    assert set(end) == {"event", "status", "reason", "by", "duration", "epochs", "steps", "time_split", "pid", "results"}
    assert (end["event"], end["status"], end["reason"], end["by"]) == ("end", "completed", "max_epochs=2 reached", None)
    assert (end["epochs"], end["steps"], end["pid"]) == (2, 2 * N, os.getpid())
    assert end["duration"] == round(state.elapsed, 3) and end["duration"] >= 0.95 * 2 * N * NAP
    assert set(end["time_split"]) == {"train", "valid"}
    assert end["time_split"]["train"] == state.time_split["train"].as_dict()
    assert end["time_split"]["train"]["batches"] == 2 * N and end["time_split"]["valid"]["batches"] == 4
    assert end["time_split"]["train"]["data"] >= 0.95 * 2 * N * NAP


def test_a_run_without_a_folder_gets_none_for_its_end_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    state = hookfit.Loop(quick, [torch.zeros(2)] * 2).fit()  # no plugin asked for run_dir
    assert state.time_split["train"].batches == 2
    assert list(tmp_path.iterdir()) == []


def test_a_resumed_run_appends_its_own_start_and_end(tmp_path: Path) -> None:
    stopped, _, _ = resumable_run(tmp_path, stop=10)  # 7 training + 2 validation batches an epoch
    assert stopped.state.status == "interrupted"
    resumed, _, _ = resumable_run(tmp_path, resume="latest")
    assert resumed.state.status == "completed"
    events = records(tmp_path)
    assert [r["event"] for r in events] == ["run", "end", "run", "end"]
    first, second = events[1], events[3]
    assert (first["status"], second["status"]) == ("interrupted", "completed")
    assert (first["steps"], second["steps"]) == (8, 21)
    # each fit() counts its own batches: together, every training batch of the three epochs once
    assert first["time_split"]["train"]["batches"] + second["time_split"]["train"]["batches"] == 21
    assert (first["time_split"]["valid"]["batches"], second["time_split"]["valid"]["batches"]) == (2, 4)


class SlowStart:
    """Data whose first ``slow`` batches take ``nap`` seconds each to come, the rest none."""

    def __init__(self, slow: int, nap: float) -> None:
        self.slow, self.nap = slow, nap

    def __len__(self) -> int:
        return N

    def __iter__(self):
        for i in range(N):
            if i < self.slow:
                time.sleep(self.nap)
            yield torch.zeros(2)


def test_a_resumed_stage_does_not_count_passing_the_batches_done_as_waiting_for_data(tmp_path: Path) -> None:
    """Passing the batches done before the checkpoint (slow here: they are drawn again) is the resume's
    time: the resumed stage's split, and its bottleneck, are its own batches'."""
    from hookfit.plugins.checkpoint import Checkpoint

    data, nap = SlowStart(4, 0.3), 0.3

    def run(**options) -> hookfit.State:
        return hookfit.Loop(quick, data, model=torch.nn.Linear(2, 1), run_dir=tmp_path, max_epochs=1,
                            plugins=[Checkpoint(background=False), *options.pop("plugins", [])], **options).fit()

    assert run(plugins=[StopAfter(4)]).status == "interrupted"
    resumed = run(resume="latest")
    assert resumed.status == "completed" and resumed.step == N
    split = resumed.time_split["train"]
    assert split.batches == N - 4
    # the 1.2 s at least (a sleep never returns early) of passing the four batches again is the run's, not the stage's
    assert resumed.elapsed - split.total >= 4 * nap, (resumed.elapsed, split)


@pytest.mark.fault
def test_a_read_only_run_folder_warns_once_for_both_records(read_only_folder: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = hookfit.Loop(quick, [torch.zeros(2)] * 2, run_dir=read_only_folder,
                             plugins=[Metrics(), MetricsLog()]).fit()
    assert state.status == "completed" and state.time_split["train"].batches == 2
    ours = [w for w in caught if w.category is FileWarning and str(w.message).startswith("hookfit: ")]
    assert len(ours) == 1 and "run.jsonl" in str(ours[0].message)
