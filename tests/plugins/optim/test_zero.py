"""An optimizer that shards its state over the processes (torch's ``ZeroRedundancyOptimizer``) under
a real ``torchrun`` (two processes, gloo, CPU): optim trains as a hand-written DDP and ZeRO loop does,
its checkpoints hold the state gathered whole, and a run stopped and resumed from one ends with the
parameters of the uninterrupted run, bit for bit, on every process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow

SCRIPT = REPO / "tests" / "scripts" / "zero_run.py"
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "GROUP_RANK", "TORCHELASTIC_RUN_ID", "HOOKFIT_DISABLE_PLUGINS", "HOOKFIT_RESUME")


def job(folder: Path, *args: str, **env: str) -> list[dict[str, Any]]:
    """``zero_run.py OUT ARGS`` under ``torchrun --nproc-per-node 2`` in ``folder``: each rank's dump."""
    folder.mkdir(parents=True, exist_ok=True)
    script = Path(sys.executable).with_name("torchrun")
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]
    launch = ["--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    environment = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    environment.update(OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1",
                       HOOKFIT_PLUGINS="interrupter,optim,distributed,checkpoint", **env)
    done = subprocess.run([*launcher, *launch, str(SCRIPT), "out", *args], cwd=folder, capture_output=True,
                          text=True, timeout=300, env=environment)
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads((folder / f"out.rank{rank}.json").read_text()) for rank in (0, 1)]


def test_zero_checkpoints_and_resumes_every_processs_partition_exactly(tmp_path: Path) -> None:
    whole = job(tmp_path / "whole", "--hand")
    for rank in whole:
        assert (rank["status"], rank["step"]) == ("completed", 12)
        assert rank["params"] == rank["hand"]  # the hand-written DDP and ZeRO loop, bit for bit
    assert whole[0]["params"] == whole[1]["params"]
    saved = sorted(p.name for p in (tmp_path / "whole" / "run" / "checkpoints").iterdir())
    assert saved == ["epoch0001-step000000004.pt", "epoch0001-step000000006.pt", "epoch0002-step000000008.pt",
                     "epoch0002-step000000012.pt"]
    # stopped after step 5 (its checkpoint inside the first epoch, Adam's moments split over the two
    # processes), then resumed: each process loads its own part of the whole state
    cut = job(tmp_path / "cut", "--max-steps", "5")
    assert [(r["status"], r["step"]) for r in cut] == [("completed", 5)] * 2
    resumed = job(tmp_path / "cut", HOOKFIT_RESUME="latest")
    for rank, (got, want) in enumerate(zip(resumed, whole)):
        assert (got["status"], got["step"]) == ("completed", 12)
        assert got["params"] == want["params"], f"rank {rank}: the resumed run's parameters"
