"""Derived metrics, ``Metrics(derived={"ppl": lambda m: math.exp(m["loss"])})``: computed from the
aggregated values at every publication and at each stage's end, train and valid, and shown by
every consumer of the snapshots like any metric."""

from __future__ import annotations

import io
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit.errors import HookfitWarning
from hookfit.plugins.console import Console
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.metrics_log import MetricsLog
from hookfit.tools import runs

TRAIN = [[1.0, 3.0], [0.5, 1.5]]  # each epoch's training losses, batch by batch (batches of one sample)
VALID = [[2.0, 2.0], [1.0, 1.0]]
PPL = {"ppl": lambda m: math.exp(m["loss"])}


class Snapshots:
    name = "snapshots"

    def __init__(self) -> None:
        self.updates: list[Any] = []
        self.epochs: list[Any] = []

    @hookfit.hookimpl
    def metrics_update(self, stage: str, metrics: Any) -> None:
        self.updates.append(metrics)

    @hookfit.hookimpl
    def epoch_metrics(self, stage: str, metrics: Any) -> None:
        self.epochs.append(metrics)


def fit(metrics: Metrics, *plugins: Any, val_data: Any = (0, 1), **loop: Any) -> hookfit.State:
    def train(loop: Any, batch: int) -> dict[str, Any]:
        return {"loss": torch.tensor(TRAIN[loop.state.epoch][batch])}

    def valid(loop: Any, batch: int) -> dict[str, Any]:
        return {"loss": torch.tensor(VALID[loop.state.epoch][batch])}

    return hookfit.Loop(train, [0, 1], val_step=valid, val_data=list(val_data) if isinstance(val_data, tuple)
                        else val_data, max_epochs=2, plugins=[metrics, *plugins], **loop).fit()


def test_the_epochs_value_is_the_function_of_the_epochs_mean_never_the_mean_of_the_function() -> None:
    seen = Snapshots()
    state = fit(Metrics(interval=0, window=1, derived=PPL), seen)
    finals = {(s.stage, s.epoch): s.values["ppl"] for s in seen.epochs}
    assert finals[("train", 0)].epoch == pytest.approx(math.exp(2.0))  # not (e + e**3) / 2
    assert finals[("train", 1)].epoch == pytest.approx(math.exp(1.0))
    assert finals[("valid", 0)].epoch == pytest.approx(math.exp(2.0))
    assert finals[("train", 0)].last == pytest.approx(math.exp(3.0))  # the last batch's loss
    # every publication carries it, from that publication's aggregate
    updates = [s for s in seen.updates if s.stage == "train"]
    assert updates and all(s.values["ppl"].running == pytest.approx(math.exp(s.values["loss"].running))
                           for s in updates)
    # history and results count it like any metric
    train_history = [s for s in seen.epochs if s.stage == "train"][-1].history
    assert [entry["ppl"] for entry in train_history] == [pytest.approx(math.exp(2.0)), pytest.approx(math.exp(1.0))]
    assert state.results["metrics"]["train/ppl"] == pytest.approx(math.exp(1.0))
    assert "train/ppl" not in state.results["best"]  # no direction given, none guessed


def test_with_a_direction_the_console_and_the_run_commands_show_its_best(tmp_path: Path) -> None:
    stream = io.StringIO()
    state = fit(Metrics(derived=PPL, best={"ppl": "min"}), Console(stream=stream), MetricsLog(),
                run_dir=tmp_path / "run")
    lines = stream.getvalue().splitlines()
    assert any(line.startswith("hookfit train epoch=1/2 done") and f" ppl={math.exp(2.0):.5g}" in line
               for line in lines), lines
    assert f"hookfit result stage=valid metric=ppl last={math.exp(1.0):.5g} best={math.exp(1.0):.5g} best_epoch=2" \
        in lines, lines
    assert state.results["best"]["valid/ppl"] == (pytest.approx(math.exp(1.0)), 2)
    info = runs.load(tmp_path / "run", metric="valid/ppl")
    assert info.mode == "min" and info.best == ("valid/ppl", pytest.approx(math.exp(1.0)), 2)


def test_several_validation_sets_each_get_theirs_and_a_stage_key_derives_in_that_stage_only() -> None:
    seen = Snapshots()
    fit(Metrics(derived={**PPL, "train/double": lambda m: 2 * m["loss"]}), seen,
        val_data={"clean": [0, 1], "noisy": [0, 1]})
    valid = [s for s in seen.epochs if s.stage == "valid"][0]
    assert set(valid.values) == {"clean/loss", "noisy/loss", "clean/ppl", "noisy/ppl"}
    train = [s for s in seen.epochs if s.stage == "train"][0]
    assert train.values["double"].epoch == pytest.approx(4.0) and "ppl" in train.values


def test_a_metric_a_function_misses_is_said_once_per_stage_and_arithmetic_errors_are_values() -> None:
    seen = Snapshots()
    with pytest.warns(HookfitWarning) as said:
        fit(Metrics(interval=0, derived={"acc2": lambda m: m["acc"] ** 2, "big": lambda m: math.exp(1e6 * m["loss"]),
                                         "log": lambda m: math.log(m["loss"] - 5)}), seen)
    messages = [str(w.message) for w in said if "derived" in str(w.message)]
    assert messages == [f"metrics: the derived metric 'acc2' reads 'acc', which stage {stage!r} does not have (it "
                        f"has loss): not derived there" for stage in ("train", "valid")]
    assert {w.filename for w in said if "derived" in str(w.message)} == {__file__}  # the fit() line, not hookfit's
    final = seen.epochs[0].values
    assert "acc2" not in final and final["big"].epoch == math.inf and math.isnan(final["log"].epoch)


@pytest.mark.bad_input
@pytest.mark.parametrize("derived, error, message", [
    ([("ppl", math.exp)], TypeError, "metrics: derived must be a mapping of metric names to functions"),
    ({"": math.exp}, ValueError, "metrics: derived must have metric names as keys"),
    ({"valid": math.exp}, ValueError, "metrics: derived must name a metric after the stage"),
    ({"valid/": math.exp}, ValueError, "metrics: derived must have metric names as keys"),
    ({"ppl": 2.0}, TypeError, "metrics: derived['ppl'] must be a function of the aggregated metrics"),
])
def test_derived_is_checked_when_metrics_is_built(derived: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match="^" + message.replace("[", r"\[").replace("]", r"\]")):
        Metrics(derived=derived)


@pytest.mark.bad_input
@pytest.mark.parametrize("derived, message", [
    ({"loss": lambda m: m["loss"]}, "metrics: the derived metric 'loss' has the name of a metric of stage 'train'"),
    ({"ppl": lambda m: "high"}, "metrics: the derived metric 'ppl' must be a real number, its function returned str"),
])
def test_a_derived_metric_that_cannot_be_is_an_error_naming_it(derived: Any, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match="^" + message):
        fit(Metrics(derived=derived))


def test_an_error_of_the_function_names_the_derived_metric() -> None:
    with pytest.raises(AttributeError) as raised:
        fit(Metrics(derived={"ppl": lambda m: m.nothing}))
    assert "metrics: raised by the function of the derived metric 'ppl'" in raised.value.__notes__


def test_the_dashboard_rebuilt_by_hookfit_show_has_it_as_any_metric(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The dashboard's model takes the snapshots as they come: ``hookfit show`` rebuilds it from
    the metric log, with the derived metric in its table and its summary."""
    from hookfit.plugins.tui.replay import _dashboard, _print_summary

    fit(Metrics(derived=PPL, best={"ppl": "min"}), MetricsLog(), run_dir=tmp_path / "run")
    model, follower, info, _ = _dashboard(tmp_path / "run", draw=False)
    assert "ppl" in model.names
    _print_summary(tmp_path / "run", model, follower, info)
    row = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["ppl"]]
    assert row and row[0][1:3] == [f"{math.exp(1.0):.4g}", f"{math.exp(1.0):.4g}"], row


def test_a_derived_metric_is_a_real_number_read_as_a_step_output_or_a_gauge_is_a_bool_one_too() -> None:
    seen = Snapshots()
    fit(Metrics(derived={"low": lambda m: m["loss"] < 10, "high": lambda m: torch.tensor(m["loss"] > 10)}), seen)
    assert [(s.values["low"].epoch, s.values["high"].epoch) for s in seen.epochs] == [(1.0, 0.0)] * 4
