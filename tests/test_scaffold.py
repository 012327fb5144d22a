"""``hookfit new-plugin``: the generated package installs, is discovered and its test passes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def run(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOOKFIT_", "PIP_")) and k != "PYTHONPATH"}
    result = subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_new_plugin_installs_is_discovered_and_its_test_passes(tmp_path: Path) -> None:
    made = run(sys.executable, "-m", "hookfit.cli", "new-plugin", "epoch_log", "--dir", str(tmp_path), cwd=tmp_path)
    root = tmp_path / "hookfit-epoch-log"
    assert f"created {root}" in made.stdout
    try:
        run(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(root), cwd=tmp_path)
        listing = json.loads(run(sys.executable, "-m", "hookfit.cli", "plugins", "--json", cwd=tmp_path).stdout)
        row = next(r for r in listing if r["name"] == "epoch_log")
        assert row["distribution"] == "hookfit-epoch-log" and row["enabled"] and row["hooks"] == ["epoch_end"]
        tests = run(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", cwd=root)
        assert "2 passed" in tests.stdout
    finally:
        run(sys.executable, "-m", "pip", "uninstall", "-y", "-q", "hookfit-epoch-log", cwd=tmp_path, check=False)
    after = json.loads(run(sys.executable, "-m", "hookfit.cli", "plugins", "--json", cwd=tmp_path).stdout)
    assert "epoch_log" not in [r["name"] for r in after]


def test_new_plugin_refuses_bad_names_and_existing_folders(tmp_path: Path) -> None:
    bad = run(sys.executable, "-m", "hookfit.cli", "new-plugin", "Bad-Name", "--dir", str(tmp_path), cwd=tmp_path, check=False)
    assert bad.returncode == 2 and "must be lowercase letters" in bad.stderr
    run(sys.executable, "-m", "hookfit.cli", "new-plugin", "twice", "--dir", str(tmp_path), cwd=tmp_path)
    again = run(sys.executable, "-m", "hookfit.cli", "new-plugin", "twice", "--dir", str(tmp_path), cwd=tmp_path, check=False)
    assert again.returncode == 2 and "already exists" in again.stderr
