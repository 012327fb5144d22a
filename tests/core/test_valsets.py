"""hookfit.valsets: several validation sets in one stage, each reported under its name."""

from __future__ import annotations

import pytest
import torch

import hookfit
from hookfit.state import State
from hookfit.valsets import SizedValSets, ValSets

from conftest import Recorder


def test_the_sets_run_in_order_naming_themselves_and_the_name_is_cleared_after() -> None:
    state = State()
    sets = ValSets({"a": [1, 2], "b": [3]}, state)
    assert isinstance(sets, SizedValSets) and len(sets) == 3
    seen = [(state.val_set, batch) for batch in sets]
    assert seen == [("a", 1), ("a", 2), ("b", 3)] and state.val_set is None
    stream = ValSets({"a": iter([1, 2])}, state)
    assert not hasattr(stream, "__len__")  # a set without a length: the sum has none
    batches = iter(stream)
    next(batches)
    assert state.val_set == "a"
    batches.close()  # a stage cut short: the name does not linger
    assert state.val_set is None



def test_several_validation_sets_run_in_one_stage_each_reported_under_its_name(recorder: Recorder) -> None:
    from hookfit.plugins.metrics import Metrics

    seen = []

    def valid(loop, batch):
        seen.append((loop.state.val_set, batch))
        return {"loss": torch.tensor(float(batch)), "batch_size": 2}

    published = []

    class Watch:
        name = "watch"

        @hookfit.hookimpl
        def epoch_metrics(self, stage, metrics):
            if stage == "valid":
                published.append({k: v.epoch for k, v in metrics.values.items()})

    loop = hookfit.Loop(lambda l, b: None, [1], val_step=valid, val_data={"clean": [1, 3], "noisy": [10, 20, 30]},
                        max_epochs=2, plugins=[Metrics(), Watch(), recorder])
    state = loop.fit()
    assert state.status == "completed" and state.val_set is None
    assert seen == [("clean", 1), ("clean", 3), ("noisy", 10), ("noisy", 20), ("noisy", 30)] * 2
    assert published == [{"clean/loss": 2.0, "noisy/loss": 20.0}] * 2  # each set its own mean
    assert [e for e in recorder.events if e[0] == "stage_start"] == [("stage_start", {"stage": s}) for s in
                                                                     ("train", "valid") * 2]


def test_a_monitor_names_the_metric_of_one_validation_set() -> None:
    from hookfit.plugins.early_stopping import EarlyStopping
    from hookfit.plugins.metrics import Metrics

    def valid(loop, batch):  # the noisy set stops improving after the first epoch, the clean one never
        epoch = loop.state.epoch
        return {"loss": torch.tensor(1.0 + epoch if loop.state.val_set == "noisy" else 1.0 / (1 + epoch))}

    state = hookfit.Loop(lambda l, b: None, [1], val_step=valid, val_data={"clean": [1], "noisy": [1]}, max_epochs=9,
                         plugins=[Metrics(), EarlyStopping(monitor="valid/noisy/loss", patience=2)]).fit()
    assert state.epoch == 2 and state.stop_reason.startswith("early stopping: valid/noisy/loss did not improve")


@pytest.mark.bad_input
@pytest.mark.parametrize("val_data, error, message", [
    ({}, ValueError, r"val_data is an empty mapping"),
    ({"a/b": [1]}, ValueError, r"the name of a validation set must be a non-empty string without '/', got 'a/b'"),
    ({3: [1]}, ValueError, r"the name of a validation set must be a non-empty string without '/', got 3"),
    ({"a": 5}, TypeError, r"val_data\['a'\] must be an iterable of batches"),
])
def test_bad_validation_sets_are_named_when_the_loop_is_built(val_data, error, message) -> None:
    with pytest.raises(error, match=message):
        hookfit.Loop(lambda l, b: None, [1], val_step=lambda l, b: None, val_data=val_data)


def test_step_output_of_several_sets_arrives_prefixed_as_documented() -> None:
    """hooks.md's step_output: a validation output's keys arrive prefixed with the set's name,
    batch_size unprefixed, while loop.state.val_set names the set; training outputs unchanged."""
    seen = []

    class Watch:
        name = "watch"

        @hookfit.hookimpl
        def step_output(self, loop, output):
            seen.append((loop.state.stage, loop.state.val_set, dict(output)))

    hookfit.Loop(lambda l, b: {"loss": b}, [1], val_step=lambda l, b: {"loss": b, "batch_size": 2},
                 val_data={"clean": [2], "noisy": [3]}, plugins=[Watch()]).fit()
    assert seen == [("train", None, {"loss": 1}), ("valid", "clean", {"clean/loss": 2, "batch_size": 2}),
                    ("valid", "noisy", {"noisy/loss": 3, "batch_size": 2})]
