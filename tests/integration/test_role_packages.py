"""Two role packages written from the documents alone take the built-ins' places.

``tests/packages/hookfit-sam-optim`` (plugin ``sam_optim``) plays the optimizer role with
Sharpness-Aware Minimization: two forward/backward passes per batch (the step's, then a closure's)
and gradient accumulation. ``tests/packages/hookfit-snapshot-metrics`` (plugin
``snapshot_metrics``) plays the metrics role publishing ``MetricsSnapshot``s and writing no file.
Both were written from ``README.md`` and ``core/hooks.md`` (the roles) without reading the
built-ins' or the core's source. They are installed with a real pip into one temporary virtual
environment (tests/venvs.py), never into the one running the suite, and run by real processes
(``tests/scripts/role_train.py``) with the built-in ``optim`` and ``metrics`` disabled by name and
every other built-in discovered, configured from a ``hookfit.toml``: ``checkpoint`` (``monitor=``
on a metric of the package, an exact resume after ``kill -9``), ``early_stopping``, ``ema``,
``metrics_log`` (whose ``metrics.jsonl`` ``hookfit runs``, ``compare`` and ``show --text`` read),
the console, the dashboard in a real terminal, and ``distributed`` under ``torchrun``.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from venvs import Venv, assert_installed_copy_needs_no_builtin, assert_not_in_running_env, make_venv
from conftest import REPO

pytestmark = pytest.mark.slow

PACKAGES = REPO / "tests" / "packages"
SCRIPT = REPO / "tests" / "scripts" / "role_train.py"
DISTRIBUTIONS = {  # distribution -> (import package, plugin name, class)
    "hookfit-sam-optim": ("hookfit_sam_optim", "sam_optim", "SamOptim"),
    "hookfit-snapshot-metrics": ("hookfit_snapshot_metrics", "snapshot_metrics", "SnapshotMetrics"),
}
REPLACED = {"HOOKFIT_DISABLE_PLUGINS": "optim,metrics"}  # every other built-in stays discovered
TIMEOUT = 180
RHO, ACCUMULATE, EVERY, DECAY = 0.05, 3, 4, 0.5
SCORES = [0.5, 0.875, 0.75, 0.625]  # role_train.py's valid/score per epoch: best (max) at epoch 2
STEPS = 40  # early stopping (patience 2) ends the run after epoch 4 of 6; 10 batches an epoch
WINDOW_ENDS = [2, 5, 8, 9]  # batches after which the optimizer steps: windows of 3, the last partial
CONFIG = f"""
[plugins.sam_optim]
rho = {RHO}
accumulate = {ACCUMULATE}

[plugins.snapshot_metrics]
every_n_batches = {EVERY}
best = {{ "valid/score" = "max", mae = "min" }}

[plugins.checkpoint]
every_n_steps = 4
background = false
monitor = "valid/score"
mode = "max"

[plugins.early_stopping]
monitor = "valid/score"
mode = "max"
patience = 2

[plugins.ema]
decay = {DECAY}
"""


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One venv for the module with both packages installed (not editable, from copies)."""
    env = make_venv(tmp_path_factory.mktemp("roles") / "venv")
    for distribution in DISTRIBUTIONS:
        env.install(PACKAGES / distribution)
    yield env
    for distribution, (module, _, _) in DISTRIBUTIONS.items():
        assert_not_in_running_env(distribution, module)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's folder, with its ``hookfit.toml`` (given by ``HOOKFIT_CONFIG``)."""
    folder = tmp_path_factory.mktemp("work")
    (folder / "hookfit.toml").write_text(CONFIG)
    return folder


def env_for(work: Path, **extra: str) -> dict[str, str]:
    return {"OMP_NUM_THREADS": "1", "HOOKFIT_CONFIG": str(work / "hookfit.toml"), **REPLACED, **extra}


def train(venv: Venv, work: Path, out: str, *args: Any, **extra: str) -> dict[str, Any]:
    venv.run(SCRIPT, work / out, "--rho", RHO, "--accumulate", ACCUMULATE, *args, cwd=work, timeout=TIMEOUT,
             **env_for(work, **extra))
    return load(work / f"{out}.rank0.json")


def load(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def tensor(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


@pytest.fixture(scope="module")
def straight(venv: Venv, work: Path) -> dict[str, Any]:
    """The uninterrupted run, with the hand-written SAM's weights over the same batches."""
    return train(venv, work, "straight", "--run-dir", work / "runs" / "role" / "straight", "--reference")


@pytest.fixture(scope="module")
def resumed(venv: Venv, work: Path) -> dict[str, Any]:
    """A run killed with SIGKILL in the step of global step 14, then resumed with
    ``resume="latest"`` from the checkpoint of step 12 (epoch 2, inside the window [0, 2])."""
    run_dir = work / "runs" / "role" / "resumed"
    marker = work / "killed.blocked"
    process = venv.popen(SCRIPT, work / "killed", "--run-dir", run_dir, "--block-at-step", 14, cwd=work,
                         **env_for(work))
    try:
        deadline = time.monotonic() + TIMEOUT
        while not marker.exists():
            if process.poll() is not None:
                out, err = process.communicate()
                pytest.fail(f"the run ended before its step 14 ({process.returncode}):\n{out}\n{err}")
            assert time.monotonic() < deadline, "the run did not reach its step 14"
            time.sleep(0.05)  # polling for the marker, not waiting a fixed time
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
    assert process.returncode == -signal.SIGKILL
    from hookfit.plugins.checkpoint import read  # the test reads the file; the runs are the venv's

    files = sorted((run_dir / "checkpoints").glob("*.pt"))
    saved = read(files[-1])
    record = train(venv, work, "resumed", "--run-dir", run_dir, "--resume", "latest")
    return {"record": record, "newest": files[-1].name, "saved": saved}


# -- the packages ----------------------------------------------------------------------------------


def test_the_packages_are_installed_in_the_venv_only_and_configured_from_hookfit_toml(
        venv: Venv, work: Path, tmp_path: Path) -> None:
    listing = {row["name"]: row for row in json.loads(
        venv.run("-m", "hookfit.tools.cli", "plugins", "--json", cwd=work, **env_for(work)).stdout)}
    hooks = {
        "sam_optim": ["backward", "configure", "fit_end", "load_state", "save_state", "should_sync_gradients",
                      "stage_end", "stage_start"],
        "snapshot_metrics": ["batch_end", "fit_end", "fit_start", "load_state", "results", "save_state",
                             "stage_end", "stage_start"],
    }
    options = {
        "sam_optim": {"rho": RHO, "accumulate": ACCUMULATE},
        "snapshot_metrics": {"every_n_batches": EVERY, "best": {"valid/score": "max", "mae": "min"}},
    }
    for distribution, (module, name, cls) in DISTRIBUTIONS.items():
        row = listing[name]
        assert (row["distribution"], row["version"], row["source"]) == (distribution, "0.1.0", "entry point")
        assert row["value"] == f"{module}:{cls}" and row["enabled"] and row["error"] is None
        assert row["hooks"] == hooks[name]
        assert {k: v["value"] for k, v in row["options"].items()} == options[name]
        assert {v["from"] for v in row["options"].values()} == {"file"}
        assert venv.has(distribution)
        assert_installed_copy_needs_no_builtin(venv, module, tmp_path)
    assert not listing["optim"]["enabled"] and not listing["metrics"]["enabled"]


@pytest.mark.bad_input
def test_bad_options_and_a_step_without_a_closure_are_refused_naming_the_plugin(venv: Venv, tmp_path: Path) -> None:
    code = r'''
import torch, hookfit
from hookfit_sam_optim import SamOptim
from hookfit_snapshot_metrics import SnapshotMetrics
for build in (lambda: SamOptim(rho=-1), lambda: SamOptim(accumulate=0), lambda: SamOptim(accumulate=True),
              lambda: SnapshotMetrics(every_n_batches=0), lambda: SnapshotMetrics(best={"valid/score": "up"})):
    try:
        build()
    except ValueError as error:
        print("refused:", error)
model = torch.nn.Linear(2, 1)
def step(loop, batch):
    loop.backward(model(batch).sum())
    loop.optimizers.step()
try:
    hookfit.Loop(step, [torch.ones(4, 2)], model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                 run_dir="run", plugins=[SamOptim()]).fit()
except TypeError as error:
    print("failed:", str(error).splitlines()[0])
'''
    lines = venv.run("-c", code, cwd=tmp_path, HOOKFIT_PLUGINS="").stdout.splitlines()
    assert lines == [
        "refused: sam_optim: rho must be a positive finite number, got -1",
        "refused: sam_optim: accumulate must be a positive integer, got 0",
        "refused: sam_optim: accumulate must be a positive integer, got True",
        "refused: snapshot_metrics: every_n_batches must be a positive integer, got 0",
        "refused: snapshot_metrics: best must map metric names to 'min' or 'max', got {'valid/score': 'up'}",
        "failed: sam_optim: loop.optimizers.step(closure) needs a closure that recomputes the loss and calls "
        "loop.backward on it (SAM's second pass); got NoneType",
    ]


# -- hookfit-sam-optim -------------------------------------------------------------------------------


def test_sam_optim_steps_as_a_hand_written_sam(straight: dict[str, Any]) -> None:
    """Two passes a batch, each announced; one real step a window of 3 (the epoch's last batch
    alone in a partial window, stepped at stage_end); the weights those of a plain-torch SAM
    over the same batches; with one process nothing asks should_sync_gradients."""
    assert straight["optimizers_type"] == "hookfit_sam_optim.SamStepper"  # the package's, not optim's
    batches = straight["batches"]
    assert [(b["epoch"], b["batch"]) for b in batches] == [(e, i) for e in range(4) for i in range(10)]
    assert all((b["before"], b["after"], b["sync"]) == (2, 2, []) for b in batches)
    steps = straight["steps"]
    assert [(s["epoch"], s["batch"], s["name"]) for s in steps] == [
        (e, i, "default") for e in range(4) for i in WINDOW_ENDS]
    assert [s["stage"] for s in steps if s["batch"] == 9] == ["train"] * 4  # inside the stage: its stage_end
    torch.testing.assert_close(tensor(straight["params"]), tensor(straight["reference"]), rtol=1e-5, atol=1e-6)
    assert not torch.equal(tensor(straight["per_epoch"][0]["params"]), tensor(straight["per_epoch"][1]["params"]))


def test_ema_averages_after_every_sam_step_and_validates_with_the_average(straight: dict[str, Any]) -> None:
    """EMA reads the package's after_optimizer_step: its average, computed here from the weights
    after every real step, is what every validation ran with and what ``ema.module`` ends with."""
    averages, average = [], None
    for step in straight["steps"]:
        weights = tensor(step["params"])
        average = weights if average is None else DECAY * average + (1 - DECAY) * weights
        averages.append(average)
    assert [(v["epoch"], v["step"]) for v in straight["valid"]] == [(e, 10 * (e + 1)) for e in range(4)]
    for seen in straight["valid"]:
        expected = averages[len(WINDOW_ENDS) * (seen["epoch"] + 1) - 1]
        torch.testing.assert_close(tensor(seen["params"]), expected, rtol=1e-5, atol=1e-7)
        assert not torch.equal(tensor(seen["params"]), tensor(straight["per_epoch"][seen["epoch"]]["params"]))
    torch.testing.assert_close(tensor(straight["ema"]), averages[-1], rtol=1e-5, atol=1e-7)


# -- hookfit-snapshot-metrics ------------------------------------------------------------------------


def test_snapshot_metrics_publishes_what_the_steps_returned(straight: dict[str, Any]) -> None:
    epochs = straight["epochs"]
    assert [(e["stage"], e["epoch"]) for e in epochs] == [(s, e) for e in range(4) for s in ("train", "valid")]
    for snap in epochs:
        train = snap["stage"] == "train"
        assert snap["final"] and snap["max_epochs"] == 6 and snap["step"] == 10 * (snap["epoch"] + 1)
        assert (snap["batches"], snap["total"], snap["samples"]) == ((10, 10, 160) if train else (4, 4, 64))
        assert sorted(snap["values"]) == (["const", "loss", "mae"] if train else ["loss", "mae", "score", "target"])
        for key, (_, _, mean) in snap["values"].items():
            assert mean == pytest.approx(snap["mine"][key], rel=1e-12), (snap["stage"], snap["epoch"], key)
        assert snap["best"] == {"loss": "min", "mae": "min", **({} if train else {"score": "max"})}
        assert snap["lr"] == {"default": 0.1}  # read from sam_optim's loop.optimizers
        mine = [e for e in epochs if e["stage"] == snap["stage"] and e["epoch"] <= snap["epoch"]]
        assert snap["history"] == [{"epoch": e["epoch"], "step": e["step"], **{k: v[2] for k, v in e["values"].items()}}
                                   for e in mine]
        assert snap["state_stage"] == snap["stage"]  # from stage_end
    assert [e["values"]["score"][2] for e in epochs if e["stage"] == "valid"] == SCORES
    updates = straight["updates"]
    assert {(u["stage"], u["batches"]) for u in updates} == {("train", 4), ("train", 8), ("valid", 4)}
    assert len(updates) == 4 * 3 and not any(u["final"] or u["history"] for u in updates)
    # the results event: each metric's last epoch mean and, for those with a direction, the best
    results = straight["results"]
    last = {f"{e['stage']}/{k}": v[2] for e in epochs[-2:] for k, v in e["values"].items()}
    assert results["metrics"] == last
    assert results["best"]["valid/score"] == [0.875, 2]
    assert sorted(results["best"]) == ["train/loss", "train/mae", "valid/loss", "valid/mae", "valid/score"]


def test_early_stopping_and_the_checkpoint_monitor_read_a_metric_of_the_package(
        straight: dict[str, Any], work: Path) -> None:
    from hookfit.plugins.checkpoint import read

    assert (straight["status"], straight["by"], straight["step"]) == ("completed", "early_stopping", STEPS)
    assert "valid/score" in straight["reason"] and "0.875 at epoch 2" in straight["reason"]
    best = Path(straight["results"]["best_checkpoint"])
    assert best.parent == work / "runs" / "role" / "straight" / "checkpoints" and best.exists()
    meta = read(best)["meta"]
    assert (meta["monitor"], meta["metric"]) == ("valid/score", 0.875)
    assert read(best)["loop"]["step"] == 20  # saved at the end of epoch 2
    assert {s["step"] for s in straight["saved"] if s["reason"] == "step"} == {4, 8, 12, 16, 20, 24, 28, 32, 36, 40}


@pytest.mark.fault
def test_a_run_killed_with_sigkill_resumes_bit_for_bit(straight: dict[str, Any], resumed: dict[str, Any]) -> None:
    """The newest checkpoint before the kill holds an open window (2 of its 3 batches done): its
    summed closure gradients travel in sam_optim's state, the open epoch's sums in
    snapshot_metrics'. The resumed run ends as the uninterrupted one did, bit for bit: weights,
    EMA average, every epoch's metrics and history, the early stop."""
    assert resumed["newest"] == "epoch0002-step000000012.pt"
    plugins = resumed["saved"]["plugins"]
    sam = plugins["sam_optim"]
    assert sam["pending"] and all(g is not None and g.abs().sum() > 0 for g in sam["grads"])
    assert sam["optimizer"]["state"]  # momentum after 4 steps
    metrics = plugins["snapshot_metrics"]
    assert metrics["train"]["batches"] == 2 and len(metrics["history"]["valid"]) == 1
    record = resumed["record"]
    assert record["resumed"]["source"].endswith("epoch0002-step000000012.pt")
    assert (record["resumed"]["epoch"], record["resumed"]["batch"], record["resumed"]["step"]) == (1, 2, 12)
    assert [(b["epoch"], b["batch"]) for b in record["batches"]][:2] == [(1, 2), (1, 3)]
    assert (record["status"], record["by"], record["step"]) == ("completed", "early_stopping", STEPS)
    assert torch.equal(tensor(record["params"]), tensor(straight["params"]))
    assert torch.equal(tensor(record["ema"]), tensor(straight["ema"]))
    reference = {(e["stage"], e["epoch"]): e for e in straight["epochs"]}
    assert [(e["stage"], e["epoch"]) for e in record["epochs"]] == list(reference)[2:]
    for snap in record["epochs"]:  # the resumed epoch too: its first two batches came from the checkpoint
        assert snap["values"] == reference[(snap["stage"], snap["epoch"])]["values"]
        assert snap["history"] == reference[(snap["stage"], snap["epoch"])]["history"]
    assert (record["results"]["metrics"], record["results"]["best"]) == (
        straight["results"]["metrics"], straight["results"]["best"])


# -- the commands read the metric log built from the snapshots --------------------------------------


def test_runs_compare_and_show_read_the_snapshots_through_metrics_log(
        venv: Venv, work: Path, straight: dict[str, Any], resumed: dict[str, Any]) -> None:
    runs = work / "runs" / "role"
    rows = [json.loads(line) for line in (runs / "straight" / "metrics.jsonl").read_text().splitlines()]
    epochs = [row for row in rows if row["event"] == "epoch"]
    assert [(row["stage"], row["epoch"]) for row in epochs] == [(s, e) for e in range(1, 5) for s in ("train", "valid")]
    for row, snap in zip(epochs, straight["epochs"]):
        assert {k: row[k] for k in snap["values"]} == {k: v[2] for k, v in snap["values"].items()}
    assert rows[-1]["event"] == "end" and rows[-1]["by"] == "early_stopping"

    def hookfit(*args: Any) -> str:
        return venv.run("-m", "hookfit.tools.cli", *args, cwd=work).stdout

    listed = {row["folder"]: row for row in json.loads(hookfit("runs", "runs", "--json", "--metric", "valid/score"))}
    assert sorted(listed) == ["runs/role/resumed", "runs/role/straight"]
    for row in listed.values():
        assert (row["epochs"], row["steps"], row["mode"]) == (4, STEPS, "max")
        assert row["best"] == {"metric": "valid/score", "value": 0.875, "epoch": 2}  # the direction from the snapshots
    assert listed["runs/role/straight"]["status"] == "completed" and not listed["runs/role/straight"]["resumed_from"]
    assert listed["runs/role/resumed"]["resumed_from"].endswith("epoch0002-step000000012.pt")
    assert listed["runs/role/resumed"]["fits"] == 2

    table = hookfit("compare", "runs/role/straight", "runs/role/resumed", "--metric", "valid/score", "--width", "50",
                    "--height", "6")
    for name in ("straight", "resumed"):
        assert re.search(rf"^\d\s+runs/role/{name}\s+\w+\s+4\s+{STEPS}\s+0\.625\s+0\.875 \(epoch 2\)\s*$",
                         table, re.M), table

    shown = hookfit("show", "--text", "runs/role/straight")
    assert "hookfit: training completed" in shown and "stop asked by early_stopping" in shown
    assert re.search(r"^\s+score\s+-\s+0\.625\s*$", shown, re.M), shown
    mae = [e["values"]["mae"][2] for e in straight["epochs"][-2:]]
    row = re.search(r"^\s+mae\s+(\S+)\s+(\S+)\s*$", shown, re.M)
    assert row and [float(row[1]), float(row[2])] == pytest.approx(mae, rel=1e-3), shown

    # the killed fit left no end line, the resumed one ended completed: the last fit decides
    status = listed["runs/role/resumed"]["status"]
    assert status == "completed"


# -- the dashboard ----------------------------------------------------------------------------------


def test_the_dashboard_shows_the_snapshots_and_a_stop_publishes_the_partial_epoch(venv: Venv, work: Path) -> None:
    """In a real terminal (tmux, tests/terminal.py): the dashboard's table fills from
    snapshot_metrics' snapshots while sam_optim trains; q stops the run, the stage cut short is
    published once more, final, from fit_end, and the text summary shows its numbers."""
    import terminal as tui  # skips this test (only) when tmux is missing

    plugins = "sam_optim,snapshot_metrics,tui,console,interrupter,checkpoint,metrics_log,early_stopping,ema"
    term = tui.Terminal(work)
    out = work / "dash"
    try:
        # 600 training batches of 50 ms: far longer than the test needs
        term.launch(venv.python, SCRIPT, out, "--run-dir", work / "dash-run", "--batches", "600", "--sleep", "0.05",
                    "--epochs", "1",
                    env=f"PYTHONNOUSERSITE=1 OMP_NUM_THREADS=1 HOOKFIT_CONFIG={work / 'hookfit.toml'} "
                        f"HOOKFIT_PLUGINS={plugins}", unset=("PIP_", "PYTHONPATH"))
        row = re.compile(r"^const\s+0\.25\s+0\.25\s+0\.25\s", re.M)
        term.wait_until(lambda: bool(row.search(term.screen())) and bool(re.search(r"^mae\s+\d", term.screen(), re.M)),
                        "snapshot_metrics' values in the dashboard's table")
        screen = term.screen()
        assert term.alternate() and screen.lstrip().startswith(tui.STATUS_LINE)
        term.keys("q")
        code, flags, text = term.wait_exit()
        assert code == 0, text
        term.assert_restored(flags)
        result = load(Path(f"{out}.rank0.json"))
        assert (result["status"], result["reason"]) == ("interrupted", "q pressed in the dashboard")
        assert result["by"] == "tui"
        assert 0 < result["step"] < 600
        assert all(u["batches"] % EVERY == 0 for u in result["updates"])
        [partial] = result["epochs"]  # the stage a stop cut short, published at fit_end
        assert (partial["stage"], partial["batches"], partial["total"], partial["state_stage"]) == (
            "train", result["step"], 600, None)
        assert partial["final"] and partial["values"]["const"] == [0.25, 0.25, 0.25]
        assert "hookfit: training interrupted (q pressed in the dashboard)" in text
        mae = re.search(r"^  mae\s+(\S+) \(partial\)\s+-$", text, re.M)  # the epoch the stop cut short
        assert mae, text
        assert float(mae[1]) == pytest.approx(partial["values"]["mae"][2], rel=1e-3)
    finally:
        term.kill()


# -- torchrun ---------------------------------------------------------------------------------------


def test_under_torchrun_the_first_pass_is_not_all_reduced(venv: Venv, work: Path, tmp_path: Path) -> None:
    """Two processes (gloo), accumulation 2: the step's own pass is answered False and leaves
    each process its own gradients; only the closure's pass of a window's last batch is
    all-reduced (a DDP comm hook counts the buckets: one per optimizer step); the processes step
    with equal gradients, end equal, and where a hand-written two-process SAM ends. The metrics
    are global: the validation's mean target is the whole validation set's."""
    config = tmp_path / "hookfit.toml"
    config.write_text(CONFIG.replace(f"accumulate = {ACCUMULATE}", "accumulate = 2"))
    launch = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", "localhost:0"]
    process = venv.popen(*launch, SCRIPT, tmp_path / "ddp", "--run-dir", tmp_path / "run", "--epochs", "2",
                         "--batches", "20", "--rho", RHO, "--accumulate", "2", "--reference", cwd=tmp_path,
                         **env_for(work, HOOKFIT_CONFIG=str(config)))
    try:
        out, err = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"torchrun did not end in {TIMEOUT} s:\n{out}\n{err}")
    assert process.returncode == 0, f"torchrun exited {process.returncode}\n{out}\n{err}"
    ranks = [load(tmp_path / f"ddp.rank{rank}.json") for rank in (0, 1)]
    for rank, record in enumerate(ranks):
        assert (record["rank"], record["world_size"], record["model"]) == (rank, 2, "DistributedDataParallel")
        assert (record["status"], record["step"]) == ("completed", 20)
        # every n-th batch of the list: rank r's k-th batch is the list's (2k + r)-th
        assert [b["ids"][0] for b in record["batches"]] == [16 * (2 * k + rank) for k in range(10)] * 2
        assert [b["sync"] for b in record["batches"]] == [[False, k % 2 == 1] for k in range(10)] * 2
        assert [(s["epoch"], s["batch"]) for s in record["steps"]] == [(e, k) for e in (0, 1) for k in (1, 3, 5, 7, 9)]
        assert record["allreduces"] == len(record["steps"]) == 10
    zero, one = ranks
    assert all(a["first_grads"] != b["first_grads"] for a, b in zip(zero["batches"], one["batches"]))
    assert [s["grads"] for s in zero["steps"]] == [s["grads"] for s in one["steps"]]
    assert zero["params"] == one["params"] and zero["ema"] == one["ema"]
    torch.testing.assert_close(tensor(zero["params"]), tensor(zero["reference"]), rtol=1e-5, atol=1e-6)
    for record in ranks:  # the same global numbers on both processes
        valid = [e for e in record["epochs"] if e["stage"] == "valid"]
        assert [(e["samples"], e["batches"]) for e in valid] == [(64, 2), (64, 2)]
        assert all(e["values"]["target"][2] == pytest.approx(record["valid_target"], rel=1e-6) for e in valid)
        assert [e["samples"] for e in record["epochs"] if e["stage"] == "train"] == [320, 320]
    assert [e["values"] for e in zero["epochs"]] == [e["values"] for e in one["epochs"]]
    assert math.isclose(zero["results"]["best"]["valid/score"][0], 0.875)
