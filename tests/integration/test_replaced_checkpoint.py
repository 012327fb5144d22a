"""A package that replaces the built-in checkpoint on purpose, as core/hooks.md's checkpoint role
says: ``tests/packages/hookfit-json-checkpoint`` (entry point ``checkpoint``, and
``checkpoint = "hookfit"`` in its ``hookfit.replaces`` entry points; safetensors for tensors,
JSON for the rest), installed with a real pip into a temporary virtual environment. Nothing warns
of a clash, ``hookfit plugins`` names it and what it replaced, runs killed with SIGKILL in their
second epoch resume bit for bit (a list of batches, a shuffled DataLoader on the global
generator, one with a seeded generator of its own), its ``hookfit export`` writes the model, and
a damaged checkpoint is refused by name."""

from __future__ import annotations

import json
import signal
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from venvs import Venv, assert_not_in_running_env, make_venv
from conftest import REPO, TESTS

pytestmark = pytest.mark.slow

PACKAGE = REPO / "tests" / "packages" / "hookfit-json-checkpoint"
DISTRIBUTION, MODULE = "hookfit-json-checkpoint", "hookfit_json_checkpoint"
SCRIPT = TESTS / "scripts" / "replaced_checkpoint_train.py"
STEPS, PAUSE = 24, 13  # 3 epochs of 8 batches; the kill: batch 5 of the second epoch (saves every 3 steps)
KINDS = ["list", "global", "own"]


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Any:
    env = make_venv(tmp_path_factory.mktemp("json_checkpoint") / "venv")
    got = env.pip("install", "-q", "safetensors", check_rc=False)
    if got.returncode != 0:
        pytest.skip(f"safetensors cannot be installed here: {got.stderr.strip()[-300:]}")
    env.install(PACKAGE)
    yield env
    assert_not_in_running_env(DISTRIBUTION, MODULE)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("json_checkpoint_work")
    (folder / "hookfit.toml").write_text("[plugins.checkpoint]\nevery_n_steps = 3\nkeep_last = 2\n", encoding="utf-8")
    return folder


def environment(work: Path) -> dict[str, str]:
    return {"OMP_NUM_THREADS": "1", "HOOKFIT_CONFIG": str(work / "hookfit.toml")}


def start(venv: Venv, work: Path, out: Path, run_dir: Path, kind: str, *args: Any):
    return venv.popen(SCRIPT, out, "--run-dir", run_dir, "--data", kind, *args, cwd=work, **environment(work))


def finish(proc, out: Path) -> tuple[dict, str]:
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr
    assert "two distributions" not in stderr, stderr
    return torch.load(out, weights_only=True), stderr


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def straight(venv: Venv, work: Path) -> dict[str, tuple[dict, Path]]:
    """The uninterrupted run of each kind of data, and its folder (the three run at once)."""
    runs: dict[str, tuple[dict, Path]] = {}
    procs = {kind: start(venv, work, work / f"straight-{kind}.pt", work / f"straight-{kind}", kind) for kind in KINDS}
    for kind, proc in procs.items():
        result, _ = finish(proc, work / f"straight-{kind}.pt")
        assert (result["status"], result["step"], result["resumed"]) == ("completed", STEPS, None)
        runs[kind] = (result, work / f"straight-{kind}")
    return runs


def test_the_package_holds_the_checkpoint_role_without_a_clash(venv: Venv, work: Path) -> None:
    listed = venv.run("-m", "hookfit", "plugins", "--json", cwd=work, **environment(work))
    assert "two distributions" not in listed.stderr, listed.stderr
    row = {r["name"]: r for r in json.loads(listed.stdout)}["checkpoint"]
    assert (row["distribution"], row["value"], row["enabled"], row["error"]) == (
        DISTRIBUTION, f"{MODULE}:JsonCheckpoint", True, None)
    assert row["replaces"].startswith("hookfit ") and row["replaces"].endswith("(hookfit.plugins.checkpoint:Checkpoint)")
    text = venv.run("-m", "hookfit", "plugins", cwd=work, **environment(work)).stdout
    assert f"checkpoint  [active]  {DISTRIBUTION} 0.1.0" in text and "    replaces: hookfit " in text, text


@pytest.mark.fault
@pytest.mark.parametrize("kind", KINDS)
def test_a_run_killed_in_its_second_epoch_resumes_bit_for_bit(venv: Venv, work: Path, straight, kind: str) -> None:
    want, _ = straight[kind]
    run_dir = work / f"killed-{kind}"
    proc = start(venv, work, work / f"killed-{kind}.pt", run_dir, kind, "--pause-at", PAUSE)
    for line in proc.stdout:
        if line.startswith("paused"):
            break
    else:
        pytest.fail(f"the run ended without pausing: {proc.communicate()[1]}")
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    left = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert left == ["epoch0002-step000000009.json", "epoch0002-step000000009.safetensors",
                    "epoch0002-step000000012.json", "epoch0002-step000000012.safetensors"], left  # keep_last=2

    got, said = finish(start(venv, work, work / f"resumed-{kind}.pt", run_dir, kind, "--resume", "latest"),
                       work / f"resumed-{kind}.pt")
    assert (got["status"], got["step"], got["resumed"]) == ("completed", STEPS, 12)
    assert "cannot be rebuilt" not in said, said
    assert same(got["params"], want["params"])


def test_export_writes_the_model_of_the_newest_checkpoint(venv: Venv, work: Path, straight) -> None:
    want, run_dir = straight["own"]
    out = work / "exported.pt"
    done = venv.run("-m", "hookfit", "export", run_dir, out, cwd=work, **environment(work))
    assert "epoch0003-step000000024.json" in done.stdout, done.stdout  # the end of the third epoch
    assert same(torch.load(out, weights_only=True), want["params"])


@pytest.mark.bad_input
def test_a_damaged_checkpoint_is_refused_by_name(venv: Venv, work: Path, straight) -> None:
    _, run_dir = straight["list"]
    copy = work / "damaged"
    shutil.copytree(run_dir, copy)
    tensors = copy / "checkpoints" / "epoch0003-step000000024.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 0xFF
    tensors.write_bytes(bytes(data))
    for source in ("latest", str(tensors.with_suffix(".json"))):
        proc = start(venv, work, work / "damaged.pt", copy, "list", "--resume", source)
        _, stderr = proc.communicate(timeout=180)
        assert proc.returncode != 0
        assert f"checkpoint: {tensors} is damaged" in stderr, stderr
