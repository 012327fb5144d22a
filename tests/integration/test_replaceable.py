"""Built-in plugins are replaceable: two packages written only against core/hooks.md take over.

``tests/packages/hookfit-plain-optim`` (plugin ``plain_optim``) replaces the built-in ``optim``,
``tests/packages/hookfit-mean-metrics`` (plugin ``mean_metrics``) the built-in ``metrics``. Both
are installed with a real pip into a temporary virtual environment (tests/venvs.py), never into
the one running the suite, and exercised end to end by real processes running
``tests/scripts/replaced_*.py`` with the venv's interpreter, together with the built-in plugins
that consume what they provide: ``distributed`` (``should_sync_gradients``), ``metrics``
(learning rates from ``loop.optimizers``), ``checkpoint`` (``save_state``/``load_state``, and
``epoch_metrics`` for ``monitor``), ``console`` and ``tui`` (the snapshots).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from venvs import Venv, assert_installed_copy_needs_no_builtin, assert_not_in_running_env, make_venv
from conftest import REPO

pytestmark = pytest.mark.slow

ROOT = REPO
PACKAGES = ROOT / "tests" / "packages"
OPTIM_SCRIPT = ROOT / "tests" / "scripts" / "replaced_optim.py"
METRICS_SCRIPT = ROOT / "tests" / "scripts" / "replaced_metrics.py"
DISTRIBUTIONS = {  # distribution -> (import package, plugin name, class)
    "hookfit-plain-optim": ("hookfit_plain_optim", "plain_optim", "PlainOptim"),
    "hookfit-mean-metrics": ("hookfit_mean_metrics", "mean_metrics", "MeanMetrics"),
}
TIMEOUT = 180


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One venv for the module with both packages installed (not editable, from copies)."""
    env = make_venv(tmp_path_factory.mktemp("replaceable") / "venv")
    for distribution in DISTRIBUTIONS:
        env.install(PACKAGES / distribution)
    yield env
    for distribution, (module, _, _) in DISTRIBUTIONS.items():
        assert_not_in_running_env(distribution, module)


def run_script(venv: Venv, script: Path, *args: Any, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return venv.run(script, *args, cwd=cwd, timeout=TIMEOUT, OMP_NUM_THREADS="1", **env)


def load(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


# -- the packages -------------------------------------------------------------------------------


def test_the_packages_are_installed_in_the_venv_only_and_discovered_there(venv: Venv, tmp_path: Path) -> None:
    listing = {row["name"]: row for row in json.loads(venv.run("-m", "hookfit.tools.cli", "plugins", "--json").stdout)}
    hooks = {
        "plain_optim": ["backward", "configure", "fit_end", "load_state", "save_state", "should_sync_gradients",
                        "stage_end", "stage_start"],
        "mean_metrics": ["batch_end", "fit_start", "load_state", "save_state", "stage_end", "stage_start",
                         "step_output"],
    }
    for distribution, (module, name, cls) in DISTRIBUTIONS.items():
        row = listing[name]
        assert (row["distribution"], row["version"], row["source"]) == (distribution, "0.1.0", "entry point")
        assert row["value"] == f"{module}:{cls}" and row["enabled"] and row["error"] is None
        assert row["hooks"] == hooks[name]
        assert venv.has(distribution)
        assert_not_in_running_env(distribution, module)
        assert_installed_copy_needs_no_builtin(venv, module, tmp_path)  # the installed copy


# -- hookfit-plain-optim -------------------------------------------------------------------------


def torchrun(venv: Venv, cwd: Path, *args: Any, **env: str) -> None:
    """``torchrun --nproc-per-node 2`` with the venv's interpreter; killed, children included,
    if it runs past the timeout."""
    launch = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", "localhost:0"]
    process = venv.popen(*launch, *args, cwd=cwd, OMP_NUM_THREADS="1", **env)
    try:
        out, err = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"torchrun did not end in {TIMEOUT} s:\n{out}\n{err}")
    assert process.returncode == 0, f"torchrun exited {process.returncode}\n{out}\n{err}"


def windows(record: dict[str, Any]) -> list[tuple[int, int, bool, int]]:
    """(epoch, batch, should_sync_gradients answer, optimizer steps after it) per training batch."""
    return [tuple(entry) for entry in record["batches"]]


def expected_windows(epochs: int, batches: int, accumulate: int, first_epoch: int = 0) -> list[tuple]:
    """Steps on a window's last batch and on the stage's last batch (a partial window)."""
    out = []
    for epoch in range(first_epoch, epochs):
        for b in range(batches):
            closes = (b + 1) % accumulate == 0 or b == batches - 1
            out.append((epoch, b, closes, 1 if closes else 0))
    return out


def test_ddp_all_reduces_once_per_accumulation_window(venv: Venv, tmp_path: Path) -> None:
    """2 processes with batch 32 and accumulation 2 over 960 samples: 15 batches per epoch and
    rank, so 7 whole windows and a partial one per epoch; DDP must all-reduce once per window
    (the distributed plugin asks plain_optim's should_sync_gradients before every batch)."""
    common = ("--samples", "960", "--epochs", "2", "--shuffle")
    torchrun(venv, tmp_path, OPTIM_SCRIPT, tmp_path / "ddp", *common, "--batch-size", "32", "--count-allreduce",
             HOOKFIT_PLUGINS="distributed,plain_optim,metrics", PLAIN_OPTIM_ACCUMULATE="2")
    run_script(venv, OPTIM_SCRIPT, tmp_path / "one", *common, "--batch-size", "64", cwd=tmp_path,
               HOOKFIT_PLUGINS="distributed,plain_optim,metrics", PLAIN_OPTIM_ACCUMULATE="2")
    ranks = [load(tmp_path / f"ddp.rank{r}.json") for r in (0, 1)]
    single = load(tmp_path / "one.rank0.json")
    expected = expected_windows(epochs=2, batches=15, accumulate=2)
    for rank, record in enumerate(ranks):
        assert (record["rank"], record["world_size"], record["model"]) == (rank, 2, "DistributedDataParallel")
        assert record["optimizers_type"] == "hookfit_plain_optim.Steppers"  # the package's, not optim's
        assert (record["status"], record["step"]) == ("completed", 30)
        assert windows(record) == expected  # answered exactly: True where it then stepped
        assert record["allreduces"] == 2 * 8 == sum(sync for _, _, sync, _ in expected)
    assert (single["world_size"], single["model"], single["allreduces"]) == (1, "Sequential", 0)
    assert windows(single) == expected
    # identical on both ranks, and the one-process run with the doubled batch over the same samples
    assert len(ranks[0]["epochs"]) == len(single["epochs"]) == 2
    for r0, r1, one in zip(ranks[0]["epochs"], ranks[1]["epochs"], single["epochs"]):
        assert r0["params"] == r1["params"], f"the ranks differ after epoch {r0['epoch']}"
        torch.testing.assert_close(torch.tensor(r0["params"]), torch.tensor(one["params"]), rtol=1e-5, atol=1e-6)


def test_learning_rates_reach_the_builtin_metrics(venv: Venv, tmp_path: Path) -> None:
    """The built-in metrics plugin reads ``param_groups[0]["lr"]`` from what plain_optim put in
    ``loop.optimizers``; a StepLR halves the rate every epoch, so a stale copy would show.
    Accumulation 4 over 15 batches: the last window of every epoch is stepped at stage_end."""
    run = tmp_path / "run"
    run_script(venv, OPTIM_SCRIPT, tmp_path / "out", "--samples", "960", "--batch-size", "64", "--epochs", "3",
               "--gamma", "0.5", "--run-dir", run, cwd=tmp_path,
               HOOKFIT_PLUGINS="plain_optim,metrics,metrics_log", PLAIN_OPTIM_ACCUMULATE="4")
    record = load(tmp_path / "out.rank0.json")
    assert record["optimizers_mapping"] and record["optimizer_names"] == ["default"]
    assert record["status"] == "completed"
    assert record["lr"] == [0.05, 0.025, 0.0125]
    assert windows(record) == expected_windows(epochs=3, batches=15, accumulate=4)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    epochs = [row for row in rows if row["event"] == "epoch"]
    assert [(row["stage"], row["epoch"]) for row in epochs] == [  # epochs counted from 1 in the log
        (stage, epoch + 1) for epoch in range(3) for stage in ("train", "valid")]
    for row in epochs:
        assert sorted(key for key in row if key.startswith("lr_")) == ["lr_default"]
        assert row["lr_default"] == record["lr"][row["epoch"] - 1], row


def test_checkpoint_resume_is_exact(venv: Venv, tmp_path: Path) -> None:
    """SGD with momentum and accumulation 2 on shuffled data, with the built-in checkpoint
    plugin: 2 epochs, then resumed to 3 epochs but stopped inside an accumulation window, then
    resumed again to the end; the parameters equal, bit for bit, an uninterrupted run's."""
    from hookfit.plugins.checkpoint import read  # the test reads the files; the runs are the venv's

    common = ("--samples", "960", "--batch-size", "64", "--shuffle")
    env = {"HOOKFIT_PLUGINS": "plain_optim,checkpoint,metrics", "PLAIN_OPTIM_ACCUMULATE": "2"}
    resumed, straight = tmp_path / "resumed", tmp_path / "straight"

    def train(out: str, run_dir: Path, *args: str, **extra: str) -> dict[str, Any]:
        run_script(venv, OPTIM_SCRIPT, tmp_path / out, *common, "--run-dir", run_dir, *args, cwd=tmp_path,
                   **env, **extra)
        return load(tmp_path / f"{out}.rank0.json")

    def newest() -> dict[str, Any]:
        files = sorted((resumed / "checkpoints").glob("epoch*.pt"))
        return read(files[-1])

    first = train("first", resumed, "--epochs", "2")
    assert (first["status"], first["step"]) == ("completed", 30)
    saved = newest()
    assert saved["loop"]["epoch"] == 2
    state = saved["plugins"]["plain_optim"]  # saved under the plugin's name, with no help from it
    assert state["pending"] == [] and state["grads"] is None
    momentum = state["optimizers"]["default"]["state"]
    assert momentum and all(entry["momentum_buffer"].abs().sum() > 0 for entry in momentum.values())

    # stopped after global step 36: epoch 2, batch 6, the first batch of the window [6, 7]
    second = train("second", resumed, "--epochs", "3", "--stop-at-step", "36", HOOKFIT_RESUME="latest")
    assert (second["status"], second["reason"], second["step"]) == ("interrupted", "stopped by the test", 37)
    assert windows(second) == expected_windows(epochs=3, batches=15, accumulate=2, first_epoch=2)[:7]
    saved = newest()
    assert saved["loop"]["resume_batch"] == 7 and saved["meta"]["reason"] == "interrupt"
    state = saved["plugins"]["plain_optim"]
    assert state["pending"] == ["default"]  # the open window's gradients travel with it
    assert all(grad is not None and grad.abs().sum() > 0 for grad in state["grads"]["default"])

    third = train("third", resumed, "--epochs", "3", HOOKFIT_RESUME="latest")
    assert (third["status"], third["step"]) == ("completed", 45)
    assert windows(third) == expected_windows(epochs=3, batches=15, accumulate=2, first_epoch=2)[7:]

    whole = train("whole", straight, "--epochs", "3")
    assert (whole["status"], whole["step"]) == ("completed", 45)
    assert torch.equal(torch.tensor(third["params"]), torch.tensor(whole["params"]))
    for done, reference in zip(first["epochs"] + third["epochs"], whole["epochs"]):
        assert done["epoch"] == reference["epoch"]
        assert torch.equal(torch.tensor(done["params"]), torch.tensor(reference["params"])), done["epoch"]


# -- hookfit-mean-metrics ------------------------------------------------------------------------

CONSOLE_DONE = re.compile(r"^hookfit (train|valid) epoch=(\d+)/(\d+) done batches=(\d+) (.*)$")
CONSOLE_RESULT = re.compile(r"^hookfit result stage=(\w+) metric=(\w+) last=(\S+) "
                            r"(?:best=(\S+) best_epoch=(\d+)|min=(\S+) min_epoch=(\d+) max=(\S+) max_epoch=(\d+))$")
SCALARS = ["const", "half", "loss", "mae"]  # what the steps return as scalars, sorted


def check_published(result: dict[str, Any], epochs: int, every: int) -> dict[tuple[str, int], dict[str, Any]]:
    """What mean_metrics published matches the script's own batch-size-weighted account;
    returns the final snapshots by (stage, epoch)."""
    sizes = {"train": (7, 100), "valid": (3, 40)}  # batches and samples per stage
    final = {(e["stage"], e["epoch"]): e for e in result["epochs"]}
    assert [(e["stage"], e["epoch"]) for e in result["epochs"]] == [
        (stage, epoch) for epoch in range(epochs) for stage in ("train", "valid")]
    for (stage, epoch), snap in final.items():
        assert snap["final"] and (snap["batches"], snap["samples"]) == sizes[stage]
        assert (snap["total"], snap["max_epochs"], snap["step"]) == (sizes[stage][0], epochs, 7 * (epoch + 1))
        assert sorted(snap["values"]) == SCALARS  # the vector and the string were left out
        for key, (last, running, mean) in snap["values"].items():
            assert mean == pytest.approx(snap["mine"][key], rel=1e-12), (stage, epoch, key)
        assert snap["lr"] == {"default": 0.05}  # from the built-in optim's loop.optimizers
        history = [final[(stage, e)] for e in range(epoch + 1)]
        assert snap["history"] == [{"epoch": h["epoch"], "step": h["step"], **{k: v[2] for k, v in h["values"].items()}}
                                   for h in history]
    assert result["updates"], "no metrics_update"
    for update in result["updates"]:
        assert not update["final"] and update["history"] == [] and update["batches"] % every == 0
        for key, (_, _, mean) in update["values"].items():
            assert mean == pytest.approx(update["mine"][key], rel=1e-12)
    return final


def number(text: str) -> float:
    return math.nan if text == "nan" else float(text)


def test_the_console_prints_what_mean_metrics_publishes(venv: Venv, tmp_path: Path) -> None:
    done = run_script(venv, METRICS_SCRIPT, tmp_path / "out.json", "--epochs", "3", "--valid-losses", "0.9,0.4,0.7",
                      "--best", '{"loss": "min"}', cwd=tmp_path, HOOKFIT_PLUGINS="mean_metrics,optim", MEAN_METRICS_EVERY="3")
    result = load(tmp_path / "out.json")
    assert result["status"] == "completed"
    final = check_published(result, epochs=3, every=3)
    lines = done.stdout.splitlines()
    start = re.match(r"^hookfit start epochs=3 batches_per_epoch=7 plugins=(\S+)$", lines[0])
    assert start and sorted(start[1].split(",")) == ["console", "mean_metrics", "optim", "record"], lines[0]
    assert all(line.startswith("hookfit ") for line in lines), done.stdout
    # epoch summaries (throttled by the console; the last epoch's always printed)
    summaries = [CONSOLE_DONE.match(line) for line in lines if CONSOLE_DONE.match(line)]
    assert {(m[1], int(m[2])) for m in summaries} >= {("train", 3), ("valid", 3)}, done.stdout
    for m in summaries:
        snap = final[(m[1], int(m[2]) - 1)]
        assert int(m[4]) == snap["batches"]
        fields = dict(field.split("=", 1) for field in m[5].split())
        assert sorted(set(fields) - {"time", "samples_per_s"}) == SCALARS
        for key in SCALARS:
            assert number(fields[key]) == pytest.approx(snap["values"][key][2], rel=1e-3), (m[0], key)
    # end results: every metric of both stages, last and best (loss: configured "min") or the
    # range (the others, whose direction nobody configured) over the published epochs
    results = {(m[1], m[2]): m for m in map(CONSOLE_RESULT.match, lines) if m}
    assert sorted(results) == [(stage, key) for stage in ("train", "valid") for key in SCALARS]
    for (stage, key), m in results.items():
        means = [final[(stage, epoch)]["values"][key][2] for epoch in range(3)]
        assert number(m[3]) == pytest.approx(means[-1], rel=1e-3)
        if key == "loss":
            best = min(means)
            assert number(m[4]) == pytest.approx(best, rel=1e-3) and int(m[5]) == means.index(best) + 1
        else:
            low, high = min(means), max(means)
            assert number(m[6]) == pytest.approx(low, rel=1e-3) and int(m[7]) == means.index(low) + 1
            assert number(m[8]) == pytest.approx(high, rel=1e-3) and int(m[9]) == means.index(high) + 1
    valid_loss = results[("valid", "loss")]
    assert int(valid_loss[5]) == 2  # the scripted valid losses 0.9, 0.4, 0.7 (+ 0.01 per batch)
    assert number(valid_loss[4]) == pytest.approx(final[("valid", 1)]["values"]["loss"][2], rel=1e-3)


def test_checkpoint_monitor_keeps_the_best_epoch_by_mean_metrics(venv: Venv, tmp_path: Path) -> None:
    """Checkpoint(monitor="valid/loss", keep_last=1) over 4 epochs whose scripted valid losses
    are 0.9, 0.4, 0.7, 0.6: the last checkpoint and the second epoch's are kept."""
    from hookfit.plugins.checkpoint import read

    run = tmp_path / "run"
    run_script(venv, METRICS_SCRIPT, tmp_path / "out.json", "--epochs", "4", "--valid-losses", "0.9,0.4,0.7,0.6",
               "--checkpoint-dir", run, cwd=tmp_path, HOOKFIT_PLUGINS="mean_metrics,optim", MEAN_METRICS_EVERY="3")
    result = load(tmp_path / "out.json")
    assert result["status"] == "completed"
    final = check_published(result, epochs=4, every=3)
    valid = [final[("valid", epoch)]["values"]["loss"][2] for epoch in range(4)]
    assert min(valid) == valid[1] and valid != sorted(valid, reverse=True)
    files = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert files == ["epoch0002-step000000014.pt", "epoch0004-step000000028.pt"]
    for name, epoch in zip(files, (1, 3)):
        meta = read(run / "checkpoints" / name)["meta"]
        assert (meta["monitor"], meta["reason"]) == ("valid/loss", "epoch")
        assert meta["metric"] == valid[epoch]  # exactly the value mean_metrics published
    plugins = read(run / "checkpoints" / files[-1])["plugins"]
    assert [entry["loss"] for entry in plugins["mean_metrics"]["history"]["valid"]] == valid


def test_the_dashboard_shows_what_mean_metrics_publishes(venv: Venv, tmp_path: Path) -> None:
    """In a real terminal (tmux, as tests/plugins/tui/test_tui_terminal.py): the dashboard's table fills
    from mean_metrics' snapshots; q stops the run and the terminal is restored."""
    import terminal as tui  # skips this test (only) when tmux is missing

    term = tui.Terminal(tmp_path)
    try:
        # 600 training batches of 50 ms: far longer than the test needs
        term.launch(venv.python, METRICS_SCRIPT, term.result, "--train-samples", "9600", "--sleep", "0.05",
                    env="PYTHONNOUSERSITE=1 OMP_NUM_THREADS=1 MEAN_METRICS_EVERY=5 HOOKFIT_PLUGINS=mean_metrics,tui,optim",
                    unset=("PIP_", "PYTHONPATH"))
        table = re.compile(r"^half\s+0\.5\s+0\.5\s+0\.5\s", re.M)
        term.wait_until(lambda: bool(re.search(r"^mae\s+\d", term.screen(), re.M)) and bool(table.search(term.screen())),
                        "mean_metrics' values in the dashboard's table")
        screen = term.screen()
        assert term.alternate() and screen.lstrip().startswith(tui.STATUS_LINE)
        assert re.search(r"^metric\s+train last\s+running\s+epoch\s+valid", screen, re.M)
        assert re.search(r"^const\s+3\s+3\s+3\s", screen, re.M)
        assert not re.search(r"^(vector|name)\s", screen, re.M)  # not scalars: not published
        term.keys("q")
        code, flags, text = term.wait_exit()
        assert code == 0
        result = term.outcome()
        assert (result["outcome"], result["status"]) == ("returned", "interrupted")
        assert result["reason"] == "q pressed in the dashboard" and 0 < result["step"] < 600
        term.assert_restored(flags)
        assert "hookfit: training interrupted (q pressed in the dashboard)" in text
        assert result["updates"] and result["epochs"] == []  # stopped inside the first epoch
        assert {u["stage"] for u in result["updates"]} == {"train"}
        assert all(u["batches"] % 5 == 0 for u in result["updates"])
        # the summary printed after the dashboard closed: the epoch mean of one of the last
        # snapshots published (one may still have been on its way to the dashboard's thread)
        row = re.search(r"^  mae\s+(\S+)\s+-$", text, re.M)
        assert row, text
        assert any(float(row[1]) == pytest.approx(u["values"]["mae"][2], rel=1e-3) for u in result["updates"][-2:])
    finally:
        term.kill()
