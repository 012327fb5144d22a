"""Resuming over the loaders users bring: data that restores its own position (torchdata's
``StatefulDataLoader``) is never skipped again by the core, and a plain shuffled
``DataLoader`` gets its order back. Killed with SIGKILL mid-epoch and resumed, a run of a model
with dropout ends bitwise equal to an uninterrupted one, having trained on every batch exactly
once, in the same order."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TESTS

pytest.importorskip("torchdata.stateful_dataloader")

CHILD = TESTS / "scripts" / "stateful_child.py"


def _run(run_dir: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHILD), str(run_dir), str(out), *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.parametrize("loader, workers", [("stateful", 0), ("stateful", 2), ("plain", 0), ("plain", 2)])
def test_a_dataloader_killed_mid_epoch_resumes_bitwise_equal(tmp_path: Path, loader: str, workers: int) -> None:
    options = ("--loader", loader, "--workers", str(workers))
    whole = _run(tmp_path / "whole", tmp_path / "whole.pt", *options)
    assert whole.returncode == 0, whole.stderr
    want = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert want["status"] == "completed" and want["step"] == 60

    killed = _run(tmp_path / "run", tmp_path / "never.pt", *options, "--kill-at", "23")
    assert killed.returncode == -9, killed.stderr  # SIGKILL, in epoch 2 (20 batches an epoch)
    resumed = _run(tmp_path / "run", tmp_path / "resumed.pt", *options, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    got = torch.load(tmp_path / "resumed.pt", weights_only=True)

    assert got["status"] == "completed" and got["step"] == 60
    # the resumed process trained on what the uninterrupted one did after the checkpoint it
    # continued from (the newest whole one: step 23 or, written meanwhile, 24), no batch twice
    done = 60 - len(got["seen"])
    assert done in (23, 24) and got["seen"] == want["seen"][done:]
    assert all(torch.equal(got["params"][k], want["params"][k]) for k in want["params"])
