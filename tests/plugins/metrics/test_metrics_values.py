"""``metrics_values``: a plugin's own numbers, asked at each publication of the metrics (never per
batch) and published with the step's metrics as gauges, ``Value(v, v, v)``, so every consumer of
the snapshots sees them; bad answers are refused naming the plugin, the event and the key."""

from __future__ import annotations

import csv
import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit.errors import HookfitWarning, ObserverWarning, RefusedAnswer
from hookfit.payloads import Value
from hookfit.plugins.csv_log import CSVLogger
from hookfit.plugins.early_stopping import EarlyStopping
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.metrics_log import MetricsLog

BATCHES = 5
GAUGE = "plugin 'gauge' (test_metrics_values.Gauge, given to Loop)"


def blamed(error: BaseException, hook: str) -> bool:
    """Whether ``error``'s one note blames plugin ``gauge``'s ``metrics_values``, called from the
    metrics plugin's ``hook`` (what ``hookfit.blame`` writes)."""
    return len(notes := error.__notes__) == 1 and re.fullmatch(
        rf"hookfit: raised by plugin 'gauge' \(.*\) in hook 'metrics_values', called from plugin 'metrics' "
        rf"\(.*Metrics, given to Loop\) in its hook '{hook}'( \(.*\))?", notes[0]) is not None


class Gauge:
    """Answers ``{"temp": <its value>}``, one more every time it is asked, and counts the asks."""

    name = "gauge"

    def __init__(self, answer: Any = None) -> None:
        self.asked: list[tuple[str, int, int]] = []  # (stage, epoch, batches done in the stage)
        self.answer = answer

    @hookfit.hookimpl
    def metrics_values(self, loop: Any, stage: str) -> Any:
        self.asked.append((stage, loop.state.epoch, loop.state.batch_idx))
        return {"temp": torch.tensor(float(len(self.asked)))} if self.answer is None else self.answer


class ObserverGauge(Gauge):
    name = "observer_gauge"
    observer = True


class Snapshots:
    name = "snapshots"

    def __init__(self) -> None:
        self.published: list[Any] = []

    @hookfit.hookimpl
    def metrics_update(self, metrics: Any) -> None:
        self.published.append(metrics)

    @hookfit.hookimpl
    def epoch_metrics(self, metrics: Any) -> None:
        self.published.append(metrics)


def fit(*plugins: Any, interval: float = 1e9, best: dict[str, str] | None = None, derived: Any = None,
        **loop: Any) -> hookfit.State:
    def train(loop: Any, batch: int) -> dict[str, Any]:
        return {"loss": torch.tensor(1.0 / (1 + batch))}

    def valid(loop: Any, batch: int) -> dict[str, Any]:
        return {"loss": torch.tensor(2.0)}

    return hookfit.Loop(train, list(range(BATCHES)), val_step=valid, val_data=loop.pop("val_data", [0, 1]),
                        max_epochs=loop.pop("max_epochs", 2),
                        plugins=[Metrics(interval=interval, best=best, derived=derived), *plugins], **loop).fit()


def test_answers_join_every_snapshot_as_gauges_asked_at_publications_only() -> None:
    gauge, seen = Gauge(), Snapshots()
    state = fit(gauge, seen, best={"temp": "max"}, derived={"twice": lambda m: 2 * m["temp"]})
    assert state.status == "completed"
    # no publication by time (interval): asked once per stage's end, never per batch
    assert [(s, e) for s, e, _ in gauge.asked] == [("train", 0), ("valid", 0), ("train", 1), ("valid", 1)]
    assert [s.values["temp"] for s in seen.published] == [Value(n, n, n) for n in (1.0, 2.0, 3.0, 4.0)]
    assert all("loss" in s.values for s in seen.published)  # beside the step's metrics
    assert [s.values["twice"].epoch for s in seen.published] == [2.0, 4.0, 6.0, 8.0]  # derived metrics read it
    last = seen.published[-1]
    assert [entry["temp"] for entry in last.history] == [2.0, 4.0]  # the valid stage's, at each end
    assert last.best["temp"] == "max"
    assert state.results["metrics"]["valid/temp"] == 4.0 and state.results["best"]["train/temp"] == (3.0, 2)


def test_asked_for_every_metrics_update_too() -> None:
    gauge, seen = Gauge(), Snapshots()
    fit(gauge, seen, interval=0, max_epochs=1)
    assert len(gauge.asked) == len(seen.published) > 2 * 2  # a publication per batch: one answer each
    assert [s.values["temp"].last for s in seen.published] == [float(n) for n in range(1, len(seen.published) + 1)]


def test_a_gauge_reaches_the_csv_and_metrics_jsonl_and_early_stopping_watches_it(tmp_path: Path) -> None:
    class Rising:
        name = "rising"

        @hookfit.hookimpl
        def metrics_values(self, loop: Any, stage: str) -> dict[str, float]:
            return {"err": 1.0 + loop.state.epoch}  # worse every epoch

    state = fit(Rising(), MetricsLog(), CSVLogger(), EarlyStopping(monitor="valid/err", patience=0),
                max_epochs=5, run_dir=tmp_path)
    assert state.status == "completed" and state.epoch == 1  # stopped after the second epoch: no better
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["stage"], r["err"]) for r in lines if r["event"] == "epoch"] == [
        ("train", 1.0), ("valid", 1.0), ("train", 2.0), ("valid", 2.0)]
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["stage"], float(r["err"])) for r in rows] == [
        ("train", 1.0), ("valid", 1.0), ("train", 2.0), ("valid", 2.0)]


def test_a_stage_a_stop_cuts_short_is_published_with_its_gauge() -> None:
    gauge, seen = Gauge(), Snapshots()
    state = fit(gauge, seen, max_steps=3)
    assert state.status == "completed"
    assert gauge.asked == [("train", 0, 2)]  # from fit_end, for the stage named, not loop.state.stage (None)
    assert seen.published[-1].values["temp"] == Value(1.0, 1.0, 1.0) and seen.published[-1].batches == 3


BAD = [
    (["temp", 1.0], "with list ['temp', 1.0]: answer a mapping"),
    ({"temp": torch.ones(3)}, "with Tensor of shape (3,) tensor([1., 1., 1.]) under 'temp'"),
    ({"temp": "hot"}, "with str 'hot' under 'temp': a value is a real number"),
    ({"temp": torch.tensor(1j)}, "under 'temp': a value is a real number"),
    ({3: 1.0}, "with the key 3: a metric's name is a non-empty string"),
    ({"loss": 0.5}, "with 'loss', a name the stage publishes already (a value its step returns, or a metric object"),
]


@pytest.mark.bad_input
@pytest.mark.parametrize(("answer", "said"), BAD, ids=["list", "vector", "text", "complex", "key", "step's name"])
def test_a_participants_bad_answer_fails_the_run_naming_it_the_event_and_the_key(answer: Any, said: str) -> None:
    with pytest.raises(RefusedAnswer) as raised:
        fit(Gauge(answer))
    message = str(raised.value)
    assert message.startswith(f"{GAUGE} answered metrics_values for stage 'train'") and said in message
    assert blamed(raised.value, "stage_end")


@pytest.mark.bad_input
def test_a_name_another_plugin_publishes_is_refused_naming_both() -> None:
    class Second(Gauge):
        name = "second"

    with pytest.raises(RefusedAnswer) as raised:
        fit(Second({"temp": 1.0}), Gauge())  # (the plugin given last is asked first)
    assert str(raised.value).startswith("plugin 'second' (")
    assert str(raised.value).endswith(f"answered metrics_values for stage 'train' with 'temp', a name the stage "
                                      f"publishes already (the answer of {GAUGE}): rename one of them")


@pytest.mark.bad_input
def test_a_stage_a_stop_cut_short_blames_the_answer_too() -> None:
    with pytest.raises(RefusedAnswer) as raised:
        fit(Gauge({"temp": "hot"}), max_steps=3)
    assert blamed(raised.value, "fit_end")


@pytest.mark.bad_input
def test_an_observers_bad_answer_switches_it_off_with_one_warning() -> None:
    gauge, seen = ObserverGauge({"temp": "hot"}), Snapshots()
    with pytest.warns(ObserverWarning, match=r"observer plugin 'observer_gauge' \(.*\) failed in hook "
                                             r"'metrics_values'.*with str 'hot' under 'temp'") as warned:
        state = fit(gauge, seen)
    assert state.status == "completed" and len([w for w in warned if w.category is ObserverWarning]) == 1
    assert [s.plugin for s in state.silenced] == ["observer_gauge"] and len(gauge.asked) == 1
    assert all("temp" not in s.values for s in seen.published)


@pytest.mark.fault
def test_an_observer_that_raises_is_switched_off_and_a_participant_fails_the_run() -> None:
    class Failing(Gauge):
        @hookfit.hookimpl
        def metrics_values(self, loop: Any, stage: str) -> Any:
            raise RuntimeError("sensor gone")

    class FailingObserver(Failing):
        observer = True

    with pytest.warns(ObserverWarning, match="'metrics_values'.*sensor gone"):
        assert fit(FailingObserver()).status == "completed"
    with pytest.raises(RuntimeError, match="sensor gone") as raised:
        fit(Failing())
    assert blamed(raised.value, "stage_end")


def test_with_several_validation_sets_a_gauge_is_the_stages_and_each_sets_derived_metrics_read_it() -> None:
    gauge, seen = Gauge(), Snapshots()
    with warnings.catch_warnings():
        warnings.simplefilter("error", HookfitWarning)  # no derived metric said missing
        fit(gauge, seen, max_epochs=1, val_data={"a": [0, 1], "b": [0, 1]},
            derived={"r": lambda m: m["loss"] * m["temp"], "twice": lambda m: 2 * m["temp"]})
    valid = seen.published[-1]
    assert valid.stage == "valid" and valid.final
    assert {k: v.epoch for k, v in valid.values.items()} == {  # one gauge for the stage, asked at its end
        "a/loss": 2.0, "b/loss": 2.0, "temp": 2.0, "a/r": 4.0, "b/r": 4.0, "twice": 4.0}
    assert gauge.asked[-1][0] == "valid" and len(gauge.asked) == 2


class Counter:
    """A metric object (torchmetrics' shape) counting its updates."""

    def __init__(self) -> None:
        self.count = 0

    def update(self) -> None:
        self.count += 1

    def compute(self) -> float:
        return float(self.count)

    def reset(self) -> None:
        self.count = 0


@pytest.mark.bad_input
def test_a_gauge_named_as_a_metric_object_is_refused_at_its_first_publication() -> None:
    counter, seen = Counter(), Snapshots()

    def train(loop: Any, batch: int) -> dict[str, Any]:
        counter.update()
        return {"loss": torch.tensor(1.0), "acc": counter}

    with pytest.raises(RefusedAnswer, match=f"^{re.escape(GAUGE)} answered metrics_values for stage 'train' with "
                                            f"'acc', a name the stage publishes already") as raised:
        hookfit.Loop(train, list(range(BATCHES)), max_epochs=1,
                     plugins=[Metrics(interval=0), Gauge({"acc": 0.5}), seen]).fit()
    assert blamed(raised.value, "batch_end") and seen.published == []  # never published under the object's name


@pytest.mark.bad_input
@pytest.mark.parametrize("name", ["epoch", "step"])
def test_a_gauge_or_a_step_output_named_as_a_field_of_the_history_is_refused_naming_who(name: str) -> None:
    why = (f"{name!r} is a field of every entry of the stage's history ({{'epoch': ..., 'step': ..., <metric>: ...}}), "
           f"which a metric of that name would overwrite: rename the metric")
    with pytest.raises(RefusedAnswer) as raised:
        fit(Gauge({name: 1.0}))
    assert str(raised.value) == f"{GAUGE} answered metrics_values for stage 'train' with {name!r}: {why}"

    for value in (1.0, torch.tensor(1.0), Counter()):  # the plain, the tensor and the metric object's paths
        def step(loop: Any, batch: int, value: Any = value) -> dict[str, Any]:
            return {"loss": torch.tensor(1.0), name: value}

        with pytest.raises(ValueError) as refused:
            hookfit.Loop(step, [0, 1], max_epochs=1, plugins=[Metrics()]).fit()
        assert str(refused.value) == f"step function {step.__qualname__!r} returned the key {name!r}: {why}"
    with pytest.raises(ValueError, match=f"^metrics: derived must name no field of the history: {re.escape(why)}"):
        Metrics(derived={f"valid/{name}": lambda m: m["loss"]})
