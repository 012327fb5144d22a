"""The suite's own xdist scheduling (``conftest.pytest_xdist_make_scheduler``) ends a run in
which a worker dies near its end: a real pytest run with two workers and the suite's hooks,
one test killing its worker with SIGKILL once (as the OOM killer ends a process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

CONFTEST = f'''
import importlib.util, sys
sys.path.insert(0, {str(REPO / "tests")!r})
spec = importlib.util.spec_from_file_location("hookfit_suite_conftest", {str(REPO / "tests" / "conftest.py")!r})
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
pytest_collection_modifyitems = suite.pytest_collection_modifyitems
pytest_xdist_make_scheduler = suite.pytest_xdist_make_scheduler
'''

TESTS = '''
import os, signal, pytest

@pytest.mark.parametrize("i", range(30))
def test_before(i):
    pass

def test_killed_near_the_end():
    if not os.path.exists("killed"):
        open("killed", "w").close()
        os.kill(os.getpid(), signal.SIGKILL)

@pytest.mark.parametrize("i", range(3))
def test_after(i):
    pass
'''


@pytest.mark.slow
@pytest.mark.fault
def test_a_worker_killed_near_the_end_fails_its_test_and_the_run_ends(tmp_path: Path) -> None:
    """It waited forever: the replacement worker got one test and the others held their last,
    each waiting for a next test or the word to stop that never came (no test was running, so
    no per-test timeout could end it)."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_killed.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "-q"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "node down: Not properly terminated" in out, out
    assert "FAILED test_killed.py::test_killed_near_the_end - worker 'gw" in out, out
    assert "1 failed, 34 passed" in out, out  # every other test ran; the killed one ran again, whole
