"""metrics aggregation and the console renderer."""

from __future__ import annotations

import csv
import io
import json
import math
import re
import shlex
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit import HookfitWarning
from conftest import saved_run
from hookfit.plugins.console import Console
from hookfit.payloads import MetricsSnapshot
from hookfit.plugins.metrics import Metrics, batch_size
from hookfit.plugins.metrics_log import MetricsLog

from conftest import mse_step


class Collect:
    name = "collect"

    def __init__(self) -> None:
        self.updates: list[MetricsSnapshot] = []
        self.epochs: list[MetricsSnapshot] = []

    @hookfit.hookimpl
    def metrics_update(self, metrics):
        self.updates.append(metrics)

    @hookfit.hookimpl
    def epoch_metrics(self, metrics):
        self.epochs.append(metrics)


def run(step, data, tmp_path, *, metrics=None, val=None, epochs=1, extra=()):
    collect = Collect()
    kwargs = dict(val_step=val, val_data=data) if val else {}
    hookfit.Loop(step, data, max_epochs=epochs, run_dir=tmp_path,
                 plugins=[metrics or Metrics(), collect, *extra], **kwargs).fit()
    return collect


def test_batch_size_weighted_epoch_mean_last_and_running(tmp_path: Path) -> None:
    sizes = [4, 4, 2]
    values = [1.0, 2.0, 10.0]
    data = [torch.zeros(n, 3) for n in sizes]

    def step(loop, batch):
        return {"loss": torch.tensor(values[loop.state.batch_idx]), "count": loop.state.batch_idx}

    got = run(step, data, tmp_path, metrics=Metrics(window=2)).epochs[0]
    loss = got.values["loss"]
    assert loss.epoch == pytest.approx((4 * 1 + 4 * 2 + 2 * 10) / 10)
    assert loss.last == 10.0
    assert loss.running == pytest.approx((4 * 2 + 2 * 10) / 6)  # window of the last 2 batches
    assert got.values["count"].epoch == pytest.approx((0 * 4 + 1 * 4 + 2 * 2) / 10)
    assert got.samples == 10 and got.batches == 3 and got.total == 3 and got.final


def test_explicit_batch_size_wins_and_is_not_a_metric(tmp_path: Path) -> None:
    def step(loop, batch):
        return {"acc": float(batch), "batch_size": 1 if batch == 0 else 3}

    got = run(step, [0, 1], tmp_path).epochs[0]
    assert got.values["acc"].epoch == pytest.approx(0.75) and "batch_size" not in got.values


def test_non_scalar_and_foreign_values_are_ignored(tmp_path: Path) -> None:
    def step(loop, batch):
        return {"loss": torch.tensor([[0.5]]), "vector": torch.ones(3), "name": "x", "flag": None}

    got = run(step, [1, 2], tmp_path).epochs[0]
    assert set(got.values) == {"loss"} and got.values["loss"].epoch == 0.5


def test_train_and_valid_kept_apart_with_history(tmp_path: Path) -> None:
    def step(loop, batch):
        return {"loss": torch.tensor(1.0 if loop.training else 5.0)}

    got = run(step, [1, 2], tmp_path, val=step, epochs=3)
    stages = [(s.stage, s.epoch, s.values["loss"].epoch) for s in got.epochs]
    assert stages == [("train", 0, 1.0), ("valid", 0, 5.0), ("train", 1, 1.0),
                      ("valid", 1, 5.0), ("train", 2, 1.0), ("valid", 2, 5.0)]
    assert [h["loss"] for h in got.epochs[-1].history] == [5.0, 5.0, 5.0]
    with pytest.raises(TypeError):
        got.epochs[-1].values["loss"] = 0  # read-only snapshot


class Clock:
    """The metrics aggregates' clock (``time`` in their module), moved on only by the step functions."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


def test_a_training_stages_time_and_pace_leave_out_the_validations_inside_it(tmp_path: Path, monkeypatch) -> None:
    from hookfit.plugins.metrics import aggregate

    clock = Clock()
    monkeypatch.setattr(aggregate, "time", clock)

    def step(loop, batch):  # a training batch takes 1 s, a validation batch 10 s
        clock.now += 1.0 if loop.training else 10.0
        return {"loss": torch.tensor(1.0), "batch_size": 4}

    collect = Collect()
    hookfit.Loop(step, [1, 2, 3, 4], val_step=step, val_data=[1, 2, 3], val_every_n_steps=2, max_epochs=1,
                 run_dir=tmp_path, plugins=[Metrics(), collect]).fit()
    got = [(s.stage, s.batches, s.elapsed) for s in collect.epochs]
    # two validations inside the epoch (after batches 2 and 4), 3 batches of 10 s each
    assert got == [("valid", 3, 30.0), ("valid", 3, 30.0), ("train", 4, 4.0)]
    assert collect.epochs[-1].samples_per_s == 16 / 4.0  # the training's own pace, not 16 / 64 s


def test_metrics_update_is_rate_bounded(tmp_path: Path) -> None:
    def step(loop, batch):
        return {"loss": torch.tensor(1.0)}

    few = run(step, list(range(3000)), tmp_path, metrics=Metrics(interval=3600)).updates
    many = run(step, list(range(50)), tmp_path, metrics=Metrics(interval=0)).updates
    assert few == [] and len(many) == 50


def test_device_path_reads_the_host_once_per_publication(tmp_path: Path, monkeypatch) -> None:
    """The accelerator path, on CPU: with defer=True no value is read per step; values are
    brought over in one transfer when a snapshot is published."""
    reads = {"item": 0, "tolist": 0}
    item, tolist = torch.Tensor.item, torch.Tensor.tolist

    def counting(name, original):
        def wrapper(self, *a, **k):
            reads[name] += 1
            return original(self, *a, **k)
        return wrapper

    monkeypatch.setattr(torch.Tensor, "item", counting("item", item))
    monkeypatch.setattr(torch.Tensor, "tolist", counting("tolist", tolist))

    def step(loop, batch):
        return {"loss": torch.tensor(float(batch)), "acc": torch.tensor(0.5)}

    got = run(step, list(range(200)), tmp_path, metrics=Metrics(defer=True, interval=3600))
    assert reads == {"item": 0, "tolist": 1}  # one read for 400 values, at the end of the stage
    assert got.epochs[0].values["loss"].epoch == pytest.approx(99.5)


@pytest.mark.slow
def test_torchmetrics_objects_are_computed_at_stage_end(tmp_path: Path) -> None:
    torchmetrics = pytest.importorskip("torchmetrics")
    metric = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")
    targets = [torch.tensor([0, 1, 2, 2]), torch.tensor([1, 1, 0, 0])]
    preds = [torch.tensor([0, 1, 2, 0]), torch.tensor([1, 0, 0, 0])]

    def step(loop, i):
        metric.update(preds[i], targets[i])
        return {"acc": metric}

    got = run(step, [0, 1], tmp_path, epochs=2).epochs
    assert [s.values["acc"].epoch for s in got] == [pytest.approx(6 / 8)] * 2  # reset per epoch


@pytest.mark.bad_input
def test_one_torchmetrics_object_for_training_and_a_validation_inside_it_is_refused(tmp_path: Path) -> None:
    """With validations at epoch ends one object may serve both stages (each computes and resets it at its
    end); a validation inside the epoch counted the training's samples in the object and reset it mid-epoch:
    a wrong validation accuracy, a training one of 0, without a word."""
    torchmetrics = pytest.importorskip("torchmetrics")
    metric = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")

    def step(loop, i):
        metric.update(torch.tensor([0, 1, 2, 0]), torch.tensor([0, 1, 2, 2]))
        return {"acc": metric}

    with pytest.raises(ValueError, match=r"metrics: the validation step returned under 'acc' the metric object that "
                                         r"the training step returns under 'acc': a validation inside the training "
                                         r"epoch \(val_every_n_steps\)"):
        hookfit.Loop(step, [0, 1, 2, 3], val_step=step, val_data=[0, 1], val_every_n_steps=2, run_dir=tmp_path,
                     plugins=[Metrics()]).fit()
    got = run(step, [0, 1], tmp_path / "ends", val=step, epochs=2).epochs  # validations at epoch ends: shared
    assert [(s.stage, s.values["acc"].epoch) for s in got] == [(stage, 0.75) for stage in ("train", "valid") * 2]


def test_one_torchmetrics_object_over_several_validation_sets_gives_each_set_its_value(tmp_path: Path) -> None:
    """One ``Accuracy`` the ``val_step`` updates and returns, over ``val_data={"clean": ..., "noisy":
    ...}``: each set's value is its own (1.0 and 0.5), computed as the next set begins, not the
    accuracy over both sets for the first and nothing for the second (a newcomer's early
    stopping stopped on that 0)."""
    torchmetrics = pytest.importorskip("torchmetrics")
    accuracy = torchmetrics.Accuracy(task="binary")

    def val_step(loop, batch):
        accuracy.update(*batch)
        return {"acc": accuracy}

    clean = [(torch.tensor([1, 1]), torch.tensor([1, 1])), (torch.tensor([0, 1]), torch.tensor([0, 1]))]
    noisy = [(torch.tensor([1, 0]), torch.tensor([1, 1])), (torch.tensor([1, 0]), torch.tensor([1, 1]))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (torchmetrics warns of a compute() before any update())
        state = hookfit.Loop(lambda loop, batch: None, [0], val_step=val_step, val_data={"clean": clean, "noisy": noisy},
                             max_epochs=2, run_dir=tmp_path, plugins=[Metrics()]).fit()
    assert state.results["metrics"] == {"valid/clean/acc": 1.0, "valid/noisy/acc": 0.5}


def test_a_metric_object_computing_a_number_per_name_publishes_each_and_a_vector_is_warned_of(tmp_path: Path) -> None:
    """Per-class F1 through torchmetrics' ``ClasswiseWrapper`` (a mapping of names to numbers) is published as
    ``f1/<name>``; ``F1Score(average=None)`` (a vector) was computed, reset and published nowhere without a word:
    one warning a run names it and its shape."""
    torchmetrics = pytest.importorskip("torchmetrics")
    per_class = torchmetrics.F1Score(task="multiclass", num_classes=3, average=None)
    named = torchmetrics.wrappers.ClasswiseWrapper(torchmetrics.F1Score(task="multiclass", num_classes=3, average=None),
                                                   labels=["cat", "dog", "fox"])
    preds, targets = torch.tensor([0, 1, 2, 2]), torch.tensor([0, 1, 1, 2])

    def val_step(loop, batch):
        per_class.update(preds, targets)
        named.update(preds, targets)
        return {"f1": named, "f1_vector": per_class}

    with pytest.warns(HookfitWarning) as caught:
        state = hookfit.Loop(lambda loop, batch: None, [0], val_step=val_step, val_data=[0, 1], max_epochs=2,
                             run_dir=tmp_path, plugins=[Metrics()]).fit()
    said = [str(w.message) for w in caught if "more than one number" in str(w.message)]
    assert said == ["metrics: the metric object 'f1_vector' of the valid stage computes more than one number (f1_vector "
                    "a tensor of shape (3,)): it is computed and reset at the stage's end and published nowhere; have "
                    "it compute one number (F1Score(average='macro')), or a number per name (torchmetrics' "
                    "ClasswiseWrapper, published as 'f1_vector/<name>')"], said
    f1 = "valid/f1/multiclassf1score_"  # (torchmetrics' names: the metric's, then the label)
    assert state.results["metrics"] == {f"{f1}cat": 1.0, f"{f1}dog": pytest.approx(2 / 3),
                                        f"{f1}fox": pytest.approx(2 / 3)}, state.results["metrics"]


class Counted:
    """A metric object without torchmetrics' ``metric_state``/``merge_state``: the share of ones."""

    def __init__(self) -> None:
        self.ones = self.seen = 0

    def update(self, values: list[int]) -> None:
        self.ones, self.seen = self.ones + sum(values), self.seen + len(values)

    def compute(self) -> torch.Tensor:
        return torch.tensor(self.ones / self.seen)

    def reset(self) -> None:
        self.ones = self.seen = 0


def test_a_metric_object_in_a_stage_resumed_mid_way_covers_the_whole_stage(tmp_path: Path) -> None:
    """A torchmetrics ``Accuracy`` the training step returns, the run stopped after 2 of 4 batches
    (``max_steps``) and resumed: its epoch value is the uninterrupted run's (0.5; the resumed
    batches alone give 0.0), its state kept in the checkpoint and merged back (``merge_state``).
    An object that cannot be merged is said to count the batches since the resume only."""
    torchmetrics = pytest.importorskip("torchmetrics")
    from hookfit.plugins.checkpoint import Checkpoint

    right, wrong = (torch.tensor([1, 1]), torch.tensor([1, 1])), (torch.tensor([0, 0]), torch.tensor([1, 1]))
    data = [right, right, wrong, wrong]

    def fit(folder: Path, make: Any, **options: Any) -> Any:
        metric = make()

        def step(loop, batch):
            if isinstance(metric, Counted):
                metric.update((batch[0] == batch[1]).int().tolist())
            else:
                metric.update(*batch)
            return {"acc": metric}

        return hookfit.Loop(step, data, model=torch.nn.Linear(1, 1), max_epochs=1, run_dir=folder, resume="latest",
                            plugins=[Metrics(), Checkpoint(background=False)], **options).fit()

    accuracy = lambda: torchmetrics.Accuracy(task="binary")  # noqa: E731
    whole = fit(tmp_path / "whole", accuracy).results["metrics"]["train/acc"]
    fit(tmp_path / "resumed", accuracy, max_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HookfitWarning)
        assert fit(tmp_path / "resumed", accuracy).results["metrics"]["train/acc"] == whole == 0.5
    collection = lambda: torchmetrics.MetricCollection([torchmetrics.Accuracy(task="binary")])  # noqa: E731
    fit(tmp_path / "collection", collection, max_steps=2)  # a state of dicts: none kept, nothing raised
    assert fit(tmp_path / "collection", collection).status == "completed"
    fit(tmp_path / "counted", Counted, max_steps=2)
    with pytest.warns(HookfitWarning, match=r"metrics: the metric object\(s\) 'acc' of the train stage of epoch 1 "
                                            r"count only its 2 batch\(es\) since the resume"):
        assert fit(tmp_path / "counted", Counted).results["metrics"]["train/acc"] == 0.0


def test_jsonl_log_in_the_run_directory(tmp_path: Path) -> None:
    def step(loop, batch):
        return {"loss": torch.tensor(2.0)}

    # the log is the metrics_log plugin's (from the published snapshots: every batch here)
    run(step, [1, 2, 3, 4], tmp_path, metrics=Metrics(interval=0), epochs=2, extra=[MetricsLog(every_n_steps=2)])
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lines = [line for line in lines if line["event"] != "best"]  # the directions: test_metrics_log.py
    assert [(l["event"], l.get("step")) for l in lines] == [
        ("step", 2), ("step", 4), ("epoch", 4), ("step", 6), ("step", 8), ("epoch", 8), ("end", 8)]
    assert lines[2]["loss"] == 2.0 and lines[-1]["status"] == "completed"


@pytest.mark.slow
def test_memory_stays_flat_with_metrics(tmp_path: Path) -> None:
    import tracemalloc

    def step(loop, batch):
        return {"loss": torch.tensor(1.0), "acc": 0.5}

    def peak(n):  # the most allocated at any time during the run (freed values included)
        tracemalloc.start()
        hookfit.Loop(step, range(n), run_dir=tmp_path, plugins=[Metrics(interval=1e9)]).fit()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak

    peak(5_000)  # warm: the interpreter's free lists and caches filled
    # no publication for the whole run; a leak of one small object per batch would be > 1 MB
    assert peak(50_000) - peak(5_000) < 200_000


class TwoProcesses:
    """Pretends to be one of two processes: the other reports the same batches with every
    value ``factor`` times larger (or, with ``rename``, other metric names)."""

    name = "two"

    def __init__(self, factor: float = 3.0, rename: bool = False) -> None:
        self.factor, self.rename, self.calls = factor, rename, 0

    @hookfit.hookimpl
    def configure(self, loop):
        loop.state.world_size = 2

    @hookfit.hookimpl
    def all_reduce(self, tensor):
        self.calls += 1
        other = tensor.clone()
        rows = other[3:].view(-1, 5)  # last, weighted, count, window sum, window count
        rows[:, 0] *= self.factor
        rows[:, 1] *= self.factor
        rows[:, 3] *= self.factor
        if self.rename:
            other[1] += 1
        return tensor + other


def test_with_several_processes_snapshots_carry_global_sample_weighted_numbers(tmp_path: Path) -> None:
    data = [torch.full((2, 1), float(i)) for i in range(6)]
    two = TwoProcesses()
    collect = run(lambda l, b: {"v": b.mean()}, data, tmp_path,
                  metrics=Metrics(interval=1e9, sync_every=2), extra=[two])
    assert [u.batches for u in collect.updates] == [2, 4, 6]  # by batch count, not by time
    final = collect.epochs[-1]
    local_mean = sum(range(6)) / 6
    assert final.values["v"].epoch == pytest.approx((local_mean + 3 * local_mean) / 2)
    assert final.values["v"].last == pytest.approx((5 + 15) / 2)
    assert final.samples == 24 and two.calls == 4


@pytest.mark.bad_input
def test_interval_0_with_several_processes_says_publications_come_every_sync_every_batches(tmp_path: Path) -> None:
    """Metrics(interval=0) for a line every step (MetricsLog, TensorBoard) under torchrun got one every 50
    batches, silently: said once a run, with sync_every=1 for every batch."""
    data = [torch.full((2, 1), float(i)) for i in range(4)]
    with pytest.warns(HookfitWarning, match=r"metrics: interval=0 asks for a publication after every batch; with "
                                            r"several processes they come every sync_every=50 batches") as said:
        run(lambda l, b: {"v": b.mean()}, data, tmp_path, metrics=Metrics(interval=0), extra=[TwoProcesses()],
            epochs=2)
    assert len([w for w in said if "sync_every" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", HookfitWarning)
        every = run(lambda l, b: {"v": b.mean()}, data, tmp_path, metrics=Metrics(interval=0, sync_every=1),
                    extra=[TwoProcesses()])
    assert [u.batches for u in every.updates] == [1, 2, 3, 4]
    with warnings.catch_warnings():  # an evaluation publishes by time: nothing to say
        warnings.simplefilter("error", HookfitWarning)
        hookfit.Loop(lambda l, b: None, [], val_step=lambda l, b: {"v": b.mean()}, val_data=data,
                     plugins=[Metrics(interval=0), TwoProcesses()]).validate()


@pytest.mark.bad_input
def test_processes_reporting_different_metric_names_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="processes of this run report different metric names"):
        run(lambda l, b: {"v": b.mean()}, [torch.ones(2, 1)], tmp_path,
            metrics=Metrics(), extra=[TwoProcesses(rename=True)])


def test_a_resumed_training_stage_ends_with_the_uninterrupted_epoch_means(tmp_path: Path) -> None:
    data = [torch.full((i + 1, 1), float(i)) for i in range(6)]
    whole = run(lambda l, b: {"v": b.mean()}, data, tmp_path, metrics=Metrics(window=3))

    saved = {}

    class Save:
        name = "save"

        @hookfit.hookimpl(trylast=True)  # after every plugin took the batch into account
        def batch_end(self, loop, batch_idx):
            if loop.training and batch_idx == 2:
                saved.update(loop.plugin_states())

    run(lambda l, b: {"v": b.mean()}, data, tmp_path, metrics=Metrics(window=3), extra=[Save()])

    class Resume:
        name = "resume"

        @hookfit.hookimpl
        def resume(self, loop):
            loop.load_plugin_states(saved)
            loop.load_state_dict(saved_run(0, 3, 3))
            return True

    collect = Collect()
    hookfit.Loop(lambda l, b: {"v": b.mean()}, data, resume="x", plugins=[
        Metrics(window=3), collect, Resume()]).fit()
    want, got = whole.epochs[-1], collect.epochs[-1]
    assert got.values == want.values and got.samples == want.samples == 21 and got.batches == 6
    assert [dict(e) for e in got.history] == [dict(e) for e in want.history]


def test_batch_size_inference() -> None:
    assert batch_size(torch.zeros(7, 2)) == 7
    assert batch_size((torch.zeros(5, 1), torch.zeros(5))) == 5
    assert batch_size({"x": torch.zeros(3, 1)}) == 3
    assert batch_size(torch.tensor(1.0)) == 1 and batch_size("text") == 1


# -- console --------------------------------------------------------------------------------

ESCAPES = re.compile(r"[\x1b\r\x08]")


def console_run(tmp_path, epochs=3, n=20, **console):
    out = io.StringIO()

    def step(loop, batch):
        return {"loss": torch.tensor(1.0 / (loop.state.epoch + 1)), "accuracy": 0.5 + loop.state.epoch / 10}

    hookfit.Loop(step, list(range(n)), val_step=step, val_data=[0, 1], max_epochs=epochs, run_dir=tmp_path,
                 plugins=[Metrics(interval=0), Console(stream=out, **console)]).fit()
    return out.getvalue().splitlines()


def test_console_lines_are_complete_key_value_and_escape_free(tmp_path: Path) -> None:
    lines = console_run(tmp_path, interval=0, best={"loss": "min", "accuracy": "max"})
    assert lines[0].startswith("hookfit start epochs=3 batches_per_epoch=20 plugins=")
    assert any(l.startswith("hookfit train epoch=1/3 batch=") and "eta=" in l for l in lines)
    assert "hookfit valid epoch=3/3 done batches=2" in "\n".join(lines)
    assert any(l.startswith('hookfit end status=completed reason="max_epochs=3 reached"') for l in lines)
    assert "hookfit result stage=train metric=loss last=0.3333 best=0.3333 best_epoch=3" in lines
    assert "hookfit result stage=valid metric=accuracy last=0.7 best=0.7 best_epoch=3" in lines
    for line in lines:
        assert not ESCAPES.search(line)
        assert all("=" in field for field in shlex.split(line)[2:] if field != "done"), line


def test_console_progress_never_floods_and_every_epoch_has_its_summary(tmp_path: Path) -> None:
    lines = console_run(tmp_path, epochs=200, n=50)  # default throttles: a second or two of training
    progress = [l for l in lines if re.match(r"hookfit (train|valid) epoch=\d+/200 batch=", l)]
    assert len(progress) < 5, progress  # at most one every 10 s
    summaries = [l for l in lines if re.match(r"hookfit (train|valid) epoch=\d+/200 done ", l)]
    assert [l.split()[1:3] for l in summaries] == [
        [stage, f"epoch={e}/200"] for e in range(1, 201) for stage in ("train", "valid")]
    end = next(i for i, l in enumerate(lines) if l.startswith("hookfit end"))
    assert lines[end - 1].startswith("hookfit valid epoch=200/200 done")


@pytest.mark.fault
def test_a_run_that_fails_before_metrics_started_ends_without_a_second_error(tmp_path: Path) -> None:
    class Broken:
        name = "broken"

        @hookfit.hookimpl(tryfirst=True)
        def fit_start(self):
            raise RuntimeError("broken at start")

    import warnings

    with warnings.catch_warnings(record=True) as caught, pytest.raises(RuntimeError, match="broken at start"):
        warnings.simplefilter("always")
        hookfit.Loop(lambda l, b: None, [1], run_dir=tmp_path, plugins=[Metrics(), Broken()]).fit()
    assert [str(w.message) for w in caught] == []  # no "fit_end failed while the run was ending"
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("order", ["optim registered first", "metrics registered first"])
def test_epoch_metrics_sees_the_finished_stage_whatever_the_registration_order(order: str) -> None:
    """optim steps the last, partial window in its stage_end (tryfirst) and metrics publishes
    the epoch in its own (trylast): the learning rate in epoch_metrics is the one that step used
    (not the third step's), whichever plugin was registered first."""
    from hookfit.plugins.optim import Optim

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    data = [(torch.ones(4, 2), torch.zeros(4, 1))] * 10
    epochs: list = []

    class Catch:
        name = "catch"

        @hookfit.hookimpl
        def epoch_metrics(self, metrics):
            epochs.append(metrics)

    def step(loop, batch):
        loop.backward(torch.nn.functional.mse_loss(model(batch[0]), batch[1]))
        loop.optimizers.step()
        return {"loss": torch.tensor(1.0)}

    optim, metrics = Optim(accumulate=3, schedulers=schedule), Metrics()
    # names of no entry point, so that the order given is the order registered
    optim.name, metrics.name = "stepper", "aggregator"
    plugins = [optim, metrics] if order.startswith("optim") else [metrics, optim]
    hookfit.Loop(step, data, model=model, optimizers=opt, plugins=[*plugins, Catch()]).fit()
    # windows end after batches 2, 5, 8 and the partial one at the stage's end: four steps
    assert epochs[0].lr == {"default": 0.5 ** 3}


class Rates:
    """The learning rates of every ``epoch_metrics`` snapshot, in ``seen``."""

    name = "catch"

    def __init__(self) -> None:
        self.seen: list[dict[str, float]] = []

    @hookfit.hookimpl
    def epoch_metrics(self, metrics: MetricsSnapshot) -> None:
        self.seen.append(dict(metrics.lr))


def test_a_named_first_parameter_group_publishes_its_learning_rate_by_its_name(tmp_path: Path) -> None:
    """A group's own ``"name"`` names its rate, the first group's too (``lr_<optimizer>/<group name>``); an
    unnamed first group keeps the optimizer's name alone, an unnamed further one its index."""
    from hookfit.plugins.csv_log import CSVLogger
    from hookfit.plugins.optim import Optim

    backbone, (head, tail, critic) = torch.nn.Linear(2, 2), (torch.nn.Linear(2, 1) for _ in range(3))
    opt = torch.optim.SGD([{"params": backbone.parameters(), "lr": 1e-4, "name": "backbone"},
                           {"params": head.parameters(), "lr": 0.1, "name": "head"}, {"params": tail.parameters()}],
                          lr=0.3)
    other = torch.optim.SGD(critic.parameters(), lr=0.2)
    catch = Rates()
    seen = catch.seen

    def step(loop, batch):
        loss = (head(backbone(batch)) + tail(batch)).sum()
        loop.backward(loss)
        loop.optimizers["main"].step()
        loop.optimizers["main"].zero_grad()
        return loss

    hookfit.Loop(step, [torch.ones(4, 2)] * 2, model=torch.nn.ModuleList([backbone, head, tail, critic]),
                 optimizers={"main": opt, "other": other}, run_dir=tmp_path,
                 plugins=[Optim(), Metrics(), CSVLogger(), catch]).fit()
    assert seen == [{"main/backbone": 1e-4, "main/head": 0.1, "main/2": 0.3, "other": 0.2}]
    with open(tmp_path / "metrics.csv", newline="", encoding="utf-8") as file:
        header = next(csv.reader(file))
    assert {"lr_main/backbone", "lr_main/head", "lr_main/2", "lr_other"} <= set(header) and "lr_main" not in header


def test_every_parameter_group_publishes_its_learning_rate_by_its_name_or_index(tmp_path: Path) -> None:
    """A fine-tuning's backbone and head each have their rate in the snapshots, the CSV table and
    TensorBoard: the first group's under the optimizer's name, each further one's under its
    ``"name"`` entry, else its index (a key taken: ``#<index>`` after it); a second optimizer's apart."""
    from hookfit.plugins.csv_log import CSVLogger
    from hookfit.plugins.optim import Optim

    backbone, head, critic = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    opt = torch.optim.SGD([{"params": backbone.parameters(), "lr": 0.1},
                           {"params": head.parameters(), "lr": 1.0, "name": "head"},
                           {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.5},
                           {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.7, "name": "2"}], lr=0.3)
    other = torch.optim.SGD(critic.parameters(), lr=0.2)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, [lambda e: 1.0, lambda e: 0.5 ** e, lambda e: 1.0,
                                                       lambda e: 1.0])
    catch = Rates()
    epochs = catch.seen

    def step(loop, batch):
        loss = head(backbone(batch)).sum() + critic(batch).sum()
        loop.backward(loss)
        for name in ("main", "critic"):
            loop.optimizers[name].step()
            loop.optimizers[name].zero_grad()
        return loss

    hookfit.Loop(step, [torch.ones(4, 2)] * 2, model=torch.nn.ModuleList([backbone, head, critic]),
                 optimizers={"main": opt, "critic": other}, max_epochs=2, run_dir=tmp_path,
                 plugins=[Optim(schedulers={"main": schedule}), Metrics(), CSVLogger(), catch]).fit()
    # the schedule halves the head's rate every step: two steps an epoch, each epoch the rate of its last
    # (a group named "2" after the third group, unnamed: both kept)
    assert epochs == [{"main": 0.1, "main/head": 0.5, "main/2": 0.5, "main/2#3": 0.7, "critic": 0.2},
                      {"main": 0.1, "main/head": 0.125, "main/2": 0.5, "main/2#3": 0.7, "critic": 0.2}]
    with open(tmp_path / "metrics.csv", newline="", encoding="utf-8") as file:
        rows = list(csv.DictReader(file))
    assert [float(row["lr_main/head"]) for row in rows] == [0.5, 0.125]


def test_the_outcome_names_the_reason_and_who_asked(tmp_path: Path) -> None:
    class Budget:
        name = "budget"

        @hookfit.hookimpl
        def epoch_end(self, loop, epoch):
            if epoch == 1:
                loop.request_stop("time budget spent")

    out = io.StringIO()
    hookfit.Loop(lambda l, b: {"loss": torch.tensor(1.0)}, [1, 2], max_epochs=5, run_dir=tmp_path,
                 plugins=[Metrics(), MetricsLog(), Console(stream=out), Budget()]).fit()
    assert 'hookfit end status=interrupted reason="time budget spent" by="budget" ' in out.getvalue()
    end = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert (end["event"], end["status"], end["reason"], end["by"], end["step"]) == (
        "end", "interrupted", "time budget spent", "budget", 4)


# -- metrics.jsonl: resumes, epochs from 1 (its file policy: tests/plugins/metrics_log) --------

class FakeResume:
    """Resumes "from" a named file: restores the metrics history and the position."""

    name = "fake_resume"

    def __init__(self, source: str, states: dict, epoch: int, step: int, batch: int) -> None:
        self.source, self.states, self.position = source, states, (epoch, step, batch)

    @hookfit.hookimpl
    def resume(self, loop):
        loop.load_plugin_states(self.states, strict=False)
        loop.load_state_dict(saved_run(*self.position))
        return self.source


def test_metrics_log_records_the_resume_and_counts_epochs_from_1(tmp_path: Path) -> None:
    data = [torch.ones(2, 1)] * 4
    step = lambda l, b: {"loss": b.mean()}  # noqa: E731
    saved = {}

    class Save:
        name = "save"

        @hookfit.hookimpl(trylast=True)
        def batch_end(self, loop):
            if loop.state.step == 6:  # epoch 2 (from 1), 2 of its 4 batches done
                saved.update(loop.plugin_states())

    first, second = tmp_path / "first", tmp_path / "second"
    hookfit.Loop(step, data, max_epochs=3, run_dir=first, plugins=[Metrics(), MetricsLog(), Save()]).fit()
    hookfit.Loop(step, data, max_epochs=3, run_dir=second, resume="earlier/ckpt.pt",
                 plugins=[Metrics(), MetricsLog(), FakeResume("earlier/ckpt.pt", saved, epoch=1, step=6, batch=2)]).fit()
    records = [json.loads(line) for line in (second / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if r["event"] != "best"]  # the directions: test_metrics_log.py
    assert records[0] == {"event": "resume", "from": "earlier/ckpt.pt", "epoch": 2, "batch": 2, "step": 6}
    assert [(r["event"], r["epoch"]) for r in records[1:]] == [("epoch", 2), ("epoch", 3), ("end", 3)]
    whole = [json.loads(line) for line in (first / "metrics.jsonl").read_text().splitlines()]
    whole = [r for r in whole if r["event"] != "best"]
    assert [(r["event"], r["epoch"]) for r in whole] == [("epoch", 1), ("epoch", 2), ("epoch", 3), ("end", 3)]
    assert records[-1]["step"] == whole[-1]["step"] == 12


# -- values the metrics plugin cannot aggregate: refused at once, naming the step ---------------

class Steps:
    """Step functions with a qualified name, returning ``bad`` under ``key`` from batch 2 on."""

    def __init__(self, key, bad) -> None:
        self.key, self.bad = key, bad

    def train_step(self, loop, batch):
        out = {"loss": torch.tensor(1.0)}
        if loop.training and loop.state.batch_idx >= 2:
            out[self.key] = self.bad
        return out

    def val_step(self, loop, batch):
        out = {"loss": torch.tensor(1.0)}
        if loop.state.batch_idx >= 2:
            out[self.key] = self.bad
        return out


@pytest.mark.bad_input
@pytest.mark.parametrize("bad, what", [(torch.tensor(1 + 2j), r"a complex tensor \(torch.complex64\)"),
                                       (1 + 2j, r"a complex number \(\(1\+2j\)\)")])
@pytest.mark.parametrize("defer", [False, True])
def test_a_value_that_cannot_be_aggregated_is_refused_at_the_batch_it_appears_in(tmp_path, bad, what, defer) -> None:
    steps, collect = Steps("phase", bad), Collect()
    loop = hookfit.Loop(steps.train_step, list(range(6)), max_epochs=2, run_dir=tmp_path,
                        plugins=[Metrics(defer=defer), collect])
    with pytest.raises(TypeError) as raised:
        loop.fit()
    message = str(raised.value)
    assert re.search(rf"step function 'Steps.train_step' returned {what} under the key 'phase', which "
                     rf"the metrics plugin cannot aggregate", message), message
    assert ".abs()" in message  # what to do instead
    # at the batch it appeared in, not at the end of the epoch
    assert (loop.run.state.epoch, loop.run.state.batch_idx) == (0, 2) and collect.epochs == []


@pytest.mark.bad_input
def test_the_validation_step_is_named_when_it_returns_what_cannot_be_aggregated(tmp_path) -> None:
    steps = Steps("z", torch.tensor([1j]))
    loop = hookfit.Loop(steps.train_step, [1, 2], val_step=steps.val_step, val_data=list(range(5)),
                        run_dir=tmp_path, plugins=[Metrics()])
    with pytest.raises(TypeError, match=r"step function 'Steps.val_step' returned a complex tensor "
                                        r"\(torch.complex64\) under the key 'z'"):
        loop.fit()
    assert (loop.run.state.stage, loop.run.state.batch_idx) == (None, 2)


@pytest.mark.bad_input
def test_a_key_that_is_not_a_string_after_the_first_batch_is_refused(tmp_path) -> None:
    steps = Steps(("acc", 1), 0.5)  # the core checks the keys of a stage's first output only
    with pytest.raises(TypeError, match=r"step function 'Steps.train_step' returned the key \('acc', 1\) "
                                        r"\(tuple\) with a value to aggregate; keys must be strings"):
        hookfit.Loop(steps.train_step, list(range(4)), run_dir=tmp_path, plugins=[Metrics()]).fit()


def test_values_are_checked_once_per_key_and_publication_not_per_batch(tmp_path, monkeypatch) -> None:
    """The per-batch path stays one append per value: the check runs where a key's list is
    created, at its first value in the stage and after each publication (none here)."""
    import hookfit.plugins.metrics.aggregate as aggregate

    checked = []
    original = aggregate.check
    monkeypatch.setattr(aggregate, "check", lambda key, value, step: (checked.append(key), original(key, value, step)))

    def step(loop, batch):
        return {"loss": torch.tensor(1.0), "acc": 0.5, "n": 3}

    hookfit.Loop(step, list(range(3000)), val_step=step, val_data=[0, 1], max_epochs=2, run_dir=tmp_path,
                 plugins=[Metrics(interval=3600)]).fit()
    # two stages of two epochs, three keys each; FOLD_EVERY (1024) folds create lists anew
    folds = 3000 // aggregate.FOLD_EVERY
    assert len(checked) == 2 * 3 * (1 + folds) + 2 * 3


# -- console: resumes, the run's plugins, best only where configured --------------------------

def test_the_console_says_where_a_run_resumed_and_lists_the_users_plugins(tmp_path: Path) -> None:
    from hookfit.plugins.checkpoint import Checkpoint
    from hookfit.plugins.optim import Optim

    model = torch.nn.Linear(2, 1)
    data = [(torch.ones(4, 2), torch.zeros(4, 1))] * 4

    step = mse_step

    class Stop:
        name = "stop"

        @hookfit.hookimpl
        def batch_end(self, loop):
            if loop.state.step == 6:
                loop.request_stop("enough for now")

    def fit(*plugins, **kwargs):
        out = io.StringIO()
        # Optim(accumulate=2) and Checkpoint(every_n_steps=...) register helpers of their own
        hookfit.Loop(step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                     max_epochs=3, run_dir=tmp_path / "my run", plugins=[
                         Optim(accumulate=2), Metrics(), MetricsLog(), Console(stream=out),
                         Checkpoint(every_n_steps=5, background=False), *plugins], **kwargs).fit()
        return out.getvalue().splitlines()

    lines = fit(Stop())
    assert re.fullmatch(r"hookfit start epochs=3 batches_per_epoch=4 plugins=(\S+)", lines[0])
    assert sorted(lines[0].split("plugins=")[1].split(",")) == ["checkpoint", "console", "metrics", "metrics_log",
                                                                "optim", "stop"]
    assert not any(line.startswith("hookfit resumed") for line in lines)
    [saved] = (tmp_path / "my run" / "checkpoints").glob("*step000000006*")  # the one saved at the stop
    lines = fit(resume="latest")
    assert lines[1:3] == ["hookfit model params=3 trainable=3 size_mb=0.00",  # the model's size first
                          "hookfit model module=(direct) type=Linear params=3 trainable=3 size_mb=0.00"]
    assert lines[3] == f'hookfit resumed from="{saved}" epoch=2 batch=2 step=6'
    assert shlex.split(lines[3])[2] == f"from={saved}"  # quoted: the path has a space
    assert sorted(lines[0].split("plugins=")[1].split(",")) == ["checkpoint", "console", "metrics", "metrics_log",
                                                                "optim"]
    resumed = [r for r in map(json.loads, (tmp_path / "my run" / "metrics.jsonl").read_text().splitlines())
               if r["event"] == "resume"][-1]
    assert resumed == {"event": "resume", "from": str(saved), "epoch": 2, "batch": 2, "step": 6}


def results(lines: list[str]) -> dict[tuple[str, str], str]:
    out = {}
    for line in lines:
        if line.startswith("hookfit result "):
            fields = dict(field.split("=", 1) for field in line.split()[2:])
            where = (fields.pop("stage"), fields.pop("metric"))
            out[where] = " ".join(f"{k}={v}" for k, v in fields.items())
    return out


def directed_run(tmp_path: Path, **console) -> dict[tuple[str, str], str]:
    """Epoch means: mae 3, 1, 2 (best low); perplexity 9, 4, 6 (best low); accuracy 0.5, 0.9,
    0.7 (best high); the valid loss is higher in epoch 3."""
    table = {"mae": [3.0, 1.0, 2.0], "perplexity": [9.0, 4.0, 6.0], "accuracy": [0.5, 0.9, 0.7],
             "loss": [0.3, 0.2, 0.1]}

    def step(loop, batch):
        out = {k: v[loop.state.epoch] for k, v in table.items()}
        if not loop.training:
            out["loss"] = [0.3, 0.2, 0.8][loop.state.epoch]
        return out

    out = io.StringIO()
    hookfit.Loop(step, [0, 1], val_step=step, val_data=[0], max_epochs=3, run_dir=tmp_path,
                 plugins=[Metrics(), Console(stream=out, **console)]).fit()
    return results(out.getvalue().splitlines())


def test_best_follows_the_configured_direction_never_the_name(tmp_path: Path) -> None:
    got = directed_run(tmp_path, best={"mae": "min", "perplexity": "min", "accuracy": "max", "loss": "min",
                                       "valid/loss": "max"})
    assert got[("train", "mae")] == "last=2 best=1 best_epoch=2"
    assert got[("train", "perplexity")] == "last=6 best=4 best_epoch=2"
    assert got[("valid", "accuracy")] == "last=0.7 best=0.9 best_epoch=2"
    assert got[("train", "loss")] == "last=0.1 best=0.1 best_epoch=3"
    assert got[("valid", "loss")] == "last=0.8 best=0.8 best_epoch=3"  # "valid/loss" wins over "loss"


def test_without_a_direction_the_console_shows_both_extremes(tmp_path: Path) -> None:
    got = directed_run(tmp_path, best={"accuracy": "max"})
    assert got[("train", "mae")] == "last=2 min=1 min_epoch=2 max=3 max_epoch=1"
    assert got[("valid", "perplexity")] == "last=6 min=4 min_epoch=2 max=9 max_epoch=1"
    assert got[("train", "accuracy")] == "last=0.7 best=0.9 best_epoch=2"
    # (the loss's direction is the metrics plugin's to say: hookfit.payloads.MetricsSnapshot.best)
    assert not any("best=" in v for k, v in got.items() if k[1] not in ("accuracy", "loss"))
    assert directed_run(tmp_path)[("valid", "mae")].startswith("last=2 min=")  # nothing is guessed


def test_nan_is_never_the_best_value(tmp_path: Path) -> None:
    values = [math.nan, 2.0, 1.0, math.nan]
    out = io.StringIO()
    hookfit.Loop(lambda l, b: {"loss": values[l.state.epoch]}, [0], max_epochs=4, run_dir=tmp_path,
                 plugins=[Metrics(), Console(stream=out, best={"loss": "min"})]).fit()
    assert results(out.getvalue().splitlines())[("train", "loss")] == "last=nan best=1 best_epoch=3"


@pytest.mark.bad_input
@pytest.mark.parametrize("best, error, message", [
    ({"loss": "lowest"}, ValueError, r"console: best\['loss'\] is 'lowest'; the direction of a metric is 'min' "
                                     r"\(lower is better\) or 'max' \(higher is better\)"),
    ({"valid/acc": None}, ValueError, r"best\['valid/acc'\] is None"),
    ({"": "min"}, ValueError, r"console: best has the key ''; keys are metric names"),
    ({3: "max"}, ValueError, r"console: best has the key 3"),
    ({"valid/": "max"}, ValueError, r"best has the key 'valid/'"),
    (["loss"], TypeError, r"console: best must map metric names to 'min' or 'max'.*got list \['loss'\]"),
    ("min", TypeError, r"got str 'min'"),
])
def test_a_bad_best_option_is_refused_when_the_console_is_made(best, error, message) -> None:
    with pytest.raises(error, match=message):
        Console(best=best)


# -- console: the model's size at the start --------------------------------------------------

def fields(line: str) -> dict[str, str]:
    return dict(field.split("=", 1) for field in shlex.split(line)[2:])


def size_mb(modules: list[torch.nn.Module]) -> str:
    """Parameters and buffers, each tensor once, in MB of 2**20 bytes, counted here."""
    params = {id(p): p for m in modules for p in m.parameters()}.values()
    buffers = {id(b): b for m in modules for b in m.buffers()}.values()
    return f"{sum(t.numel() * t.element_size() for t in [*params, *buffers]) / 2**20:.2f}"


def counts(modules: list[torch.nn.Module]) -> dict[str, str]:
    params = {id(p): p for m in modules for p in m.parameters()}.values()
    return {"params": str(sum(p.numel() for p in params)),
            "trainable": str(sum(p.numel() for p in params if p.requires_grad)), "size_mb": size_mb(modules)}


def model_lines(model, *plugins, **loop) -> list[str]:
    out = io.StringIO()
    hookfit.Loop(lambda l, b: None, [0, 1], model=model, max_epochs=1, plugins=[Console(stream=out), *plugins],
                 **loop).fit()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("hookfit start ")
    return lines


def test_the_console_prints_the_models_size_after_the_start_line(tmp_path: Path) -> None:
    encoder = torch.nn.Sequential(torch.nn.Embedding(3000, 64), torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
    decoder = torch.nn.Linear(64, 3000)
    decoder.weight = encoder[0].weight  # tied: counted once
    encoder[1].requires_grad_(False)  # frozen: not trainable
    model = torch.nn.Sequential()
    model.add_module("encoder", encoder)
    model.add_module("act", torch.nn.ReLU())
    model.add_module("decoder", decoder)
    lines = model_lines(model, run_dir=tmp_path)
    model_at_start = [line for line in lines if line.startswith("hookfit model ")]
    assert lines[1:5] == model_at_start  # right after the start line, four of them
    total = fields(lines[1])
    assert total == counts([model])
    # 199,288 parameters of 4 bytes and 520 bytes of BatchNorm's buffers: 797,672 bytes
    assert total == {"params": str(3000 * 64 + 64 * 64 + 64 + 2 * 64 + 3000),
                     "trainable": str(3000 * 64 + 2 * 64 + 3000), "size_mb": "0.76"}
    rows = [fields(line) for line in lines[2:5]]
    assert rows == [{"module": "encoder", "type": "Sequential", **counts([encoder])},
                    {"module": "act", "type": "ReLU", "params": "0", "trainable": "0", "size_mb": "0.00"},
                    {"module": "decoder", "type": "Linear", "params": "3000", "trainable": "3000", "size_mb": "0.01",
                     "tied_to": "encoder"}]  # the tied weight counted in the encoder's line: the lines add up
    assert sum(int(row["params"]) for row in rows) == int(total["params"])
    for line in lines:
        assert not ESCAPES.search(line) and all("=" in field for field in shlex.split(line)[2:] if field != "done")


def test_several_models_lazy_ones_many_modules_and_no_model(tmp_path: Path) -> None:
    generator, critic = torch.nn.Linear(100, 100), torch.nn.Sequential(torch.nn.LazyLinear(10), torch.nn.Linear(10, 1))
    lines = model_lines({"my generator": generator, "critic": critic}, run_dir=tmp_path)
    assert fields(lines[1]) == {"params": "10111", "trainable": "10111", "size_mb": "0.04", "uninitialised": "2"}
    assert lines[2] == 'hookfit model module="my generator" type=Linear params=10100 trainable=10100 size_mb=0.04'
    assert lines[3] == "hookfit model module=critic type=Sequential params=11 trainable=11 size_mb=0.00 uninitialised=2"
    assert not lines[4].startswith("hookfit model")
    deep = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(35)))
    lines = model_lines(deep, run_dir=tmp_path)
    assert [fields(line)["module"] for line in lines[2:32]] == [str(i) for i in range(30)]  # MODULE_LINES
    assert lines[32] == "hookfit model more_modules=5" and not lines[33].startswith("hookfit model")
    assert fields(lines[1])["params"] == str(35 * 6)
    assert not any(line.startswith("hookfit model") for line in model_lines(None, run_dir=tmp_path))


def test_only_the_main_process_prints_the_model(tmp_path: Path) -> None:
    class Rank1:
        name = "rank1"

        @hookfit.hookimpl
        def configure(self, loop):
            loop.state.rank = 1

    lines = model_lines(torch.nn.Linear(2, 2), Rank1(), run_dir=tmp_path)
    assert not any(line.startswith("hookfit model") for line in lines)
    assert any(line.startswith("hookfit end status=completed") for line in lines)


# -- options are checked when the plugins are built ------------------------------------------

BAD_OPTIONS = [
    (Metrics, "window", -1), (Metrics, "window", 0), (Metrics, "window", 2.5), (Metrics, "interval", "x"),
    (Metrics, "interval", -1), (Metrics, "interval", math.nan), (Metrics, "history_epochs", -3),
    (MetricsLog, "every_n_steps", "5"), (MetricsLog, "every_n_steps", 0), (Metrics, "sync_every", 0),
    (Metrics, "defer", 1),
    (Console, "interval", "x"), (Console, "interval", math.inf), (Console, "every_n_batches", 0),
    (Console, "every_n_batches", 2.5), (Console, "every_n_batches", True), (Console, "stream", "out.txt"),
]


@pytest.mark.bad_input
@pytest.mark.parametrize("plugin, option, value", BAD_OPTIONS, ids=[f"{p.name}-{o}={v!r}" for p, o, v in BAD_OPTIONS])
def test_options_are_checked_when_the_plugin_is_built_naming_plugin_option_and_value(plugin, option, value) -> None:
    shown = type(value).__name__ if option == "stream" else re.escape(repr(value))  # a stream by its type
    with pytest.raises(ValueError, match=rf"^{plugin.name}: {option} must be .*, got {shown}$"):
        plugin(**{option: value})


@pytest.mark.bad_input
def test_a_bad_option_in_the_configuration_file_names_the_file_the_plugin_the_option_and_the_value(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text("[plugins.metrics]\nhistory_epochs = -3\n")
    monkeypatch.setenv("HOOKFIT_CONFIG", str(tmp_path / "run.toml"))
    monkeypatch.setenv("HOOKFIT_PLUGINS", "metrics")  # the discovered plugin, built with the file's options
    with pytest.raises(hookfit.config.ConfigError, match=r"run.toml \[plugins.metrics\]: metrics: history_epochs "
                                                          r"must be an integer >= 0 .*, got -3$"):
        hookfit.Loop(lambda loop, batch: None, [1], run_dir=tmp_path / "run").fit()
