"""wandb: real runs in W&B's offline mode, read back from the run's ``.wandb`` file (config,
history rows with their steps, artifacts, summary, exit code); a resumed run continues the
same W&B run without a step twice; off until configured; a missing package warns once; bad
options fail at construction; under torchrun only rank 0 logs, to W&B and to MLflow.

``wandb.Api`` cannot read offline runs and wandb has no reader of its own for the file, so
:func:`records` reads it: a LevelDB-style log (a 7-byte header ``:W&B`` + magic + version, then
32 KiB blocks of chunks, each with a 7-byte header: CRC, length, type) of ``Record`` protobuf
messages, which wandb's own ``wandb_internal_pb2`` parses. Nothing goes to the network: the
mode is offline and every folder W&B writes to is the test's."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, StopAfter

pytest.importorskip("wandb")

from google.protobuf.message import DecodeError  # noqa: E402
from wandb.proto import wandb_internal_pb2  # noqa: E402

import hookfit  # noqa: E402
from hookfit.errors import ObserverWarning  # noqa: E402
from hookfit.plugins.checkpoint import Checkpoint  # noqa: E402
from hookfit.plugins.metrics import Metrics  # noqa: E402
from hookfit.plugins.optim import Optim  # noqa: E402
from hookfit.plugins.wandb import INSTALL, WandB  # noqa: E402

VALID = [3.0, 2.0, 2.5]  # the valid loss of each epoch
BLOCK = 32768


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """W&B offline and silent, every folder it writes to under the tests' temporary folder:
    what a test's child processes get too. The same for every test of a process: W&B reads
    its environment once a process, at its first run."""
    home = tmp_path_factory.getbasetemp() / "wandb-home"
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CACHE_DIR": str(home / "cache"),
           "WANDB_DATA_DIR": str(home / "data"), "WANDB_CONFIG_DIR": str(home / "config"),
           "WANDB_ARTIFACT_DIR": str(home / "artifacts")}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in ("WANDB_DIR", "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    return env


# -- reading an offline run back -------------------------------------------------------------

def records(path: Path) -> Iterator[Any]:
    """The ``Record`` messages of a ``.wandb`` file, in order."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    position, pending = 7, b""
    while position + 7 <= len(data):
        if BLOCK - position % BLOCK < 7:  # a block's tail too short for a header is padding
            position += BLOCK - position % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind == 1:  # the whole record
            pending = b""
            whole = chunk
        elif kind in (2, 3):  # its first or a middle part
            pending += chunk
            continue
        elif kind == 4:  # its last part
            whole, pending = pending + chunk, b""
        else:
            assert kind == 0 and length == 0, (kind, length)  # zeros after the last record
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(whole)
        yield record


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


class Offline:
    """What one offline run folder holds."""

    def __init__(self, folder: Path) -> None:
        (self.file,) = folder.glob("run-*.wandb")
        self.run: Any = None
        self.config: dict[str, Any] = {}
        self.rows: dict[int, dict[str, Any]] = {}  # step -> the row's values (W&B's own "_..." left out)
        self.artifacts: list[Any] = []
        self.summary: dict[str, Any] = {}
        self.exit_code: int | None = None
        for record in records(self.file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                self.run = record.run
                self.config.update({_key(u): json.loads(u.value_json) for u in record.run.config.update})
            elif kind == "config":
                self.config.update({_key(u): json.loads(u.value_json) for u in record.config.update})
            elif kind == "history":
                row = {_key(i): json.loads(i.value_json) for i in record.history.item}
                self.rows[row["_step"]] = {k: v for k, v in row.items() if not k.startswith("_")}
            elif kind == "artifact":
                self.artifacts.append(record.artifact)
            elif kind == "summary":
                self.summary.update({_key(u): json.loads(u.value_json) for u in record.summary.update})
            elif kind == "exit":
                self.exit_code = record.exit.exit_code

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(step, row[key]) for step, row in sorted(self.rows.items()) if key in row]


def finished(folder: Path, timeout: float = 60) -> Offline:
    """The offline run in ``folder`` once W&B has written all of it: W&B's writer (a process of
    its own) closes the file after ``finish()`` returns, so wait for its last record, the
    run's exit."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = Offline(folder)
            if found.exit_code is not None:
                return found
        except (ValueError, AssertionError, struct.error, DecodeError):  # not all of it is there yet
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"W&B did not finish writing {folder} in {timeout} s")
        time.sleep(0.05)  # polling for the condition, not a fixed wait


def offline_runs(folder: Path) -> list[Offline]:
    """The offline runs W&B wrote under ``folder``, oldest first, each once it is whole."""
    return [finished(f) for f in sorted((folder / "wandb").glob("offline-run-*"))]


# -- runs ------------------------------------------------------------------------------------

class Published:
    """Keeps what the metrics plugin publishes, and the checkpoints announced."""

    name = "published"

    def __init__(self) -> None:
        self.updates: list = []
        self.epochs: list = []
        self.checkpoints: list[tuple[str, int]] = []

    @hookfit.hookimpl
    def metrics_update(self, stage, metrics):
        if stage == "train":
            self.updates.append(metrics)

    @hookfit.hookimpl
    def epoch_metrics(self, stage, metrics):
        self.epochs.append(metrics)

    @hookfit.hookimpl
    def checkpoint_saved(self, path, step):
        self.checkpoints.append((path, step))


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

    def val_step(loop, batch):
        return {"loss": torch.tensor(VALID[min(loop.state.epoch, 2)])}

    loop = hookfit.Loop(step, data, val_step=val_step, val_data=[0, 1], model=model, optimizers=optimizer,
                        max_epochs=max_epochs, run_dir=run_dir,
                        plugins=[Optim(), Metrics(interval=0.0), *plugins], **kwargs)
    loop.fit()
    return loop


@pytest.mark.slow
def test_config_history_checkpoints_and_the_end_read_back(tmp_path: Path) -> None:
    published = Published()
    tracker = WandB(log_checkpoints=True, hparams={"batch_size": 4, "note": "baseline"},
                    init={"tags": ["baseline"], "notes": "a test"})
    loop = run(tmp_path / "run", Checkpoint(background=False), tracker, published)
    assert loop.state.status == "completed" and tracker.run is None  # finished at fit_end
    (found,) = offline_runs(tmp_path / "run")  # the run folder is W&B's folder
    assert found.run.run_id == tracker.run_id and found.file.name == f"run-{tracker.run_id}.wandb"
    assert found.run.project == "run" and found.run.display_name == "run"  # the run's and its folder's names
    assert list(found.run.tags) == ["baseline"] and found.run.notes == "a test"

    config = found.config
    assert config["loop.max_epochs"] == 3 and config["optimizer.default"] == "SGD"
    assert config["optimizer.default.momentum"] == 0.9 and "optimizer.default.foreach" not in config
    assert config["plugin.wandb.log_checkpoints"] is True and config["plugin.metrics.interval"] == 0.0
    assert (config["batch_size"], config["note"]) == (4, "baseline")
    assert config["hookfit.run_dir"] == str(tmp_path / "run")

    # one row per global step: every training publication's running mean, each step once
    assert sorted(found.rows) == [m.step for m in published.updates] == list(range(1, 13))
    got = found.series("train_step/loss")
    assert [v for _, v in got] == pytest.approx([m.values["loss"].running for m in published.updates])
    for stage in ("train", "valid"):
        want = [(m.step, m.values["loss"].epoch) for m in published.epochs if m.stage == stage]
        got = found.series(f"{stage}/loss")
        assert [s for s, _ in got] == [s for s, _ in want] == [4, 8, 12]
        assert [v for _, v in got] == pytest.approx([v for _, v in want])
    assert [v for _, v in found.series("valid/loss")] == VALID
    assert found.series("epoch") == [(4, 1), (8, 2), (12, 3)]
    rates = dict(found.series("lr/default"))
    assert sorted(rates) == list(range(1, 13))
    assert [round(rates[s], 6) for s in (4, 8, 12)] == [0.1, 0.05, round(0.1 / 3, 6)]

    # every announced checkpoint is a version of one artifact, with its step
    assert len(published.checkpoints) == 3
    assert {a.name for a in found.artifacts} == {f"checkpoint-{tracker.run_id}"}
    assert [a.type for a in found.artifacts] == ["model"] * 3
    for artifact, (path, step) in zip(found.artifacts, published.checkpoints):
        assert set(artifact.aliases) == {"latest", f"step-{step}"}
        assert json.loads(artifact.metadata) == {"reason": "epoch", "step": step}
        assert [c.path for c in artifact.manifest.contents] == [Path(path).name]
        assert artifact.manifest.contents[0].size == Path(path).stat().st_size

    assert found.summary["hookfit/status"] == "completed"
    assert found.summary["hookfit/stop_reason"] == loop.state.stop_reason == "max_epochs=3 reached"
    assert found.exit_code == 0


class Fail:
    name = "fail"

    @hookfit.hookimpl
    def epoch_end(self, epoch):
        if epoch == 1:
            raise RuntimeError("boom")


@pytest.mark.slow
@pytest.mark.parametrize("outcome", ["failed", "interrupted"])
def test_a_failed_or_interrupted_run_ends_its_wandb_run_so(tmp_path: Path, outcome: str) -> None:
    tracker = WandB(every_publication=False)
    if outcome == "failed":
        with pytest.raises(RuntimeError, match="boom"):
            run(tmp_path / "run", tracker, Fail())
    else:
        assert run(tmp_path / "run", tracker, StopAfter(8)).state.step == 6  # inside epoch 2's training
    (found,) = offline_runs(tmp_path / "run")
    assert found.exit_code == (1 if outcome == "failed" else 0)
    assert found.summary["hookfit/status"] == outcome
    assert found.summary["hookfit/stop_reason"] == ("RuntimeError: boom" if outcome == "failed" else "test stop")
    assert not any("train_step/loss" in row for row in found.rows.values())  # every_publication=False
    # the training stage a stop cut short is published at fit_end, before the W&B run ends
    assert [s for s, _ in found.series("train/loss")] == ([4, 8] if outcome == "failed" else [4, 6])


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_wandb_run_without_a_step_twice(tmp_path: Path) -> None:
    """A run stopped at step 6 (its checkpoint holds the W&B run's id) resumes: offline, W&B
    writes a second folder for the same run, which starts at step 7."""
    folder = tmp_path / "run"
    first = WandB()
    assert run(folder, first, Checkpoint(background=False), StopAfter(8)).state.step == 6
    again = WandB()
    loop = run(folder, again, Checkpoint(background=False), resume="latest")
    assert loop.state.resumed_from is not None and loop.state.resumed_from.step == 6
    assert loop.state.status == "completed" and again.run_id == first.run_id
    before, after = offline_runs(folder)
    assert before.run.run_id == after.run.run_id == first.run_id
    assert sorted(before.rows) == list(range(1, 7)) and sorted(after.rows) == list(range(7, 13))
    steps = [s for part in (before, after) for s, _ in part.series("train_step/loss")]
    assert steps == list(range(1, 13))  # each step once
    assert [s for part in (before, after) for s, _ in part.series("train/loss")] == [4, 6, 8, 12]
    assert after.config["loop.max_epochs"] == 3 and after.summary["hookfit/status"] == "completed"


@pytest.mark.slow
def test_discovered_it_is_inert_until_configured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOKFIT_PLUGINS", "wandb")
    loop = run(tmp_path / "found")
    assert loop.run.pm.get_plugin("wandb") is None  # unregistered at configure: no hook of it runs
    assert not (tmp_path / "found" / "wandb").exists()

    config = tmp_path / "hookfit.toml"
    config.write_text('[plugins.wandb]\nproject = "configured"\nevery_publication = false\n')
    monkeypatch.setenv("HOOKFIT_CONFIG", str(config))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))  # the user's folder for W&B wins
    (tmp_path / "elsewhere").mkdir()
    run(tmp_path / "configured")
    assert not (tmp_path / "configured" / "wandb").exists()
    (found,) = offline_runs(tmp_path / "elsewhere")
    assert found.run.project == "configured" and [s for s, _ in found.series("train/loss")] == [4, 8, 12]
    assert sorted(found.rows) == [4, 8, 12]  # epoch means only

    monkeypatch.delenv("HOOKFIT_CONFIG")
    config.unlink()  # (a file next to the script would be found, and warned about: the given plugin wins)
    run(tmp_path / "off", WandB(enabled=False, dir=tmp_path / "off-wandb"))
    assert not (tmp_path / "off-wandb").exists() and len(offline_runs(tmp_path / "elsewhere")) == 1


def test_a_smoke_run_logs_offline_in_its_temporary_folder_and_nothing_reaches_the_project(tmp_path: Path) -> None:
    """HOOKFIT_SMOKE=1 on a script that logs online to a folder of its own: the W&B run is offline, in the
    smoke run's temporary folder, removed with it."""
    from hookfit.plugins.smoke import Smoke

    where: list[bool] = []

    class Where:
        name = "where"

        @hookfit.hookimpl
        def fit_end(self, loop):
            where.append((loop.run_dir / "wandb").is_dir())

    def kept() -> list[Path]:  # what W&B keeps of the process's runs outside their folders (artifacts staged)
        data = Path(os.environ["WANDB_DATA_DIR"])
        return sorted(p for p in data.rglob("*") if p.is_file()) if data.exists() else []

    before = kept()
    tracker = WandB(dir=tmp_path / "elsewhere", mode="online", log_checkpoints=True)
    loop = run(tmp_path / "run", tracker, Where(), Smoke(), Checkpoint(background=False), smoke=True)
    assert loop.state.status == "completed" and tracker.run_id is not None and where == [True]
    assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "run").exists()
    assert kept() == before  # no checkpoint staged as an artifact


def test_a_smoke_run_keeps_wandb_disabled_where_it_was_asked(tmp_path: Path) -> None:
    """WandB(mode="disabled"): a smoke run does not turn it into an offline run."""
    from hookfit.plugins.smoke import Smoke

    seen: list[Any] = []

    class Mode:
        name = "mode"

        @hookfit.hookimpl
        def fit_end(self, loop):  # (before the tracker's, which ends its run last)
            seen.append(getattr(tracker.run, "disabled", None))

    tracker = WandB(mode="disabled")
    loop = run(tmp_path / "run", tracker, Mode(), Smoke(), smoke=True)
    assert loop.state.status == "completed" and seen == [True]


def test_only_the_main_process_logs(tmp_path: Path) -> None:
    class Rank1:
        name = "rank1"

        @hookfit.hookimpl(tryfirst=True)
        def configure(self, loop):
            loop.state.rank, loop.state.world_size = 1, 1  # as a distributed plugin on a worker

    tracker = WandB(log_checkpoints=True)
    loop = run(tmp_path / "run", tracker, Rank1(), Checkpoint(background=False))
    assert loop.state.status == "completed" and tracker.run_id is None
    assert not (tmp_path / "run" / "wandb").exists()


@pytest.mark.bad_input
@pytest.mark.parametrize("options, message", [
    ({"project": ""}, r"wandb: project must be a non-empty string or None, got ''"),
    ({"mode": "online!"}, r"wandb: mode must be 'online', 'offline', 'disabled' or None, got 'online!'"),
    ({"entity": 1}, r"wandb: entity must be a non-empty string or None, got 1"),
    ({"run_name": " "}, r"wandb: run_name must be a non-empty string or None, got ' '"),
    ({"dir": 3}, r"wandb: dir must be a folder \(a str or os.PathLike\) or None, got 3"),
    ({"log_checkpoints": 1}, r"wandb: log_checkpoints must be True or False, got 1"),
    ({"every_publication": "no"}, r"wandb: every_publication must be True or False, got 'no'"),
    ({"enabled": "yes"}, r"wandb: enabled must be True, False or None, got 'yes'"),
    ({"hparams": {"layers": [64, 64]}}, r"wandb: hparams\['layers'\] is \[64, 64\]; a hyperparameter is"),
    ({"init": ["tags"]}, r"wandb: init must map wandb.init's argument names to values, or be None, got \['tags'\]"),
    ({"init": {"id": "x", "config": {}}}, r"wandb: init may not give config, id: the plugin sets them"),
])
def test_bad_options_are_named(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WandB(**options)


@pytest.mark.bad_input
def test_a_bad_option_in_the_configuration_file_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "hookfit.toml"
    config.write_text('[plugins.wandb]\nmode = "offlin"\n')
    monkeypatch.setenv("HOOKFIT_PLUGINS", "wandb")
    monkeypatch.setenv("HOOKFIT_CONFIG", str(config))
    with pytest.raises(hookfit.config.ConfigError, match=r"hookfit.toml \[plugins.wandb\]: wandb: "
                                                          r"mode must be 'online', 'offline', 'disabled' or None"):
        run(tmp_path / "run")


@pytest.mark.bad_input
def test_a_checkpoint_state_that_names_no_run_is_refused() -> None:
    with pytest.raises(ValueError, match=r"wandb: the checkpoint's state of this plugin is 'abc'; "
                                         r"expected \{'run_id': <a W&B run id>\}"):
        WandB().load_state(None, "abc")  # type: ignore[arg-type]


@pytest.mark.bad_input
def test_without_wandb_the_message_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ImportError, match=r"wandb: the plugin needs the wandb package.*"
                                          r"`pip install hookfit\[wandb\]`"):
        WandB(enabled=True)
    with pytest.warns(ObserverWarning, match=r"observer plugin 'wandb'.*failed in hook 'configure'.*"
                                             r"pip install hookfit\[wandb\]") as caught:
        loop = run(tmp_path / "run", WandB())
    assert loop.state.status == "completed" and loop.state.step == 12  # an observer: training goes on
    assert len([w for w in caught if w.category is ObserverWarning]) == 1
    assert not (tmp_path / "run" / "wandb").exists() and INSTALL == "pip install hookfit[wandb]"


# -- under torchrun --------------------------------------------------------------------------

@pytest.mark.slow
def test_under_torchrun_only_rank_0_logs_to_wandb_and_mlflow(tmp_path: Path, _offline: dict[str, str]) -> None:
    """Two processes, each given both trackers: rank 0 keeps them, the other rank's are
    switched off by the distributed plugin before they start, so one MLflow run (in a SQLite
    store both processes could otherwise create at once) and one W&B run hold the global
    metrics of the two processes. Resumed with a strict checkpoint and the trackers given to rank
    0 only, rank 1 leaves the trackers' states to rank 0 (it failed the run: states no plugin of
    rank 1 restores), and rank 0 continues both tracker runs."""
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow.tracking import MlflowClient

    launch = ["--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    launched = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HOOKFIT_DISABLE_PLUGINS")
    # (WANDB_SERVICE, which this process's earlier W&B runs set, would have the children use its service)
    env = {k: v for k, v in os.environ.items() if k not in launched and not k.startswith("WANDB_")}
    env.update(_offline, OMP_NUM_THREADS="1", HOOKFIT_PLUGINS="distributed", PYTHONFAULTHANDLER="1")
    done = subprocess.run([*command, *launch, str(REPO / "tests" / "scripts" / "tracker_dist.py")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert [r["trackers"] for r in ranks] == [["mlflow", "wandb"], []]  # registered at fit_start
    want = ranks[0]["train_loss"]  # the global epoch means, the same on both ranks
    assert [s for s, _ in want] == [4, 8] and want == ranks[1]["train_loss"]

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(ranks[0]["name"])  # the run's name, by default
    (one,) = client.search_runs([experiment.experiment_id])
    assert one.info.status == "FINISHED" and one.info.run_id == ranks[0]["mlflow"]
    got = sorted((m.step, m.value) for m in client.get_metric_history(one.info.run_id, "train/loss"))
    assert [s for s, _ in got] == [4, 8] and [v for _, v in got] == pytest.approx([v for _, v in want])

    (found,) = offline_runs(tmp_path / "run")
    assert found.run.run_id == ranks[0]["wandb"] and found.exit_code == 0
    got = found.series("train/loss")
    assert [s for s, _ in got] == [4, 8] and [v for _, v in got] == pytest.approx([v for _, v in want])

    # resumed with Checkpoint(strict=True), the trackers given on rank 0 alone: their states are rank 0's to restore,
    # not a mismatch on rank 1
    done = subprocess.run([*command, *launch, str(REPO / "tests" / "scripts" / "tracker_dist.py"), "resume"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "plugin states do not match" not in done.stdout + done.stderr
    resumed = [json.loads((tmp_path / f"resumed{r}.json").read_text()) for r in (0, 1)]
    assert [(r["status"], r["step"]) for r in resumed] == [("completed", 12)] * 2
    assert resumed[0]["mlflow"] == ranks[0]["mlflow"] and resumed[0]["wandb"] == ranks[0]["wandb"]
