"""hookfit.loop: the configuration is checked when the Loop is made, a Loop runs once, and a
run never changes it."""

from __future__ import annotations

import dataclasses
import re

import numpy
import pytest
import torch

import hookfit
from hookfit.plugins.optim import Optim

from conftest import mse_step


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"max_epochs": 0}, ValueError, "max_epochs must be a positive integer, got 0"),
        ({"max_epochs": -2}, ValueError, "max_epochs must be a positive integer, got -2"),
        ({"max_steps": 0}, ValueError, "max_steps must be a positive integer"),
        ({"max_epochs": 2.0}, ValueError, r"max_epochs must be a positive integer, got 2.0"),
        ({"val_every_n_steps": numpy.float64(3)}, ValueError, r"val_every_n_steps must be a positive integer"),
        ({"max_epochs": torch.tensor(3.0)}, ValueError, r"max_epochs must be a positive integer, got tensor\(3\.\)"),
        ({"max_steps": numpy.array([3.0])}, ValueError, r"max_steps must be a positive integer"),
        ({"max_epochs": torch.tensor(True)}, ValueError, r"max_epochs must be a positive integer, got tensor\(True\)"),
        ({"seed": torch.tensor([True])}, ValueError, r"seed must be "),
        ({"val_step": lambda l, b: None}, ValueError, "val_step .* without val_data"),
        ({"val_data": [1]}, ValueError, "val_data was given without a val_step"),
        ({"val_grad_mode": "off"}, ValueError, "val_grad_mode"),
        ({"model": "resnet"}, TypeError, "model must be a torch.nn.Module"),
    ],
)
@pytest.mark.bad_input
def test_bad_arguments_are_named(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        hookfit.Loop(lambda l, b: None, [1], **kwargs)


@pytest.mark.bad_input
@pytest.mark.parametrize("misspelt, meant", [("max_epoch", "'max_epochs'"), ("optimiser", "'optimizers'"),
                                             ("val_every_n_step", "'val_every_n_steps'"),
                                             ("epochs", "'max_epochs'"), ("xyzzy", "it takes train_step, ")])
def test_a_misspelt_keyword_names_the_one_meant(misspelt: str, meant: str) -> None:
    with pytest.raises(TypeError, match=rf"Loop\(\) got an unexpected keyword argument '{misspelt}'; "
                                        rf"(did you mean )?{re.escape(meant)}"):
        hookfit.Loop(lambda l, b: None, [1], **{misspelt: 3})


def test_numpy_integers_are_taken_as_the_plain_integers_they_hold() -> None:
    # counts computed with NumPy (np.ceil(n / batch).astype(int), an array's len) are integers too
    loop = hookfit.Loop(lambda l, b: None, [1, 2], val_step=lambda l, b: None, val_data=[1],
                        max_epochs=numpy.int64(3), max_steps=numpy.int32(5), val_every_n_steps=numpy.uint8(2),
                        seed=numpy.uint32(7))
    assert (loop.max_epochs, loop.max_steps, loop.val_every_n_steps, loop.seed) == (3, 5, 2, 7)
    assert all(type(v) is int for v in (loop.max_epochs, loop.max_steps, loop.val_every_n_steps, loop.seed))
    assert loop.fit().step == 5  # max_steps=5 over two batches an epoch ends the third epoch early


@pytest.mark.bad_input
def test_train_data_not_iterable() -> None:
    with pytest.raises(TypeError, match="train_data must be an iterable of batches.*got int"):
        hookfit.Loop(lambda l, b: None, 5)
    with pytest.raises(TypeError, match=r"got NoneType; a Loop that only validates reads no training data: give \[\]"):
        hookfit.Loop(lambda l, b: None, None)


@pytest.mark.bad_input
@pytest.mark.parametrize("given, match", [
    ("list", r"optimizers: give one optimizer, or several as a dict of names \(\{'gen': g_opt, 'disc': d_opt\}\), not "
             r"a list"),
    ("parameters", r"optimizers: got a generator \(model.parameters\(\)\?\), not an optimizer: build one on them"),
    ("class", r"optimizers: got the class SGD, not an optimizer: build one, optimizers=SGD\(model.parameters"),
])
def test_optimizers_that_are_a_slip_are_refused_when_the_loop_is_made(given: str, match: str) -> None:
    """A list of optimizers, the parameters themselves or an optimizer's class fail at Loop(),
    saying what to give instead, before any plugin is set up."""
    model = torch.nn.Linear(2, 1)
    value = {"list": lambda: [torch.optim.SGD(model.parameters())], "parameters": model.parameters,
             "class": lambda: torch.optim.SGD}[given]()
    with pytest.raises(TypeError, match=match):
        hookfit.Loop(lambda loop, b: None, [1], model=model, optimizers=value)


@pytest.mark.bad_input
def test_fit_without_a_train_step_says_so_before_the_run() -> None:
    """A Loop made with no train step (for validate() alone) cannot fit(): said at once, with
    no plugin set up and no run started."""
    loop = hookfit.Loop(None, [], val_step=lambda loop, b: None, val_data=[1])
    with pytest.raises(TypeError, match=r"^fit\(\) needs a train_step: this Loop was given None"):
        loop.fit()
    assert loop.run is None


@pytest.mark.bad_input
def test_training_data_without_a_train_step_is_refused_when_the_loop_is_made() -> None:
    """As val_data without a val_step is: Loop(model=m, train_data=dl) was accepted and failed only at
    fit(). A Loop only for evaluations may still be given empty training data, which it never reads."""
    model, evaluate = torch.nn.Linear(2, 1), {"val_step": lambda loop, b: None, "val_data": [1]}
    for data in ([torch.ones(2)], iter([torch.ones(2)]), torch.utils.data.DataLoader(torch.ones(3, 2))):
        with pytest.raises(ValueError, match=r"^train_data was given without a train_step to run on it: "
                                             r"Loop\(train_step, train_data, \.\.\.\); a Loop only for validate\(\) "
                                             r"takes neither \(or train_data=\[\]\)$"):
            hookfit.Loop(model=model, train_data=data, **evaluate)
    with pytest.raises(ValueError, match=r"^train_data was given without a train_step"):
        hookfit.Loop(model=model, train_data=[torch.ones(2)])
    for empty in ([], torch.utils.data.DataLoader(torch.ones(0, 2))):
        assert hookfit.Loop(None, empty, model=model, **evaluate).train_data is empty


def test_a_loop_for_evaluations_alone_needs_no_train_step_nor_training_data() -> None:
    """Lightning's trainer.validate(model, dataloaders): Loop(val_step=..., val_data=..., model=...) validates;
    its fit() says what it lacks."""
    model = torch.nn.Linear(2, 1)
    from hookfit.plugins.metrics import Metrics

    loop = hookfit.Loop(val_step=lambda loop, b: {"loss": loop.model(b).mean()}, val_data=[torch.ones(3, 2)],
                        model=model, plugins=[Metrics()])
    assert loop.validate().results["metrics"] == {"valid/loss": pytest.approx(model(torch.ones(3, 2)).mean().item())}
    with pytest.raises(TypeError, match=r"^fit\(\) needs a train_step: this Loop was given None"):
        hookfit.Loop(val_step=lambda loop, b: None, val_data=[1]).fit()


def test_a_loop_runs_once() -> None:
    loop = hookfit.Loop(lambda loop, b: None, [1])
    loop.fit()
    with pytest.raises(RuntimeError, match="already run"):
        loop.fit()


def test_a_run_never_changes_the_loops_configuration() -> None:
    """What plugins replace for a run (the model wrapped, the data sharded, managed
    optimizers) is the run's own: the Loop keeps what the user gave it."""
    model, data = torch.nn.Linear(1, 1), [torch.ones(1)] * 4
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []

    class Replacer:
        name = "replacer"

        @hookfit.hookimpl(tryfirst=True)
        def configure(self, loop):
            loop.model = torch.nn.Sequential(loop.model)
            loop.train_data = loop.train_data[:2]

        @hookfit.hookimpl
        def fit_start(self, loop):
            loop.optimizers = {"wrapped": loop.optimizers}

    def step(loop, batch):
        seen.append((type(loop.model).__name__, type(loop.optimizers).__name__, loop is loop_.run))

    loop_ = hookfit.Loop(step, data, model=model, optimizers=opt, plugins=[Replacer()])
    state = loop_.fit()
    assert seen == [("Sequential", "dict", True)] * 2 and state.step == 2
    assert loop_.model is model and loop_.train_data is data and loop_.optimizers is opt
    run = loop_.run
    assert isinstance(run, hookfit.Run) and run.state is state is loop_.state
    assert run.pm is not None and [n for n, _ in run.pm.list_name_plugin()] == ["replacer"]
    assert "backward" not in vars(run)  # the bound backward went with the run's end

@pytest.mark.bad_input
def test_loop_request_stop_outside_a_run_is_an_error() -> None:
    loop = hookfit.Loop(lambda l, b: None, [1])
    with pytest.raises(RuntimeError, match="needs a running loop"):
        loop.request_stop("too early")
    loop.fit()
    with pytest.raises(RuntimeError, match="needs a running loop"):
        loop.request_stop("too late")


# -- validate() and predict() -----------------------------------------------------------------


class _Frozen(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(2, 1)
        self.bn = torch.nn.BatchNorm1d(1)


def test_validate_runs_the_validation_stage_alone_with_every_plugin(recorder) -> None:
    from hookfit.plugins.metrics import Metrics

    model = _Frozen()
    model.bn.eval()  # a module kept in eval mode on purpose keeps it
    seen = []

    def valid(loop, batch):
        seen.append((model.training, torch.is_grad_enabled()))
        return {"loss": torch.tensor(float(batch))}

    published = []

    class Watch:
        name = "watch"

        @hookfit.hookimpl
        def epoch_metrics(self, stage, metrics):
            published.append((stage, metrics.values["loss"].epoch))

    def train(loop, batch):
        raise AssertionError("validate() ran a training batch")

    loop = hookfit.Loop(train, [1, 2], val_step=valid, val_data=[1.0, 2.0, 6.0], model=model,
                        plugins=[Metrics(), Watch(), recorder])
    state = loop.validate()
    assert (state.status, state.stop_reason, state.step) == ("completed", "validation done", 0)
    assert seen == [(False, False)] * 3 and published == [("valid", 3.0)]
    names = recorder.names()
    assert "epoch_start" not in names and "epoch_end" not in names
    assert names.count("batch_end") == 3 and names[-1] == "fit_end"
    assert model.training and model.body.training and not model.bn.training  # modes restored
    with pytest.raises(RuntimeError, match="already run"):
        loop.fit()


@pytest.mark.fault
def test_validate_from_a_checkpoint_loads_its_weights_and_writes_nothing(tmp_path) -> None:
    from hookfit.plugins.checkpoint import Checkpoint
    from hookfit.plugins.optim import Optim

    def make():
        torch.manual_seed(0)
        return torch.nn.Linear(2, 1)

    data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(4)]

    step = mse_step

    losses = []

    def valid(loop, batch):
        losses.append(float(torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])))

    trained = make()
    hookfit.Loop(step, data, val_step=valid, val_data=data, model=trained, max_epochs=3, name="exp",
                 optimizers=torch.optim.SGD(trained.parameters(), lr=0.1),
                 plugins=[Optim(), Checkpoint(background=False)]).fit()
    last = losses[-4:]
    files = sorted(p.name for p in tmp_path.glob("runs/exp/*/checkpoints/*"))
    fresh = make()
    assert not torch.equal(fresh.weight, trained.weight)
    losses.clear()
    state = hookfit.Loop(step, data, val_step=valid, val_data=data, model=fresh, name="exp",
                         optimizers=torch.optim.SGD(fresh.parameters(), lr=0.1),
                         plugins=[Optim(), Checkpoint(background=False)]).validate(resume="latest")
    assert state.status == "completed" and state.resumed_from is not None
    assert torch.equal(fresh.weight, trained.weight) and losses == last
    assert sorted(p.name for p in tmp_path.glob("runs/exp/*/checkpoints/*")) == files  # none written


@pytest.mark.bad_input
def test_validate_and_predict_need_a_step() -> None:
    with pytest.raises(ValueError, match=r"validate\(\) needs a val_step and val_data"):
        hookfit.Loop(lambda l, b: None, [1]).validate()
    with pytest.raises(TypeError, match=r"predict\(\) needs a step function"):
        hookfit.Loop(lambda l, b: None, [1]).predict([1])
    with pytest.raises(TypeError, match=r"predict\(\) data must be an iterable of batches, got int"):
        hookfit.Loop(lambda l, b: None, [1]).predict(3, lambda l, b: b)


def test_predict_yields_one_output_at_a_time_in_eval_mode_and_restores_the_modes() -> None:
    model = _Frozen()
    model.bn.eval()
    read = []

    def data():
        for i in range(1000):
            read.append(i)
            yield torch.full((3, 2), float(i))

    def step(loop, batch):
        assert not loop.model.training and torch.is_inference_mode_enabled()
        return loop.model.body(batch).sum()

    loop = hookfit.Loop(lambda l, b: None, [1], model=model)
    outputs = loop.predict(data(), step)
    first = next(outputs)
    assert read == [0], "data is read as outputs are asked for, none kept ahead"
    assert not torch.is_inference_mode_enabled(), "between batches the caller's grad mode holds"
    assert not model.training  # in eval mode while predicting
    second = next(outputs)
    assert torch.allclose(first, model.body(torch.zeros(3, 2)).sum()) and read == [0, 1]
    assert second.item() != first.item()
    outputs.close()  # abandoned: modes come back
    assert model.training and model.body.training and not model.bn.training
    results = list(hookfit.Loop(lambda l, b: None, [1], model=model, val_step=step, val_data=[1])
                   .predict([torch.ones(1, 2)] * 3))
    assert len(results) == 3 and model.training


def test_predict_of_named_sets_names_each_as_a_validation_does_and_other_data_none() -> None:
    """The default ``val_step`` of a Loop with several sets reads ``loop.state.val_set`` (a head per set): given
    the sets by name, ``predict`` runs them one after the other as a validation names them, yielding what the
    step returns, unrenamed; given other data, the step sees no set (``None``)."""
    scale = {"a": 1.0, "b": 10.0}
    seen: list[tuple[object, int]] = []

    def val_step(loop, batch):
        seen.append((loop.state.val_set, batch))
        return {"y": batch * scale[loop.state.val_set]}

    loop = hookfit.Loop(val_step=val_step, val_data={"a": [1], "b": [2]}, model=torch.nn.Linear(1, 1))
    run = loop.predict({"a": [1, 2], "b": [3]})
    assert list(run) == [{"y": 1.0}, {"y": 2.0}, {"y": 30.0}]
    assert seen == [("a", 1), ("a", 2), ("b", 3)]
    with pytest.raises(KeyError, match="None"):
        list(loop.predict([4]))
    assert seen[-1] == (None, 4)


@pytest.mark.bad_input
@pytest.mark.parametrize("sets, error, says", [
    ({}, ValueError, r"^predict\(\) data is an empty mapping: give at least one validation set, \{name: data\}$"),
    ({"a/b": [1]}, ValueError, r"^predict\(\) data: the name of a validation set must be a non-empty string "
                               r"without '/', got 'a/b'$"),
    ({"a": 3}, TypeError, r"^predict\(\) data\['a'\] must be an iterable of batches \(a list, a DataLoader, "
                          r"\.\.\.\), got int$"),
])
def test_predict_refuses_named_sets_as_the_loop_refuses_them_in_val_data(sets, error, says) -> None:
    loop = hookfit.Loop(val_step=lambda loop, batch: batch, val_data=[1])
    with pytest.raises(error, match=says):
        loop.predict(sets)


class _Unsized:
    """Re-iterable batches without a len(), as an IterableDataset's loader."""

    def __iter__(self):
        return iter(range(4))


@pytest.mark.parametrize("data, epochs_seen", [(list(range(3)), 4), (_Unsized(), 10)])
def test_max_steps_alone_runs_until_that_many_steps(data, epochs_seen) -> None:
    """``Loop(max_steps=10)`` without ``max_epochs`` runs 10 steps (it used to stop after one
    epoch); plugins see from configure on how many epochs that takes when the data has a
    length (else the bound that never ends the run first)."""
    seen = []

    class Watcher:
        name = "watcher"

        @hookfit.hookimpl
        def fit_start(self, loop):
            seen.append(loop.max_epochs)

    state = hookfit.Loop(lambda loop, b: None, data, max_steps=10, plugins=[Watcher()]).fit()
    assert (state.status, state.step, state.stop_reason) == ("completed", 10, "max_steps=10 reached")
    assert state.epoch == (3 if epochs_seen == 4 else 2)  # 3+3+3+1, 4+4+2
    assert seen == [epochs_seen]


def test_max_epochs_still_ends_a_run_with_max_steps_and_one_epoch_is_the_default() -> None:
    assert hookfit.Loop(lambda loop, b: None, [1, 2], max_steps=10, max_epochs=2).fit().step == 4
    state = hookfit.Loop(lambda loop, b: None, [1, 2]).fit()
    assert (state.step, state.stop_reason) == (2, "max_epochs=1 reached")


@pytest.mark.bad_input
@pytest.mark.parametrize("given, match", [
    ("csv", r"plugins\[1\] is not a plugin: str 'csv' implements no hookfit event; give the plugin object "
            r"\(hookfit\.plugins\.csv_log\.CSVLogger\(\)\), or choose plugins by name in hookfit\.toml "
            r"\(\[plugins\.csv\]\) or HOOKFIT_PLUGINS"),
    ("tensorbord", r"plugins\[1\] is not a plugin: str 'tensorbord' .*; installed plugins are chosen by name"),
    (42, r"plugins\[1\] is not a plugin: int 42 implements no hookfit event; a plugin is an object, class or "
         r"module with functions marked @hookfit\.hookimpl"),
    ([Optim()], r"plugins\[1\] is not a plugin: list \[<hookfit"),
    (torch.nn.MSELoss(), r"plugins\[1\] is not a plugin: MSELoss MSELoss\(\) .*give a model to Loop\(model=\.\.\.\)"),
    (torch.optim.SGD([torch.zeros(1, requires_grad=True)]), r"plugins\[1\] is not a plugin: SGD implements no "
                                                             r"hookfit event; .*optimizers to Loop\(optimizers=\.\.\.\)"),
])
def test_an_element_of_plugins_that_is_no_plugin_is_named_when_the_loop_is_made(given: object, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        hookfit.Loop(lambda l, b: None, [1], plugins=[Optim(), given])


def test_none_in_plugins_is_left_out_and_a_plugin_without_hooks_is_registered() -> None:
    class Service:  # no hook: other plugins and steps find it by name
        name = "service"

    seen = []
    loop = hookfit.Loop(lambda l, b: seen.append(l.pm.get_plugin("service")), [1],
                        plugins=[None, Service(), None])
    loop.fit()
    assert [type(s).__name__ for s in seen] == ["Service"]
    assert "NoneType" not in dict(loop.run.pm.list_name_plugin())


@pytest.mark.bad_input
def test_an_unhashable_plugin_is_named_when_the_loop_is_made() -> None:
    @dataclasses.dataclass
    class Counter:  # compares by value, so unhashable: pluggy keys its plugins by the objects
        seen: int = 0

        @hookfit.hookimpl
        def batch_end(self) -> None:
            self.seen += 1

    with pytest.raises(TypeError, match=r"plugins\[0\], a Counter, is unhashable.*@dataclass\(eq=False\)"):
        hookfit.Loop(lambda l, b: None, [1], plugins=[Counter()])

    @dataclasses.dataclass(eq=False)
    class Counted:
        seen: int = 0

        @hookfit.hookimpl
        def batch_end(self) -> None:
            self.seen += 1

    counted = Counted()
    hookfit.Loop(lambda l, b: None, [1, 2], plugins=[counted]).fit()
    assert counted.seen == 2
