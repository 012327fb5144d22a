"""A GPT-2-style training script (a DataLoader seeded with a generator of its own, AdamW, a
warmup schedule, accumulation over 4 batches, clipping, bf16 autocast, a checkpoint every 5
steps) killed with SIGKILL in the middle of its second epoch and resumed ends with the
parameters of the run never killed, and says nothing of an order it cannot rebuild."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import TESTS
import warm

SCRIPT = TESTS / "scripts" / "gpt2_train.py"
BATCHES = 24  # training batches an epoch
PAUSE = BATCHES + 13  # the kill: batch 13 of the second epoch, inside an accumulation window of 4


def child(run_dir: Path, out: Path, *args: str) -> subprocess.Popen:
    return warm.Popen([sys.executable, str(SCRIPT), str(run_dir), str(out), *args], stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True, env={**os.environ, "HOOKFIT_PLUGINS": ""})


def finish(proc: subprocess.Popen, out: Path) -> tuple[dict, str]:
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    return torch.load(out, weights_only=True), stderr


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_gpt2_script_killed_in_its_second_epoch_resumes_to_the_uninterrupted_parameters(
        tmp_path: Path, workers: str) -> None:
    straight = child(tmp_path / "straight", tmp_path / "straight.pt", "--workers", workers)
    killed = child(tmp_path / "run", tmp_path / "killed.pt", "--workers", workers, "--pause-at", str(PAUSE))
    for line in killed.stdout:  # wait for the marker: the script waits there for a signal
        if line.startswith("paused"):
            break
    else:
        pytest.fail(f"the script ended without pausing: {killed.communicate()[1]}")
    killed.send_signal(signal.SIGKILL)
    _, stderr = killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL, stderr
    want, _ = finish(straight, tmp_path / "straight.pt")

    got, said = finish(child(tmp_path / "run", tmp_path / "resumed.pt", "--workers", workers, "--resume"),
                       tmp_path / "resumed.pt")
    assert got["status"] == "completed" and got["step"] == 2 * BATCHES
    assert BATCHES < got["resumed_from"] < PAUSE  # a checkpoint inside the second epoch, before the kill
    assert "cannot be rebuilt" not in said, said
    assert want["params"].keys() == got["params"].keys()
    differ = [k for k in want["params"] if not torch.equal(want["params"][k], got["params"][k])]
    assert not differ, differ
