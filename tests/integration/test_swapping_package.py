"""A package validating with an average of its own (``tests/packages/hookfit-avg-swap``, stochastic
weight averaging written against ``core/hooks.md``'s "Changing the model for a stage"), installed
with a real pip into a temporary venv and run with the built-in ``ema`` by a real process
(``tests/scripts/swap_train.py``): a real SIGINT during validation, then a resume, ends with the
weights and both averages of the uninterrupted run, bit for bit, under an entry-point name sorting
before ``ema`` (registered before it) or after it."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from venvs import make_venv
from conftest import REPO

pytestmark = pytest.mark.slow

SCRIPT = REPO / "tests" / "scripts" / "swap_train.py"


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Any:
    env = make_venv(tmp_path_factory.mktemp("swap") / "venv")
    env.install(REPO / "tests" / "packages" / "hookfit-avg-swap")
    return env


@pytest.mark.fault
@pytest.mark.parametrize("name", ["avg_swap", "swap"])
def test_a_sigint_during_validation_resumes_as_the_uninterrupted_run_bit_for_bit(
        venv: Any, name: str, tmp_path: Path) -> None:
    env = {"HOOKFIT_PLUGINS": f"interrupter,{name}", "SWAP_NAME": name}
    whole = venv.run(SCRIPT, tmp_path / "whole", cwd=tmp_path, **env)
    assert "STATUS completed" in whole.stdout, whole.stderr

    process = venv.popen(SCRIPT, tmp_path / "cut", "--stop-in-validation", cwd=tmp_path, **env)
    try:
        line = process.stdout.readline().strip() if process.stdout else ""
        assert line == "VALIDATING", line + (process.stderr.read() if process.stderr else "")
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "STATUS interrupted" in out, err
    assert "stopping after this batch" in err

    resumed = venv.run(SCRIPT, tmp_path / "cut", cwd=tmp_path, **env)
    assert "STATUS completed" in resumed.stdout, resumed.stderr
    expected, got = torch.load(tmp_path / "whole" / "final.pt"), torch.load(tmp_path / "cut" / "final.pt")
    assert got["swapped"] == expected["swapped"] == 3
    for part in ("model", "ema", "swap"):
        assert expected[part].keys() == got[part].keys()
        assert all(torch.equal(expected[part][k], got[part][k]) for k in expected[part]), part
