"""hookfit.payloads: the types that travel between plugins are the core's, immutable, and
importable without torch (a renderer or logger package can be written against them alone)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from hookfit.payloads import MetricsSnapshot, StopRequest, Value


def snapshot(**changes) -> MetricsSnapshot:
    fields = dict(stage="train", epoch=1, max_epochs=3, step=40, batches=10, total=20, samples=640,
                  elapsed=2.0, values={"loss": Value(0.5, 0.6, 0.7)}, lr={"default": 0.1})
    return MetricsSnapshot(**{**fields, **changes})


def test_importing_the_payloads_and_the_hookfit_package_does_not_import_torch() -> None:
    code = ("import sys, hookfit, hookfit.payloads, hookfit.hookspecs, hookfit.state; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_snapshot_cannot_be_changed_by_a_receiver() -> None:
    values = {"loss": Value(0.5, 0.6, 0.7)}
    snap = snapshot(values=values)
    values["acc"] = Value(1, 1, 1)  # the publisher's own dict changes later: the snapshot does not
    assert list(snap.values) == ["loss"]
    with pytest.raises(TypeError):
        snap.values["loss"] = Value(0, 0, 0)  # type: ignore[index]
    with pytest.raises(TypeError):
        snap.lr["default"] = 1.0  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.step = 41  # type: ignore[misc]


def test_derived_progress_and_the_json_row() -> None:
    snap = snapshot()
    assert (snap.samples_per_s, snap.batches_per_s, snap.step_time, snap.eta) == (320.0, 5.0, 0.2, 2.0)
    assert snapshot(total=None).eta is None and snapshot(elapsed=0.0).samples_per_s == 0.0
    row = snap.row()
    assert row == {"stage": "train", "epoch": 2, "step": 40, "batches": 10, "samples": 640, "time": 2.0,
                   "samples_per_s": 320.0, "loss": 0.7, "lr_default": 0.1}
    json.dumps(row)  # epoch counted from 1 in what people read; the snapshot's own from 0
    assert snap.epoch == 1


@pytest.mark.bad_input
def test_a_metric_named_as_a_field_of_the_row_never_overwrites_it() -> None:
    values = {name: Value(1.0, 1.0, 9.0) for name in ("step", "time", "event", "total", "lr_default", "loss")}
    row = snapshot(values=values).row()
    assert (row["step"], row["time"], row["lr_default"]) == (40, 2.0, 0.1) and "event" not in row
    assert {k: v for k, v in row.items() if k.startswith("metric.")} == {
        "metric.step": 9.0, "metric.time": 9.0, "metric.event": 9.0, "metric.total": 9.0, "metric.lr_default": 9.0}
    assert row["loss"] == 9.0


def test_a_stop_request_says_why_and_who_asked() -> None:
    assert str(StopRequest("SIGINT", by="interrupter")) == "SIGINT (asked by interrupter)"
    assert str(StopRequest("budget spent")) == "budget spent"
    assert StopRequest("a", "b") == StopRequest("a", "b") and hash(StopRequest("a", "b"))
