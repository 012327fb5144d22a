"""A third-party checkpoint plugin takes over from the built-in one and resumes bit for bit.

``tests/packages/hookfit-tiny-checkpoint`` (plugin ``tiny_checkpoint``) was written from
``README.md`` and ``core/hooks.md`` alone ("Saving and resuming a run (the checkpoint role)"),
without reading the built-in checkpoint plugin or the run's source. It
is installed with a real pip into a temporary virtual environment (tests/venvs.py), never into
the one running the suite, and the built-in is disabled by name, as README.md's "Replacing a
built-in plugin" says (``HOOKFIT_DISABLE_PLUGINS=checkpoint``); every other discovered plugin
stays on. Real processes run :data:`SCRIPT` with the venv's interpreter: a model with dropout,
a shuffled ``DataLoader`` drawing from the global generator, the built-in ``Optim`` with
``accumulate=2`` and a validation every 4 steps whose step draws noise from the global
generator. A run stopped gracefully (mid-epoch, at a step whose validation is due, inside that
validation) and resumed from the plugin's files ends with the parameters and the metric history
of a run never interrupted, and the built-in wrote nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from venvs import Venv, assert_installed_copy_needs_no_builtin, assert_not_in_running_env, make_venv
from conftest import REPO

pytestmark = pytest.mark.slow

ROOT = REPO
PACKAGE = ROOT / "tests" / "packages" / "hookfit-tiny-checkpoint"
DISTRIBUTION, MODULE = "hookfit-tiny-checkpoint", "hookfit_tiny_checkpoint"
TIMEOUT = 180
STEPS = 33  # 3 epochs of 11 batches; validations after steps 4, 8, ..., 32
# the uninterrupted run's files: every 5 steps (hookfit.toml) and every epoch; names count
# epochs from 1 and say where a resume would continue (after an epoch: the next one)
STRAIGHT_FILES = ["000001-epoch0001-step000000005-step.pt", "000002-epoch0001-step000000010-step.pt",
                  "000003-epoch0002-step000000011-epoch.pt", "000004-epoch0002-step000000015-step.pt",
                  "000005-epoch0002-step000000020-step.pt", "000006-epoch0003-step000000022-epoch.pt",
                  "000007-epoch0003-step000000025-step.pt", "000008-epoch0003-step000000030-step.pt",
                  "000009-epoch0004-step000000033-epoch.pt"]

SCRIPT = '''"""A training run for tests/test_third_party_checkpoint.py, in a venv where hookfit-tiny-checkpoint
is installed and the built-in checkpoint disabled.

``python train.py OUT --run-dir DIR [--resume latest|PATH] [--stop-train STEP] [--stop-valid STEP BATCH]``:
a small regression with dropout on a shuffled DataLoader (no generator of its own: it draws
from the global one), the built-in Optim with accumulate=2, a validation every 4 training
steps whose step adds random noise. Writes OUT (JSON): every epoch_metrics snapshot, where the
run resumed from, how it ended and the final parameters.
"""

import argparse
import json

import torch
from torch.utils.data import DataLoader, TensorDataset

import hookfit
from hookfit import hookimpl
from hookfit.plugins.optim import Optim

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--run-dir", required=True)
parser.add_argument("--resume")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--stop-train", type=int, help="request a stop in the train step of this global step (0-based)")
parser.add_argument("--stop-valid", type=int, nargs=2, metavar=("STEP", "BATCH"),
                    help="request a stop in the val step of batch BATCH of the validation due at STEP")
args = parser.parse_args()

hookfit.seed_everything(0)
x = torch.randn(200, 8)
y = torch.sin(x[:, :1] * 2 - x[:, 1:2]) + 0.1 * torch.randn(200, 1)
train = DataLoader(TensorDataset(x[:168], y[:168]), batch_size=16, shuffle=True)  # 11 batches, the last of 8
valid = DataLoader(TensorDataset(x[168:], y[168:]), batch_size=8)  # 4 batches
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
record = {"snapshots": [], "resumed": None, "stopped_in": None}


def train_step(loop, batch):
    if loop.state.step == args.stop_train:
        record["stopped_in"] = [loop.state.stage, loop.state.step, loop.state.batch_idx, loop.state.val_due]
        loop.request_stop("stopped by the test")
    inputs, targets = batch
    loss = torch.nn.functional.mse_loss(loop.model(inputs), targets)
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    return {"loss": loss}


def val_step(loop, batch):
    if args.stop_valid and loop.state.stage == "valid" and [loop.state.step, loop.state.batch_idx] == args.stop_valid:
        record["stopped_in"] = [loop.state.stage, loop.state.step, loop.state.batch_idx, loop.state.val_due]
        loop.request_stop("stopped by the test in a validation")
    inputs, targets = batch
    noise = 0.1 * torch.randn(len(inputs), 1)  # draws from the global generator
    return {"loss": torch.nn.functional.mse_loss(loop.model(inputs) + noise, targets)}


class Probe:
    name = "probe"

    @hookimpl(optionalhook=True)  # declared by the metrics plugin
    def epoch_metrics(self, loop, stage, metrics):
        record["snapshots"].append({"stage": stage, "epoch": metrics.epoch, "step": metrics.step,
                                    "partial": metrics.total is not None and metrics.batches < metrics.total,
                                    "values": {k: v.epoch for k, v in metrics.values.items()},
                                    "history": [dict(row) for row in metrics.history]})

    @hookimpl
    def resumed(self, loop, info):
        record["resumed"] = {"source": info.source, "epoch": info.epoch, "step": info.step, "batch": info.batch,
                             "stage": info.stage}


loop = hookfit.Loop(train_step, train, val_step=val_step, val_data=valid, model=model, optimizers=optimizer,
                    max_epochs=args.epochs, val_every_n_steps=4, seed=0, run_dir=args.run_dir, resume=args.resume,
                    plugins=[Optim(accumulate=2), Probe()])
state = loop.fit()
record.update(status=state.status, reason=state.stop_reason, stopped_by=state.stopped_by, step=state.step,
              params=torch.cat([p.detach().flatten() for p in model.parameters()]).tolist())
with open(args.out, "w") as file:
    json.dump(record, file)
'''


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One venv for the module with the package installed (not editable, from a copy)."""
    env = make_venv(tmp_path_factory.mktemp("tiny_checkpoint") / "venv")
    env.install(PACKAGE)
    yield env
    assert_not_in_running_env(DISTRIBUTION, MODULE)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the training script and the hookfit.toml that configures the plugin."""
    folder = tmp_path_factory.mktemp("tiny_checkpoint_work")
    (folder / "train.py").write_text(SCRIPT, encoding="utf-8")
    (folder / "hookfit.toml").write_text("[plugins.tiny_checkpoint]\nevery_n_steps = 5\n", encoding="utf-8")
    return folder


def environment(work: Path) -> dict[str, str]:
    return {"OMP_NUM_THREADS": "1", "HOOKFIT_DISABLE_PLUGINS": "checkpoint",
            "HOOKFIT_CONFIG": str(work / "hookfit.toml")}


def train(venv: Venv, work: Path, name: str, run_dir: Path, *args: Any) -> dict[str, Any]:
    """Run the script in ``run_dir``; what it recorded (JSON)."""
    out = work / f"{name}.json"
    venv.run(work / "train.py", out, "--run-dir", run_dir, *args, cwd=work, timeout=TIMEOUT, **environment(work))
    record = json.loads(out.read_text(encoding="utf-8"))
    assert not (run_dir / "checkpoints").exists(), "the built-in checkpoint plugin wrote files"
    return record


def snapshots(record: dict[str, Any]) -> list[tuple]:
    """Every epoch_metrics snapshot the run published of a whole stage: stage, epoch, step,
    epoch means (a stage a stop cut short is published too, at fit_end: see partial)."""
    return [(s["stage"], s["epoch"], s["step"], s["values"]) for s in record["snapshots"] if not s["partial"]]


def partial(record: dict[str, Any]) -> list[tuple]:
    """The snapshots of stages a stop cut short: stage and step."""
    return [(s["stage"], s["step"]) for s in record["snapshots"] if s["partial"]]


def logged(run_dir: Path) -> list[tuple]:
    """The metric history metrics.jsonl keeps (the built-in metrics plugin's, appended by
    each run in the folder): stage, epoch, step and loss of every stage published."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    kept: list[tuple] = []
    for r in rows:
        if r["event"] == "resume":  # what a stopped run published from its checkpoint on (the stage the
            kept = [k for k in kept if k[2] < r["step"]]  # stop cut short) the resumed run publishes again
        elif r["event"] == "epoch":
            kept.append((r["stage"], r["epoch"], r["step"], r["loss"]))
    return kept


def tiny_files(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "tiny").iterdir())


@pytest.fixture(scope="module")
def straight(venv: Venv, work: Path) -> tuple[dict[str, Any], Path]:
    """The uninterrupted run, and its folder."""
    run_dir = work / "straight"
    record = train(venv, work, "straight", run_dir)
    assert (record["status"], record["step"], record["resumed"]) == ("completed", STEPS, None)
    assert tiny_files(run_dir) == STRAIGHT_FILES
    assert len(snapshots(record)) == 11  # 8 validations and 3 training epochs
    return record, run_dir


def test_the_package_replaces_the_builtin_checkpoint(venv: Venv, work: Path) -> None:
    listing = {row["name"]: row for row in json.loads(
        venv.run("-m", "hookfit.tools.cli", "plugins", "--json", cwd=work, **environment(work)).stdout)}
    tiny = listing["tiny_checkpoint"]
    assert (tiny["distribution"], tiny["version"], tiny["source"]) == (DISTRIBUTION, "0.1.0", "entry point")
    assert tiny["value"] == f"{MODULE}:TinyCheckpoint" and tiny["enabled"] and tiny["error"] is None
    assert tiny["hooks"] == ["after_batch", "after_epoch", "fit_end", "resume"]
    assert tiny["options"] == {"every_n_steps": {"value": 5, "from": "file"}}
    assert (listing["checkpoint"]["distribution"], listing["checkpoint"]["enabled"]) == ("hookfit", False)
    assert all(row["error"] is None for row in listing.values()), listing
    assert venv.has(DISTRIBUTION)
    assert_not_in_running_env(DISTRIBUTION, MODULE)
    assert_installed_copy_needs_no_builtin(venv, MODULE, work)  # the installed copy


STOPS = {  # case -> (script arguments, where the step asked: stage, step, batch, val_due; resume from)
    # the first batch of an accumulation window (epoch 1, batch 2): its gradients are pending
    "mid_epoch": (["--stop-train", "13"], ["train", 13, 2, False], "latest"),
    # after step 16, whose validation is due and has not run: the resumed run runs it first
    "before_a_due_validation": (["--stop-train", "15"], ["train", 15, 4, False], "latest"),
    # inside the validation due at step 16 (nested in training), at its second batch
    "inside_a_validation": (["--stop-valid", "16", "1"], ["valid", 16, 1, True], "path"),
}


@pytest.mark.parametrize("case", list(STOPS))
def test_a_stopped_run_resumes_bit_for_bit(venv: Venv, work: Path, straight: tuple, case: str) -> None:
    reference, reference_dir = straight
    args, stopped_in, source = STOPS[case]
    run_dir = work / case
    first = train(venv, work, f"{case}-first", run_dir, *args)
    assert first["stopped_in"] == stopped_in
    assert first["status"] == "interrupted" and first["reason"].startswith("stopped by the test")
    assert first["stopped_by"] == "step function '%s'" % {"train": "train_step", "valid": "val_step"}[stopped_in[0]]
    step = stopped_in[1] + (stopped_in[0] == "train")  # a stop ends after the current batch
    assert first["step"] == step
    # the cadence's files up to the stop (as the uninterrupted run's), then the graceful stop's,
    # written at fit_end
    before = [name for name in STRAIGHT_FILES if int(name.split("-step")[1][:9]) <= step]
    stop_file = f"{len(before) + 1:06d}-epoch0002-step{step:09d}-interrupt.pt"
    assert tiny_files(run_dir) == before + [stop_file]
    saved = torch.load(run_dir / "tiny" / stop_file, weights_only=True)
    assert sorted(saved) == ["format", "model", "plugins", "reason", "run"]
    assert {"optim", "metrics"} <= set(saved["plugins"])  # loop.plugin_states(), keyed by plugin

    resume = "latest" if source == "latest" else str(run_dir / "tiny" / stop_file)
    second = train(venv, work, f"{case}-second", run_dir, "--resume", resume)
    info = second["resumed"]  # the resumed event's ResumeInfo
    assert Path(info.pop("source")).resolve() == (run_dir / "tiny" / stop_file).resolve()
    assert info == {"epoch": 1, "step": step, "batch": step - 11, "stage": "train"}
    assert (second["status"], second["step"]) == ("completed", STEPS)
    assert second["params"] == reference["params"]  # float32 values, exactly
    # the metric history: what each run published, and what metrics.jsonl kept
    assert snapshots(first) + snapshots(second) == snapshots(reference)
    # the stages the stop cut short, innermost first (a validation inside training, then training)
    assert partial(first)[0] == (stopped_in[0], step) and {at for _, at in partial(first)} == {step}
    assert partial(second) == partial(reference) == []
    assert second["snapshots"][-1]["history"] == reference["snapshots"][-1]["history"]
    assert logged(run_dir) == logged(reference_dir)


def test_a_checkpoint_saved_where_a_validation_is_due_resumes_with_it(venv: Venv, work: Path,
                                                                     straight: tuple) -> None:
    """hooks.md, after_batch: a run resumed from a checkpoint saved there "continues with
    the next batch, running first the validation due here". The uninterrupted run saved at
    step 20, whose validation was due; a run resumed from that file (by path, in a folder of
    its own) runs that validation, then the rest, as the uninterrupted run did."""
    reference, reference_dir = straight
    source = reference_dir / "tiny" / STRAIGHT_FILES[4]
    run_dir = work / "from_step_20"
    resumed = train(venv, work, "from-step-20", run_dir, "--resume", source)
    assert resumed["resumed"] == {"source": str(source), "epoch": 1, "step": 20, "batch": 9, "stage": "train"}
    assert (resumed["status"], resumed["step"]) == ("completed", STEPS)
    assert resumed["params"] == reference["params"]
    done = [s for s in snapshots(reference) if s[2] < 20]  # published before that validation
    assert done + snapshots(resumed) == snapshots(reference)
    assert logged(run_dir) == logged(reference_dir)[len(done):]
