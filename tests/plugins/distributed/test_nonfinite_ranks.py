"""A loss that is not finite on one process only, under a real ``torchrun`` (two processes, gloo, CPU, DDP)
(tests/scripts/nonfinite_ranks.py). With optim's check on the host every rank skips that batch's backward pass and
step (their collective operations stay matched, their replicas identical), or every rank raises naming the rank; on
the device path (``defer=True``) every rank skips that batch's step (the other ranks on their all-reduced gradients),
or every rank raises at the flags' read."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from test_distributed import ROOT, _env, _not_launched, _torchrun  # noqa: F401 - _not_launched: autouse

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests" / "scripts" / "nonfinite_ranks.py"


def _ranks(folder: Path, *options: str) -> list[dict[str, Any]]:
    launch = ["--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    done = subprocess.run([*_torchrun(), *launch, str(SCRIPT), *options], cwd=folder, env=_env(HOOKFIT_PLUGINS=""),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads((folder / f"out.rank{rank}.json").read_text()) for rank in (0, 1)]


def test_a_nonfinite_loss_on_one_rank_skips_that_step_on_every_rank(tmp_path: Path) -> None:
    """Rank 0's loss is NaN at step 2: both ranks skip step 2 (announced, warned about, counted), take every other
    step, complete the run and end with the same finite parameters."""
    for rank in _ranks(tmp_path, "skip"):
        assert (rank["status"], rank["step"], rank["error"], rank["same"], rank["counted"]) == (
            "completed", 8, None, True, 1)
        assert rank["taken"] == [0, 1, 3, 4, 5, 6, 7]
        assert rank["skipped"] == [["non-finite loss at epoch 1, batch 3", 2]]
        assert rank["warnings"] == ["optim: skipped the step of optimizer 'default': non-finite loss at epoch 1, "
                                    "batch 3; further skips are counted and reported at the end of the run"]


def test_under_nonfinite_raise_every_rank_raises_naming_the_rank(tmp_path: Path) -> None:
    """``Optim(nonfinite="raise")``: both ranks fail at step 2 with a FloatingPointError naming rank 0."""
    for rank in _ranks(tmp_path, "raise"):
        assert (rank["status"], rank["step"], rank["taken"], rank["skipped"]) == ("failed", 2, [0, 1], [])
        assert rank["error"] == ["FloatingPointError", "optim: non-finite loss on rank 0 at epoch 1, batch 3"]


def test_on_the_device_path_a_nonfinite_loss_on_one_rank_skips_that_step_on_every_rank(tmp_path: Path) -> None:
    """``Optim(defer=True)``: rank 0's NaN loss at step 2 is back-propagated, and DDP's all-reduce makes both ranks'
    gradients NaN. Rank 0 skips that step on its loss's flag, rank 1 on its gradients' (checked on the device path of
    several processes), each counted at the training stage's read; both take every other step, complete the run
    and end with the same finite parameters."""
    read = "(skipped on the device; read on the host at epoch 1, batch 4)"
    for rank, what in zip(_ranks(tmp_path, "skip", "defer"), ("loss", "gradient")):
        assert (rank["status"], rank["step"], rank["error"], rank["same"], rank["counted"]) == (
            "completed", 8, None, True, 1)
        assert rank["taken"] == list(range(8))  # a step skipped on the device looks real until the read
        assert rank["skipped"] == [[f"non-finite {what} at epoch 1, batch 3 {read}", 4]]
        assert rank["warnings"] == [f"optim: skipped the step of optimizer 'default': non-finite {what} at epoch 1, "
                                    f"batch 3 {read}; further skips are counted and reported at the end of the run"]


def test_on_the_device_path_under_nonfinite_raise_every_rank_raises_at_the_read(tmp_path: Path) -> None:
    """``Optim(nonfinite="raise", defer=True)``: both ranks fail at the first epoch's read of the flags (the training
    stage's end), rank 0 naming its loss, rank 1 its gradients, batch 3 each (step 2: the third batch)."""
    read = "skipped on the device; read on the host at epoch 1, batch 4)"
    for rank, what in zip(_ranks(tmp_path, "raise", "defer"), ("loss", "gradient")):
        assert (rank["status"], rank["step"], rank["skipped"], rank["warnings"]) == ("failed", 4, [], [])
        steps = "its steps were" if what == "loss" else "its step was"
        assert rank["error"] == ["FloatingPointError", f"optim: non-finite {what} at epoch 1, batch 3 ({steps} {read}"]
