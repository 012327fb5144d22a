"""A run that ends inside a stage publishes that stage's epoch as it got: a
stop request, ``max_steps``, a stop inside a validation; nothing for a stage with no batch;
a checkpoint saved at the stop counts no partial stage, so a resumed run counts that epoch
once."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from conftest import StopAfter, resumable_run
from hookfit.payloads import MetricsSnapshot
from hookfit.plugins.checkpoint.storage import read
from hookfit.plugins.console import Console
from hookfit.plugins.early_stopping import EarlyStopping
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.metrics_log import MetricsLog

# resumable_run's Metrics() is told, rightly, that the metrics_log plugin writes the log


class Collect:
    name = "collect"

    def __init__(self) -> None:
        self.epochs: list[MetricsSnapshot] = []
        self.stages: list[str | None] = []

    @hookfit.hookimpl
    def epoch_metrics(self, loop, metrics: MetricsSnapshot) -> None:
        self.epochs.append(metrics)
        self.stages.append(loop.state.stage)


class StopAt:
    """Asks for a stop at ``event`` (``batch_end``, ``epoch_start``, ``stage_start`` or
    ``stage_end``) once the global step is ``step``."""

    name = "stop_at"

    def __init__(self, event: str, step: int) -> None:
        self.event, self.step = event, step

    def _maybe(self, loop: Any, event: str) -> None:
        if event == self.event and loop.state.step == self.step:
            loop.request_stop("enough")

    @hookfit.hookimpl
    def batch_end(self, loop: Any) -> None:
        self._maybe(loop, "batch_end")

    @hookfit.hookimpl
    def epoch_start(self, loop: Any) -> None:
        self._maybe(loop, "epoch_start")

    @hookfit.hookimpl
    def stage_start(self, loop: Any) -> None:
        self._maybe(loop, "stage_start")

    @hookfit.hookimpl
    def stage_end(self, loop: Any) -> None:
        self._maybe(loop, "stage_end")


def step(loop, batch):
    return {"loss": torch.tensor(float(batch))}


def rows(folder: Path) -> list[dict[str, Any]]:
    lines = map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
    return [r for r in lines if r["event"] not in ("best", "checkpoint")]


def test_a_stop_inside_the_training_stage_publishes_its_partial_epoch(tmp_path: Path) -> None:
    collect = Collect()
    state = hookfit.Loop(step, [1, 2, 3, 4], max_epochs=3, run_dir=tmp_path,
                         plugins=[Metrics(), MetricsLog(), collect, StopAt("batch_end", 6)]).fit()
    assert (state.status, state.step) == ("interrupted", 6)
    assert [(s.stage, s.epoch, s.batches, s.total, s.final) for s in collect.epochs] == [
        ("train", 0, 4, 4, True), ("train", 1, 2, 4, True)]
    partial = collect.epochs[-1]
    assert partial.values["loss"].epoch == 1.5 and partial.step == 6 and partial.best == {"loss": "min"}
    # the history it carries ends with the partial epoch
    assert [dict(h) for h in partial.history] == [{"epoch": 0, "step": 4, "loss": 2.5},
                                                  {"epoch": 1, "step": 6, "loss": 1.5}]
    assert collect.stages[-1] is None  # published at fit_end, outside any stage
    assert [(r["event"], r.get("stage"), r["epoch"], r.get("batches")) for r in rows(tmp_path)] == [
        ("epoch", "train", 1, 4), ("epoch", "train", 2, 2), ("end", None, 2, None)]


def test_max_steps_inside_an_epoch_publishes_the_partial_epoch(tmp_path: Path) -> None:
    collect = Collect()
    state = hookfit.Loop(step, [1, 2, 3, 4], max_epochs=3, max_steps=5, run_dir=tmp_path,
                         plugins=[Metrics(), MetricsLog(), collect]).fit()
    assert (state.status, state.stop_reason) == ("completed", "max_steps=5 reached")
    assert [(s.stage, s.epoch, s.batches) for s in collect.epochs] == [("train", 0, 4), ("train", 1, 1)]
    assert rows(tmp_path)[1]["loss"] == 1.0


def test_a_stop_inside_a_validation_within_training_publishes_both_innermost_first(tmp_path: Path) -> None:
    collect = Collect()
    hookfit.Loop(step, [1, 2, 3, 4, 5, 6], val_step=step, val_data=[10, 20, 30], val_every_n_steps=2,
                 max_epochs=2, run_dir=tmp_path, plugins=[Metrics(), MetricsLog(), collect, StopAfter(8)]).fit()
    # training batches 1, 2, the validation (3 batches), training batches 3, 4, then the 8th
    # batch: the first of the second validation
    got = [(s.stage, s.epoch, s.batches, s.total, s.values["loss"].epoch) for s in collect.epochs]
    assert got == [("valid", 0, 3, 3, 20.0), ("valid", 0, 1, 3, 10.0), ("train", 0, 4, 6, 2.5)]
    assert [(r.get("stage"), r.get("batches")) for r in rows(tmp_path)] == [
        ("valid", 3), ("valid", 1), ("train", 4), (None, None)]


def test_the_total_of_several_validation_sets_is_their_batches_so_a_cut_one_reads_partial(tmp_path: Path) -> None:
    """``total`` of a validation over two sets (2 and 1 batches) is 3, not the 2 sets: stopped
    after the first set, its 2 batches read as a part of it (the console's ``batches=2/3``)."""
    collect, printed = Collect(), io.StringIO()
    hookfit.Loop(step, [1, 2], val_step=step, val_data={"clean": [10, 20], "noisy": [30]}, max_epochs=2,
                 run_dir=tmp_path, plugins=[Metrics(), Console(stream=printed), collect, StopAfter(4)]).fit()
    assert [(s.stage, s.epoch, s.batches, s.total) for s in collect.epochs] == [("train", 0, 2, 2), ("valid", 0, 2, 3)]
    assert "batches=2/3" in next(line for line in printed.getvalue().splitlines() if line.startswith("hookfit valid"))


def test_a_stop_inside_the_epochs_validation_publishes_the_partial_validation(tmp_path: Path) -> None:
    collect = Collect()
    hookfit.Loop(step, [1, 2], val_step=step, val_data=[10, 20, 30], max_epochs=2, run_dir=tmp_path,
                 plugins=[Metrics(), collect, StopAfter(4)]).fit()
    assert [(s.stage, s.epoch, s.batches) for s in collect.epochs] == [("train", 0, 2), ("valid", 0, 2)]


@pytest.mark.parametrize("where", ["stage_start", "epoch_start", "stage_end"])
def test_a_stage_without_a_batch_publishes_nothing(tmp_path: Path, where: str) -> None:
    collect = Collect()
    state = hookfit.Loop(step, [1, 2], max_epochs=3, run_dir=tmp_path,
                         plugins=[Metrics(), collect, StopAt(where, 2)]).fit()
    assert state.status == "interrupted"
    # stopped at the start of epoch 2 (or after epoch 1's training): epoch 1 only, once
    assert [(s.stage, s.epoch, s.batches) for s in collect.epochs] == [("train", 0, 2)]


def test_a_failed_run_publishes_no_partial_epoch(tmp_path: Path) -> None:
    def failing(loop, batch):
        if loop.state.step == 3:
            raise ValueError("broken")
        return {"loss": torch.tensor(1.0)}

    collect = Collect()
    with pytest.raises(ValueError, match="broken"):
        hookfit.Loop(failing, [1, 2], max_epochs=3, run_dir=tmp_path, plugins=[Metrics(), collect]).fit()
    assert [(s.stage, s.epoch) for s in collect.epochs] == [("train", 0)]


@pytest.mark.parametrize("order", ["log first", "log last"])
def test_a_resumed_run_counts_the_partial_epoch_once(tmp_path: Path, order: str) -> None:
    """Stopped at the 10th batch (epoch 2, after 1 of its 7 training batches): the partial epoch
    is published after the checkpoint saved at the stop, so neither the metrics history nor
    early stopping's count in it holds that epoch; the resumed run ends as an uninterrupted
    one, and metrics.jsonl has that epoch's partial row, then its whole one."""
    def extra(*plugins: Any) -> tuple[Any, ...]:
        return (MetricsLog(), *plugins) if order == "log first" else (*plugins, MetricsLog())

    whole_stop = EarlyStopping(monitor="train/loss", patience=5)
    _, whole_model, whole_history = resumable_run(tmp_path / "whole", extra=extra(whole_stop))

    cut_stop, collect = EarlyStopping(monitor="train/loss", patience=5), Collect()
    loop, _, _ = resumable_run(tmp_path / "cut", stop=10, extra=extra(cut_stop, collect))
    assert loop.run.state.status == "interrupted"
    assert [(s.stage, s.epoch, s.batches) for s in collect.epochs] == [
        ("train", 0, 7), ("valid", 0, 2), ("train", 1, 1)]
    assert cut_stop.wait + (cut_stop.best_epoch == 1) == 1  # it heard the partial epoch...
    [saved] = (tmp_path / "cut" / "checkpoints").glob("*step000000008*")
    states = read(saved)["plugins"]
    # ... after the checkpoint saved the run: neither its history nor early stopping's count has it
    assert [e["epoch"] for e in states["metrics"]["history"]["train"]] == [0]
    assert states["metrics"]["train_stage"]["batches"] == 1
    assert (states["early_stopping"]["best_epoch"], states["early_stopping"]["wait"]) == (0, 0)

    again_stop = EarlyStopping(monitor="train/loss", patience=5)
    _, model, history = resumable_run(tmp_path / "cut", resume="latest", extra=extra(again_stop))
    assert history == whole_history
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), whole_model.state_dict().values()))
    assert (again_stop.best, again_stop.best_epoch, again_stop.wait) == (
        whole_stop.best, whole_stop.best_epoch, whole_stop.wait)
    log = rows(tmp_path / "cut")
    assert [(r["event"], r.get("stage"), r["epoch"], r.get("batches", r.get("batch"))) for r in log] == [
        ("epoch", "train", 1, 7), ("epoch", "valid", 1, 2), ("epoch", "train", 2, 1), ("end", None, 2, None),
        ("resume", None, 2, 1), ("epoch", "train", 2, 7), ("epoch", "valid", 2, 2), ("epoch", "train", 3, 7),
        ("epoch", "valid", 3, 2), ("end", None, 3, None)]
    whole = [r for r in rows(tmp_path / "whole") if r["event"] == "epoch"]
    resumed = [r for r in log[5:] if r["event"] == "epoch"]
    same = ("stage", "epoch", "step", "batches", "loss", "noise", "vloss", "vnoise")
    assert [[r.get(k) for k in same] for r in resumed] == [[r.get(k) for k in same] for r in whole[2:]]


def test_a_resumed_stage_stopped_before_its_next_batch_publishes_no_second_partial_row(tmp_path: Path) -> None:
    resumable_run(tmp_path, stop=10, extra=(MetricsLog(),))
    # resumed, and stopped at once at the training stage's start: no batch of this run
    resumable_run(tmp_path, resume="latest", extra=(MetricsLog(), StopAt("stage_start", 8)))
    log = rows(tmp_path)
    assert [(r["event"], r.get("stage"), r["epoch"], r.get("batches", r.get("batch"))) for r in log[-3:]] == [
        ("end", None, 2, None), ("resume", None, 2, 1), ("end", None, 2, None)]
    assert [(r.get("stage"), r["epoch"]) for r in log if r["event"] == "epoch"] == [
        ("train", 1), ("valid", 1), ("train", 2)]
