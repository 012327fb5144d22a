"""The package's own metadata: what a base install brings."""

from __future__ import annotations

import shutil
import subprocess
import sys
from email.parser import Parser
from pathlib import Path

from conftest import REPO


def test_a_base_install_brings_numpy(tmp_path: Path) -> None:
    """torch imports numpy when it is there and prints "Failed to initialize NumPy" on every
    command when it is not: numpy is a dependency. Read from the metadata a build makes of the
    sources (a copy, so the work tree gets no build files)."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "setup.cfg", "README.md"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, source / name)
    for folder in ("core", "plugins"):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "meta"
    out.mkdir()
    code = ("import sys, setuptools.build_meta as b; "
            "print(b.prepare_metadata_for_build_wheel(sys.argv[1]))")
    done = subprocess.run([sys.executable, "-c", code, str(out)], cwd=source, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    info = out / done.stdout.strip().splitlines()[-1]
    metadata = Parser().parsestr((info / "METADATA").read_text())
    required = [r.split(";")[0].strip() for r in metadata.get_all("Requires-Dist") or [] if "extra ==" not in r]
    names = {r.split(">")[0].split("=")[0].split("<")[0].strip().lower() for r in required}
    assert {"numpy", "torch", "pluggy"} <= names, required
