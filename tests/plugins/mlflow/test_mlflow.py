"""mlflow: real runs logged to a SQLite tracking store and read back through MLflow's own
client (parameters, metric histories with their steps, status, artifacts); a resumed run
continues the same MLflow run without a step twice; off until configured; a missing package
warns once; bad options fail at construction."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import StopAfter

pytest.importorskip("mlflow")
pytest.importorskip("sqlalchemy")  # the SQLite store (the [mlflow] extra brings it)

from mlflow.tracking import MlflowClient  # noqa: E402

import hookfit  # noqa: E402
from hookfit.errors import HookfitWarning  # noqa: E402
from hookfit.errors import ObserverWarning  # noqa: E402
from hookfit.plugins.checkpoint import Checkpoint  # noqa: E402
from hookfit.plugins.metrics import Metrics  # noqa: E402
from hookfit.plugins.mlflow import INSTALL, MLflow  # noqa: E402
from hookfit.plugins.optim import Optim  # noqa: E402

VALID = [3.0, 2.0, 2.5]  # the valid loss of each epoch


@pytest.fixture(autouse=True)
def _mlflow_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No tracking server, store or experiment of the environment's."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


class Published:
    """Keeps what the metrics plugin publishes, and the checkpoints announced."""

    name = "published"

    def __init__(self) -> None:
        self.updates: list = []
        self.epochs: list = []
        self.checkpoints: list[str] = []

    @hookfit.hookimpl
    def metrics_update(self, stage, metrics):
        if stage == "train":
            self.updates.append(metrics)

    @hookfit.hookimpl
    def epoch_metrics(self, stage, metrics):
        self.epochs.append(metrics)

    @hookfit.hookimpl
    def checkpoint_saved(self, path):
        self.checkpoints.append(path)


def run(run_dir: Path, *plugins: Any, max_epochs: int = 3, **kwargs: Any) -> hookfit.Loop:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(4)]

    def step(loop, batch):
        for group in loop.optimizers.param_groups:  # a learning rate that changes every epoch
            group["lr"] = 0.1 / (1 + loop.state.epoch)
        loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    def val_step(loop, batch):  # batches 0 and 1: the epoch's mean is VALID's, the first batch's lower
        return {"loss": torch.tensor(VALID[min(loop.state.epoch, 2)] + batch - 0.5)}

    loop = hookfit.Loop(step, data, val_step=val_step, val_data=[0, 1], model=model, optimizers=optimizer,
                        max_epochs=max_epochs, run_dir=run_dir,
                        plugins=[Optim(), Metrics(interval=0.0), *plugins], **kwargs)
    loop.fit()
    return loop


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One SQLite store for the module's tests (creating one runs MLflow's migrations, seconds),
    each test in experiments of its own."""
    return f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"


def experiment(store: str, name: str) -> Any:
    return MlflowClient(tracking_uri=store).get_experiment_by_name(name)


def the_run(store: str, name: str) -> Any:
    """The one MLflow run of the experiment ``name``."""
    found = experiment(store, name)
    assert found is not None
    (one,) = MlflowClient(tracking_uri=store).search_runs([found.experiment_id])
    return one


def history(store: str, run_id: str, key: str) -> list[tuple[int, float]]:
    points = MlflowClient(tracking_uri=store).get_metric_history(run_id, key)
    return sorted((m.step, m.value) for m in points)


def steps(points: list[tuple[int, float]]) -> list[int]:
    return [s for s, _ in points]


@pytest.mark.slow
def test_parameters_metrics_status_and_checkpoints_read_back(tmp_path: Path, store: str) -> None:
    published = Published()
    tracker = MLflow(tracking_uri=store, experiment="read-back", log_checkpoints=True,
                     hparams={"batch_size": 4, "note": "baseline"})
    loop = run(tmp_path / "run", Checkpoint(background=False), tracker, published)
    assert loop.state.status == "completed"
    found = the_run(store, "read-back")
    assert found.info.run_id == tracker.run_id and found.info.status == "FINISHED"
    assert found.info.run_name == "run"  # the run folder's name
    assert found.data.tags["hookfit.status"] == "completed"
    assert found.data.tags["hookfit.stop_reason"] == loop.state.stop_reason == "max_epochs=3 reached"
    assert found.data.tags["hookfit.run_dir"] == str(tmp_path / "run")

    params = found.data.params
    assert params["loop.max_epochs"] == "3" and params["optimizer.default"] == "SGD"
    assert params["optimizer.default.momentum"] == "0.9" and "optimizer.default.foreach" not in params
    assert params["plugin.mlflow.log_checkpoints"] == "True" and params["plugin.metrics.interval"] == "0.0"
    assert (params["batch_size"], params["note"]) == ("4", "baseline")

    # every training publication's running mean at its global step, each step once
    got = history(store, tracker.run_id, "train_step/loss")
    assert steps(got) == [m.step for m in published.updates] == list(range(1, 13))
    assert [v for _, v in got] == pytest.approx([m.values["loss"].running for m in published.updates])
    # the epoch means at the step their stage ended, the epoch (from 1) with the training's
    for stage in ("train", "valid"):
        want = [(m.step, m.values["loss"].epoch) for m in published.epochs if m.stage == stage]
        got = history(store, tracker.run_id, f"{stage}/loss")
        assert steps(got) == steps(want) == [4, 8, 12]
        assert [v for _, v in got] == pytest.approx([v for _, v in want])
    assert [v for _, v in history(store, tracker.run_id, "valid/loss")] == VALID
    assert history(store, tracker.run_id, "epoch") == [(4, 1.0), (8, 2.0), (12, 3.0)]
    rates = dict(history(store, tracker.run_id, "lr/default"))
    assert sorted(rates) == list(range(1, 13))  # once per step
    assert [round(rates[s], 6) for s in (4, 8, 12)] == [0.1, 0.05, round(0.1 / 3, 6)]

    # every announced checkpoint is an artifact, byte for byte
    client = MlflowClient(tracking_uri=store)
    names = [Path(p).name for p in published.checkpoints]
    assert len(names) == 3
    assert sorted(a.path for a in client.list_artifacts(tracker.run_id, "checkpoints")) == \
        sorted(f"checkpoints/{n}" for n in names)
    copy = client.download_artifacts(tracker.run_id, f"checkpoints/{names[-1]}", str(tmp_path / "download"))
    assert Path(copy).read_bytes() == Path(published.checkpoints[-1]).read_bytes()


@pytest.mark.slow
def test_the_optimizer_settings_logged_are_those_given_for_every_parameter_group(tmp_path: Path, store: str) -> None:
    """A warmup scheduler has scaled ``lr`` by the time the run starts: the rate logged is the one given
    (``initial_lr``); a no-decay group's ``weight_decay=0`` is logged under its group, what it shares is not."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2), torch.nn.Linear(2, 1))
    decay = [p for p in model.parameters() if p.dim() == 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=3e-3)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(6e-4)  # scaled before the run starts
    data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(2)]

    def step(loop, batch):
        loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    tracker = MLflow(tracking_uri=store, experiment="groups")
    hookfit.Loop(step, data, model=model, optimizers=optimizer, max_epochs=1, run_dir=tmp_path / "run",
                 plugins=[Optim(schedulers=warmup), tracker]).fit()
    params = the_run(store, "groups").data.params
    given = {key: value for key, value in params.items() if key.startswith("optimizer.")}
    assert given["optimizer.default"] == "AdamW"
    assert given["optimizer.default.lr"] == "0.003" and given["optimizer.default.weight_decay"] == "0.1"
    assert given["optimizer.default.group1.weight_decay"] == "0.0"
    assert given["optimizer.default.betas"] == "(0.9, 0.999)"
    assert [key for key in given if key.startswith("optimizer.default.group1.")] == [
        "optimizer.default.group1.weight_decay"], given  # the settings both groups share are logged once
    assert not [key for key in given if key.endswith("initial_lr")], given


class Fail:
    name = "fail"

    @hookfit.hookimpl
    def epoch_end(self, epoch):
        if epoch == 1:
            raise RuntimeError("boom")


@pytest.mark.slow
@pytest.mark.parametrize("outcome", ["failed", "interrupted"])
def test_a_failed_or_interrupted_run_ends_its_mlflow_run_so(tmp_path: Path, store: str, outcome: str) -> None:
    tracker = MLflow(tracking_uri=store, experiment=outcome, every_publication=False)
    if outcome == "failed":
        with pytest.raises(RuntimeError, match="boom"):
            run(tmp_path / "run", tracker, Fail())
    else:
        assert run(tmp_path / "run", tracker, StopAfter(8)).state.step == 6  # inside epoch 2's training
    found = the_run(store, outcome)
    assert found.info.status == {"failed": "FAILED", "interrupted": "KILLED"}[outcome]
    assert found.data.tags["hookfit.status"] == outcome
    assert found.data.tags["hookfit.stop_reason"] == ("RuntimeError: boom" if outcome == "failed" else "test stop")
    assert "train_step/loss" not in found.data.metrics  # every_publication=False
    # the training stage a stop cut short is published at fit_end, before the MLflow run ends
    assert steps(history(store, found.info.run_id, "train/loss")) == ([4, 8] if outcome == "failed" else [4, 6])
    assert len(MlflowClient(tracking_uri=store).search_runs([found.info.experiment_id])) == 1


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_mlflow_run_without_a_step_twice(tmp_path: Path, store: str) -> None:
    """The first run logged epoch 3 and then lost its last checkpoint (as a kill right before
    it would): the resumed run redoes epoch 3 into the same MLflow run, and each metric has
    each step once. A longer run then resumes it again: the changed max_epochs is named."""
    folder = tmp_path / "run"
    first = MLflow(tracking_uri=store, experiment="resumed")
    run(folder, first, Checkpoint(background=False))
    (last,) = (folder / "checkpoints").glob("epoch0003-*.pt")
    last.unlink()
    again = MLflow(tracking_uri=store, experiment="resumed")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop = run(folder, again, Checkpoint(background=False), resume="latest")
    assert not [str(w.message) for w in caught if issubclass(w.category, HookfitWarning)]  # same parameters
    assert loop.state.resumed_from is not None and loop.state.resumed_from.step == 8
    found = the_run(store, "resumed")  # still one run in the experiment
    assert again.run_id == first.run_id == found.info.run_id and found.info.status == "FINISHED"
    for key in ("train_step/loss", "lr/default"):
        assert steps(history(store, found.info.run_id, key)) == list(range(1, 13)), key
    for key in ("train/loss", "valid/loss", "epoch"):
        assert steps(history(store, found.info.run_id, key)) == [4, 8, 12], key

    longer = MLflow(tracking_uri=store, experiment="resumed")
    with pytest.warns(HookfitWarning, match=rf"mlflow: run {first.run_id} keeps the parameters it started with.*"
                                            r"this resumed run changed loop.max_epochs") as caught:
        run(folder, longer, Checkpoint(background=False), resume="latest", max_epochs=4)
    assert len([w for w in caught if issubclass(w.category, HookfitWarning)]) == 1
    found = the_run(store, "resumed")
    assert longer.run_id == first.run_id and found.data.params["loop.max_epochs"] == "3"
    assert steps(history(store, found.info.run_id, "train_step/loss")) == list(range(1, 17))
    assert steps(history(store, found.info.run_id, "epoch")) == [4, 8, 12, 16]


@pytest.mark.slow
@pytest.mark.parametrize("stop", [8, 11])
def test_a_run_stopped_and_resumed_logs_every_point_of_the_run_that_never_stopped(
        tmp_path: Path, store: str, stop: int) -> None:
    """A stop inside epoch 2's training (after 8 batches, at step 6) or its validation (after
    11, at step 8): the stopped run logs the stage cut short, its means so far, at the stop's
    step; the resumed run logs the rest, that stage whole included, into the same MLflow run.
    MLflow cannot remove a point: what remains besides the uninterrupted run's points is those
    means of the stopped run, at the stop's step, before the whole stage's at its own."""
    whole, resumed = MLflow(tracking_uri=store, experiment=f"whole{stop}"), MLflow(tracking_uri=store,
                                                                                   experiment=f"resumed{stop}")
    run(tmp_path / "whole", whole)
    run(tmp_path / "resumed", resumed, Checkpoint(background=False), StopAfter(stop))
    again = MLflow(tracking_uri=store, experiment=f"resumed{stop}")
    loop = run(tmp_path / "resumed", again, Checkpoint(background=False), resume="latest")
    assert loop.state.resumed_from is not None and again.run_id == resumed.run_id
    client = MlflowClient(tracking_uri=store)
    keys = sorted(the_run(store, f"whole{stop}").data.metrics)
    assert sorted(the_run(store, f"resumed{stop}").data.metrics) == keys
    extra = {}
    for key in keys:
        expected, got = history(store, whole.run_id, key), history(store, resumed.run_id, key)
        for point in expected:
            got.remove(point)  # every point of the uninterrupted run is there
        if got:
            extra[key] = got
    if stop == 8:  # epoch 2's training means after 2 of its 4 batches; it ends at step 8
        assert sorted(extra) == ["epoch", "train/loss"] and extra["epoch"] == [(6, 2.0)]
        assert steps(extra["train/loss"]) == [6]
    else:  # epoch 2's validation after its first batch, then whole, later, at the same step
        assert extra == {"valid/loss": [(8, 1.5)]}
        points = sorted(client.get_metric_history(resumed.run_id, "valid/loss"), key=lambda m: m.timestamp)
        assert [(m.step, m.value) for m in points if m.step == 8] == [(8, 1.5), (8, 2.0)]


@pytest.mark.fault
def test_a_run_that_fails_before_its_first_epoch_opens_no_mlflow_run(tmp_path: Path) -> None:
    """A plugin's configure fails before MLflow's (the checkpoint's, which comes first, on a
    resume file that does not exist): fit_end reaches the chosen plugin, and it ends no tracker
    run because none was started; it starts none either (the store is not even created)."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MLflow(tracking_uri=store, experiment="never")
    with pytest.raises(FileNotFoundError, match="no/such/file.pt"):
        run(tmp_path / "run", tracker, Checkpoint(background=False), resume="no/such/file.pt")
    assert tracker.run_id is None and not (tmp_path / "mlflow.db").exists()


def test_an_evaluation_of_a_checkpoint_is_an_mlflow_run_of_its_own(tmp_path: Path, store: str) -> None:
    """Loop.validate(resume=...) loads the tracker run's id with the plugins' states: the
    evaluation logs its own run, and the training's (interrupted: KILLED) stays as it was."""
    trained = MLflow(tracking_uri=store, experiment="evaluated")
    run(tmp_path / "run", trained, Checkpoint(background=False), StopAfter(8))
    evaluation = MLflow(tracking_uri=store, experiment="evaluated")
    model = torch.nn.Linear(2, 1)
    state = hookfit.Loop(lambda loop, batch: None, [0] * 4, val_step=lambda loop, batch: {"loss": torch.tensor(1.5)},
                         val_data=[0, 1], model=model, run_dir=tmp_path / "run",
                         plugins=[Metrics(interval=0.0), Checkpoint(background=False), evaluation]
                         ).validate(resume="latest")
    assert state.status == "completed" and evaluation.run_id not in (None, trained.run_id)
    client = MlflowClient(tracking_uri=store)
    assert client.get_run(trained.run_id).info.status == "KILLED"
    assert client.get_run(evaluation.run_id).info.status == "FINISHED"
    assert history(store, evaluation.run_id, "valid/loss") == [(6, 1.5)]  # at the checkpoint's step


def test_discovered_it_is_inert_until_configured(tmp_path: Path, store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOKFIT_PLUGINS", "mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)  # where MLflow would log by default
    loop = run(tmp_path / "found")
    assert loop.run.pm.get_plugin("mlflow") is None  # unregistered at configure: no hook of it runs
    assert experiment(store, "found") is None  # (the run's name: the default experiment)

    config = tmp_path / "hookfit.toml"
    config.write_text('[plugins.mlflow]\nexperiment = "configured"\nevery_publication = false\n')
    monkeypatch.setenv("HOOKFIT_CONFIG", str(config))
    run(tmp_path / "configured")
    found = the_run(store, "configured")
    assert steps(history(store, found.info.run_id, "train/loss")) == [4, 8, 12]
    assert "train_step/loss" not in found.data.metrics

    monkeypatch.delenv("HOOKFIT_CONFIG")
    config.unlink()  # (a file next to the script would be found, and warned about: the given plugin wins)
    run(tmp_path / "off", MLflow(enabled=False, experiment="off"))
    assert experiment(store, "off") is None


@pytest.mark.slow
def test_a_smoke_run_logs_to_a_store_in_its_temporary_folder_not_the_tracking_store(
        tmp_path: Path, store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """HOOKFIT_SMOKE=1 on a script that logs to a tracking store: the MLflow run is in a store of the smoke
    run's own, removed with it; the real store has no experiment for it."""
    from hookfit.plugins.smoke import Smoke

    tracker = MLflow(tracking_uri=store, experiment="smoke-kept-out", log_checkpoints=True)
    saved = Published()
    monkeypatch.chdir(tmp_path)  # (where MLflow would keep artifacts by default: ./mlruns)
    loop = run(tmp_path / "run", tracker, Smoke(), Checkpoint(background=False), saved, smoke=True)
    assert loop.state.status == "completed" and tracker.run_id is not None and saved.checkpoints
    assert experiment(store, "smoke-kept-out") is None and not (tmp_path / "run").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no checkpoint copied as an artifact either


@pytest.mark.bad_input
def test_names_mlflow_refuses_are_written_safely_and_said_once_not_the_tracker_switched_off(
        tmp_path: Path, store: str) -> None:
    """A metric ``acc (top1)`` and a parameter group named ``bias (no decay)``: MLflow refuses both names
    (parentheses), which switched the tracker off for the run; each is written with ``_`` instead, once
    said, and every point is logged."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD([{"params": [model.weight], "lr": 0.1},
                                 {"params": [model.bias], "lr": 0.2, "name": "bias (no decay)"}])

    def step(loop, batch):
        loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss, "acc _top1_": 0.25, "acc (top1)": 0.5}

    tracker = MLflow(tracking_uri=store, experiment="refused-names")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hookfit.Loop(step, [(torch.randn(4, 2), torch.randn(4, 1))] * 2, model=model, optimizers=optimizer,
                     max_epochs=2, run_dir=tmp_path / "run", plugins=[tracker, Optim(), Metrics()]).fit()
    assert not [w for w in caught if issubclass(w.category, ObserverWarning)], [str(w.message) for w in caught]
    said = sorted(str(w.message) for w in caught if "is written as" in str(w.message))
    assert said == ["mlflow: 'lr/default/bias (no decay)' is written as 'lr/default/bias _no decay_' in MLflow (a "
                    "metric's name takes letters, digits, '_', '-', '.', ' ' and '/' only, no empty part)",
                    "mlflow: 'train/acc (top1)' is written as 'train/acc _top1__2' in MLflow (a metric's name "
                    "takes letters, digits, '_', '-', '.', ' ' and '/' only, no empty part; 'train/acc _top1_' was "
                    "taken by another name)"], said
    run_id = the_run(store, "refused-names").info.run_id
    assert steps(history(store, run_id, "train/acc _top1__2")) == [2, 4]
    assert history(store, run_id, "train/acc _top1_") == [(2, 0.25), (4, 0.25)]
    assert [v for _, v in history(store, run_id, "lr/default/bias _no decay_")] == [0.2, 0.2]


def test_only_the_main_process_logs(tmp_path: Path, store: str) -> None:
    class Rank1:
        name = "rank1"

        @hookfit.hookimpl(tryfirst=True)
        def configure(self, loop):
            loop.state.rank, loop.state.world_size = 1, 1  # as a distributed plugin on a worker

    tracker = MLflow(tracking_uri=store, experiment="main-only", log_checkpoints=True)
    loop = run(tmp_path / "run", tracker, Rank1())
    assert loop.state.status == "completed" and tracker.run_id is None
    assert experiment(store, "main-only") is None


@pytest.mark.bad_input
@pytest.mark.parametrize("options, message", [
    ({"tracking_uri": 5}, r"mlflow: tracking_uri must be a tracking URI or a folder \(a str or os.PathLike\) "
                          r"or None, got 5"),
    ({"tracking_uri": " "}, r"mlflow: tracking_uri must be a tracking URI or a folder"),
    ({"experiment": ""}, r"mlflow: experiment must be a non-empty string or None, got ''"),
    ({"run_name": 3}, r"mlflow: run_name must be a non-empty string or None, got 3"),
    ({"log_checkpoints": "yes"}, r"mlflow: log_checkpoints must be True or False, got 'yes'"),
    ({"every_publication": None}, r"mlflow: every_publication must be True or False, got None"),
    ({"enabled": 1}, r"mlflow: enabled must be True, False or None, got 1"),
    ({"hparams": [("lr", 0.1)]}, r"mlflow: hparams must map names to numbers, strings or booleans, got list"),
    ({"hparams": {"lr": math.inf}}, r"mlflow: hparams\['lr'\] is inf; a hyperparameter is a finite number"),
    ({"hparams": {"": 1}}, r"mlflow: hparams has the key ''; names are non-empty strings"),
])
def test_bad_options_are_named(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MLflow(**options)


@pytest.mark.bad_input
def test_a_bad_option_in_the_configuration_file_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "hookfit.toml"
    config.write_text("[plugins.mlflow]\nexperiment = 7\n")
    monkeypatch.setenv("HOOKFIT_PLUGINS", "mlflow")
    monkeypatch.setenv("HOOKFIT_CONFIG", str(config))
    with pytest.raises(hookfit.config.ConfigError, match=r"hookfit.toml \[plugins.mlflow\]: mlflow: "
                                                          r"experiment must be a non-empty string or None, got 7"):
        run(tmp_path / "run")


@pytest.mark.bad_input
def test_a_checkpoint_state_that_names_no_run_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"mlflow: the checkpoint's state of this plugin is \{'run': 1\}; "
                                         r"expected \{'run_id': <an MLflow run id>\}"):
        MLflow().load_state(None, {"run": 1})  # type: ignore[arg-type]


@pytest.mark.bad_input
def test_without_mlflow_the_message_says_how_to_install_it(tmp_path: Path, store: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patched:
        patched.setitem(sys.modules, "mlflow", None)  # import mlflow raises ImportError
        with pytest.raises(ImportError, match=r"mlflow: the plugin needs the mlflow package.*"
                                              r"`pip install hookfit\[mlflow\]`"):
            MLflow(enabled=True)
        with pytest.warns(ObserverWarning, match=r"observer plugin 'mlflow'.*failed in hook 'configure'.*"
                                                 r"pip install hookfit\[mlflow\]") as caught:
            loop = run(tmp_path / "run", MLflow(tracking_uri=store, experiment="missing"))
    assert loop.state.status == "completed" and loop.state.step == 12  # an observer: training goes on
    assert len([w for w in caught if w.category is ObserverWarning]) == 1
    assert experiment(store, "missing") is None and INSTALL == "pip install hookfit[mlflow]"
