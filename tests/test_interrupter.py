"""The interrupter with real signals sent to a real training subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = r'''
import json, signal, sys, time
import hookfit

before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
ended = []

class Watch:
    name = "watch"
    @hookfit.hookimpl
    def batch_end(self, batch_idx):
        if batch_idx == 0:
            print("TRAINING", flush=True)
    @hookfit.hookimpl
    def fit_end(self, loop):
        ended.append(loop.state.status)

def step(loop, batch):
    time.sleep(0.05)

loop = hookfit.Loop(step, list(range(10_000)), plugins=[Watch()])
try:
    state = loop.fit()
    outcome = "returned"
except KeyboardInterrupt:
    outcome = "KeyboardInterrupt"
restored = all(signal.getsignal(s) is h for s, h in before.items())
print(json.dumps({"outcome": outcome, "status": loop.state.status, "reason": loop.state.stop_reason,
                  "fit_end": ended, "restored": restored, "step": loop.state.step}), flush=True)
'''


def start(tmp_path: Path) -> subprocess.Popen:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")}
    env["HOOKFIT_PLUGINS"] = "interrupter"
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=tmp_path)
    assert proc.stdout.readline().strip() == "TRAINING"
    return proc


def finish(proc: subprocess.Popen) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=60)
    return json.loads(out.strip().splitlines()[-1]), err


@pytest.mark.parametrize("signum, name", [(signal.SIGINT, "SIGINT"), (signal.SIGTERM, "SIGTERM")])
def test_one_signal_stops_gracefully(tmp_path: Path, signum: int, name: str) -> None:
    proc = start(tmp_path)
    proc.send_signal(signum)
    result, err = finish(proc)
    assert result["outcome"] == "returned" and result["status"] == "interrupted"
    assert result["reason"] == name and result["fit_end"] == ["interrupted"]
    assert result["restored"] and proc.returncode == 0
    assert f"{name} received, stopping after this batch" in err


def test_second_sigint_aborts_after_fit_end(tmp_path: Path) -> None:
    proc = start(tmp_path)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.01)  # inside the same 50 ms batch
    proc.send_signal(signal.SIGINT)
    result, err = finish(proc)
    assert result["outcome"] == "KeyboardInterrupt" and result["status"] == "interrupted"
    assert result["fit_end"] == ["interrupted"] and result["restored"]
    assert "press Ctrl-C again to abort" in err
