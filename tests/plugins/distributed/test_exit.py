"""Every process of a finished distributed job exits 0 (issue 30): nothing of hookfit's (the
process group, its store, a background checkpoint save, DCP's writers) is alive when the
interpreter exits, which would abort a rank after it printed "completed" (``terminate called
without an active exception``, exit -6) and make a scheduler retry a finished job. Whether a
thread outlives the interpreter depends on timing, so the job runs several times, two at once,
beside a process that keeps a core busy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from test_distributed import _env, _torchrun, _not_launched  # noqa: F401 - _not_launched: autouse

pytestmark = [pytest.mark.slow, pytest.mark.fault]

JOB = REPO / "tests" / "scripts" / "exit_job.py"
ROUNDS = 2  # each round: one DDP job and one FSDP job at the same time


def _start(folder: Path, strategy: str) -> subprocess.Popen[str]:
    folder.mkdir(parents=True)
    launch = ["--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    return subprocess.Popen([*_torchrun(), *launch, str(JOB), strategy], cwd=folder, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=_env(HOOKFIT_PLUGINS="interrupter,optim,distributed,checkpoint"))


def test_finished_jobs_exit_0_on_every_rank_under_load(tmp_path: Path) -> None:
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for round_ in range(ROUNDS):
            jobs = {strategy: _start(tmp_path / f"{round_}-{strategy}", strategy) for strategy in ("ddp", "fsdp")}
            for strategy, job in jobs.items():
                try:
                    out, _ = job.communicate(timeout=300)
                except subprocess.TimeoutExpired:
                    job.kill()
                    out, _ = job.communicate()
                    pytest.fail(f"round {round_}, {strategy}: the job did not end\n{out}")
                where = f"round {round_}, {strategy}"
                assert "exit_job rank 0 completed" in out and "exit_job rank 1 completed" in out, f"{where}\n{out}"
                for sign in ("terminate called", "Fatal Python error", "Traceback"):
                    assert sign not in out, f"{where}: {sign!r}\n{out}"
                assert job.returncode == 0, f"{where}: exit {job.returncode}\n{out}"
                checkpoints = sorted(p.name for p in (tmp_path / f"{round_}-{strategy}" / "run" / "checkpoints").iterdir())
                assert checkpoints[-1].startswith("epoch0002-step000000008"), (where, checkpoints)
    finally:
        hog.kill()
        hog.wait()
