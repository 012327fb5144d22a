"""A distributed run resumed after ``kill -9`` mid-epoch continues every process's own state:
each process's random stream (its dropout masks, with a seed of its own) and each
process's partial sums of the epoch's metrics, so the parameters AND the metric history equal
the uninterrupted run's, for DDP and FSDP. A failed run's checkpoint says how many processes wrote
it, so that a resume on another number of them is told, and one on the same is not."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from conftest import REPO
from hookfit.plugins.checkpoint import Checkpoint
from test_distributed import _env, _not_launched, _torchrun  # noqa: F401 - _not_launched: autouse

pytestmark = [pytest.mark.slow, pytest.mark.fault]

SCRIPT = REPO / "tests" / "scripts" / "rank_state_run.py"
PLUGINS = "interrupter,optim,metrics,distributed,checkpoint"


def job(folder: Path, *args: str, **env: str) -> tuple[int, str]:
    folder.mkdir(parents=True, exist_ok=True)
    launch = ["--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    done = subprocess.run([*_torchrun(), *launch, str(SCRIPT), "out", *args], cwd=folder, capture_output=True,
                          text=True, timeout=300, env=_env(HOOKFIT_PLUGINS=PLUGINS, **env))
    return done.returncode, done.stdout + done.stderr


def dumps(folder: Path) -> list[dict[str, Any]]:
    return [json.loads((folder / f"out.rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_killed_run_resumes_every_processs_own_random_stream_and_metric_sums(tmp_path: Path,
                                                                                strategy: str) -> None:
    code, out = job(tmp_path / "whole", strategy)
    assert code == 0, out
    whole = dumps(tmp_path / "whole")
    # 6 batches an epoch on each process, a checkpoint every 3 steps: killed at a random step
    # after the first checkpoint (the moment is in the assertions' messages), it resumes from the
    # checkpoint before it, mid-epoch or at an epoch's end
    kill = random.randint(4, 11)
    code, out = job(tmp_path / "cut", strategy, "--kill-at", str(kill))
    assert code != 0 and not (tmp_path / "cut" / "out.rank0.json").exists(), (kill, out)
    code, out = job(tmp_path / "cut", strategy, HOOKFIT_RESUME="latest")
    assert code == 0, (kill, out)
    resumed = dumps(tmp_path / "cut")
    for rank in (0, 1):
        assert (resumed[rank]["status"], resumed[rank]["step"]) == ("completed", 12), kill
        assert resumed[rank]["params"] == whole[rank]["params"], f"killed at step {kill}, rank {rank}: parameters"
        # the resumed run publishes the epochs it ends: their losses, over both processes'
        # batches of the whole epoch (partial sums from before the kill included)
        published = len(resumed[rank]["losses"])
        assert published in (1, 2) and resumed[rank]["losses"] == whole[rank]["losses"][-published:], (kill, rank)


def test_a_failed_runs_checkpoint_says_how_many_processes_wrote_it(tmp_path: Path) -> None:
    """A 2-process run that fails writes its ``failed-*.pt`` after the process group is gone (no ``ranks``
    entry of every process's random states): resumed by its path in 2 processes, one warning on the main
    process says that rank 1 takes the main process's random states, none that the number of processes
    changed; resumed in one, one warning says it was written by 2."""
    script = REPO / "tests" / "scripts" / "failed_ranks_run.py"
    launch = ["--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]

    def run(*args: str) -> list[dict[str, Any]]:
        done = subprocess.run([*_torchrun(), *launch, str(script), *args], cwd=tmp_path, capture_output=True,
                              text=True, timeout=300, env=_env(HOOKFIT_PLUGINS=""))
        assert done.returncode == 0, done.stdout + done.stderr
        return [json.loads((tmp_path / f"{args[0]}.rank{rank}.json").read_text()) for rank in (0, 1)]

    assert [(r["status"], r["world_size"]) for r in run("failed")] == [("failed", 2)] * 2
    failed = next((tmp_path / "run" / "checkpoints").glob("failed-*.pt"))
    again = run("again", str(failed))  # (the main process's random states alone: rank 1 takes them)
    assert [(r["status"], r["warned"]) for r in again] == [("completed", [
        f"checkpoint: {failed} holds the random states of 1 process(es) (a checkpoint of 2 processes written after "
        f"the process group was gone, as a failed run's is, holds the main process's alone) and this run has 2: "
        f"each process resumes its own where it has one, the others the main process's (random draws of those "
        f"processes differ from the run it continues)"]), ("completed", [])]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = hookfit.Loop(lambda loop, batch: None, [(torch.zeros(2, 1), torch.zeros(2, 1))] * 4,
                             model=torch.nn.Linear(1, 1), max_epochs=3, resume=failed, run_dir=tmp_path / "one",
                             plugins=[Checkpoint(background=False)]).fit()
    said = [str(w.message) for w in caught if "process(es)" in str(w.message)]
    assert state.status == "completed" and len(said) == 1, said
    assert said[0].startswith(f"checkpoint: {failed} was written by 2 process(es) and is resumed in 1: "
                              f"from here on the data is read by one process instead of 2"), said[0]


@pytest.mark.parametrize("data", ["batches", "list"])
def test_a_run_of_one_process_resumed_on_two_says_the_second_takes_the_main_processs_random_states(
        tmp_path: Path, data: str) -> None:
    """A plain ``python`` run's checkpoint holds one process's random states (no ``ranks`` entry), and
    ``meta["world_size"]`` 1: resumed under ``torchrun --nproc-per-node 2`` rank 1 takes rank 0's, and the main
    process says so once. Over ``Batches`` of the same global batch (the run goes on with the same batches) that
    is the one warning; over a list of batches it is said in the warning that the data is shared anew."""
    script = REPO / "tests" / "scripts" / "ranks_resume_run.py"
    alone = subprocess.run([sys.executable, str(script), "one", data], cwd=tmp_path, capture_output=True,
                           text=True, timeout=120, env=_env(HOOKFIT_PLUGINS=""))
    assert alone.returncode == 0, alone.stdout + alone.stderr
    launch = ["--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    done = subprocess.run([*_torchrun(), *launch, str(script), "two", data, "latest"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=_env(HOOKFIT_PLUGINS=""))
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = [json.loads((tmp_path / f"two.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [(r["status"], r["world_size"], r["epoch"]) for r in ranks] == [("completed", 2, 1)] * 2  # (epochs counted from 0: the second)
    path = Path("run", "checkpoints", "epoch0001-step000000004.pt")  # (as resume="latest" names it)
    assert ranks[1]["warned"] == [] and len(ranks[0]["warned"]) == 1, ranks
    said = ranks[0]["warned"][0]
    if data == "batches":
        assert said == (f"checkpoint: {path} holds the random states of 1 process(es) and this run has 2: each "
                        f"process resumes its own where it has one, the others the main process's (random draws "
                        f"of those processes differ from the run it continues)"), said
    else:
        assert said.startswith(f"checkpoint: {path} was written by 1 process(es) and is resumed in 2: "), said
        assert "(max_steps, a scheduler's steps, every_n_steps) count other batches, and the processes beyond 1 " \
               "take the main process's random states: the run goes on as another run would" in said, said


def test_an_evaluation_of_one_processs_checkpoint_on_two_says_nothing_of_random_states(tmp_path: Path) -> None:
    """``Loop.validate(resume="latest")`` under ``torchrun --nproc-per-node 2`` of a plain run's checkpoint
    continues no run: no process warns that random draws differ from the run it continues."""
    script = REPO / "tests" / "scripts" / "ranks_resume_run.py"
    alone = subprocess.run([sys.executable, str(script), "one", "list"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=120, env=_env(HOOKFIT_PLUGINS=""))
    assert alone.returncode == 0, alone.stdout + alone.stderr
    launch = ["--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    done = subprocess.run([*_torchrun(), *launch, str(script), "two", "list", "latest", "validate"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=_env(HOOKFIT_PLUGINS=""))
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = [json.loads((tmp_path / f"two.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [(r["status"], r["world_size"], r["warned"]) for r in ranks] == [("completed", 2, [])] * 2, ranks
