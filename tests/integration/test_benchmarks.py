"""The benchmarks (benchmarks/*.py) still run and measure what they say: smoke runs at tiny sizes,
no timing asserted."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

PROBE = (
    "import sys; sys.path.insert(0, sys.argv[1]); import overhead, torch;"
    "overhead.measure(overhead.framework_workload(5), ['raw'], 15, 0); print(torch.Tensor.backward.__name__)"
)


def clean_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """The environment of a benchmark's process: no HOOKFIT_ setting, and a temporary folder
    of its own, to check that its runs' folders are gone when it exits (:func:`left`)."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")}
    return {**env, "TMPDIR": str(temp)}, temp


def left(temp: Path) -> list[str]:
    """What a benchmark left in its temporary folder, torch's own compile cache aside."""
    return [p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_")]


@pytest.mark.slow
def test_overhead_framework_workload_runs_each_variant_with_its_plugins(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    env, temp = clean_env(tmp_path)
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "overhead.py"), "--framework-only", "--rounds", "15",
         "--warmup", "1", "--fw-batches", "50", "--json", str(out), "--quiet"],
        check=True, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )
    result = json.loads(out.read_text())
    rows = {r["variant"]: r for r in result["workloads"]["framework"]["results"]}
    assert rows["core"]["plugins"] == [] and rows["default"]["plugins"] == ["console", "interrupter", "metrics", "optim"]
    assert all(len(r["rounds_run_us"]) == 15 for r in rows.values())
    assert left(temp) == []  # every run's folder removed at exit
    # the framework workload's no-op backward is undone after the passes (it patches torch)
    assert "lambda" not in subprocess.run(
        [sys.executable, "-c", PROBE, str(REPO / "benchmarks")],
        check=True, capture_output=True, text=True, timeout=120, env=env,
    ).stdout


@pytest.mark.slow
def test_the_hand_written_floors_train_as_the_raw_loop_does_and_only_on_the_model(tmp_path: Path) -> None:
    """``inline`` and ``floor``, the raw loop with the default stack's per-batch work (or the
    least of it) written into it, make the same steps as the raw loop (their reads change
    nothing), and the framework-only table, which has no such loops, leaves them out."""
    out = tmp_path / "overhead.json"
    env, temp = clean_env(tmp_path)
    probe = ("import sys, torch; sys.path.insert(0, sys.argv[1]); import overhead;"
             "w = overhead.model_workload(6); a, b, c, d = (w.make() for _ in range(4));"
             "a.raw_pass(); b.inline_pass(); d.floor_pass();"
             "same = lambda p, q: all(torch.equal(x, y) for x, y in zip(p.model.parameters(), q.model.parameters()));"
             "print(same(a, b), same(a, d), same(b, c));"
             "overhead.floor_variant(overhead.framework_workload(4))")
    done = subprocess.run([sys.executable, "-c", probe, str(REPO / "benchmarks")], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.stdout.split() == ["True", "True", "False"]
    # built on a workload without the loop (only through code: the command line leaves it out)
    assert done.returncode == 1 and "the floor variant has no framework workload" in done.stderr
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "overhead.py"), "--variants", "inline,floor,core", "--rounds", "15",
         "--warmup", "0", "--batches", "5", "--fw-batches", "20", "--json", str(out), "--quiet"],
        check=True, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    workloads = json.loads(out.read_text())["workloads"]
    assert [r["variant"] for r in workloads["model"]["results"]] == ["raw", "inline", "floor", "core"]
    assert [r["variant"] for r in workloads["framework"]["results"]] == ["raw", "core"]
    assert left(temp) == []


@pytest.mark.slow
def test_syncs_counts_host_reads_per_step_of_the_default_stack(tmp_path: Path) -> None:
    """benchmarks/syncs.py runs and counts what the optim docs promise on the accelerator
    path: none per step, from the first, with torch's SGD as users build it (optim runs its
    fused kernel; without momentum a skipped first step leaves nothing uninitialised), the
    one read at the step with the kernel torch picks (``Optim(fuse=False)``)."""
    out = tmp_path / "syncs.json"
    env, temp = clean_env(tmp_path)
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "syncs.py"), "--variants",
         "hookfit-default,hookfit-fuse-false", "--batches", "8", "--json", str(out)],
        check=True, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )
    rows = json.loads(out.read_text())["variants"]
    assert rows["hookfit-default"]["per_step"] == [0] * 7
    assert rows["hookfit-fuse-false"]["per_step"] == [1] * 7
    assert left(temp) == []


@pytest.mark.slow
def test_the_budget_table_measures_each_plugin_against_its_baseline(tmp_path: Path) -> None:
    """``overhead.py --budget``: a row per built-in plugin, each run with the plugins it names
    (the consumers of metrics with metrics), and a checkpoint's save cost per save."""
    out = tmp_path / "overhead.json"
    env, temp = clean_env(tmp_path)
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "overhead.py"), "--framework-only", "--budget", "--rounds", "15",
         "--warmup", "1", "--fw-batches", "20", "--json", str(out), "--quiet"],
        check=True, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    budget = json.loads(out.read_text())["budget"]
    rows = {r["name"]: r for r in budget["rows"]}
    assert rows["core"]["plugins"] == [] and rows["core"]["baseline"] == "raw"
    assert rows["optim (managed step)"]["plugins"] == ["optim"]
    assert rows["console"]["plugins"] == ["console", "metrics"] and rows["console"]["baseline"] == "core + metrics"
    assert rows["checkpoint (every epoch)"]["plugins"] == ["checkpoint"]
    assert all(r["added_ci"][0] <= r["added_us"] <= r["added_ci"][1] for r in rows.values())
    save = budget["save_us"]  # measured, not judged: a save's cost is under the fit()'s noise on a loaded machine
    assert math.isfinite(save["median"]) and save["ci"][0] <= save["median"] <= save["ci"][1]
    assert "the default stack's parts" in budget["text"]
    assert left(temp) == []  # the checkpoints' folders too


@pytest.mark.slow
def test_the_model_budget_measures_the_default_stack_s_parts_between_real_steps(tmp_path: Path) -> None:
    """``overhead.py --budget-model``: the core and each part of the default stack on the tiny
    model, each against its baseline (a smoke run: the numbers of 5 batches mean nothing)."""
    out = tmp_path / "overhead.json"
    env, temp = clean_env(tmp_path)
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "overhead.py"), "--framework-only", "--budget-model", "--rounds",
         "15", "--warmup", "0", "--batches", "5", "--fw-batches", "20", "--json", str(out), "--quiet"],
        check=True, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    budget = json.loads(out.read_text())["budget_model"]
    rows = {r["name"]: r for r in budget["rows"]}
    assert list(rows) == ["core", "optim (managed step)", "metrics", "console", "interrupter"]
    assert rows["optim (managed step)"]["plugins"] == ["optim"] and rows["metrics"]["baseline"] == "core"
    assert "the tiny model" in budget["text"] and budget["save_us"] is None
    assert left(temp) == []


@pytest.mark.slow
def test_counts_runs_each_pass_once_inside_qsort_and_says_when_valgrind_is_missing(tmp_path: Path) -> None:
    """``counts.py``: its child (what runs under valgrind) makes a variant's counted pass once,
    inside one ``qsort`` comparison, where callgrind collects, with the metrics' publication by
    time off (callgrind's slowdown would make it per-batch work); with no valgrind on the ``PATH``
    the script says so and counts nothing (callgrind itself is too slow for the suite: a run
    takes minutes, see benchmarks/README.md)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")}
    script = str(REPO / "benchmarks" / "counts.py")
    for name in ("raw", "optim", "metrics"):
        child = subprocess.run([sys.executable, script, "--child", name, "--batches", "3"],
                               check=True, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
        untimed = " (metrics by time every 1e+09 s)" if name == "metrics" else ""  # no publication by time
        assert child.stdout == f"counted {name} 3{untimed}\n"
    bare = {**env, "PATH": str(tmp_path)}  # nothing on it, valgrind least of all
    parent = subprocess.run([sys.executable, script, "--variants", "core"], check=True, capture_output=True,
                            text=True, timeout=120, env=bare, cwd=tmp_path)
    assert "valgrind is not installed" in parent.stdout and "per batch" not in parent.stdout


@pytest.mark.slow
def test_gpu_kernels_counts_what_the_default_stack_adds_to_a_raw_step(tmp_path: Path) -> None:
    """benchmarks/gpu_kernels.py on the CPU (``--device cpu``: torch's operators, not kernels)
    shows the CPU path's cost: the two host reads of the loss (optim's check, metrics), and
    nothing else; without a GPU, the default (CUDA) says it needs one."""
    env, temp = clean_env(tmp_path)
    script = str(REPO / "benchmarks" / "gpu_kernels.py")
    done = subprocess.run([sys.executable, script, "--device", "cpu", "--steps", "4"], check=True,
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    lines = [line.split() for line in done.stdout.splitlines()]
    assert lines[0][:4] == ["operators", "a", "step", "over"], done.stdout
    assert sorted((w[0], w[-1]) for w in lines[1:]) == [("+2.00", "aten::_local_scalar_dense"), ("+2.00", "aten::item")]
    assert left(temp) == []
    import torch

    if not torch.cuda.is_available():
        done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
        assert done.returncode == 2 and "needs a CUDA device" in done.stderr


@pytest.mark.slow
def test_checkpoint_training_times_each_variant_and_every_save_is_announced(tmp_path: Path) -> None:
    """``checkpoint_training.py`` at a tiny size: a round of each variant (raw, without, with
    saves), every save of the round announced written (a smoke run: its times mean nothing)."""
    out = tmp_path / "checkpoint_training.json"
    env, temp = clean_env(tmp_path)
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "checkpoint_training.py"), "--layers", "2", "--width", "64",
         "--batch", "4", "--rounds", "1", "--saves", "2", "--every", "2", "--json", str(out), "--quiet"],
        check=True, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )
    result = json.loads(out.read_text())
    assert result["every"] == 2 and result["steps"] == 5 and len(result["write_alone_s"]) == 2
    rounds = result["rounds"]
    assert {v: len(r) for v, r in rounds.items()} == {"raw": 1, "without": 1, "with": 1}
    assert len(rounds["with"][0]["lags"]) == 2 and rounds["without"][0]["lags"] == []
    assert all(r[0]["per_step_s"] > 0 and r[0]["peak_mb"] > 0 for r in rounds.values())
    assert "with / without, per round" in result["text"]
    assert left(temp) == []  # the checkpoints' folders too


ONE_LAYER = 2048 * 2048 + 2048
"""The parameters of checkpoint.py's smallest model, one ``Linear(2048, 2048)`` (any size under 6 M)."""


@pytest.mark.slow
def test_checkpoint_one_file_times_each_save_against_torch_save_and_the_floor(tmp_path: Path) -> None:
    """``checkpoint.py`` at its smallest model: torch.save, the copy floor, the one-file
    background save (the first, then every save after it) and the synchronous save each
    measured, the table printed, its folders gone (a smoke run: its times mean nothing)."""
    out, work = tmp_path / "checkpoint.json", tmp_path / "work"
    work.mkdir()
    env, temp = clean_env(tmp_path)
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "checkpoint.py"), "--sizes", "1", "--rounds", "4", "--saves", "3",
         "--gap", "2", "--dir", str(work), "--json", str(out)],
        check=True, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )
    result = json.loads(out.read_text())
    assert result["gap"] == 2 and len(result["rows"]) == 1
    row = result["rows"][0]
    assert row["params_m"] == ONE_LAYER / 1e6 and row["state_mb"] == ONE_LAYER * 4 / 2**20  # float32
    assert len(row["one_file_ms"]) == 2  # every save after the first
    assert len(row["torch_save_ms"]) == 4 and len(row["floor_ms"]) == 4 and len(row["sync_ms"]) == 2
    times = [row["one_file_first_ms"], *row["one_file_ms"], *row["torch_save_ms"], *row["floor_ms"], *row["sync_ms"]]
    assert all(t > 0 for t in times)
    assert row["worst_over_floor"] == max(row["one_file_ms"]) / statistics.median(row["floor_ms"])
    assert row["peak_rss_mb"] > 0 and row["rss_rise_mb"] >= 0 and 0 <= row["found_busy"] <= 2
    lines = done.stdout.splitlines()
    assert lines[0].startswith("Checkpoint saves blocking the loop (ms; medians; one-file over 2 saves after the first, "
                               "a save every 2 steps"), done.stdout
    assert [line.split()[0] for line in lines[2:-1]] == ["4M"]
    assert lines[-1].startswith("  target: every one-file save after the first <= 1.5x the floor: ")
    assert list(work.iterdir()) == [] and left(temp) == []  # the checkpoints' folders too


@pytest.mark.slow
def test_checkpoint_sharded_times_each_kind_of_save_under_torchrun(tmp_path: Path) -> None:
    """``checkpoint.py --sharded`` at its smallest model: each kind of save (DCP's synchronous
    save, the plugin's synchronous and background sharded saves) timed in a torchrun job of 2
    processes, every save counted, the table printed, its folders gone (a smoke run)."""
    out, work = tmp_path / "checkpoint.json", tmp_path / "work"
    work.mkdir()
    env, temp = clean_env(tmp_path)
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "checkpoint.py"), "--sharded", "--sizes", "1", "--saves", "3",
         "--gap", "2", "--dir", str(work), "--json", str(out)],
        capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["sharded"] is True and result["gap"] == 2 and len(result["rows"]) == 1
    row = result["rows"][0]
    assert row["params_m"] == ONE_LAYER / 1e6
    # the background saves: the first and every one after it; the synchronous kinds: max(2, saves // 2)
    assert {k: len(row[f"{k}_ms"]) for k in ("background", "sync", "dcp")} == {"background": 3, "sync": 2, "dcp": 2}
    for kind in ("background", "sync", "dcp"):
        assert all(t > 0 for t in row[f"{kind}_ms"]), kind
        assert row[f"{kind}_step_ms"] > 0 and row[f"{kind}_peak_rss_mb"] > 0 and row[f"{kind}_rss_rise_mb"] >= 0
    assert row["worst_over_sync"] == max(row["background_ms"][1:]) / statistics.median(row["sync_ms"])
    assert 0 <= row["found_busy"] <= 2
    lines = done.stdout.splitlines()
    assert lines[0].startswith("Sharded checkpoint saves blocking the loop, 2 processes, FSDP2, gloo"), done.stdout
    assert "background over 2 saves after the first, a save every 2 steps" in lines[0]
    assert [line.split()[0] for line in lines[2:-1]] == ["4M"]
    assert lines[-1].startswith("  target: every background sharded save after the first <= 0.25x the synchronous one: ")
    assert list(work.iterdir()) == []
    assert left(temp) == []  # torchrun's logs too: the suite gives torchrun a folder for them (tests/conftest.py)


@pytest.mark.slow
def test_opcodes_counts_hookfit_s_own_python_a_batch_the_same_every_run(tmp_path: Path) -> None:
    """``opcodes.py``: the core alone runs one function of hookfit's a batch (the stage's loop,
    which calls none of hookfit's), the default stack the plugins' handlers once a batch each;
    the count is the same in a second run (``--against`` finds no function that differs), and a
    variant that runs no hookfit Loop is refused by name."""
    env, temp = clean_env(tmp_path)
    script = str(REPO / "benchmarks" / "opcodes.py")

    def count(variant: str, *more: str) -> tuple[dict[str, Any], str]:
        out = tmp_path / f"{variant}.json"
        done = subprocess.run([sys.executable, script, "--variant", variant, "--batches", "3,7", "--json", str(out),
                               *more], check=True, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
        assert done.stderr == ""  # no warning: a metrics plugin given to Loop is made untimed too
        return json.loads(out.read_text()), done.stdout

    core, text = count("core")
    assert [(r["function"], r["calls"]) for r in core["functions"]] == [("run_stage", 0)]
    assert core["opcodes"] == core["functions"][0]["opcodes"] > 0 and core["hookfit"] in text
    default, _ = count("default")
    calls = {r["function"]: r["calls"] for r in default["functions"]}
    assert calls["Metrics.batch_end"] == calls["Optim.backward"] == calls["ManagedOptimizer.step"] == 1
    assert default["opcodes"] > core["opcodes"] and default["calls"] == sum(calls.values())
    assert all(r["file"].startswith(("core/", "plugins/")) for r in default["functions"])
    again, text = count("default", "--against", str(tmp_path / "default.json"))
    assert again == default and "no function differs" in text
    _, text = count("device-path")  # its Metrics(defer=True), given to Loop, reads no config file
    refused = subprocess.run([sys.executable, script, "--variant", "raw"], capture_output=True, text=True,
                             timeout=120, env=env, cwd=tmp_path)
    assert refused.returncode == 2 and "invalid choice: 'raw'" in refused.stderr
    assert left(temp) == []
