"""metrics aggregation and the console renderer."""

from __future__ import annotations

import io
import json
import re
import shlex
from pathlib import Path

import pytest
import torch

import hookfit
from hookfit.plugins.console import Console
from hookfit.payloads import MetricsSnapshot
from hookfit.plugins.metrics import Metrics, batch_size


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

    got = run(step, list(range(200)), tmp_path, metrics=Metrics(defer=True, interval=3600, log=False))
    assert reads == {"item": 0, "tolist": 1}  # one read for 400 values, at the end of the stage
    assert got.epochs[0].values["loss"].epoch == pytest.approx(99.5)


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


def test_jsonl_log_in_the_run_directory(tmp_path: Path) -> None:
    def step(loop, batch):
        return {"loss": torch.tensor(2.0)}

    run(step, [1, 2, 3, 4], tmp_path, metrics=Metrics(log_every_n_steps=2), epochs=2)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(l["event"], l.get("step")) for l in lines] == [
        ("step", 2), ("step", 4), ("epoch", 4), ("step", 6), ("step", 8), ("epoch", 8), ("end", 8)]
    assert lines[2]["loss"] == 2.0 and lines[-1]["status"] == "completed"


def test_memory_stays_flat_with_metrics(tmp_path: Path) -> None:
    import tracemalloc

    def step(loop, batch):
        return {"loss": torch.tensor(1.0), "acc": 0.5}

    def peak(n):  # the most allocated at any time during the run (freed values included)
        tracemalloc.start()
        hookfit.Loop(step, range(n), run_dir=tmp_path, plugins=[Metrics(log=False, interval=1e9)]).fit()
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
                  metrics=Metrics(interval=1e9, sync_every=2, log=False), extra=[two])
    assert [u.batches for u in collect.updates] == [2, 4, 6]  # by batch count, not by time
    final = collect.epochs[-1]
    local_mean = sum(range(6)) / 6
    assert final.values["v"].epoch == pytest.approx((local_mean + 3 * local_mean) / 2)
    assert final.values["v"].last == pytest.approx((5 + 15) / 2)
    assert final.samples == 24 and two.calls == 4


def test_processes_reporting_different_metric_names_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="processes of this run report different metric names"):
        run(lambda l, b: {"v": b.mean()}, [torch.ones(2, 1)], tmp_path,
            metrics=Metrics(log=False), extra=[TwoProcesses(rename=True)])


def test_a_resumed_training_stage_ends_with_the_uninterrupted_epoch_means(tmp_path: Path) -> None:
    data = [torch.full((i + 1, 1), float(i)) for i in range(6)]
    whole = run(lambda l, b: {"v": b.mean()}, data, tmp_path, metrics=Metrics(window=3, log=False))

    saved = {}

    class Save:
        name = "save"

        @hookfit.hookimpl(trylast=True)  # after every plugin took the batch into account
        def batch_end(self, loop, batch_idx):
            if loop.training and batch_idx == 2:
                saved.update(loop.plugin_states())

    run(lambda l, b: {"v": b.mean()}, data, tmp_path, metrics=Metrics(window=3, log=False), extra=[Save()])

    class Resume:
        name = "resume"

        @hookfit.hookimpl
        def resume(self, loop):
            loop.load_plugin_states(saved)
            loop.state.step = loop.state.resume_batch = 3
            return True

    collect = Collect()
    hookfit.Loop(lambda l, b: {"v": b.mean()}, data, resume="x", plugins=[
        Metrics(window=3, log=False), collect, Resume()]).fit()
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
    lines = console_run(tmp_path, interval=0, summary_interval=0)
    assert lines[0].startswith("hookfit start epochs=3 batches_per_epoch=20 plugins=")
    assert any(l.startswith("hookfit train epoch=1/3 batch=") and "eta=" in l for l in lines)
    assert "hookfit valid epoch=3/3 done batches=2" in "\n".join(lines)
    assert any(l.startswith('hookfit end status=completed reason="max_epochs=3 reached"') for l in lines)
    assert "hookfit result stage=train metric=loss last=0.3333 best=0.3333 best_epoch=3" in lines
    assert "hookfit result stage=valid metric=accuracy last=0.7 best=0.7 best_epoch=3" in lines
    for line in lines:
        assert not ESCAPES.search(line)
        assert all("=" in field for field in shlex.split(line)[2:] if field != "done"), line


def test_console_never_floods(tmp_path: Path) -> None:
    lines = console_run(tmp_path, epochs=200, n=50)  # default throttles: a second or two of training
    assert len(lines) < 20, lines
    end = next(i for i, l in enumerate(lines) if l.startswith("hookfit end"))
    assert lines[end - 1].startswith("hookfit valid epoch=200/200 done")  # the last epoch is always shown


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
    the epoch in its own (trylast): the learning rate in epoch_metrics is the one after that
    step, whichever plugin was registered first."""
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

    optim, metrics = Optim(accumulate=3, schedulers=schedule), Metrics(log=False)
    # names of no entry point, so that the order given is the order registered
    optim.name, metrics.name = "stepper", "aggregator"
    plugins = [optim, metrics] if order.startswith("optim") else [metrics, optim]
    hookfit.Loop(step, data, model=model, optimizers=opt, plugins=[*plugins, Catch()]).fit()
    # windows end after batches 2, 5, 8 and the partial one at the stage's end: four steps
    assert epochs[0].lr == {"default": 0.5 ** 4}


def test_the_outcome_names_the_reason_and_who_asked(tmp_path: Path) -> None:
    class Budget:
        name = "budget"

        @hookfit.hookimpl
        def epoch_end(self, loop, epoch):
            if epoch == 1:
                loop.request_stop("time budget spent")

    out = io.StringIO()
    hookfit.Loop(lambda l, b: {"loss": torch.tensor(1.0)}, [1, 2], max_epochs=5, run_dir=tmp_path,
                 plugins=[Metrics(), Console(stream=out), Budget()]).fit()
    assert 'hookfit end status=interrupted reason="time budget spent" by="budget" ' in out.getvalue()
    end = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert (end["event"], end["status"], end["reason"], end["by"], end["step"]) == (
        "end", "interrupted", "time budget spent", "budget", 4)
