"""The package passes ``mypy --strict``, and its few ``type: ignore`` comments are narrow and
explained (at most 20, each with its error code and its reason).

mypy cannot follow the editable install's folder mapping (``hookfit`` is ``core/``,
``hookfit.plugins`` is ``plugins/``), so the check runs over a tree of symbolic links laid out
as the import package is. It needs mypy in the suite's interpreter (the ``test`` extra has it)
and is skipped without it.
"""

from __future__ import annotations

import importlib.util
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
from conftest import REPO

ROOT = REPO

PACKAGES = ["hookfit"]
"""The packages ``mypy --strict`` checks (``-p``): the whole of hookfit, its plugins included."""

COUNTED = ["core", "plugins"]
"""The source folders whose ``type: ignore`` comments are counted."""

MAX_IGNORES = 20
"""At most this many ``type: ignore`` comments in the counted folders together."""

IGNORE = re.compile(r"#\s*type:\s*ignore\b")
EXPLAINED = re.compile(r"#\s*type:\s*ignore\[[a-z0-9-]+(?:\s*,\s*[a-z0-9-]+)*\]\s*#\s*\S")
"""``# type: ignore[code]  # the reason``: one or more error codes, then a comment."""


def _shim(where: Path) -> Path:
    """A tree ``where/hookfit`` of links that is the import package: ``core/``'s modules and
    sub-packages, and ``plugins/`` as ``hookfit/plugins``."""
    package = where / "hookfit"
    package.mkdir(parents=True)
    for entry in sorted((ROOT / "core").iterdir()):
        if entry.suffix == ".py" or (entry.is_dir() and (entry / "__init__.py").exists()):
            (package / entry.name).symlink_to(entry)
    (package / "plugins").symlink_to(ROOT / "plugins")
    return where


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                    reason="mypy is not installed in this interpreter (pip install -e '.[test]' brings it)")
def test_mypy_strict_passes_over_the_package(tmp_path: Path) -> None:
    shim = _shim(tmp_path / "shim")
    command = [sys.executable, "-m", "mypy", "--strict", "--config-file", str(ROOT / "pyproject.toml"),
               "--python-executable", sys.executable, "--cache-dir", str(tmp_path / "mypy_cache")]
    for package in PACKAGES:
        command += ["-p", package]
    result = subprocess.run(command, cwd=shim, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"mypy --strict over {', '.join(PACKAGES)} failed:\n{output}"


def _ignores() -> list[tuple[str, int, str]]:
    """Every ``type: ignore`` comment in the counted folders: (file, line, comment)."""
    found = []
    for folder in COUNTED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            source = path.read_text(encoding="utf-8")
            for token in tokenize.generate_tokens(io.StringIO(source).readline):
                if token.type == tokenize.COMMENT and IGNORE.search(token.string):
                    found.append((str(path.relative_to(ROOT)), token.start[0], token.string))
    return found


def test_type_ignores_are_few_narrow_and_explained() -> None:
    ignores = _ignores()
    listing = "\n".join(f"  {file}:{line}: {comment}" for file, line, comment in ignores)
    assert len(ignores) <= MAX_IGNORES, (
        f"{len(ignores)} type: ignore comments in {', '.join(COUNTED)} (at most {MAX_IGNORES}):\n{listing}")
    unexplained = [(file, line, comment) for file, line, comment in ignores if not EXPLAINED.search(comment)]
    assert not unexplained, (
        "each type: ignore names its error code(s) and gives its reason, as in "
        "`# type: ignore[no-untyped-call]  # unannotated in torch`:\n"
        + "\n".join(f"  {file}:{line}: {comment}" for file, line, comment in unexplained))
