"""Sharded checkpoints written in the background (``torch.distributed.checkpoint.async_save``,
the default ``background=True``) keep the foreground save's guarantees: training goes on while a
write is in flight, the checkpoints hold what the foreground save writes and resume bitwise; a
SIGKILL at a random moment of the writes leaves only whole checkpoints under their names, and the
resumed run ends bitwise where the uninterrupted one does; a failed write is raised on every
rank at the same step (``on_save_error="raise"``); a copy into host memory that fails on one rank
is a failed save on every rank at its step, warned about or raised as ``on_save_error`` says, and
one interrupted on one rank (``KeyboardInterrupt``) stops every rank there, interrupted; a save
asked during a write waits for it or is skipped on every rank (``when_busy``).

Real ``torchrun`` jobs (2 processes, gloo on the CPU) run ``tests/scripts/sharded_run.py``:
``--hold`` keeps each write from starting until the next save is asked (so every save after the
first finds a write in flight, and a save that blocked training until its write ended would
never end), ``--pace`` prints a line before each piece of a write (the kill's moments),
``--fail-staging`` makes rank 1's copy into host memory raise at one save (or be interrupted)."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from test_sharded_trust import LAUNCH_ENV, SCRIPT, _not_launched, _torchrun, run_sharded  # noqa: F401

from hookfit.plugins.checkpoint import read

EVERY = ("--epochs", "3", "--every-n-steps", "2")
NAMES = ["epoch0001-step000000002.dcp", "epoch0001-step000000004.dcp", "epoch0002-step000000006.dcp",
         "epoch0002-step000000008.dcp", "epoch0003-step000000010.dcp", "epoch0003-step000000012.dcp"]


def _checkpoints(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != "run.lock")


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """A run of 12 steps, a sharded checkpoint every 2 steps, each write held until the next
    save is asked (``when_busy="wait"``): its checkpoints and each rank's dump."""
    folder = tmp_path_factory.mktemp("held")
    ranks, output = run_sharded(folder, "--dir", "ckpt", *EVERY, "--hold")
    assert [r.get("status") for r in ranks] == ["completed", "completed"], output
    return folder / "ckpt", ranks


@pytest.mark.slow
def test_training_goes_on_while_a_sharded_write_is_in_flight_and_the_checkpoints_equal_the_foreground_ones(
        held: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    folder, ranks = held
    for rank in ranks:
        saves = rank["saves"]
        assert [s["step"] for s in saves] == [2, 4, 6, 8, 10, 12], saves
        # each write ended only once the next save was asked: training went on past it meanwhile
        assert [s["in_flight"] for s in saves] == [False] + [True] * 5, saves
        assert all(s["ended_at"] >= s["step"] + 2 for s in saves[:-1]), saves
        assert (rank["failed_saves"], rank["skipped_saves"]) == (0, 0)
    assert ranks[0]["params"] == ranks[1]["params"]
    assert _checkpoints(folder) == NAMES  # no temporary folder left

    sync, output = run_sharded(tmp_path / "sync", "--dir", "ckpt", *EVERY, "--sync")
    assert [r.get("status") for r in sync] == ["completed", "completed"], output
    assert sync[0]["saves"] == [] and sync[0]["params"] == ranks[0]["params"]
    for name in NAMES:  # what the foreground save writes, tensor for tensor (read checks every digest)
        background, foreground = read(folder / name), read(tmp_path / "sync" / "ckpt" / name)
        assert background["loop"] == foreground["loop"], name
        assert background["meta"]["files"].keys() == foreground["meta"]["files"].keys(), name
        for key in ("__0_0.distcp", "__1_0.distcp"):  # the same bytes: DCP wrote the same tensors
            assert (folder / name / key).read_bytes() == (tmp_path / "sync" / "ckpt" / name / key).read_bytes()


@pytest.mark.slow
def test_a_background_sharded_checkpoint_resumes_bitwise_and_keep_last_prunes(
        held: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    folder, ranks = held
    middle = folder / NAMES[2]
    resumed, output = run_sharded(tmp_path, "--dir", "ckpt", *EVERY, "--resume", str(middle), "--keep-last", "2")
    for rank in resumed:
        assert (rank.get("status"), rank.get("step"), rank.get("resumed_from")) == ("completed", 12, str(middle)), output
        assert rank["params"] == ranks[0]["params"]  # the uninterrupted run's end, bitwise
    assert _checkpoints(tmp_path / "ckpt") == NAMES[4:]  # of the 3 written in the background, the last 2


def _killed(folder: Path, at: int) -> tuple[str, int]:
    """The paced run, both ranks killed with SIGKILL when the ``at``-th piece of a write
    starts (torchrun after them): the output and how many pieces had started."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV and k != "HOOKFIT_DISABLE_PLUGINS"}
    env.update(OMP_NUM_THREADS="1", HOOKFIT_PLUGINS="", PYTHONFAULTHANDLER="1")
    folder.mkdir(parents=True, exist_ok=True)
    launch = ["--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    process = subprocess.Popen([*_torchrun(), *launch, str(SCRIPT), "out", "--dir", "ckpt", *EVERY, "--pace", "0.01"],
                               cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    assert process.stdout is not None
    pids, lines, pieces = [], [], 0
    try:
        for line in process.stdout:  # reads until the ranks, torchrun and every copy of the pipe are gone
            lines.append(line)
            if line.startswith("pid "):
                pids.append(int(line.split()[2]))
            elif line.startswith("ckpt-io ") and pieces < at:
                pieces += 1
                if pieces == at:
                    for pid in pids:
                        os.kill(pid, signal.SIGKILL)
                    os.killpg(process.pid, signal.SIGKILL)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
    return "".join(lines), pieces


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.parametrize("seed", [2, 9])  # a kill in the first write, one in the fifth
def test_sigkill_during_background_sharded_writes_resumes_bitwise_from_the_last_whole_checkpoint(
        held: tuple[Path, list[dict[str, Any]]], tmp_path: Path, seed: int) -> None:
    """Each rank prints a line before each piece of a write: the 12 tensors DCP writes (each
    rank's shard of 4 parameters and of Adam's 2 moments and step for each), and rank 0's
    ``state.pt`` and rename; 6 checkpoints. Both ranks are killed at a random one of those lines.
    Every folder under a checkpoint's name is whole (its digests check), and the run resumed
    from the newest ends bitwise where the uninterrupted run did."""
    at = random.Random(seed).randint(1, 6 * (12 * 2 + 2) - 1)
    output, pieces = _killed(tmp_path, at)
    assert pieces == at, f"the run ended before piece {at} of its writes:\n{output}"
    assert not (tmp_path / "out.rank0.json").exists(), output  # killed, not ended
    folder = tmp_path / "ckpt"
    whole = [name for name in NAMES if (folder / name).exists()]
    assert _checkpoints(folder) == sorted(whole + [p.name for p in folder.glob(".*.tmp")])
    for name in whole:
        read(folder / name)  # every digest checks: never a partial folder under a checkpoint's name

    resumed, output = run_sharded(tmp_path, "--dir", "ckpt", *EVERY, "--resume", "latest")
    for rank in resumed:
        assert (rank.get("status"), rank.get("step")) == ("completed", 12), output
        resumed_from = rank["resumed_from"] and Path(tmp_path, rank["resumed_from"]).relative_to(folder).as_posix()
        assert resumed_from == (whole[-1] if whole else None), (at, whole)
        assert rank["params"] == held[1][0]["params"], (at, whole)
    assert not list(folder.glob(".*.tmp")), _checkpoints(folder)  # the killed write's removed at the start


@pytest.mark.slow
@pytest.mark.fault
def test_a_failed_background_write_is_raised_on_every_rank_at_the_same_step(
        tmp_path: Path, read_only_folder: Path) -> None:
    """``on_save_error="raise"``: the write of step 2 fails (a read-only folder) on every rank;
    its outcome is taken at the next save (step 4) on every rank, which raises the same error."""
    ranks, output = run_sharded(tmp_path, "--dir", str(read_only_folder), *EVERY, "--on-save-error", "raise")
    errors = [r.get("error") for r in ranks]
    assert errors[0] is not None and errors[0] == errors[1], output
    assert errors[0].startswith("OSError: rank ") and "epoch0001-step000000002.dcp" in errors[0], errors[0]
    assert [(r["step"], r["failed_saves"]) for r in ranks] == [(4, 1), (4, 1)], output
    assert _checkpoints(read_only_folder) == []


@pytest.mark.slow
@pytest.mark.fault
def test_a_sharded_save_asked_during_a_write_is_skipped_on_every_rank(tmp_path: Path) -> None:
    """``when_busy="skip"``: the save of step 4 finds the write of step 2 held, on every rank,
    and is skipped on every rank (counted on every rank; one warning, rank 0's: only rank 0
    prints); later saves find it done or not, the same on every rank; every save not skipped is a
    whole checkpoint."""
    ranks, output = run_sharded(tmp_path, "--dir", "ckpt", *EVERY, "--hold", "--when-busy", "skip")
    for number, rank in enumerate(ranks):
        assert rank.get("status") == "completed", output
        assert rank["saves"][1] == {"step": 4, "in_flight": True, "skipped": True}, rank["saves"]
        skipped = [s["step"] for s in rank["saves"] if s["skipped"]]
        assert rank["skipped_saves"] == len(skipped) >= 1
        warned = [m for c, m in rank["warnings"] if c == "CheckpointWarning" and "was skipped" in m]
        assert len(warned) == (1 if number == 0 else 0), rank["warnings"]
        assert all("the save at step 4 was skipped" in m for m in warned), rank["warnings"]
    assert [[s["skipped"] for s in r["saves"]] for r in ranks][0] == [s["skipped"] for s in ranks[1]["saves"]]
    # each save not skipped, by its step (NAMES: steps 2, 4, ... 12); the run's last step, if skipped, is saved
    # again by the completed run's end (its final weights), which the writer is asked for too
    written = sorted({NAMES[save["step"] // 2 - 1] for save in ranks[0]["saves"] if not save["skipped"]})
    assert _checkpoints(tmp_path / "ckpt") == written
    for name in written:
        read(tmp_path / "ckpt" / name)
    assert ranks[0]["params"] == ranks[1]["params"]


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.parametrize("what, error", [("shards", "MemoryError: the host copy of the shards was refused"),
                                         ("rest", r"\[Errno 12\] Cannot allocate memory for the host copy")])
def test_a_copy_into_host_memory_failing_on_one_rank_is_a_failed_save_on_every_rank(
        held: tuple[Path, list[dict[str, Any]]], tmp_path: Path, what: str, error: str) -> None:
    """``on_save_error="warn"``: rank 1's copy of its state into host memory raises at the save of
    step 4 (DCP's stager of the shards, or the staging of the rest). That save is a failed save on
    every rank, at that step: counted on both, warned about once (by rank 0, naming rank 1 and its
    error), no folder for it; training goes on, and every other save is the checkpoint the run
    without the failure writes, byte for byte; the one after it resumes bitwise."""
    folder = tmp_path / "ckpt"
    ranks, output = run_sharded(tmp_path, "--dir", "ckpt", *EVERY, "--fail-staging", f"{what}:4")
    for rank in ranks:
        assert (rank.get("status"), rank.get("step"), rank.get("failed_saves")) == ("completed", 12, 1), output
        assert [s.get("failed", False) for s in rank["saves"]] == [False, True, False, False, False, False]
        assert rank["params"] == held[1][0]["params"]  # training went on as if nothing happened
    [warning] = [m for c, m in ranks[0]["warnings"] if c == "CheckpointWarning"]
    assert all("could not write" not in m for _, m in ranks[1]["warnings"])  # said once, by rank 0
    assert re.search(rf"^checkpoint: could not write .*/{NAMES[1]}, the save at step 4 \(\w+: rank 1: .*{error}\); the previous "
                     r"checkpoints are kept and training goes on$", warning), warning
    written = [name for name in NAMES if name != NAMES[1]]
    assert _checkpoints(folder) == written  # nothing of step 4's save, not even a temporary folder
    for name in written:
        assert read(folder / name)["loop"] == read(held[0] / name)["loop"], name
        for key in ("__0_0.distcp", "__1_0.distcp"):
            assert (folder / name / key).read_bytes() == (held[0] / name / key).read_bytes(), (name, key)

    resumed, output = run_sharded(tmp_path / "resumed", "--dir", "ckpt", *EVERY, "--resume", str(folder / NAMES[2]))
    for rank in resumed:
        assert (rank.get("status"), rank.get("step")) == ("completed", 12), output
        assert rank["params"] == held[1][0]["params"]


@pytest.mark.slow
@pytest.mark.fault
def test_a_failed_sharded_run_writes_no_failure_checkpoint_of_one_ranks_parts(tmp_path: Path) -> None:
    """``on_failure=True``: the run fails on every rank (rank 1's copy into host memory at step 4,
    ``on_save_error="raise"``), and its process group ends with the failure, so the ranks cannot
    write a sharded checkpoint together any more. The failure's save is a failed save on every
    rank, said in one warning each, and no folder is written (not a ``failed-*.dcp`` of rank 0's
    half of each tensor). The run's own error stays the one raised."""
    ranks, output = run_sharded(tmp_path, "--dir", "ckpt", *EVERY, "--on-save-error", "raise",
                                "--fail-staging", "shards:4", "--on-failure")
    for rank in ranks:
        assert rank.get("error", "").startswith("CheckpointError: rank 1: copying its state into host memory"), output
        assert (rank["status"], rank["step"], rank["failed_saves"]) == ("failed", 4, 2), output
        [warned] = [m for c, m in rank["warnings"] if "fit_end failed" in m]
        assert ("checkpoint: every process writes its part of a sharded checkpoint, and the 2 processes of this run "
                "can no longer work together (their process group ended with the run's failure): nothing of "
                "failed-epoch0001-step000000004.dcp is written (hookfit: raised by plugin 'checkpoint'") in warned, warned
    assert _checkpoints(tmp_path / "ckpt") == NAMES[:1]


@pytest.mark.slow
@pytest.mark.fault
def test_a_copy_into_host_memory_failing_on_one_rank_is_raised_on_every_rank_at_its_step(tmp_path: Path) -> None:
    """``on_save_error="raise"``: rank 1's copy of the shards into host memory raises at the save
    of step 4; every rank stops there with the same error, naming rank 1 and its error (none
    waits for the other: the run ends within ``run_sharded``'s timeout); the checkpoint of step
    2 is whole, and nothing of step 4's is left."""
    ranks, output = run_sharded(tmp_path, "--dir", "ckpt", *EVERY, "--on-save-error", "raise",
                                "--fail-staging", "shards:4")
    errors = [r.get("error") for r in ranks]
    assert errors[0] is not None and errors[0] == errors[1], output
    assert errors[0] == ("CheckpointError: rank 1: copying its state into host memory: MemoryError: the host copy "
                         "of the shards was refused"), errors[0]
    assert [(r["step"], r["failed_saves"]) for r in ranks] == [(4, 1), (4, 1)], output
    assert _checkpoints(tmp_path / "ckpt") == NAMES[:1]
    assert read(tmp_path / "ckpt" / NAMES[0])["loop"]["step"] == 2


@pytest.mark.slow
@pytest.mark.fault
def test_an_interrupt_while_one_rank_copies_into_host_memory_stops_every_rank_at_its_step(tmp_path: Path) -> None:
    """Rank 1's copy of the shards into host memory raises ``KeyboardInterrupt`` at the save of
    step 4 (a second Ctrl-C on that rank alone): every rank stops there, interrupted (none waits
    in a collective the other never starts: the run ends within ``run_sharded``'s timeout), with
    ``KeyboardInterrupt`` (rank 1 its own, rank 0 one naming rank 1), though
    ``on_save_error="warn"`` goes on after a failed save: it is no failed save, and no warning;
    the checkpoint of step 2 is whole, and nothing of step 4's is left."""
    ranks, output = run_sharded(tmp_path, "--dir", "ckpt", *EVERY, "--fail-staging", "interrupt:4")
    for rank in ranks:
        assert (rank.get("status"), rank.get("stop_reason"), rank.get("step")) == (
            "interrupted", "KeyboardInterrupt", 4), output
        assert rank["failed_saves"] == 0 and [s["step"] for s in rank["saves"]] == [2, 4], rank
        assert not [m for c, m in rank["warnings"] if c == "CheckpointWarning"], rank["warnings"]
    assert ranks[1]["error"] == "KeyboardInterrupt: raised by rank 1's stager", ranks[1]["error"]  # its own
    assert ranks[0]["error"] == ("KeyboardInterrupt: rank 1: interrupted while copying its state into host "
                                 "memory"), ranks[0]["error"]
    assert _checkpoints(tmp_path / "ckpt") == NAMES[:1]  # no temporary folder of step 4's
    assert read(tmp_path / "ckpt" / NAMES[0])["loop"]["step"] == 2
