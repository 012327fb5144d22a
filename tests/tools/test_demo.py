"""hookfit.tools.demo: ``hookfit demo`` trains a real classifier with the discovered plugins."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_hookfit_demo_learns_the_digits_with_the_built_in_plugins(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")}
    done = subprocess.run([sys.executable, "-m", "hookfit.tools.cli", "demo", "--epochs", "3"], cwd=tmp_path, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    plugins = re.search(r"^hookfit start .* plugins=(\S+)", out, re.M).group(1).split(",")
    assert {"optim", "metrics", "console", "interrupter", "checkpoint"} <= set(plugins)
    accuracy = float(re.search(r"stage=valid metric=accuracy last=([\d.]+)", out).group(1))
    assert accuracy > 0.85, out
    assert 'hookfit end status=completed reason="max_epochs=3 reached"' in out
    [log] = tmp_path.glob("runs/demo/*/metrics.jsonl")  # the run named demo, where it was started
    folder = log.parent.relative_to(tmp_path)
    assert f"hookfit demo: this run's files are in {folder}; look at it again with: hookfit show {folder}" in out
