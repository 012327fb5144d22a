"""early_stopping: stops when the monitored metric stops improving, exactly across resumes."""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.early_stopping import EarlyStopping
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim

from conftest import Recorder, mse_step

# the valid loss of each epoch (epoch 1 first): best 4.0 at epoch 2, then no improvement
VALID = [5.0, 4.0, 4.5, 4.2, 4.1, 3.0, 2.0, 1.0, 0.5, 0.25]


def run(*plugins, valid=VALID, max_epochs=10, **kwargs) -> hookfit.Loop:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(3)]

    step = mse_step

    def val_step(loop, batch):
        return {"loss": torch.tensor(valid[loop.state.epoch]), "accuracy": torch.tensor(-valid[loop.state.epoch])}

    loop = hookfit.Loop(step, data, val_step=val_step, val_data=[0], model=model, max_epochs=max_epochs,
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
                        plugins=[Optim(), Metrics(), *plugins], **kwargs)
    loop.fit()
    return loop


def test_stops_after_patience_epochs_without_improvement_and_completes() -> None:
    recorder = Recorder()
    loop = run(EarlyStopping(monitor="valid/loss", patience=3), recorder)
    state = loop.state
    assert state.status == "completed" and state.stopped_by == "early_stopping"
    assert state.stop_reason == ("early stopping: valid/loss did not improve for 3 epoch(s) (patience 3); "
                                 "best (min) 4 at epoch 2")
    assert state.epoch == 4 and state.step == 15  # epochs 3, 4 and 5 did not improve on epoch 2
    names = recorder.names()
    assert names.count("epoch_end") == 5 and names.count("epoch_start") == 5  # no further batch
    assert names[-3:] == ["stop_requested", "after_epoch", "fit_end"]


@pytest.mark.parametrize("options, epochs, best", [
    ({"monitor": "valid/loss", "patience": 0}, 3, "4 at epoch 2"),      # the first epoch that does not improve
    ({"monitor": "valid/loss", "patience": 1, "min_delta": 1.0}, 2, "5 at epoch 1"),  # 4.0 is not more than 1 below 5
    ({"monitor": "valid/accuracy", "mode": "max", "patience": 2}, 4, "-4 at epoch 2"),
])
def test_mode_patience_and_min_delta(options: dict, epochs: int, best: str) -> None:
    state = run(EarlyStopping(**options)).state
    assert state.status == "completed" and state.epoch + 1 == epochs, state.stop_reason
    assert state.stop_reason.endswith(best)


def test_a_metric_that_keeps_improving_never_stops_and_nan_never_improves() -> None:
    assert run(EarlyStopping(monitor="valid/loss", patience=1), valid=[float(10 - i) for i in range(10)]).state.stop_reason \
        == "max_epochs=10 reached"
    state = run(EarlyStopping(monitor="valid/loss", patience=2), valid=[1.0, math.nan, math.nan, 0.5] + VALID).state
    assert state.epoch == 2 and "best (min) 1 at epoch 1" in state.stop_reason


def test_without_a_monitor_it_is_inert() -> None:
    plugin = EarlyStopping()
    state = run(plugin, valid=[1.0] * 10).state
    assert state.stop_reason == "max_epochs=10 reached"
    assert plugin.save_state() is None


def test_it_is_discovered_like_every_built_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOKFIT_PLUGINS", "early_stopping")
    loop = hookfit.Loop(lambda l, b: None, [1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # inert: not a word
        loop.fit()
    info = loop.run.pm.infos["early_stopping"]
    assert info.enabled and isinstance(info.plugin, EarlyStopping)  # discovered and enabled ...
    assert loop.run.pm.get_plugin("early_stopping") is None  # ... and, inert without a monitor, not in the run


def test_the_listing_and_the_run_agree_that_without_a_monitor_it_is_inert(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``hookfit plugins`` says ``[inert]``: the run then has it neither among its plugins (the
    console's ``plugins=`` line) nor calls any of its hooks; with a monitor it takes part."""
    import io

    from hookfit.plugins.console import Console
    from hookfit.tools import cli

    monkeypatch.setenv("HOOKFIT_PLUGINS", "early_stopping,console,metrics")
    assert cli.main(["plugins"]) == 0
    assert re.search(r"^early_stopping  \[inert\]", capsys.readouterr().out, re.M)
    called: list[str] = []

    class Counted(EarlyStopping):
        @hookfit.hookimpl
        def epoch_end(self, loop, epoch):
            called.append("epoch_end")
            super().epoch_end(loop, epoch)

    for plugin, takes_part in ((Counted(), False), (Counted(monitor="train/loss"), True)):
        called.clear()
        stream = io.StringIO()
        loop = hookfit.Loop(lambda l, b: torch.tensor(1.0), [1], max_epochs=2,
                            plugins=[plugin, Metrics(), Console(stream=stream)])
        loop.fit()
        start = stream.getvalue().splitlines()[0]
        assert ("early_stopping" in start.split("plugins=")[1].split(",")) is takes_part, start
        assert (loop.run.pm.get_plugin("early_stopping") is plugin) is takes_part
        assert called == (["epoch_end", "epoch_end"] if takes_part else [])


@pytest.mark.bad_input
@pytest.mark.parametrize("options, message", [
    ({"monitor": "loss"}, "monitor must be '<stage>/<metric>'"),
    ({"monitor": "test/loss"}, "monitor must be '<stage>/<metric>'"),
    ({"monitor": "valid/"}, "monitor must be '<stage>/<metric>'"),
    ({"monitor": 3}, "monitor must be '<stage>/<metric>'"),
    ({"mode": "best"}, "mode must be 'min' or 'max', got 'best'"),
    ({"patience": -1}, "patience must be an integer >= 0"),
    ({"patience": 2.5}, "patience must be an integer >= 0"),
    ({"patience": True}, "patience must be an integer >= 0"),
    ({"min_delta": -0.1}, "min_delta must be a finite number >= 0"),
    ({"min_delta": math.nan}, "min_delta must be a finite number >= 0"),
    ({"min_delta": "0.1"}, "min_delta must be a finite number >= 0"),
])
def test_options_are_checked_when_it_is_built(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=r"^early_stopping: " + message.replace("(", r"\(").replace(")", r"\)")):
        EarlyStopping(**options)


@pytest.mark.bad_input
def test_a_mode_without_a_monitor_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match=r"^early_stopping: mode='max' is the direction of the monitored metric, and "
                                         r"no monitor is given: give monitor='valid/loss'"):
        EarlyStopping(mode="max")
    with pytest.raises(ValueError, match=r"^early_stopping: min_delta=0.1 is the least change that counts as an "
                                         r"improvement of the monitored metric, and no monitor is given"):
        EarlyStopping(min_delta=0.1)
    EarlyStopping(monitor="valid/loss", mode="max", min_delta=0.1)


@pytest.mark.bad_input
def test_a_metric_the_run_never_produces_fails_with_its_stage_s_first_metrics_naming_those_it_has_and_the_closest(
        tmp_path: Path) -> None:
    recorder = Recorder()
    with pytest.raises(ValueError, match=r"^early_stopping: monitor='valid/acc' names a metric this run does not "
                                         r"produce: the valid metrics of epoch 1 are accuracy, loss; did you mean "
                                         r"monitor='valid/accuracy'\?\n"):  # then the note naming the plugin
        run(EarlyStopping(monitor="valid/acc"), recorder, Checkpoint(dir=tmp_path, background=False))
    names = recorder.names()
    assert names.count("epoch_end") == 0 and names.count("stage_end") == 2 and not list(tmp_path.glob("epoch*"))
    with pytest.raises(ValueError, match=r"^early_stopping: monitor='train/accuracy' names a metric this run does "
                                         r"not produce: the train metrics of epoch 1 are loss\n"):  # none close
        run(EarlyStopping(monitor="train/accuracy"), recorder := Recorder())
    assert recorder.names().count("stage_end") == 1  # the training stage's end: no validation batch ran


@pytest.mark.bad_input
def test_a_checkpoint_monitoring_a_metric_the_run_never_produces_is_told_the_same_in_a_warning(tmp_path: Path) -> None:
    """Early stopping cannot work without its metric and fails the run; a checkpoint still
    writes its checkpoints and warns, in the same words."""
    ckpt = Checkpoint(dir=tmp_path, monitor="valid/los", background=False)
    with pytest.warns(hookfit.HookfitWarning) as caught:
        loop = run(ckpt, max_epochs=2)
    said = [(str(w.message), w.filename) for w in caught if "monitor=" in str(w.message)]
    assert said == [("checkpoint: monitor='valid/los' names a metric this run does not produce: the valid metrics of "
                     "epoch 1 are accuracy, loss; no best checkpoint is kept by it; did you mean monitor='valid/loss'?",
                     __file__)]  # at run()'s loop.fit()
    assert loop.state.status == "completed" and ckpt.best is None and len(list(tmp_path.glob("epoch*.pt"))) == 2
    with pytest.raises(ValueError, match=r"^early_stopping: monitor='valid/los' names .* are accuracy, loss; did "
                                         r"you mean monitor='valid/loss'\?\n"):
        run(EarlyStopping(monitor="valid/los"))


@pytest.mark.bad_input
@pytest.mark.parametrize("options, why", [
    ({}, "has none"),
    ({"val_step": lambda l, b: {"loss": 1.0}, "val_data": [0], "max_epochs": 2, "val_every_n_epochs": 3},
     r"never validates: val_every_n_epochs=3, and it trains 2 epoch\(s\) at most \(max_epochs\)"),
    ({"val_step": lambda l, b: {"loss": 1.0}, "val_data": [0], "max_steps": 2, "val_every_n_steps": 3},
     r"never validates: val_every_n_steps=3, and it trains 2 step\(s\) at most \(max_steps\); give "
     r"val_every_n_steps=2 or less"),
    ({"val_step": lambda l, b: {"loss": 1.0}, "val_data": [0], "max_epochs": 1, "val_every_n_steps": 3},
     r"never validates: val_every_n_steps=3, and it trains 2 step\(s\) at most \(max_epochs=1 of 2 batches\); "
     r"give val_every_n_steps=2 or less"),
])
def test_a_valid_monitor_without_validation_fails_before_any_batch(options: dict, why: str) -> None:
    """No validation, or none before the run's end: a stop it could never decide, said by its error
    alone (no warning of the core's says the same before it)."""
    recorder = Recorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError,
                           match=rf"early_stopping: monitor='valid/loss' needs validation, and this run {why}"):
            hookfit.Loop(lambda l, b: {"loss": 1.0}, [1, 2], plugins=[Metrics(), EarlyStopping(monitor="valid/loss"),
                                                                      recorder], **options).fit()
    assert "batch_start" not in recorder.names()
    assert [str(w.message) for w in caught if "val_every_n" in str(w.message)] == []


@pytest.mark.bad_input
def test_without_a_metrics_plugin_the_first_epoch_end_says_so() -> None:
    with pytest.raises(ValueError, match=r"no plugin published the train metrics of epoch 1 .*metrics plugin enabled"):
        hookfit.Loop(lambda l, b: {"loss": 1.0}, [1, 2], plugins=[EarlyStopping(monitor="train/loss")]).fit()


@pytest.mark.fault
def test_a_resumed_run_stops_where_the_uninterrupted_one_does_and_stays_stopped(tmp_path: Path) -> None:
    """Its state (best, its epoch, epochs without improvement) is in checkpoints: a run cut
    after epoch 3 and resumed stops after epoch 5 with the same reason, as if never cut."""
    def plugins():
        return [EarlyStopping(monitor="valid/loss", patience=3), Checkpoint(background=False)]

    whole = run(*plugins(), run_dir=tmp_path / "whole").state
    run(*plugins(), max_epochs=3, run_dir=tmp_path / "cut")
    resumed = run(*plugins(), run_dir=tmp_path / "cut", resume="latest").state
    assert (resumed.status, resumed.epoch, resumed.step, resumed.stop_reason) == \
        (whole.status, whole.epoch, whole.step, whole.stop_reason) == ("completed", 4, 15, whole.stop_reason)

    # resumed after it stopped: it stops again before any batch, saying why
    recorder = Recorder()
    with pytest.warns(hookfit.HookfitWarning) as caught:
        again = run(*plugins(), recorder, run_dir=tmp_path / "cut", resume="latest").state
    assert again.status == "completed" and again.step == 15 and again.stop_reason == whole.stop_reason
    (said,) = [str(w.message) for w in caught if "early_stopping: the run resumed" in str(w.message)]
    assert said == (f"early_stopping: the run resumed had stopped early ({whole.stop_reason}): this fit trains nothing "
                    f"and ends at once, completed as before; to train on, give EarlyStopping(patience=...) above 3, "
                    f"or disable early_stopping"), said
    assert again.epoch == whole.epoch  # the epoch it ended in, not the next one it never began
    assert "batch_start" not in recorder.names()
    # ... unless given more patience: then it trains on
    more = run(EarlyStopping(monitor="valid/loss", patience=4), Checkpoint(background=False),
               run_dir=tmp_path / "cut", resume="latest").state
    assert more.step == 30 and more.stop_reason == "max_epochs=10 reached"  # epochs 6 to 10 improve


@pytest.mark.fault
def test_a_metric_never_finite_stops_and_a_resumed_run_stops_again_before_its_first_batch(tmp_path: Path) -> None:
    """No finite value ever: no epoch improves, so it stops after ``patience`` epochs with best
    "none", and the resumed run stops again before any batch, as one with a best does."""
    def plugins():
        return [EarlyStopping(monitor="valid/loss", patience=2), Checkpoint(background=False)]

    never = [math.nan] * 10
    first = run(*plugins(), valid=never, run_dir=tmp_path).state
    assert first.status == "completed" and first.epoch == 1 and first.stop_reason.endswith("best (min) none")
    recorder = Recorder()
    again = run(*plugins(), recorder, valid=never, run_dir=tmp_path, resume="latest").state
    assert (again.status, again.step, again.stop_reason) == ("completed", first.step, first.stop_reason)
    assert again.epoch == first.epoch
    assert "batch_start" not in recorder.names()


def test_a_stop_during_an_earlier_validation_set_is_no_missing_metric(tmp_path: Path) -> None:
    """Two validation sets, early stopping and the best checkpoint by the second's loss, and a stop requested
    while the first runs in epoch 2: the epoch published as it got at the run's end lacks ``b/loss``, which
    says nothing of the option (epoch 1 published it). The run ends stopped, not failed for a metric "this
    run does not produce", and no warning says so."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(3)]

    def val_step(loop, batch):
        if loop.state.val_set == "a" and loop.state.epoch == 1:
            loop.request_stop("the user's stop")
        return {"loss": torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])}

    loop = hookfit.Loop(mse_step, data, val_step=val_step, val_data={"a": data[:2], "b": data[2:]}, model=model,
                        max_epochs=5, optimizers=torch.optim.SGD(model.parameters(), lr=0.01), run_dir=tmp_path,
                        plugins=[Optim(), Metrics(), EarlyStopping(monitor="valid/b/loss", patience=2),
                                 Checkpoint(monitor="valid/b/loss", background=False)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = loop.fit()
    assert (state.status, state.stop_reason, state.epoch) == ("interrupted", "the user's stop", 1), state


def test_patience_counts_validations_every_few_epochs_and_says_so() -> None:
    """Validation every second epoch, patience 2, best at epoch 2 (the odd epochs' losses, lower, are never
    validated): validations at epochs 4 and 6 do not improve, so the run stops after epoch 6, and the reason
    counts validations, not epochs (four epochs went by)."""
    valid = [1.0, 4.0, 1.0, 4.5, 1.0, 4.2, 1.0, 0.5, 0.5, 0.25]
    loop = run(EarlyStopping(monitor="valid/loss", patience=2), valid=valid, val_every_n_epochs=2)
    state = loop.state
    assert (state.status, state.epoch) == ("completed", 5), (state.status, state.epoch)
    assert state.stop_reason == ("early stopping: valid/loss did not improve for 2 validation(s) (patience 2); "
                                 "best (min) 4 at epoch 2"), state.stop_reason


class _Parted(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Ten samples, each worker yielding its own part: with two workers and batches of 4, a DataLoader's len()
    (3, from the dataset's) is one short of the 4 batches it yields."""

    def __len__(self) -> int:
        return 10

    def __iter__(self) -> Any:
        worker = torch.utils.data.get_worker_info()
        parts, part = (1, 0) if worker is None else (worker.num_workers, worker.id)
        return (torch.full((2,), float(k)) for k in range(part, 10, parts))


def test_a_streamed_loaders_length_is_no_bound_the_run_is_refused_by() -> None:
    """len() of a DataLoader over an IterableDataset is the dataset's word: its workers' streams overrun it, and
    the run validates at step 4 of a loader whose len() is 3."""
    validated = []

    def step(loop: hookfit.Run, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        loss = loop.model(batch).pow(2).mean()
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    model = torch.nn.Linear(2, 1)
    data = torch.utils.data.DataLoader(_Parted(), batch_size=4, num_workers=2)
    assert len(data) == 3
    state = hookfit.Loop(step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                         val_step=lambda loop, b: validated.append(loop.state.step) or {"loss": torch.tensor(1.0)},
                         val_data=[0], max_epochs=1, val_every_n_steps=4,
                         plugins=[Optim(), Metrics(), EarlyStopping(monitor="valid/loss")]).fit()
    assert state.status == "completed" and validated == [4]


def _two_sets(*plugins: Any, one: bool = False, **options: Any) -> hookfit.Loop:
    """A Loop validating two sets, ``a`` and ``b`` (each step's ``loss``: ``valid/a/loss``, ``valid/b/loss``);
    ``one``: a single named set, ``val`` (``valid/val/loss``)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(3)]

    def val_step(loop, batch):
        return {"loss": torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])}

    return hookfit.Loop(mse_step, data, val_step=val_step,
                        val_data={"val": data} if one else {"a": data[:2], "b": data[2:]}, model=model,
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.01), plugins=[Optim(), Metrics(), *plugins],
                        **options)


class _Batches:
    """Counts the batches that began."""

    name = "batches"

    def __init__(self) -> None:
        self.seen = 0

    @hookfit.hookimpl
    def batch_start(self) -> None:
        self.seen += 1


SETS = (r"^early_stopping: monitor='valid/loss' names no validation set, and this run validates 2 sets \('a', 'b'\), "
        r"whose metrics are named per set \('valid/<set>/<metric>'\): give monitor='valid/a/loss' or 'valid/b/loss'\n")


@pytest.mark.bad_input
@pytest.mark.parametrize("how", ["fit", "validate"])
def test_a_one_set_monitor_with_several_sets_fails_before_any_batch_naming_each_set_s_name(how: str) -> None:
    """``valid/loss`` where the sets publish ``valid/a/loss`` and ``valid/b/loss``: known from the sets'
    names, so said before the first batch, not after the first validation."""
    batches = _Batches()  # (not a Recorder: it answers metrics_values, see the next test)
    with pytest.raises(ValueError, match=SETS):
        getattr(_two_sets(EarlyStopping(monitor="valid/loss"), batches), how)()
    assert batches.seen == 0


@pytest.mark.bad_input
def test_a_one_set_monitor_with_one_named_set_fails_naming_it_in_the_singular() -> None:
    """``valid/loss`` where a dict of one set publishes ``valid/val/loss``: refused as with several."""
    with pytest.raises(ValueError, match=r"^early_stopping: monitor='valid/loss' names no validation set, and this "
                                         r"run validates 1 set \('val'\), whose metrics are named per set "
                                         r"\('valid/<set>/<metric>'\): give monitor='valid/val/loss'\n"):
        _two_sets(EarlyStopping(monitor="valid/loss"), one=True).fit()


class _Loss:
    """Publishes a gauge ``loss`` with every snapshot: in a validation of several sets, ``valid/loss``."""

    name = "gauge_loss"

    @hookfit.hookimpl
    def metrics_values(self, loop: Any, stage: str) -> dict[str, float] | None:
        return {"loss": 2.0} if stage == "valid" else None  # (training's step returns its own loss)


def test_a_one_set_monitor_with_several_sets_is_a_gauge_s_where_a_plugin_answers_metrics_values() -> None:
    """A plugin's ``metrics_values`` answer is published unprefixed beside the sets' metrics: ``valid/loss``
    may be its gauge, so it is not refused before the first validation, and the run watches it."""
    early = EarlyStopping(monitor="valid/loss", patience=1)
    state = _two_sets(_Loss(), early, max_epochs=5).fit()
    assert (state.status, state.stopped_by, state.epoch, early.best) == ("completed", "early_stopping", 1, 2.0)
