"""The example scripts run as users run them, and learn what they claim to learn."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit.plugins.optim import Optim
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


def test_the_gans_step_calls_its_models_through_loop_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the README asks (under torchrun ``loop.model`` holds the DDP wrappers): a plugin that puts wrappers
    in ``loop.model`` sees every forward pass of the step, the generator's once a batch, the discriminator's
    three times."""
    spec = importlib.util.spec_from_file_location("gan_example", EXAMPLES / "gan.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    calls: list[str] = []

    class Counted(torch.nn.Module):
        def __init__(self, name: str, inner: torch.nn.Module) -> None:
            super().__init__()
            self.name, self.inner = name, inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(self.name)
            return self.inner(x)

    class Wraps:
        @hookfit.hookimpl
        def configure(self, loop: Any) -> None:
            loop.model = {name: Counted(name, module) for name, module in loop.model.items()}

    made = hookfit.Loop
    monkeypatch.setattr(hookfit, "Loop", lambda *args, **kwargs: made(*args, plugins=[Optim(), Wraps()], **kwargs))
    state, _ = example.main(epochs=1)
    assert state.status == "completed"
    assert (calls.count("gen"), calls.count("disc")) == (20, 3 * 20)


def test_the_gan_with_accumulate_in_hookfit_toml_says_nothing_of_its_windows_gradients(tmp_path: Path) -> None:
    """Each optimizer's loop.optimizers[...].zero_grad() before its own pass clears the gradients of a window that
    stepped, not an open window's: optim's watch of the window's gradients stays silent."""
    (tmp_path / "hookfit.toml").write_text("[plugins.optim]\naccumulate = 2\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")}
    result = subprocess.run([sys.executable, "-W", "always", str(EXAMPLES / "gan.py"), "--epochs", "1"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "hookfit end status=completed" in result.stdout
    assert "OptimWarning" not in result.stderr, result.stderr  # (the window's watch warned here, an OptimWarning)
