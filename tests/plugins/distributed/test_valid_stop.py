"""A stop asked while a distributed run validates lands inside the validation, on every rank, though the
ranks' parts of it differ by a batch (SIGTERM to torchrun; a stop asked on one rank alone), and the run
resumed from its checkpoint runs that validation again with the random state it began with: every rank's
parameters at the end equal the uninterrupted run's, bit for bit, dropout included."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO
from hookfit.plugins.checkpoint import read
from test_distributed import _env, _not_launched, _torchrun  # noqa: F401 - _not_launched: autouse

pytestmark = [pytest.mark.slow, pytest.mark.fault]

SCRIPT = REPO / "tests" / "scripts" / "valid_stop_run.py"
LAUNCH = ["--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
PARTS = {"0": 11, "1": 10}
"""Each rank's validation batches an epoch, by rank (81 samples in batches of 4, shared)."""


def start(folder: Path, *args: str) -> subprocess.Popen[str]:
    folder.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([*_torchrun(), *LAUNCH, str(SCRIPT), *args], cwd=folder, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_env(HOOKFIT_PLUGINS=""), start_new_session=True)


def finish(job: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        out, _ = job.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out, _ = job.communicate()
        raise AssertionError(f"the job did not end:\n{out}") from None
    return job.returncode, out


def dumps(folder: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads((folder / f"{name}.rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("whole")
    code, out = finish(start(folder, "whole"))
    assert code == 0, out
    ran = dumps(folder, "whole")
    assert [r["validated"] for r in ran] == [{str(e): PARTS[str(r)] for e in range(3)} for r in (0, 1)]
    return ran


def resumed_equal(folder: Path, whole: list[dict[str, Any]], out: str, inside: bool = True) -> None:
    cut = dumps(folder, "cut")
    # both ranks stopped inside the second epoch's validation, before its end (or, not inside, at its end)
    assert [r["status"] for r in cut] == ["interrupted"] * 2, out
    assert all((0 < r["validated"]["1"] < PARTS[str(rank)]) if inside else r["validated"]["1"] == PARTS[str(rank)]
               for rank, r in enumerate(cut)), (cut, out)
    (path,) = (folder / "run" / "checkpoints").glob("*.pt")
    assert read(path)["loop"]["resume_stage"] == "valid"
    code, again = finish(start(folder, "again", "--resume", "latest"))
    assert code == 0, again
    resumed = dumps(folder, "again")
    for rank in (0, 1):
        assert resumed[rank]["status"] == "completed"
        assert resumed[rank]["validated"] == {"1": PARTS[str(rank)], "2": PARTS[str(rank)]}  # from its start
        assert resumed[rank]["params"] == whole[rank]["params"], f"rank {rank}: parameters"


def test_sigterm_to_torchrun_during_a_validation_stops_it_there_and_resumes_exactly(
        tmp_path: Path, whole: list[dict[str, Any]]) -> None:
    """Each rank's second validation batch waits until its process has the SIGTERM's stop request: the
    stop lands after it on both, not after the whole validation."""
    job = start(tmp_path, "cut", "--hold-signal")
    deadline = time.monotonic() + 240
    while not all((tmp_path / f"validating.rank{rank}").exists() for rank in (0, 1)):
        assert job.poll() is None and time.monotonic() < deadline, finish(job)[1]
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)  # torchrun's agent, which signals its workers
    _, out = finish(job)
    assert all(r["reason"].endswith(": SIGTERM") for r in dumps(tmp_path, "cut")), out
    resumed_equal(tmp_path, whole, out)


def test_a_stop_asked_on_one_rank_during_a_validation_stops_every_rank_inside_it(
        tmp_path: Path, whole: list[dict[str, Any]]) -> None:
    """Rank 1 asks at its second validation batch; rank 0, which has one batch more, waits at its own
    second batch until it has asked, then stops at a later batch of its part (it looks for the ranks'
    decision after each), long before its end."""
    code, out = finish(start(tmp_path, "cut", "--ask-on-rank-1"))
    assert code == 0, out
    assert [r["reason"] for r in dumps(tmp_path, "cut")] == ["stop requested on rank 1: asked by rank 1's "
                                                             "validation"] * 2, out
    resumed_equal(tmp_path, whole, out)


def test_a_stop_asked_after_another_rank_ended_its_validation_lands_at_its_end_and_resumes_exactly(
        tmp_path: Path, whole: list[dict[str, Any]]) -> None:
    """Rank 1 is done with its part (its validation's stage_end fires) when rank 0 asks at its last batch:
    the validation runs to its end on both, the stop lands at its stage_end, and the checkpoint, which runs it
    again, holds every rank's random state as it began."""
    code, out = finish(start(tmp_path, "cut", "--ask-after-rank-1-ends"))
    assert code == 0, out
    assert [r["reason"] for r in dumps(tmp_path, "cut")] == ["stop requested on rank 0: asked by rank 0's last "
                                                             "validation batch"] * 2, out
    resumed_equal(tmp_path, whole, out, inside=False)
