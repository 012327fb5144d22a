"""Every real scalar a step returns is a metric: NumPy scalars and 0-d arrays, ``bool``, 0-d
tensors of any real dtype; complex NumPy scalars are refused like Python's."""

from __future__ import annotations

import fractions
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import hookfit
from hookfit.payloads import MetricsSnapshot
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.metrics_log import MetricsLog


class Collect:
    name = "collect"

    def __init__(self) -> None:
        self.epochs: list[MetricsSnapshot] = []

    @hookfit.hookimpl
    def epoch_metrics(self, metrics: MetricsSnapshot) -> None:
        self.epochs.append(metrics)


OUTPUTS = {  # key -> (the value returned for batch 0, for batch 1), and the epoch mean of the two
    "np_float64": ((np.float64(1.5), np.float64(2.5)), 2.0),
    "np_float32": ((np.float32(0.5), np.float32(1.5)), 1.0),
    "np_int64": ((np.int64(3), np.int64(5)), 4.0),
    "np_uint8": ((np.uint8(1), np.uint8(3)), 2.0),
    "np_bool": ((np.bool_(True), np.bool_(False)), 0.5),
    "np_0d_array": ((np.array(2.0), np.array(4.0)), 3.0),
    "ok": ((True, False), 0.5),
    "fraction": ((fractions.Fraction(1, 4), fractions.Fraction(3, 4)), 0.5),
    "t_bool": ((torch.tensor(True), torch.tensor(True)), 1.0),
    "t_int64": ((torch.tensor(2), torch.tensor(4)), 3.0),
    "t_uint8": ((torch.tensor(1, dtype=torch.uint8), torch.tensor(2, dtype=torch.uint8)), 1.5),
    "t_half": ((torch.tensor(0.5, dtype=torch.float16), torch.tensor(1.5, dtype=torch.float16)), 1.0),
    "t_bfloat16": ((torch.tensor(1.0, dtype=torch.bfloat16), torch.tensor(3.0, dtype=torch.bfloat16)), 2.0),
}


@pytest.mark.parametrize("defer", [False, True], ids=["read-at-once", "deferred"])
def test_every_real_scalar_a_step_returns_is_aggregated_as_a_float(tmp_path: Path, defer: bool) -> None:
    collect = Collect()

    def step(loop, batch):
        i = loop.state.batch_idx
        return {key: values[i] for key, (values, _) in OUTPUTS.items()} | {"name": "text is ignored"}

    hookfit.Loop(step, [torch.zeros(2, 1), torch.zeros(2, 1)], run_dir=tmp_path,
                 plugins=[Metrics(defer=defer), collect, MetricsLog()]).fit()
    values = collect.epochs[-1].values
    assert set(values) == set(OUTPUTS), "every real scalar is a metric, and nothing else"
    for key, ((_, last), mean) in OUTPUTS.items():
        assert values[key].epoch == pytest.approx(mean), key
        # the last value is a float whatever was returned (a bool tensor's item() is True)
        assert type(values[key].last) is float and values[key].last == pytest.approx(float(last)), key
    # and the metric log holds them as JSON numbers
    row = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
           if json.loads(line).get("event") == "epoch"][-1]
    assert {key: row[key] for key in OUTPUTS} == pytest.approx({key: mean for key, (_, mean) in OUTPUTS.items()})


def test_a_numpy_integer_batch_size_is_the_weight_not_a_metric(tmp_path: Path) -> None:
    collect = Collect()
    sizes, values = [1, 3], [4.0, 8.0]

    def step(loop, batch):
        i = loop.state.batch_idx
        return {"loss": np.float64(values[i]), "batch_size": np.int64(sizes[i])}

    hookfit.Loop(step, [0, 1], run_dir=tmp_path, plugins=[Metrics(), collect]).fit()
    got = collect.epochs[-1]
    assert set(got.values) == {"loss"} and got.samples == 4
    assert got.values["loss"].epoch == pytest.approx((1 * 4.0 + 3 * 8.0) / 4)


@pytest.mark.bad_input
@pytest.mark.parametrize("bad", [np.complex128(1 + 2j), np.complex64(1 + 2j), np.array(1 + 2j)],
                         ids=["complex128", "complex64", "0d-complex-array"])
def test_a_complex_numpy_scalar_is_refused_naming_the_step_and_the_key(tmp_path: Path, bad: object) -> None:
    def numpy_step(loop, batch):
        return {"z": bad}

    with pytest.raises(TypeError, match=r"step function 'test_a_complex_numpy_scalar_is_refused_naming_the_step_"
                                        r"and_the_key.<locals>.numpy_step' returned a complex number .* under the "
                                        r"key 'z'"):
        hookfit.Loop(numpy_step, [0, 1], run_dir=tmp_path, plugins=[Metrics()]).fit()


class Outputs:
    """The outputs ``batch_end`` hands the plugins, and the global step of each."""

    name = "outputs"

    def __init__(self) -> None:
        self.seen: list[tuple[int, dict]] = []

    @hookfit.hookimpl
    def batch_end(self, loop, output) -> None:
        self.seen.append((loop.state.step, dict(output or {})))


@pytest.mark.bad_input
def test_a_dict_of_numbers_inside_the_output_is_warned_of_once_a_step_function_at_its_first_batch(
        tmp_path: Path) -> None:
    """Lightning's ``{"loss": loss, "log": {"acc": acc}}``: no metric aggregates the inner dict's numbers. One
    ``HookfitWarning`` for each step function returning one, at its first batch, naming it, the key, the numbers
    and what to return; the dict still reaches ``batch_end`` for the plugins that read it."""
    collect, outputs = Collect(), Outputs()

    def train_step(loop, batch):
        return {"loss": torch.tensor(1.0), "log": {"acc": torch.tensor(0.5), "note": "text"}}

    def val_step(loop, batch):
        return {"loss": torch.tensor(2.0), "log": {"acc": np.float64(0.5)}, "extras": {"n": 3}}

    loop = hookfit.Loop(train_step, [0, 1, 2], val_step=val_step, val_data={"a": [0, 1], "b": [0]}, max_epochs=2,
                        run_dir=tmp_path, plugins=[Metrics(), collect, outputs])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop.fit()
    said = [(str(w.message), w.filename) for w in caught if issubclass(w.category, hookfit.HookfitWarning)]
    where = "test_a_dict_of_numbers_inside_the_output_is_warned_of_once_a_step_function_at_its_first_batch.<locals>"
    fix = ("which no metric aggregates: the metrics plugin takes the values of the step's output itself, not of a dict "
           "inside it (Lightning's {'log': {...}}), and drops it in every batch; return them at the top level, "
           "{'loss': loss, 'acc': ...} (README.md, 'A first script')")
    assert said == [(f"metrics: step function '{where}.train_step' returned under 'log' a dict of 'acc', {fix}",
                     __file__),
                    (f"metrics: step function '{where}.val_step' returned under 'a/log' a dict of 'acc', {fix}",
                     __file__)]  # one for each step function: not again for 'b/log' nor for 'extras'
    assert {key for snapshot in collect.epochs for key in snapshot.values} == {"loss", "a/loss", "b/loss"}
    assert outputs.seen[0][1]["log"]["acc"] == 0.5 and len(outputs.seen) == 2 * (3 + 3)
    first = Outputs()  # at the first batch: a warning made an error fails it
    with warnings.catch_warnings():
        warnings.simplefilter("error", hookfit.HookfitWarning)
        with pytest.raises(hookfit.HookfitWarning, match=r"^metrics: step function '.*train_step' returned under"):
            hookfit.Loop(train_step, [0, 1, 2], run_dir=tmp_path / "first", plugins=[Metrics(), first]).fit()
    assert len(first.seen) <= 1  # the first batch's batch_end, before or after the metrics plugin's


def test_values_another_plugin_reads_are_left_out_without_a_word(tmp_path: Path) -> None:
    """What the metrics plugin never aggregates and a plugin may read in ``batch_end``: vectors, text, lists, and
    a dict without a number (of vectors, of text, of flags; of one-element tensors that are not 0-dimensional:
    a per-sample value or an attention map at a batch of one)."""
    def step(loop, batch):
        return {"loss": torch.tensor(1.0), "logits": torch.ones(2, 3), "ids": [1, 2], "name": "x", "flag": None,
                "features": {"layer1": torch.ones(2, 4), "path": "a.png"}, "empty": {},
                "extras": {"attn": torch.rand(1, 1), "score": torch.ones(1)},
                "flags": {"hit": True, "masked": torch.tensor(False), "np": np.bool_(True)}}

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hookfit.Loop(step, [0, 1], val_step=step, val_data=[0], run_dir=tmp_path, plugins=[Metrics()]).fit()


@pytest.mark.bad_input
def test_a_dict_of_numbers_keyed_by_class_index_is_advised_under_string_names(tmp_path: Path) -> None:
    """A per-class dict, ``{0: acc0, 1: acc1}``, cannot be returned at the top level as it is (a step's keys are
    strings): the warning advises ``'<key>/<index>'``, the key as the step function returns it (without the
    validation set's name), and following the advice aggregates it."""
    def val_step(loop, batch):
        return {"loss": torch.tensor(1.0), "per_class": {0: torch.tensor(0.5), 1: 0.25}}

    loop = hookfit.Loop(lambda loop, batch: None, [0], val_step=val_step, val_data={"a": [0, 1]},
                        run_dir=tmp_path / "dict", plugins=[Metrics()])
    with pytest.warns(hookfit.HookfitWarning, match=r"returned under 'a/per_class' a dict of 0, 1, ") as caught:
        loop.fit()
    said = [str(w.message) for w in caught if "per_class" in str(w.message)]
    assert len(said) == 1 and said[0].endswith("return them at the top level, {'loss': loss, 'per_class/0': ...} "
                                               "(README.md, 'A first script')"), said

    def advised(loop, batch):
        return {"loss": torch.tensor(1.0), "per_class/0": torch.tensor(0.5), "per_class/1": 0.25}

    collect = Collect()
    with warnings.catch_warnings():
        warnings.simplefilter("error", hookfit.HookfitWarning)
        hookfit.Loop(lambda loop, batch: None, [0], val_step=advised, val_data={"a": [0, 1]},
                     run_dir=tmp_path / "top", plugins=[Metrics(), collect]).fit()
    values = [snapshot.values for snapshot in collect.epochs if "a/per_class/0" in snapshot.values]
    assert values and values[-1]["a/per_class/0"].epoch == 0.5 and values[-1]["a/per_class/1"].epoch == 0.25
