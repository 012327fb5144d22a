"""tensorboard: event files in the run folder, read back with TensorBoard's own reader and
compared with the run's metrics.jsonl; off until configured; a full disk warns once."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import StopAfter, squeeze

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.plugins.hparams import api_pb2, metadata  # noqa: E402

import hookfit  # noqa: E402
from hookfit.errors import ObserverWarning  # noqa: E402
from hookfit.files import FileWarning  # noqa: E402
from hookfit.plugins.checkpoint import Checkpoint  # noqa: E402
from hookfit.plugins.metrics import Metrics  # noqa: E402
from hookfit.plugins.metrics_log import MetricsLog  # noqa: E402
from hookfit.plugins.optim import Optim  # noqa: E402
from hookfit.plugins.tensorboard import INSTALL, TensorBoard  # noqa: E402

VALID = [3.0, 2.0, 2.5]  # the valid loss of each epoch


class Published:
    """Keeps the training snapshots the metrics plugin publishes."""

    name = "published"

    def __init__(self) -> None:
        self.updates: list = []

    @hookfit.hookimpl
    def metrics_update(self, stage, metrics):
        if stage == "train":
            self.updates.append(metrics)


def run(run_dir: Path, *plugins, max_epochs: int = 3, interval: float = 0.0, **kwargs) -> hookfit.Loop:
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
        return {"loss": torch.tensor(VALID[loop.state.epoch]), "accuracy": 1.0 / (1 + loop.state.epoch)}

    loop = hookfit.Loop(step, data, val_step=val_step, val_data=[0, 1], model=model, optimizers=optimizer,
                        max_epochs=max_epochs, run_dir=run_dir,
                        plugins=[Optim(), Metrics(interval=interval), MetricsLog(), *plugins], **kwargs)
    loop.fit()
    return loop


def read(run_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return events


def scalars(events: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in events.Scalars(tag)]


def jsonl(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-7)  # TensorBoard keeps float32


def test_epoch_means_running_means_learning_rates_and_hparams_read_back(tmp_path: Path) -> None:
    published = Published()
    tb = TensorBoard(hparams={"batch_size": 4, "note": "baseline", "augment": False})
    loop = run(tmp_path / "run", tb, published)
    assert loop.state.status == "completed"
    events = read(tmp_path / "run")
    assert tb.path is not None and Path(tb.path).parent == tmp_path / "run" and "tfevents" in Path(tb.path).name

    # every epoch mean of metrics.jsonl, at the step its stage ended, under <stage>/<metric>
    epochs = [r for r in jsonl(tmp_path / "run") if r["event"] == "epoch"]
    assert [(r["stage"], r["epoch"]) for r in epochs] == [(s, e) for e in (1, 2, 3) for s in ("train", "valid")]
    for stage, metric in (("train", "loss"), ("valid", "loss"), ("valid", "accuracy")):
        expected = [(r["step"], r[metric]) for r in epochs if r["stage"] == stage]
        got = scalars(events, f"{stage}/{metric}")
        assert [s for s, _ in got] == [s for s, _ in expected] == [4, 8, 12]
        assert all(close(g, e) for (_, g), (_, e) in zip(got, expected)), (stage, metric, got, expected)
    assert [v for _, v in scalars(events, "valid/loss")] == VALID
    assert scalars(events, "epoch") == [(4, 1.0), (8, 2.0), (12, 3.0)]

    # every training publication's running mean at its global step (interval=0: every batch)
    got = scalars(events, "train_step/loss")
    assert [s for s, _ in got] == [m.step for m in published.updates] == list(range(1, 13))
    assert [v for _, v in got] == pytest.approx([m.values["loss"].running for m in published.updates], rel=1e-6)

    # learning rates once per step, as the snapshots (and metrics.jsonl) carry them
    rates = dict(scalars(events, "lr/default"))
    assert sorted(rates) == list(range(1, 13))
    for r in epochs:
        if r["stage"] == "train":
            assert close(rates[r["step"]], r["lr_default"])
    assert [round(rates[s], 6) for s in (4, 8, 12)] == [0.1, 0.05, round(0.1 / 3, 6)]
    assert "valid_step/loss" not in events.Tags()["scalars"] and "train_step/accuracy" not in events.Tags()["scalars"]

    # hyperparameters: a session start at fit_start, a session end with the status at fit_end
    content = events.PluginTagToContent(metadata.PLUGIN_NAME)
    assert metadata.EXPERIMENT_TAG not in content  # TensorBoard builds the experiment from every run
    start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    hp = {k: getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}
    assert hp["loop.max_epochs"] == 3 and hp["loop.name"] == "run" and hp["loop.deterministic"] is False
    assert "loop.max_steps" not in hp  # None: not a hyperparameter TensorBoard can show
    assert hp["optimizer.default"] == "SGD" and hp["optimizer.default.momentum"] == 0.9
    assert hp["optimizer.default.lr"] == 0.1 and "optimizer.default.foreach" not in hp
    assert hp["plugin.metrics.interval"] == 0.0 and hp["plugin.tensorboard.every_publication"] is True
    assert (hp["batch_size"], hp["note"], hp["augment"]) == (4, "baseline", False)
    end = metadata.parse_session_end_info_plugin_data(content[metadata.SESSION_END_INFO_TAG])
    assert end.status == api_pb2.Status.Value("STATUS_SUCCESS")


def test_epoch_means_only_and_a_failed_run_ends_its_session_as_a_failure(tmp_path: Path) -> None:
    class Fail:
        name = "fail"

        @hookfit.hookimpl
        def epoch_end(self, epoch):
            if epoch == 1:
                raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run(tmp_path / "run", TensorBoard(every_publication=False), Fail())
    events = read(tmp_path / "run")
    assert not any(t.startswith("train_step/") for t in events.Tags()["scalars"])
    assert [s for s, _ in scalars(events, "train/loss")] == [4, 8]
    assert [s for s, _ in scalars(events, "lr/default")] == [4, 8]  # with the epoch means
    content = events.PluginTagToContent(metadata.PLUGIN_NAME)
    end = metadata.parse_session_end_info_plugin_data(content[metadata.SESSION_END_INFO_TAG])
    assert end.status == api_pb2.Status.Value("STATUS_FAILURE")


def _event_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("events.out.tfevents.*"))


def test_discovered_it_is_inert_until_configured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOKFIT_PLUGINS", "tensorboard")
    loop = run(tmp_path / "found")
    assert loop.run.pm.get_plugin("tensorboard") is None  # unregistered at configure: no hook of it runs
    assert _event_files(tmp_path / "found") == []

    config = tmp_path / "hookfit.toml"
    config.write_text("[plugins.tensorboard]\nenabled = true\n")
    monkeypatch.setenv("HOOKFIT_CONFIG", str(config))
    run(tmp_path / "configured")
    assert [s for s, _ in scalars(read(tmp_path / "configured"), "train/loss")] == [4, 8, 12]

    config.write_text("[plugins.tensorboard]\nevery_publication = false\n")  # any option turns it on
    run(tmp_path / "option")
    assert "train_step/loss" not in read(tmp_path / "option").Tags()["scalars"]
    assert len(_event_files(tmp_path / "option")) == 1

    monkeypatch.delenv("HOOKFIT_CONFIG")
    config.unlink()  # (a file next to the script would be found, and warned about: the given plugin wins)
    run(tmp_path / "off", TensorBoard(enabled=False))
    assert _event_files(tmp_path / "off") == []


@pytest.mark.bad_input
@pytest.mark.parametrize("options, message", [
    ({"enabled": "yes"}, r"tensorboard: enabled must be True, False or None, got 'yes'"),
    ({"every_publication": None}, r"tensorboard: every_publication must be True or False, got None"),
    ({"hparams": [("lr", 0.1)]}, r"tensorboard: hparams must map names to numbers, strings or booleans, got list"),
    ({"hparams": {"layers": [64, 64]}}, r"tensorboard: hparams\['layers'\] is \[64, 64\]; a hyperparameter is"),
    ({"hparams": {"lr": float("nan")}}, r"tensorboard: hparams\['lr'\] is nan; a hyperparameter is a finite"),
])
def test_bad_options_are_named(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TensorBoard(**options)


@pytest.mark.bad_input
def test_a_bad_option_in_the_configuration_file_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "hookfit.toml"
    config.write_text('[plugins.tensorboard]\nenabled = "yes"\n')
    monkeypatch.setenv("HOOKFIT_PLUGINS", "tensorboard")
    monkeypatch.setenv("HOOKFIT_CONFIG", str(config))
    with pytest.raises(hookfit.config.ConfigError, match=r"hookfit.toml \[plugins.tensorboard\]: tensorboard: "
                                                          r"enabled must be True, False or None"):
        run(tmp_path / "run")


@pytest.mark.bad_input
def test_without_the_tensorboard_package_the_message_says_how_to_install_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard raises ImportError
    with pytest.raises(ImportError, match=r"needs the tensorboard package.*`pip install hookfit\[tensorboard\]`"):
        TensorBoard(enabled=True)
    with pytest.warns(ObserverWarning, match=r"observer plugin 'tensorboard'.*failed in hook 'configure'.*"
                                             r"pip install hookfit\[tensorboard\]") as caught:
        loop = run(tmp_path / "run", TensorBoard())
    assert loop.state.status == "completed" and loop.state.step == 12  # an observer: training goes on
    assert len([w for w in caught if w.category is ObserverWarning]) == 1
    assert _event_files(tmp_path / "run") == [] and INSTALL == "pip install hookfit[tensorboard]"


@pytest.mark.fault
def test_a_resumed_run_continues_the_curves_as_if_it_never_stopped(tmp_path: Path) -> None:
    """The first run wrote epoch 3 and then lost its last checkpoint (as a kill right before
    it would): the resumed run redoes epoch 3, and TensorBoard shows each point once."""
    folder = tmp_path / "run"
    run(folder, TensorBoard(), Checkpoint(background=False))
    (last,) = (folder / "checkpoints").glob("epoch0003-*.pt")
    last.unlink()
    loop = run(folder, TensorBoard(), Checkpoint(background=False), resume="latest")
    assert loop.state.resumed_from is not None and loop.state.resumed_from.step == 8
    assert len(_event_files(folder)) == 2  # one event file per fit()
    events = read(folder)
    final = {}
    for r in jsonl(folder):  # the resumed run's lines come last
        if r["event"] == "epoch":
            final[(r["stage"], r["epoch"])] = r
    for stage in ("train", "valid"):
        got = scalars(events, f"{stage}/loss")
        assert [s for s, _ in got] == [4, 8, 12], got  # epoch 3 once: the earlier run's was dropped
        assert all(close(v, final[(stage, e)]["loss"]) for e, (_, v) in enumerate(got, 1))
    assert [s for s, _ in scalars(events, "train_step/loss")] == list(range(1, 13))
    assert [s for s, _ in scalars(events, "lr/default")] == list(range(1, 13))


# where a stop lands, counting batches of four training and two validation batches an epoch
STOPS = {8: "inside epoch 2's training", 10: "right after epoch 2's last training batch",
         11: "inside epoch 2's validation", 12: "right after epoch 2's validation"}


@pytest.mark.parametrize("stop", sorted(STOPS))
def test_a_run_stopped_and_resumed_reads_as_the_run_that_never_stopped(tmp_path: Path, stop: int) -> None:
    """The stopped run writes the stage the stop cut short (its means so far, at the stop's
    step); the resumed run drops that step and writes again what the checkpoint had there, so
    TensorBoard reads every curve of the uninterrupted run, point for point."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run(whole, TensorBoard())
    stopped, again = TensorBoard(), TensorBoard()
    first = run(resumed, stopped, Checkpoint(background=False), StopAfter(stop))
    assert first.state.status == "interrupted", STOPS[stop]
    loop = run(resumed, again, Checkpoint(background=False), resume="latest")
    assert loop.state.resumed_from is not None and loop.state.status == "completed"
    # TensorBoard reads a folder's files in the order of their names: the resumed run's comes
    # after, also when both runs began in the same second
    assert _event_files(resumed) == [stopped.path, again.path]
    expected, got = read(whole), read(resumed)
    tags = expected.Tags()["scalars"]
    assert sorted(got.Tags()["scalars"]) == sorted(tags) and "epoch" in tags and "lr/default" in tags
    for tag in tags:
        assert scalars(got, tag) == scalars(expected, tag), (tag, STOPS[stop])


@pytest.mark.fault
def test_an_earlier_event_file_that_cannot_be_read_warns_and_the_stop_s_step_stays(tmp_path: Path) -> None:
    """The resumed run reads the earlier files for what they have at the checkpoint's step; one
    it cannot read warns, and the purge is then from the step after, as nothing there is lost."""
    folder = tmp_path / "run"
    run(folder, TensorBoard(), Checkpoint(background=False), StopAfter(8))  # stopped at step 6
    unreadable = folder / "events.out.tfevents.0000000000.unreadable"
    unreadable.mkdir()  # an event file's name on a folder: reading it fails
    with pytest.warns(FileWarning, match=rf"tensorboard: could not read {unreadable} \(IsADirectoryError: .*\); "
                                         r"the resumed run's curves keep what the earlier run wrote after its "
                                         r"checkpoint"):
        loop = run(folder, TensorBoard(), Checkpoint(background=False), resume="latest")
    assert loop.state.status == "completed"
    unreadable.rmdir()
    events = read(folder)
    assert [s for s, _ in scalars(events, "train/loss")] == [4, 6, 8, 12]  # the stop's partial means stay
    assert [s for s, _ in scalars(events, "train_step/loss")] == list(range(1, 13))


FULL_DISK_CHILD = r'''
import json, os, resource, signal, sys, warnings
import torch
import hookfit
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.tensorboard import TensorBoard

run_dir = sys.argv[1]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the kernel answers EFBIG instead of the signal
tb = TensorBoard()


''' + squeeze('tb.path', 10) + r'''

def step(loop, batch):
    return {"loss": torch.tensor(float(batch))}

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    state = hookfit.Loop(step, [1, 2, 3, 4], max_epochs=3, run_dir=run_dir,
                         plugins=[Metrics(interval=0.0), tb, Squeeze()]).fit()
print(json.dumps({"status": state.status, "step": state.step, "path": str(tb.path),
                  "warnings": [(w.category.__name__, str(w.message)) for w in caught]}))
'''


@pytest.mark.slow
@pytest.mark.fault
def test_a_full_disk_warns_once_and_training_completes(tmp_path: Path) -> None:
    """RLIMIT_FSIZE makes the kernel refuse the writes as a full disk would (EFBIG for ENOSPC),
    in a child process, so that the limit cannot touch the test's own files."""
    script = tmp_path / "child.py"
    script.write_text(FULL_DISK_CHILD)
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, str(script), str(run_dir)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HOOKFIT_PLUGINS": ""})
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert (result["status"], result["step"]) == ("completed", 12)
    assert {category for category, _ in result["warnings"]} == {"FileWarning"}
    # the run's own run.jsonl (written by the core) may hit the limit too: not this plugin's file
    mine = [text for _, text in result["warnings"] if not text.startswith("hookfit: could not write ")]
    assert len(mine) == 1, result["warnings"]  # once, for every refused write
    message = mine[0]
    assert message.startswith(f"tensorboard: could not write {result['path']} (OSError: [Errno 27] File too large")
    assert "training goes on" in message and "tfevents" in message
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        events = read(run_dir)  # what was written before the disk filled is kept, and readable
    assert scalars(events, "train/loss") == [(4, 2.5)]
    assert [s for s, _ in scalars(events, "train_step/loss")] == [1, 2, 3, 4]


def test_only_the_main_process_writes(tmp_path: Path) -> None:
    class Rank1:
        name = "rank1"

        @hookfit.hookimpl(tryfirst=True)
        def configure(self, loop):
            loop.state.rank, loop.state.world_size = 1, 1  # as a distributed plugin on a worker

    loop = run(tmp_path / "run", TensorBoard(), Rank1())
    assert loop.state.status == "completed" and _event_files(tmp_path / "run") == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing else to say either
        run(tmp_path / "again", TensorBoard(every_publication=False), max_epochs=1)
    assert scalars(read(tmp_path / "again"), "train/loss")[0][0] == 4


def test_a_stage_a_stop_cut_short_reaches_the_loggers(tmp_path: Path) -> None:
    """The metrics plugin publishes a stage that a stop cut short from its fit_end; a logger
    given after it (whose plain fit_end pluggy would call first) still writes it: the loggers
    close in a trylast fit_end."""
    from hookfit.plugins.csv_log import CSVLogger

    class Stop:
        name = "stop"

        @hookfit.hookimpl
        def batch_end(self, loop):
            if loop.state.step == 6:  # epoch 2, 2 of its 4 batches
                loop.request_stop("enough")

    run(tmp_path, TensorBoard(), CSVLogger(), Stop())
    assert [step for step, _ in scalars(read(tmp_path), "train/loss")] == [4, 6]
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert [row.split(",")[:3] for row in rows[1:] if ",train," in f",{row},"] == [["1", "4", "train"],
                                                                                ["2", "6", "train"]]


def test_an_evaluation_in_the_runs_folder_purges_nothing_and_is_a_run_of_its_own(tmp_path: Path) -> None:
    """``Loop.validate(resume=<epoch 1's checkpoint>)`` in the training run's folder: the run's
    scalars read back unchanged (a resume would purge those after the checkpoint's step: an
    evaluation is none), and the evaluation's are in ``evaluation/``, which TensorBoard shows as
    a run of its own beside the training's."""
    loop = run(tmp_path, Checkpoint(background=False), TensorBoard())
    before = scalars(read(tmp_path), "valid/loss")
    first = sorted((tmp_path / "checkpoints").glob("*.pt"))[0]

    def test_step(loop, batch):
        return {"loss": torch.tensor(100.0)}

    hookfit.Loop(None, [], val_step=test_step, val_data=[0], model=loop.model, run_dir=tmp_path,
                 plugins=[Metrics(), Checkpoint(), TensorBoard()]).validate(resume=str(first))
    assert scalars(read(tmp_path), "valid/loss") == before and len(before) == 3
    assert scalars(read(tmp_path / "evaluation"), "valid/loss") == [(4, 100.0)]
