"""Resuming over the loaders users bring: data that restores its own position (torchdata's
``StatefulDataLoader``) is never skipped again by the core, and a plain shuffled
``DataLoader`` gets its order back. Killed with SIGKILL mid-epoch and resumed, a run of a model
with dropout ends bitwise equal to an uninterrupted one, having trained on every batch exactly
once, in the same order."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TESTS, run_script_here
import warm

pytest.importorskip("torchdata.stateful_dataloader")

CHILD = TESTS / "scripts" / "stateful_child.py"


def _run(run_dir: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    return warm.run([sys.executable, str(CHILD), str(run_dir), str(out), *args],
                    capture_output=True, text=True, timeout=300)


CASES = [("stateful", 0, True), ("stateful", 2, True), ("plain", 0, True), ("plain", 2, True),
         ("plain", 0, False), ("plain", 2, False)]


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.parametrize("loader, workers, shuffle", CASES)
def test_a_dataloader_killed_mid_epoch_resumes_bitwise_equal(tmp_path: Path, loader: str, workers: int,
                                                             shuffle: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed at a moment drawn at random (seeded by the case, so a failure
    reproduces), resumed, equal bit for bit to the uninterrupted run, which itself equals the
    original plain PyTorch loop: resume changes nothing of the random stream."""
    options = ("--loader", loader, "--workers", str(workers), *(() if shuffle else ("--no-shuffle",)))
    # the two uninterrupted runs in this process (the same script, seeded the same); the killed
    # and the resumed one each in a process of its own
    run_script_here(CHILD, str(tmp_path / "raw"), str(tmp_path / "raw.pt"), *options, "--raw", monkeypatch=monkeypatch)
    run_script_here(CHILD, str(tmp_path / "whole"), str(tmp_path / "whole.pt"), *options, monkeypatch=monkeypatch)
    want = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert want["status"] == "completed" and want["step"] == 60
    original = torch.load(tmp_path / "raw.pt", weights_only=True)
    assert want["seen"] == original["seen"]  # the same batches in the same order as the script
    assert all(torch.equal(want["params"][k], original["params"][k]) for k in original["params"])

    kill_at = random.Random(f"{loader}-{workers}-{shuffle}").randrange(2, 58)
    killed = _run(tmp_path / "run", tmp_path / "never.pt", *options, "--kill-at", str(kill_at))
    assert killed.returncode == -9, killed.stderr  # SIGKILL (20 batches an epoch)
    resumed = _run(tmp_path / "run", tmp_path / "resumed.pt", *options, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    got = torch.load(tmp_path / "resumed.pt", weights_only=True)

    assert got["status"] == "completed" and got["step"] == 60
    # the resumed process trained on what the uninterrupted one did after the checkpoint it
    # continued from (the newest whole one: the kill's step or one written meanwhile: a write is
    # announced at a later save, when the writer's two snapshots may both have been written),
    # no batch twice
    done = 60 - len(got["seen"])
    assert done in (kill_at, kill_at + 1, kill_at + 2) and got["seen"] == want["seen"][done:]
    assert all(torch.equal(got["params"][k], want["params"][k]) for k in want["params"])
