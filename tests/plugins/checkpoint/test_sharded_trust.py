"""Sharded checkpoints (FSDP2, ``torch.distributed.checkpoint``) with the one-file checkpoint's
guarantees: DCP's ``.metadata`` (a pickle) is never unpickled by anything that could
run code from it; every shard file's digest, recorded in ``state.pt``, is checked at resume and
by ``hookfit export``; a damaged or missing shard is named, and skipped by ``fallback``; a save
on a full or read-only disk, written in the background or in the foreground, warns and every rank
trains on; ``hookfit export`` never writes over the checkpoint it reads.

The checkpoints are written by real ``torchrun`` processes (2, gloo on the CPU) running
``tests/scripts/sharded_run.py``; each test damages a copy of them."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TESTS

import hookfit
from hookfit.plugins.checkpoint import Checkpoint, CheckpointWarning, digest, read
from hookfit.plugins.checkpoint.storage import CheckpointError
from hookfit.plugins.optim import Optim
from hookfit.tools import cli

SCRIPT = TESTS / "scripts" / "sharded_run.py"
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
              "TORCHELASTIC_RUN_ID")
NEWEST = "epoch0004-step000000016.dcp"
NAMES = ["epoch0001-step000000004.dcp", "epoch0002-step000000008.dcp", "epoch0003-step000000012.dcp", NEWEST]


@pytest.fixture(autouse=True)
def _not_launched(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process is not started by torchrun, whatever started pytest."""
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)


def _torchrun() -> list[str]:
    script = Path(sys.executable).with_name("torchrun")
    return [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]


def run_sharded(folder: Path, *args: str) -> tuple[list[dict[str, Any]], str]:
    """``torchrun --nproc-per-node 2 sharded_run.py out ARGS`` in ``folder``: each rank's dump
    and the output."""
    launch = ["--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV and k != "HOOKFIT_DISABLE_PLUGINS"}
    env.update(OMP_NUM_THREADS="1", HOOKFIT_PLUGINS="", PYTHONFAULTHANDLER="1")
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([*_torchrun(), *launch, str(SCRIPT), "out", *args], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=180)
    output = done.stdout + done.stderr
    dumps = [json.loads((folder / f"out.rank{rank}.json").read_text()) if (folder / f"out.rank{rank}.json").exists()
             else {} for rank in (0, 1)]
    return dumps, output


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """The checkpoints of a 2-process FSDP run of 4 epochs (one a epoch, every one kept), and
    the parameters it ended with."""
    folder = tmp_path_factory.mktemp("written")
    ranks, output = run_sharded(folder, "--dir", "ckpt", "--epochs", "4")
    assert [r.get("status") for r in ranks] == ["completed", "completed"], output
    checkpoints = folder / "ckpt"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name != "run.lock") == NAMES
    return checkpoints, ranks[0]["params"]


@pytest.fixture
def ckpt(written: tuple[Path, list[float]], tmp_path: Path) -> Path:
    """A copy of the written checkpoints' folder, this test's to damage."""
    copy = tmp_path / "ckpt"
    shutil.copytree(written[0], copy, ignore=shutil.ignore_patterns("run.lock"))
    return copy


def _contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _crafted(marker: Path) -> bytes:
    """A pickle that, unpickled, calls ``open(marker, "w")``: it runs code of the file's choosing."""

    class Runs:
        def __reduce__(self) -> Any:
            return (open, (str(marker), "w"))

    return pickle.dumps(Runs())


def _flip_a_bit_of_a_tensor(shard: Path, folder: Path) -> None:
    """Flip one bit in the bytes of a tensor stored in ``shard`` (so nothing but a digest can
    see it: the file still reads)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    raw = bytearray(shard.read_bytes())
    info = next(i for i in FileSystemReader(str(folder)).read_metadata().storage_data.values()  # our own file
                if i.relative_path == shard.name)
    piece = bytes(raw[info.offset:info.offset + info.length])
    values = torch.load(io.BytesIO(piece), weights_only=True).contiguous().numpy().tobytes()
    at = info.offset + piece.index(values)
    raw[at] ^= 0x01
    shard.write_bytes(bytes(raw))


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("hookfit_sharded_run", SCRIPT)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _resume_here(ckpt: Path, source: Path, fallback: bool = False) -> Any:
    """Resume ``source`` in this process (no process group: the shards read whole)."""
    model, optimizer, data, step = _script().build()
    checkpoint = Checkpoint(dir=ckpt, keep_last=10, fallback=fallback)
    hookfit.Loop(step, data, model=model, optimizers=optimizer, max_epochs=5, resume=str(source),
                 plugins=[Optim(), checkpoint]).fit()
    return checkpoint


def _export(source: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(["export", str(source), str(out)], plugins=[Checkpoint()])
    return code, capsys.readouterr().err


# -- DCP's metadata: never unpickled ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.fault
def test_a_crafted_metadata_is_refused_by_resume_and_export_and_never_runs(
        ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    newest = ckpt / NEWEST
    proof = tmp_path / "proof"  # what DCP's own reader does with such a file: it runs it
    shutil.copytree(newest, proof)
    (proof / ".metadata").write_bytes(_crafted(tmp_path / "ran-in-dcp"))
    with contextlib.suppress(Exception):
        FileSystemReader(str(proof)).read_metadata()
    assert (tmp_path / "ran-in-dcp").exists()

    marker = tmp_path / "ran"
    (newest / ".metadata").write_bytes(_crafted(marker))
    before = _contents(ckpt)
    with pytest.raises(CheckpointError, match=rf"{NEWEST}/\.metadata: its bytes do not match the digest"):
        _resume_here(ckpt, newest)
    code, err = _export(newest, tmp_path / "model.pt", capsys)
    assert code == 2 and f"{NEWEST}/.metadata: its bytes do not match" in err, err
    code, err = _export(ckpt, tmp_path / "model.pt", capsys)  # the folder: its newest checkpoint
    assert code == 2 and ".metadata" in err, err
    assert not marker.exists() and not (tmp_path / "model.pt").exists()
    assert _contents(ckpt) == before


@pytest.mark.slow
@pytest.mark.fault
def test_without_recorded_digests_the_metadata_is_still_read_without_running_code(
        ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A sharded checkpoint of an older hookfit (``state.pt`` records no file digests) is read
    with a warning; its ``.metadata`` is unpickled by hookfit's restricted unpickler, which
    refuses a crafted one (naming what it names), one that stores a tensor as bytes (DCP reads
    those with ``torch.load(weights_only=False)``) and one that asks for a transform."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    newest = ckpt / NEWEST
    state = torch.load(newest / "state.pt", weights_only=True)
    state["meta"].pop("files", None)
    state["digest"] = digest(state)
    torch.save(state, newest / "state.pt")
    with pytest.warns(CheckpointWarning, match=rf"{NEWEST} records no digests of its shard files"):
        assert cli.main(["export", str(newest), str(tmp_path / "model.pt")], plugins=[Checkpoint()]) == 0
    assert list(torch.load(tmp_path / "model.pt", weights_only=True)) == ["0.weight", "0.bias", "2.weight", "2.bias"]

    good = (newest / ".metadata").read_bytes()
    marker = tmp_path / "ran"
    (newest / ".metadata").write_bytes(_crafted(marker))
    with pytest.warns(CheckpointWarning, match="records no digests"):
        with pytest.raises(CheckpointError, match=r"\.metadata is refused, not DCP's metadata .*UnpicklingError: "
                                                  r"it names (io|_io|builtins)\.open"):
            read(newest)
    with pytest.warns(CheckpointWarning, match="records no digests"):
        with pytest.raises(CheckpointError, match=r"\.metadata is refused"):
            _resume_here(ckpt, newest)
    assert not marker.exists()

    metadata = pickle.loads(good)  # (our own file)
    metadata.state_dict_metadata["model/0.weight"] = BytesStorageMetadata()
    (newest / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.warns(CheckpointWarning, match="records no digests"):
        with pytest.raises(CheckpointError, match=r"stores 'model/0.weight' as BytesStorageMetadata, not as a tensor"):
            read(newest)

    metadata = pickle.loads(good)  # what one rank alone writes: its chunks of a tensor, not the others'
    entry = metadata.state_dict_metadata["model/0.weight"]
    entry.chunks = entry.chunks[:1] if len(entry.chunks) > 1 else [type(entry.chunks[0])(
        offsets=entry.chunks[0].offsets, sizes=torch.Size([entry.size[0] // 2, *entry.size[1:]]))]
    (newest / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.warns(CheckpointWarning, match="records no digests"):
        with pytest.raises(CheckpointError, match=r"its chunks of 'model/0.weight' hold 16 of its 32 elements: a "
                                                  r"checkpoint that not every process of the run wrote its part of"):
            read(newest)

    metadata = pickle.loads(good)  # a file read through a transform (a decompression) hookfit never asks for
    next(iter(metadata.storage_data.values())).transform_descriptors = ["zstd"]
    (newest / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.warns(CheckpointWarning, match="records no digests"):
        with pytest.raises(CheckpointError, match=r"has '__0_0.distcp' read through the transforms \['zstd'\]"):
            read(newest)


# -- shards: a digest each ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.fault
def test_a_flipped_bit_in_a_shard_is_named_by_resume_and_export(
        ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    newest = ckpt / NEWEST
    _flip_a_bit_of_a_tensor(newest / "__1_0.distcp", newest)
    shard = rf"{NEWEST}/__1_0\.distcp: its bytes do not match the digest state\.pt records"
    with pytest.raises(CheckpointError, match=shard):
        _resume_here(ckpt, newest)
    code, err = _export(newest, tmp_path / "model.pt", capsys)
    assert code == 2 and f"{NEWEST}/__1_0.distcp: its bytes do not match" in err, err
    assert not (tmp_path / "model.pt").exists()


@pytest.mark.slow
@pytest.mark.fault
def test_a_missing_rank_s_shard_is_named(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    newest = ckpt / NEWEST
    (newest / "__1_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=rf"{NEWEST} lacks __1_0\.distcp, one of its files .*torn"):
        _resume_here(ckpt, newest)
    code, err = _export(newest, tmp_path / "model.pt", capsys)
    assert code == 2 and f"{NEWEST} lacks __1_0.distcp" in err, err


@pytest.mark.slow
@pytest.mark.fault
def test_fallback_skips_damaged_torn_and_crafted_sharded_checkpoints_on_every_rank(
        ckpt: Path, written: tuple[Path, list[float]], tmp_path: Path) -> None:
    """Under torchrun: the newest checkpoint has a crafted ``.metadata``, the one before lost
    rank 1's shard, the one before that has a flipped bit. ``Checkpoint(fallback=True)`` skips
    each on both ranks, with a warning naming the file, and resumes from the first epoch's: the
    run ends bitwise where the uninterrupted one did."""
    marker = tmp_path / "ran"
    (ckpt / NAMES[3] / ".metadata").write_bytes(_crafted(marker))
    (ckpt / NAMES[2] / "__1_0.distcp").unlink()
    _flip_a_bit_of_a_tensor(ckpt / NAMES[1] / "__0_0.distcp", ckpt / NAMES[1])
    ranks, output = run_sharded(tmp_path / "run", "--dir", str(ckpt), "--epochs", "4", "--resume", "latest",
                                "--fallback")
    assert not marker.exists()
    for rank in ranks:
        assert rank.get("status") == "completed", output
        assert Path(rank["resumed_from"]).name == NAMES[0]
        skipped = [m for c, m in rank["warnings"] if c == "CheckpointWarning" and "trying an older one" in m]
        assert len(skipped) == 3, rank["warnings"]
        assert f"{NAMES[3]}/.metadata: its bytes do not match" in skipped[0]
        assert f"{NAMES[2]} lacks __1_0.distcp" in skipped[1]
        assert f"{NAMES[1]}/__0_0.distcp: its bytes do not match" in skipped[2]
        assert rank["params"] == written[1]  # the uninterrupted run's end, bitwise


# -- saving ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.parametrize("disk, written", [("full", "background"), ("read-only", "background"),
                                           ("read-only", "foreground")])
def test_a_sharded_save_that_cannot_be_written_warns_and_every_rank_trains_on(
        tmp_path: Path, disk: str, written: str, request: pytest.FixtureRequest) -> None:
    """A full disk (``RLIMIT_FSIZE`` from the second epoch: the kernel refuses the writes as a
    full disk does) or a read-only folder, the checkpoints written in the background (the
    default) or in the foreground (``background=False``): one ``CheckpointWarning`` (rank 0's,
    as a one-file save's), every rank completes and counts the failed saves, and no folder is
    left that looks like a checkpoint, nor a temporary one."""
    how = ("--sync",) if written == "foreground" else ()
    if disk == "full":
        folder = tmp_path / "ckpt"
        ranks, output = run_sharded(tmp_path, "--dir", str(folder), "--epochs", "3", "--squeeze-at", "2", *how)
        failed, first, error = 2, "epoch0002", "File too large"
    else:
        folder = request.getfixturevalue("read_only_folder")
        ranks, output = run_sharded(tmp_path, "--dir", str(folder), "--epochs", "3", *how)
        failed, first, error = 3, "epoch0001", "(Read-only file system|Permission denied)"
    for rank in ranks:
        assert (rank.get("status"), rank.get("step"), rank.get("failed_saves")) == ("completed", 12, failed), output
    [warning] = [m for c, m in ranks[0]["warnings"] if c == "CheckpointWarning"]
    assert all("could not write" not in m for _, m in ranks[1]["warnings"])  # said once, by rank 0
    assert re.search(rf"could not write .*/{first}-step\d+\.dcp, the save at step \d+(?: \(written in the "
                     rf"background, its failure found at step \d+\))? \(OSError: rank \d: .*{error}.*\); the previous "
                     r"checkpoints are kept and (training goes on|the run ends \(completed\))$", warning), warning
    # (the run ends: a write in the background whose failure was found as the run ended)
    left = sorted(p.name for p in folder.iterdir() if p.name != "run.lock")
    assert left == ([NAMES[0]] if disk == "full" else []), left
    if disk == "full":
        assert read(folder / NAMES[0])["loop"]["step"] == 4  # the checkpoint before, whole


# -- export never writes over its input --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.bad_input
def test_export_refuses_to_write_over_the_checkpoint_it_reads(
        ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    newest = ckpt / NEWEST
    plain = tmp_path / "plain"
    model = torch.nn.Linear(3, 1)
    hookfit.Loop(lambda loop, batch: None, [0, 1], model=model, plugins=[Checkpoint(dir=plain)]).fit()
    [file] = plain.glob("*.pt")
    before = {"sharded": _contents(ckpt), "plain": _contents(plain)}
    cases = [(file, file, "is the checkpoint it would read"), (plain, file, "is the checkpoint it would read"),
             (newest, newest, "is the checkpoint it would read"), (ckpt, newest, "is the checkpoint it would read"),
             (newest, newest / "state.pt", "is inside the checkpoint it would read"),
             (ckpt, newest / "model.pt", "is inside the checkpoint it would read")]
    for source, out, says in cases:
        code, err = _export(source, out, capsys)
        assert code == 2, (source, out)
        assert f"hookfit export: {out} {says}" in err and "would replace the checkpoint" in err, err
    assert {"sharded": _contents(ckpt), "plain": _contents(plain)} == before
