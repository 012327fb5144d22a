"""The suite's warm children (``tests/warm.py``) start, run and end as fresh interpreters do.

The suite starts many of its child processes, and every ``torchrun`` rank, from a zygote that
has imported torch already (the import is most of a child's CPU time on two cores). These tests
run one script both ways, fresh and warm, and compare what a test could observe: the exit
status (a code, an uncaught exception, a death by a signal), what it printed, its traceback,
``sys.argv``, ``__file__``, ``sys.path[0]``, the working folder, the environment, the umask and
standard input; and they check that the warm one was warm, so that a silent fallback fails here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import warm

SCRIPT = '''
import json, os, sys
preloaded = "torch" in sys.modules
mask = os.umask(0); os.umask(mask)
print(json.dumps({"argv": sys.argv, "file": __file__, "path0": sys.path[0], "cwd": os.getcwd(),
                  "name": __name__, "env": os.environ.get("WARM_TEST"), "umask": mask,
                  "stdin": sys.stdin.read() if "--stdin" in sys.argv else None,
                  "orig": sys.orig_argv[1:]}), flush=True)
print("warm" if preloaded else "fresh", file=sys.stderr, flush=True)
how = sys.argv[-1]
if how == "code":
    sys.exit(3)
if how == "raise":
    def step():
        raise ValueError("a step failed")
    step()
if how == "interrupt":
    raise KeyboardInterrupt
if how == "term":
    os.kill(os.getpid(), 15)
if how == "wait":
    sys.stdin.read()
'''

OUTCOMES = ["ok", "code", "raise", "interrupt", "term"]


@pytest.fixture(scope="module")
def zygote() -> None:
    if os.environ.get("HOOKFIT_TEST_FRESH"):
        pytest.skip("HOOKFIT_TEST_FRESH=1: every child starts fresh in this run")
    if not warm.ready():
        pytest.fail("the worker's zygote did not start (HOOKFIT_TEST_FRESH set, or see its zygote.log)")


def _compare(fresh: subprocess.CompletedProcess, other: subprocess.CompletedProcess) -> None:
    assert other.returncode == fresh.returncode
    assert json.loads(other.stdout) == json.loads(fresh.stdout)
    assert fresh.stderr.startswith("fresh\n") and other.stderr.startswith("warm\n"), warm.FRESH[-1:]
    assert other.stderr.split("\n", 1)[1] == fresh.stderr.split("\n", 1)[1]  # the same traceback


@pytest.mark.parametrize("how", OUTCOMES)
def test_a_warm_child_starts_and_ends_as_a_fresh_one(tmp_path: Path, zygote: None, how: str) -> None:
    script = tmp_path / "child.py"
    script.write_text(SCRIPT)
    os.chmod(tmp_path, 0o755)
    argv = [sys.executable, "child.py", "--stdin", how]
    # the environment the zygote started with: a package imported since may have set a variable
    # that makes a child start fresh (and the suite only slower), which this test is not about
    kw = dict(cwd=tmp_path, env={**warm.STARTED_ENV, "WARM_TEST": "yes"}, input="from stdin", capture_output=True,
              text=True, timeout=120)
    fresh = subprocess.run(argv, **kw)
    _compare(fresh, warm.run(argv, **kw))
    assert fresh.returncode == {"ok": 0, "code": 3, "raise": 1, "interrupt": -signal.SIGINT,
                                "term": -signal.SIGTERM}[how]
    if how == "raise":
        assert 'File "' + str(script) + '", line' in fresh.stderr and "ValueError: a step failed" in fresh.stderr
    relay = os.environ["PYTHON_EXEC"]  # what torchrun starts each rank with: $PYTHON_EXEC -u script ...
    _compare(subprocess.run([sys.executable, "-u", *argv[1:]], **kw), subprocess.run([relay, "-u", *argv[1:]], **kw))


def test_a_warm_child_is_this_process_s_child_and_dies_by_kill_9(tmp_path: Path, zygote: None) -> None:
    (tmp_path / "child.py").write_text(SCRIPT)
    child = warm.Popen([sys.executable, "child.py", "wait"], cwd=tmp_path, stdin=subprocess.PIPE, env=warm.STARTED_ENV,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stderr.readline() == "warm\n"
    assert int(Path(f"/proc/{child.pid}/stat").read_text().split()[3]) == os.getpid()  # its parent
    child.kill()
    assert child.wait(timeout=60) == -signal.SIGKILL  # reaped by this process, as a child is
    assert not Path(f"/proc/{child.pid}").exists()


def test_a_relayed_rank_dies_with_its_relay(tmp_path: Path, zygote: None) -> None:
    """torchrun kills a rank that does not stop with SIGKILL: the rank behind the relay goes too."""
    (tmp_path / "child.py").write_text(SCRIPT.replace('    sys.stdin.read()', '    print(os.getpid(), flush=True); sys.stdin.read()'))
    relay = subprocess.Popen([os.environ["PYTHON_EXEC"], "-u", "child.py", "wait"], cwd=tmp_path, env=warm.STARTED_ENV,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    json.loads(relay.stdout.readline())
    rank = int(relay.stdout.readline())
    assert rank != relay.pid and Path(f"/proc/{rank}").exists()
    relay.kill()
    relay.wait(timeout=60)
    assert relay.stdout.read() == ""  # end of file: the rank's copy of the pipe is closed, it is gone
