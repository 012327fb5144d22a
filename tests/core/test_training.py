"""hookfit.training: the loop of one fit(). Event order, the training flag, step outputs, train and eval
modes around validation, validation cadence, max_steps, empty data, flat memory, configure first,
wrap_step, first-batch checks."""

from __future__ import annotations

import gc
import json
import os
import re
import sys
import signal
import threading
import tracemalloc
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import hookfit
import hookfit.payloads
from hookfit.errors import HookfitWarning
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.optim import Optim
from conftest import saved_run
from conftest import Recorder, StopAt, TESTS
import warm


def test_event_sequence_two_epochs_with_validation(recorder: Recorder) -> None:
    state = hookfit.Loop(
        lambda loop, b: {"x": b},
        [1, 2],
        val_step=lambda loop, b: {"v": b},
        val_data=[10],
        max_epochs=2,
        plugins=[recorder],
    ).fit()
    assert state.status == "completed"
    batch = ["batch_start", "step_output", "batch_end", "should_stop"]
    train = ["batch_start", "step_output", "batch_end", "after_batch", "should_stop"]
    epoch = (
        ["epoch_start", "stage_start"] + train * 2 + ["stage_end", "stage_start"]
        + batch + ["stage_end", "epoch_end", "after_epoch"]
    )
    assert recorder.names() == ["configure", "fit_start"] + epoch * 2 + ["fit_end"]
    events = recorder.events
    assert events[2] == ("epoch_start", {"epoch": 0})
    assert events[3] == ("stage_start", {"stage": "train"})
    assert events[4] == ("batch_start", {"batch": 1, "batch_idx": 0})
    assert events[5] == ("step_output", {"output": {"x": 1}, "batch": 1})
    assert events[6] == ("batch_end", {"output": {"x": 1}, "batch": 1, "batch_idx": 0})
    assert ("stage_start", {"stage": "valid"}) in events
    assert ("step_output", {"output": {"v": 10}, "batch": 10}) in events
    assert ("epoch_end", {"epoch": 1}) in events
    assert state.step == 4 and state.epoch == 1
    assert state.stop_reason == "max_epochs=2 reached"


def test_loop_training_flag_and_stage_seen_by_steps_and_plugins(recorder: Recorder) -> None:
    seen = []

    def train(loop: hookfit.Loop, b: int) -> None:
        seen.append(("train", loop.training, loop.state.stage, torch.is_grad_enabled()))

    def valid(loop: hookfit.Loop, b: int) -> None:
        seen.append(("valid", loop.training, loop.state.stage, torch.is_grad_enabled()))

    hookfit.Loop(train, [1], val_step=valid, val_data=[1], plugins=[recorder]).fit()
    assert seen == [("train", True, "train", True), ("valid", False, "valid", False)]
    stage_flags = {(stage, training) for event, stage, training in recorder.seen if event == "batch_end"}
    assert stage_flags == {("train", True), ("valid", False)}


def test_every_step_output_kind_reaches_batch_end(recorder: Recorder) -> None:
    loss = torch.tensor(0.5)
    ordered = OrderedDict(acc=1.0)
    outputs = [None, {"accuracy": 0.9}, loss, ordered, {}]

    def step(loop: hookfit.Loop, i: int):
        return outputs[i]

    hookfit.Loop(step, range(len(outputs)), plugins=[recorder]).fit()
    ends = [args["output"] for event, args in recorder.events if event == "batch_end"]
    assert ends[0] is None
    assert ends[1] == {"accuracy": 0.9} and "loss" not in ends[1]
    assert ends[2] == {"loss": loss} and ends[2]["loss"] is loss
    assert ends[3] is ordered  # any mapping goes on unchanged
    assert ends[4] == {}
    step_outputs = [args["output"] for event, args in recorder.events if event == "step_output"]
    assert len(step_outputs) == 4  # None skips step_output, batch_end still fires


@pytest.mark.bad_input
def test_step_returning_a_string_names_the_step_and_type(recorder: Recorder) -> None:
    def my_train_step(loop: hookfit.Loop, b: int) -> str:
        return "oops"

    loop = hookfit.Loop(my_train_step, [1], plugins=[recorder])
    with pytest.raises(TypeError, match=r"my_train_step.*returned str"):
        loop.fit()
    assert loop.state.status == "failed"
    assert recorder.names()[-2:] == ["exception", "fit_end"]


@pytest.mark.bad_input
def test_step_returning_loss_item_is_told_to_return_the_tensor() -> None:
    model = torch.nn.Linear(2, 1)

    def train_step(loop: hookfit.Loop, batch: torch.Tensor) -> float:
        return model(batch).pow(2).mean().item()

    loop = hookfit.Loop(train_step, [torch.ones(3, 2)], model=model,
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"train_step' returned float.*return the loss tensor itself, not "
                                         r"loss.item\(\).*\{'loss': value\}"):
        loop.fit()


class Frozen(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(2, 2)
        self.bn = torch.nn.BatchNorm1d(2)
        self.head = torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Linear(2, 1))


def test_validation_restores_each_modules_own_mode() -> None:
    model = Frozen()
    model.train()
    model.bn.eval()  # a frozen BatchNorm
    before = {name: m.training for name, m in model.named_modules()}
    during = []

    def valid(loop: hookfit.Loop, b: torch.Tensor) -> None:
        during.append({name: m.training for name, m in model.named_modules()})
        assert torch.is_inference_mode_enabled()

    hookfit.Loop(lambda loop, b: None, [1], val_step=valid, val_data=[1], model=model).fit()
    assert during and not any(any(flags.values()) for flags in during)
    assert {name: m.training for name, m in model.named_modules()} == before
    assert model.bn.training is False and model.body.training is True


def test_validation_no_grad_mode_and_several_models() -> None:
    g, d = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    d.eval()
    modes = []

    def valid(loop, b):
        modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled(), g.training, d.training))

    with pytest.warns(hookfit.HookfitWarning, match=r"^model\['d'\] \(Linear\) is in eval mode as training starts"):
        hookfit.Loop(
            lambda loop, b: None, [1], val_step=valid, val_data=[1],
            model={"g": g, "d": d}, val_grad_mode="no_grad",
        ).fit()
    assert modes == [(False, False, False, False)]
    assert g.training is True and d.training is False


@pytest.mark.fault
def test_validation_restores_modes_when_the_val_step_raises() -> None:
    model = Frozen()
    model.bn.eval()

    def valid(loop, b):
        raise RuntimeError("boom in validation")

    with pytest.raises(RuntimeError, match="boom in validation"):
        hookfit.Loop(lambda loop, b: None, [1], val_step=valid, val_data=[1], model=model).fit()
    assert model.training and model.body.training and not model.bn.training


def _train(loop, batch):
    loss = loop.model(torch.ones(2, 2)).pow(2).sum()
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    return loss


@pytest.mark.bad_input
@pytest.mark.parametrize("raw", [False, True])
def test_an_optimizer_step_in_a_validation_is_refused_before_the_parameters_change(raw: bool) -> None:
    """A val_step copied from the training step stepped the optimizer in every validation batch (with
    the gradients training left, under no_grad), and the run ended completed on other weights."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def val_step(loop, batch):
        loop.optimizers.step() if not raw else opt.step()  # (no backward pass: allowed under no_grad)
        return None

    weights = {}

    class Keep:
        name = "keep"

        @hookfit.hookimpl
        def stage_start(self, loop, stage):
            weights[stage] = model.weight.detach().clone()

    with pytest.raises(hookfit.modes.StepInValidation, match=r"an optimizer \(SGD\) stepped during a validation, "
                       r"which trains nothing.*Step the optimizers in the training step only") as caught:
        hookfit.Loop(_train, [1, 2], val_step=val_step, val_data=[1], model=model,
                     optimizers=opt, plugins=[Keep(), Optim()], val_grad_mode="no_grad").fit()
    assert torch.equal(model.weight, weights["valid"])  # refused before the step
    (note,) = caught.value.__notes__  # the step that stepped is blamed, not the plugin whose optimizer it stepped
    assert note.startswith("hookfit: raised in step function 'test_an_optimizer_step_in_a_validation_is_refused"), note
    assert "plugin 'optim'" not in note and "ManagedOptimizer" not in note, note
    assert "stage valid, batch 1" in "".join(caught.value.__notes__)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()  # the refusal ends with the validation
    assert not torch.equal(model.weight, weights["valid"])


def test_a_val_step_that_enables_autograd_may_step_an_optimizer_of_its_own() -> None:
    """Test-time adaptation (TENT: the norm layers adapted on each validation batch) turns autograd on
    itself, with val_grad_mode="no_grad": that step is meant, not a copied training step."""
    model = torch.nn.Linear(2, 1)
    adapt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()

    def val_step(loop, batch):
        with torch.enable_grad():
            loop.model(torch.ones(2, 2)).pow(2).sum().backward()
            adapt.step()
            adapt.zero_grad()

    hookfit.Loop(lambda l, b: None, [1], val_step=val_step, val_data=[1], model=model, val_grad_mode="no_grad").fit()
    assert not torch.equal(model.weight, before)


def test_a_validation_refuses_steps_on_its_own_thread_only() -> None:
    """Another thread's training (two runs at once in one process) steps while this run validates."""
    other = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    other(torch.ones(1, 1)).sum().backward()
    stepped = []

    def val_step(loop, batch):
        worker = threading.Thread(target=lambda: stepped.append(opt.step()))
        worker.start()
        worker.join()

    hookfit.Loop(lambda l, b: None, [1], val_step=val_step, val_data=[1]).fit()
    assert stepped == [None]


@pytest.mark.bad_input
@pytest.mark.parametrize("raw", [False, True])
def test_a_backward_pass_in_a_validation_says_that_a_validation_trains_nothing(raw: bool) -> None:
    """torch's own words alone ("element 0 of tensors does not require grad"), blamed on optim, read as a
    bug of hookfit's."""
    model = torch.nn.Linear(2, 1)

    def val_step(loop, batch):
        loss = loop.model(torch.ones(2, 2)).sum()
        loss.backward() if raw else loop.backward(loss)

    with pytest.raises(RuntimeError, match="does not require grad") as caught:
        hookfit.Loop(_train, [1], val_step=val_step, val_data=[1], model=model,
                     optimizers=torch.optim.SGD(model.parameters(), lr=0.1), plugins=[Optim()]).fit()
    notes = "".join(caught.value.__notes__)
    assert "a validation runs without autograd" in notes and "belongs in the training step" in notes
    assert "step function 'test_a_backward_pass_in_a_validation" in notes


def test_val_every_n_epochs(recorder: Recorder) -> None:
    hookfit.Loop(
        lambda loop, b: None, [1], val_step=lambda loop, b: None, val_data=[1],
        max_epochs=4, val_every_n_epochs=2, plugins=[recorder],
    ).fit()
    valid_epochs = [
        recorder.events[i - 1] for i, (e, a) in enumerate(recorder.events)
        if e == "stage_start" and a["stage"] == "valid"
    ]
    assert len(valid_epochs) == 2


@pytest.mark.bad_input
@pytest.mark.parametrize("limits, steps", [({"max_epochs": 2}, 6), ({"max_steps": 5, "max_epochs": 3}, 5),
                                           ({"max_steps": 4}, 4)])
def test_a_validation_cadence_longer_than_the_run_is_warned_about(limits: dict, steps: int) -> None:
    """val_every_n_steps over the run's training steps validated nothing, and said nothing."""
    with pytest.warns(hookfit.HookfitWarning, match=rf"val_every_n_steps=7 is more than the run's {steps} training "
                      r"steps: no validation will run"):
        hookfit.Loop(lambda loop, b: None, [1, 2, 3], val_step=lambda loop, b: None, val_data=[1],
                     val_every_n_steps=7, **limits).fit()


class _Unsized:
    """Training data of no length: a generator factory of three batches."""

    def __iter__(self) -> Iterator[int]:
        yield from (1, 2, 3)


@pytest.mark.parametrize("data, limits, most", [
    ([1, 2, 3], {"max_epochs": 2}, 6), ([1, 2, 3], {"max_steps": 5, "max_epochs": 3}, 5),
    ([1, 2, 3], {"max_steps": 4}, 4), (_Unsized(), {"max_epochs": 2}, None), (_Unsized(), {"max_steps": 4}, 4)])
def test_max_train_steps_is_the_fewer_of_the_known_bounds(data: Any, limits: dict, most: int | None) -> None:
    seen = []

    class Probe:
        @hookfit.hookimpl
        def fit_start(self, loop: Any) -> None:
            seen.append(loop.max_train_steps)

    state = hookfit.Loop(lambda loop, b: None, data, plugins=[Probe()], **limits).fit()
    assert seen == [most] and state.step == (most or 6)


def test_a_validation_cadence_the_run_reaches_says_nothing() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hookfit.Loop(lambda loop, b: None, [1, 2, 3], val_step=lambda loop, b: None, val_data=[1],
                     val_every_n_steps=6, max_epochs=2).fit()


def test_max_steps_completes_mid_epoch(recorder: Recorder) -> None:
    """The rest of epoch 1 belongs to a longer run: no stage_end, validation or epoch_end for
    it (resuming with a larger max_steps continues it exactly)."""
    state = hookfit.Loop(lambda loop, b: None, range(10), max_epochs=5, max_steps=13, plugins=[recorder],
                         val_step=lambda loop, b: None, val_data=[1]).fit()
    assert state.status == "completed" and state.step == 13 and state.epoch == 1
    assert state.stop_reason == "max_steps=13 reached"
    assert recorder.names().count("epoch_end") == 1
    assert recorder.names().count("stage_end") == 2  # epoch 0's training and validation only
    assert recorder.names()[-1] == "fit_end" and ("batch_end", {"output": None, "batch": 2, "batch_idx": 2}) in recorder.events[-4:]


def test_max_steps_at_the_end_of_an_epoch_completes_that_epoch(recorder: Recorder) -> None:
    state = hookfit.Loop(lambda loop, b: None, range(10), max_epochs=5, max_steps=10, plugins=[recorder]).fit()
    assert (state.status, state.step, state.stop_reason) == ("completed", 10, "max_steps=10 reached")
    assert recorder.names().count("epoch_end") == 1 and recorder.names()[-3:] == ["epoch_end", "after_epoch", "fit_end"]
    unsized = Recorder()  # without a length, the stage's end is found by asking for one more batch

    class Unsized:
        def __iter__(self):
            return iter(range(10))

    hookfit.Loop(lambda loop, b: None, Unsized(), max_epochs=5, max_steps=10, plugins=[unsized]).fit()
    assert unsized.names().count("epoch_end") == 1


@pytest.mark.bad_input
def test_empty_data_fails_the_run_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOKFIT_PLUGINS", "interrupter")
    before = signal.getsignal(signal.SIGINT)
    loop = hookfit.Loop(lambda l, b: None, [])
    with pytest.raises(ValueError, match="train data yielded no batches in epoch 1"):
        loop.fit()
    assert loop.state.status == "failed"
    assert signal.getsignal(signal.SIGINT) is before  # the interrupter's fit_end ran


@pytest.mark.bad_input
def test_a_loader_with_no_batch_says_how_a_loader_gets_none() -> None:
    """An empty DataLoader (drop_last=True, fewer samples than its batch_size) said only "yielded no batches"."""
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(3, 1)), batch_size=4, drop_last=True)
    with pytest.raises(ValueError, match=r"train data yielded no batches in epoch 1 \(len\(\) is 0; a DataLoader with "
                                         r"drop_last=True and fewer samples than its batch_size has no batch\)\n"):
        hookfit.Loop(lambda l, b: None, data).fit()


@pytest.mark.bad_input
def test_exhausted_generator_is_explained() -> None:
    # several epochs of a generator: refused when the Loop is built...
    with pytest.raises(ValueError, match="train_data is a generator, an iterator that gives its batches once only"):
        hookfit.Loop(lambda l, b: None, (i for i in range(3)), max_epochs=2)
    # ... and where the epochs are not known then (max_steps alone), explained when it runs dry
    with pytest.raises(ValueError, match="epoch 2 .*generator iterator is used up after one pass"):
        hookfit.Loop(lambda l, b: None, (i for i in range(3)), max_steps=5).fit()


@pytest.mark.slow
def test_memory_is_flat_over_many_batches() -> None:
    """Outputs and batches are not kept: the traced memory after 20 000 batches is no larger
    than after 2 000 (a leak of even one small dict per batch would add over a megabyte)."""
    def step(loop, b):
        return {"loss": torch.ones(()) * b, "extra": [b] * 4}

    class Reader:
        @hookfit.hookimpl
        def batch_end(self, output):
            output["loss"].item()

    def run(n: int) -> int:
        gc.collect()
        tracemalloc.start()
        hookfit.Loop(step, range(n), plugins=[Reader()]).fit()
        gc.collect()
        current, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return current

    run(500)  # warm caches
    small, large = run(2_000), run(20_000)
    assert large - small < 50_000, (small, large)


def test_configure_fires_first_and_a_plugin_switched_off_there_sees_nothing() -> None:
    victim = Recorder()
    victim.name = "victim"

    class Gate:
        name = "gate"

        @hookfit.hookimpl
        def configure(self, loop):
            loop.state.rank, loop.state.world_size = 1, 2
            loop.pm.unregister(victim)

    order = Recorder()
    state = hookfit.Loop(lambda l, x: None, [1], plugins=[victim, Gate(), order]).fit()
    assert victim.names() in ([], ["configure"]) and order.names()[:2] == ["configure", "fit_start"]
    assert state.rank == 1 and state.world_size == 2


def test_is_main_follows_the_rank() -> None:
    seen = []
    hookfit.Loop(lambda l, x: seen.append(l.is_main), [1]).fit()
    assert seen == [True]


@pytest.mark.bad_input
def test_a_step_output_with_a_key_that_is_not_a_string_is_named_at_the_first_batch(recorder: Recorder) -> None:
    def my_step(loop, b):
        return {"loss": 1.0, 3: 2.0}

    with pytest.raises(TypeError, match=r"step function '.*my_step' returned a mapping with the key 3 \(int\)"):
        hookfit.Loop(my_step, range(5), plugins=[recorder]).fit()
    assert "step_output" not in recorder.names()  # no plugin saw it
    assert recorder.events[-3][0] == "batch_start"


@pytest.mark.bad_input
def test_a_model_left_in_eval_mode_is_warned_about_once() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    model.eval()
    with pytest.warns(hookfit.HookfitWarning, match=r"the model \(Sequential\) is in eval mode as training starts") as caught:
        hookfit.Loop(lambda l, b: None, [1], model=model, max_epochs=3,
                     val_step=lambda l, b: None, val_data=[1]).fit()
    said = [w for w in caught if "eval mode" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__  # the fit() line, not the loop's code
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hookfit.Loop(lambda l, b: None, [1], model=model.train()).fit()


def test_a_frozen_module_in_eval_mode_in_the_model_dict_is_not_warned_about() -> None:
    """A frozen teacher (``.eval().requires_grad_(False)``) beside the student in ``Loop(model={...})``, as
    checkpoint's warning of a module outside the model advises, is in eval mode on purpose: no warning, and
    it stays in eval mode through training; a module with a trainable parameter left in eval mode beside it
    is still named, alone."""
    def dicts() -> dict[str, torch.nn.Module]:
        teacher = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)).eval().requires_grad_(False)
        return {"student": torch.nn.Linear(2, 2), "teacher": teacher}

    modes = []
    model = dicts()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hookfit.Loop(lambda l, b: modes.append(l.model["teacher"].training), [1, 2], model=model).fit()
    assert not [str(w.message) for w in caught if "eval mode" in str(w.message)]
    assert modes == [False, False] and model["student"].training

    model = {**dicts(), "critic": torch.nn.Linear(2, 2).eval()}
    with pytest.warns(HookfitWarning, match=r"eval mode") as caught:
        hookfit.Loop(lambda l, b: None, [1], model=model).fit()
    said = [str(w.message) for w in caught if "eval mode" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("model['critic'] (Linear) is in eval mode as training starts"), said


def test_wrap_step_surrounds_every_call_of_both_steps_and_keeps_their_names() -> None:
    calls = []

    def tagging(tag):
        def wrapper(step):
            def wrapped(loop, batch):
                calls.append(tag)
                return step(loop, batch)
            return wrapped
        return wrapper

    class Wrapping:
        name = "wrapping"

        @hookfit.hookimpl
        def configure(self, loop):
            loop.wrap_step(tagging("inner"))

        @hookfit.hookimpl
        def fit_start(self, loop):
            loop.wrap_step(tagging("outer"))

    def my_train(loop, batch):
        calls.append("train")

    def my_valid(loop, batch):
        calls.append("valid")

    loop = hookfit.Loop(my_train, [1], val_step=my_valid, val_data=[1], plugins=[Wrapping()])
    loop.fit()
    assert calls == ["outer", "inner", "train", "outer", "inner", "valid"]
    assert loop.run.train_step.__qualname__.endswith("my_train") and loop.train_step is my_train


@pytest.mark.bad_input
def test_wrap_step_after_the_first_batch_or_returning_no_function_is_an_error() -> None:
    class Late:
        name = "late"

        @hookfit.hookimpl
        def batch_end(self, loop):
            loop.wrap_step(lambda step: step)

    with pytest.raises(RuntimeError, match=r"wrap_step\(\) must be called at configure or fit_start"):
        hookfit.Loop(lambda l, b: None, [1], plugins=[Late()]).fit()

    class Bad:
        name = "bad"

        @hookfit.hookimpl
        def configure(self, loop):
            loop.wrap_step(lambda step: None)

    with pytest.raises(TypeError, match=r"wrap_step: the wrapper returned None for train_step '.*<lambda>'"):
        hookfit.Loop(lambda l, b: None, [1], plugins=[Bad()]).fit()


def test_an_evaluation_says_nothing_of_the_training_cadence() -> None:
    """validate() trains no step: a val_every_n_steps over max_steps is not warned about there."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = hookfit.Loop(lambda loop, b: None, [1, 2], val_step=lambda loop, b: None, val_data=[1],
                             model=torch.nn.Linear(1, 1), max_steps=2, val_every_n_steps=10).validate()
    assert state.status == "completed"


@pytest.mark.bad_input
def test_a_loss_of_several_numbers_is_warned_of_once_a_run() -> None:
    """``cross_entropy(..., reduction="none")`` returned: the metrics plugin leaves a vector out and
    the console showed no loss, without a word."""
    def train_step(loop: hookfit.Loop, batch: torch.Tensor) -> torch.Tensor:
        return batch.pow(2).sum(1)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # once a place and text: hookfit's warnings are said once a run
        hookfit.Loop(train_step, [torch.ones(4, 2)] * 3, max_epochs=2).fit()
    said = [str(w.message) for w in caught if "numbers" in str(w.message)]
    assert len(said) == 1 and said[0].endswith(
        "train_step' returned a loss of 4 numbers (shape [4]), not one: no metric reports it and loop.backward takes "
        "one number; reduce it (loss.mean()), or return it under another key"), said
    assert [w.filename for w in caught if "numbers" in str(w.message)] == [__file__]


@pytest.mark.bad_input
def test_data_yielding_more_batches_than_its_length_says_is_warned_of_once_a_run() -> None:
    """A DataLoader over an IterableDataset whose workers each end with a partial batch yields more than its len():
    the progress read batch=12/11 and the last window was divided by the wrong count, without a word."""
    class Longer:
        def __len__(self) -> int:
            return 2

        def __iter__(self):
            return iter([0, 1, 2])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        state = hookfit.Loop(lambda loop, batch: None, Longer(), max_epochs=3).fit()
    said = [str(w.message) for w in caught if "more than its length says" in str(w.message)]
    assert state.step == 9 and said == [
        "train data yielded 3 batches, more than its length says (len() = 2): the progress, an accumulation window's "
        "last divisor and schedules counted by it are off (a DataLoader over an IterableDataset whose workers each "
        "end with a partial batch: its len() counts whole batches of the dataset's __len__)"]


def _fit_again(run_dir, *, stop: int | None = None, ignore: bool = False, **bounds: int):
    """A run of 5 batches an epoch saving every 3 steps into ``run_dir``, resuming its latest checkpoint; the
    state and the warnings that say there is nothing left to train (``ignore``: filtered as README says)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)

    def step(loop, batch):
        loss = loop.model(batch).pow(2).mean()
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    loop = hookfit.Loop(step, [torch.ones(4, 2)] * 5, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                        run_dir=run_dir, resume="latest", **bounds,
                        plugins=[Optim(), Checkpoint(every_n_steps=3, background=False), *([StopAt(stop)] if stop else [])])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if ignore:
            warnings.filterwarnings("ignore", message=r".*has nothing left to train", category=HookfitWarning)
        state = loop.fit()
    return state, [w for w in caught if "nothing left to train" in str(w.message)]


@pytest.mark.bad_input
def test_resuming_a_run_that_reached_its_end_is_warned_of_in_one_process(tmp_path) -> None:
    """A fit run again (a notebook's cell, a changed loss) resuming ``"latest"`` of a run that reached its
    ``max_steps`` or ``max_epochs`` trains nothing and ends completed at once: one warning says so, naming the
    checkpoint, the bound and what to do; raised bounds train on without it, as does a run stopped before its end."""
    first, said = _fit_again(tmp_path / "steps", max_steps=7)
    assert (first.status, first.step, said) == ("completed", 7, [])
    again, said = _fit_again(tmp_path / "steps", max_steps=7)
    assert (again.status, again.step, again.resumed_from.step) == ("completed", 7, 7) and len(said) == 1
    assert str(said[0].message) == (
        f"resume='latest': the run resumed from {tmp_path / 'steps' / 'checkpoints' / 'epoch0002-step000000007.pt'} "
        "had already finished and has nothing left to train (it is at step 7, and max_steps=7): this fit trains "
        "nothing and ends at once, completed as before (a script of several runs started again skips its finished "
        "ones so); to train on, raise max_steps; to train it again from the start (a changed loss, model or "
        "settings), give resume=None or a new run (Loop(name=...) or Loop(run_dir=...))")
    assert said[0].category is HookfitWarning and said[0].filename == __file__
    assert _fit_again(tmp_path / "steps", max_steps=7, ignore=True)[1] == []  # a sweep started again, silenced
    longer, said = _fit_again(tmp_path / "steps", max_steps=9)
    assert (longer.step, said) == (9, [])

    _fit_again(tmp_path / "epochs", max_epochs=2)
    again, said = _fit_again(tmp_path / "epochs", max_epochs=2)
    assert again.step == 10 and len(said) == 1 and "(its 2 epochs are done, and max_epochs=2)" in str(said[0].message)
    assert "raise max_epochs;" in str(said[0].message)
    stopped, said = _fit_again(tmp_path / "stopped", max_epochs=2, stop=4)
    resumed, said = _fit_again(tmp_path / "stopped", max_epochs=2)
    assert (stopped.status, resumed.status, resumed.step, said) == ("interrupted", "completed", 10, [])


@pytest.mark.slow
@pytest.mark.bad_input
def test_resuming_a_run_that_reached_its_end_is_warned_of_in_a_second_process(tmp_path) -> None:
    """The script run again in a new process (``HOOKFIT_RESUME=latest``): its warning on stderr, at the
    script's ``fit()`` line; the script given more epochs trains on without it."""
    script = tmp_path / "again.py"
    script.write_text((TESTS / "scripts" / "ckpt_named.py").read_text())
    env = {**os.environ, "HOOKFIT_RESUME": "latest"}

    def run(epochs: int) -> tuple[dict, str]:
        done = warm.run([sys.executable, str(script), str(tmp_path / "out.json"), "--epochs", str(epochs)],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads((tmp_path / "out.json").read_text()), done.stderr

    first, stderr = run(2)
    assert first["status"] == "completed" and first["step"] == 8 and "nothing left to train" not in stderr
    again, stderr = run(2)
    assert again["resumed_from"] is not None and (again["status"], again["step"]) == ("completed", 8)
    assert re.search(r"again\.py:\d+: HookfitWarning: resume='latest': the run resumed from \S+epoch0002-step000000008"
                     r"\.pt had already finished and has nothing left to train \(its 2 epochs are done, "
                     r"and max_epochs=2\)", stderr), stderr
    more, stderr = run(3)
    assert more["step"] == 12 and "nothing left to train" not in stderr


class _FailInValidation:
    """The validation after training step ``step`` fails at its second batch."""

    name = "fail_in_validation"

    def __init__(self, step: int) -> None:
        self.step = step

    @hookfit.hookimpl
    def batch_start(self, loop, batch_idx) -> None:
        if not loop.training and loop.state.step == self.step and batch_idx == 1:
            raise RuntimeError("injected failure in the run's last validation")


def _validated_run(run_dir, *, fail: int | None = None, every_n_steps: int = 4, **bounds: int):
    """4 shuffled training batches an epoch, 2 validation batches that draw from the RNG, step checkpoints
    every ``every_n_steps`` scored by valid/loss, resuming ``"latest"``: the state, the parameters, the
    metrics history, run.jsonl's last end line and the warnings that nothing is left to train."""
    from hookfit.data import Batches
    from hookfit.plugins.metrics import Metrics

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, 2, generator=g)
    model = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Dropout(0.2))

    def step(loop, b):
        loss = torch.nn.functional.mse_loss(loop.model(b[0]), b[1])
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    metrics = Metrics()
    loop = hookfit.Loop(step, Batches(x, y, batch_size=8, shuffle=True, seed=3), model=model,
                        val_step=lambda l, b: {"loss": torch.nn.functional.mse_loss(l.model(b[0]), b[1]),
                                               "noise": torch.rand(())},
                        val_data=Batches(x[:16], y[:16], batch_size=8), run_dir=run_dir, resume="latest",
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.1), **bounds,
                        plugins=[Optim(), metrics, Checkpoint(every_n_steps=every_n_steps, monitor="valid/loss",
                                                              background=False),
                                 *([_FailInValidation(fail)] if fail else [])])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = loop.fit()
    ends = [line for line in map(json.loads, (run_dir / "run.jsonl").read_text().splitlines()) if line["event"] == "end"]
    return (state, [p.detach().clone() for p in model.parameters()], {k: [dict(e) for e in v] for k, v in metrics.history.items()},
            ends[-1], [w for w in caught if "nothing left to train" in str(w.message)])


def _as_straight(resumed, straight, names: tuple[str, ...]) -> None:
    """The resumed run recorded what the uninterrupted one did: parameters, history, ``names``' results."""
    (state, params, history, end, said), (_, want_params, want_history, want_end, _) = resumed, straight
    assert (state.status, state.stop_reason, said) == ("completed", want_end["reason"], [])
    assert all(torch.equal(p, q) for p, q in zip(params, want_params)) and history == want_history
    for name in names:
        got, want = end["results"][name], want_end["results"][name]
        assert (os.path.basename(got) if name.endswith("checkpoint") else got) == (
            os.path.basename(want) if name.endswith("checkpoint") else want), name


@pytest.mark.fault
@pytest.mark.parametrize("bounds", [{"max_steps": 8}, {"max_epochs": 2}])
def test_a_run_failed_in_its_last_validation_runs_it_when_resumed_under_either_bound(tmp_path, bounds) -> None:
    """The step checkpoint of the last training batch (step 8, the end of epoch 2) says the epoch's end is left;
    the validation fails: resumed with the same bound, the run validates as the uninterrupted run did (metrics,
    best checkpoint by valid/loss) and ends completed without a word; resumed again, nothing is left: it says so."""
    straight = _validated_run(tmp_path / "straight", **bounds)
    with pytest.raises(RuntimeError, match="injected failure"):
        _validated_run(tmp_path / "failed", fail=8, **bounds)
    _as_straight(_validated_run(tmp_path / "failed", **bounds), straight,
                 ("metrics", "best", "best_checkpoint", "last_checkpoint"))
    assert sorted(os.listdir(tmp_path / "failed" / "checkpoints")) == sorted(os.listdir(tmp_path / "straight" / "checkpoints"))
    again, _, _, _, said = _validated_run(tmp_path / "failed", **bounds)
    assert again.status == "completed" and len(said) == 1
    assert ("(it is at step 8, and max_steps=8)" if "max_steps" in bounds else "(its 2 epochs are done, and max_epochs=2)"
            ) in str(said[0].message)


@pytest.mark.fault
@pytest.mark.parametrize("max_steps, every", [(6, 3), (8, 4)])
def test_a_run_failed_in_the_validation_due_at_its_max_steps_runs_it_when_resumed(tmp_path, max_steps, every) -> None:
    """``val_every_n_steps``: the validation due at ``max_steps`` (inside epoch 2, or after its last batch) fails
    after the step's checkpoint, which says it is due: resumed with the same ``max_steps``, it runs, as in the
    uninterrupted run, and the run ends completed without a word and trains no further batch."""
    bounds = {"max_steps": max_steps, "val_every_n_steps": every, "every_n_steps": every}
    straight = _validated_run(tmp_path / "straight", **bounds)
    with pytest.raises(RuntimeError, match="injected failure"):
        _validated_run(tmp_path / "failed", fail=max_steps, **bounds)
    resumed = _validated_run(tmp_path / "failed", **bounds)
    assert [e["step"] for e in resumed[2]["valid"]] == [every, 2 * every] and resumed[0].step == max_steps
    _as_straight(resumed, straight, ("metrics",) if max_steps == 8 else ())
    assert {k: v for k, v in resumed[3]["results"]["metrics"].items() if k.startswith("valid/")} == {
        k: v for k, v in straight[3]["results"]["metrics"].items() if k.startswith("valid/")}


class _Shards:
    """A stream written as a training stream is: ``set_epoch`` reshuffles its 4 shards of 3 rows, and an
    iteration reads the first 6 rows of that order."""

    def __init__(self) -> None:
        self.epoch, self.told = 0, []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.told.append(epoch)

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(4, generator=torch.Generator().manual_seed(self.epoch)).tolist()
        yield from [3 * shard + row for shard in order for row in range(3)][:6]


class _ShardsDataset(_Shards, torch.utils.data.IterableDataset):
    """The same stream as the ``IterableDataset`` of a ``DataLoader``."""


@pytest.mark.parametrize("loader", [False, True])
def test_validation_data_is_never_told_the_epoch_so_every_validation_reads_the_same_rows(loader: bool) -> None:
    """A held-out stream with ``set_epoch`` (reshuffled shards, a fixed number of rows) is never told the epoch:
    every validation reads the same rows, those ``Loop.validate()`` reads, so that its metrics move with the
    training alone. The training data is told every epoch."""
    train, held_out = _Shards(), (_ShardsDataset() if loader else _Shards())
    rows: dict[tuple[str, int], list[int]] = {}

    def valid(loop: Any, batch: Any) -> None:
        rows.setdefault((loop.mode, loop.state.epoch), []).extend(torch.as_tensor(batch).flatten().tolist())

    data = torch.utils.data.DataLoader(held_out, batch_size=2) if loader else held_out
    state = hookfit.Loop(lambda loop, b: None, train, val_step=valid, val_data=data, max_epochs=3).fit()
    hookfit.Loop(val_step=valid, val_data=data).validate()
    assert state.status == "completed" and train.told == [0, 1, 2] and held_out.told == []
    assert list(rows) == [("fit", 0), ("fit", 1), ("fit", 2), ("validate", 0)]
    assert all(seen == rows["fit", 0] for seen in rows.values()), rows
