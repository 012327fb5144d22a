"""Every process of a finished distributed job exits 0: nothing of hookfit's (the
process group and its gloo threads, its store, a background checkpoint save, DCP's writers) is
alive when the interpreter exits, which can abort a rank after it printed "completed"
(``terminate called without an active exception``, exit -6) and make a scheduler retry a
finished job.

``tests/scripts/exit_job.py`` says, from the last of its exit handlers, which threads are still
alive there: that is checked on every rank, so a leftover is found whatever the timing. An FSDP
job left gloo's threads running into the interpreter's finalization (its group was kept alive
by DTensor's caches of sharding decisions and by ``torch.distributed.nn.functional``'s default
arguments). Whether a leftover thread aborts the process depends on timing, so the stress test
also runs the job many times, several at once, beside a process that keeps a core busy.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from test_distributed import _env, _free_port, _torchrun, _not_launched  # noqa: F401 - _not_launched: autouse

pytestmark = [pytest.mark.slow, pytest.mark.fault]

JOB = REPO / "tests" / "scripts" / "exit_job.py"
PLUGINS = "interrupter,optim,distributed,checkpoint"
RUNS = 8  # torchrun jobs of two processes, DDP and FSDP in turn
"""About 9 s of CPU each (three interpreters importing torch, two of them torch._dynamo, which
DDP, FSDP and torch.optim import). Every rank of every job is checked for leftover threads at
exit, which does not depend on timing, so the number only widens the chance of catching a rarer
abort; and every other torchrun job of the suite (some forty) fails its test too if a rank
aborts at exit (torchrun's exit code). 16 cost the suite another 70 s of CPU on two cores."""
AT_ONCE = 4  # jobs running at the same time (each a torchrun agent and two processes)
JOB_TIMEOUT = 300.0  # seconds one job may take, on a loaded machine


def _check(folder: Path, out: str, code: int, ranks: int, where: str) -> None:
    """One job's end as a scheduler and the job see it: exit 0, every rank completed and
    clean at exit, no abort, the last checkpoint written."""
    for sign in ("terminate called", "Fatal Python error", "Traceback"):
        assert sign not in out, f"{where}: {sign!r}\n{out}"
    for rank in range(ranks):
        assert f"exit_job rank {rank} completed" in out, f"{where}: rank {rank} did not complete\n{out}"
        assert f"exit_job rank {rank} at exit: clean" in out, f"{where}: rank {rank} left threads\n{out}"
    assert code == 0, f"{where}: exit {code}\n{out}"
    checkpoints = sorted(p.name for p in (folder / "run" / "checkpoints").iterdir())
    steps = 2 * 8 // ranks  # two epochs of 8 batches, shared among the ranks
    assert checkpoints[-1].startswith(f"epoch0002-step{steps:09d}"), (where, checkpoints)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_finished_job_leaves_no_thread_of_its_group_at_exit(tmp_path: Path, strategy: str) -> None:
    """One process started as torchrun starts it (its environment): the group, its gloo
    threads and the background save are gone before the interpreter finalizes. FSDP left
    ``gloo_tcp_loop`` and two ``pt_gloo_runloop`` threads there."""
    env = _env(HOOKFIT_PLUGINS=PLUGINS, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()))
    done = subprocess.run([sys.executable, str(JOB), strategy], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    _check(tmp_path, done.stdout + done.stderr, done.returncode, 1, strategy)


def _start(folder: Path, strategy: str) -> subprocess.Popen[str]:
    """``torchrun`` of two processes on the job, its output in ``folder/out.txt`` (a file: a
    pipe would fill while the test waits for another job)."""
    folder.mkdir()
    launch = ["--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    with open(folder / "out.txt", "w") as out:
        return subprocess.Popen([*_torchrun(), *launch, str(JOB), strategy], cwd=folder,
                                env=_env(HOOKFIT_PLUGINS=PLUGINS), stdout=out, stderr=subprocess.STDOUT, text=True)


def test_finished_jobs_exit_0_on_every_rank_under_load(tmp_path: Path) -> None:
    """RUNS jobs, AT_ONCE at a time, beside a busy core: every rank of every job completes,
    leaves nothing at exit and exits 0, and torchrun reports success (its exit code)."""
    waiting = [(number, ("ddp", "fsdp")[number % 2]) for number in range(RUNS)]
    running: list[tuple[Path, subprocess.Popen[str], float]] = []
    # niced: it takes what the jobs leave of a core (every moment they wait), not a share of
    # what they would run, so the machine never idles and the test costs the jobs' time alone
    hog = subprocess.Popen([sys.executable, "-c", "import os; os.nice(19)\nwhile True: pass"])
    try:
        while waiting or running:
            while waiting and len(running) < AT_ONCE:
                number, strategy = waiting.pop(0)
                folder = tmp_path / f"{number:02d}-{strategy}"
                running.append((folder, _start(folder, strategy), time.monotonic()))
            folder, job, started = running.pop(0)  # the oldest: it ends first, or soon after
            try:
                job.wait(timeout=max(1.0, started + JOB_TIMEOUT - time.monotonic()))
            except subprocess.TimeoutExpired:
                job.kill()
                job.wait()
                pytest.fail(f"{folder.name} did not end in {JOB_TIMEOUT:.0f} s\n{(folder / 'out.txt').read_text()}")
            _check(folder, (folder / "out.txt").read_text(), job.returncode, 2, folder.name)
    finally:
        for _, job, _ in running:
            job.kill()
            job.wait()
        hog.kill()
        hog.wait()
