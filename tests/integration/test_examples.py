"""The example scripts run as users run them, and learn what they claim to learn."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

EXAMPLES = REPO / "examples"
pytestmark = pytest.mark.slow


def run(script: str, *args: str, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")}
    result = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_digits_reaches_a_sensible_validation_accuracy(tmp_path: Path) -> None:
    out = run("digits.py", "--epochs", "4", cwd=tmp_path)
    accuracy = float(re.search(r"stage=valid metric=accuracy last=([\d.]+)", out).group(1))
    assert accuracy > 0.9, out
    assert "hookfit end status=completed" in out


def test_gan_alternates_two_optimizers_and_covers_modes(tmp_path: Path) -> None:
    out = run("gan.py", cwd=tmp_path)
    covered = int(re.search(r"modes_covered=(\d)/8", out).group(1))
    assert covered >= 6, out
    assert "metric=d_loss" in out and "metric=g_loss" in out and "metric=loss" not in out
