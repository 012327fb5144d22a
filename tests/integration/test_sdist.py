"""The source distribution can run its own tests: ``MANIFEST.in`` ships the shared
test helpers, scripts, plugin packages, examples, benchmarks and ``core/hooks.md``.

The sdist is built from a copy of the project's files, unpacked, installed (not editable) into a
folder of its own, and a quick part of its suite runs from the unpacked copy against that
installation: the reference-page checks, the README's first script and reliability counts, and
the examples' plugin discovery."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import REPO
from venvs import copy_project

pytestmark = pytest.mark.slow

QUICK = [
    "tests/tools/test_cli.py::test_the_hooks_reference_page_is_up_to_date",
    "tests/tools/test_cli.py::test_the_reference_page_opens_with_the_loop_and_has_a_section_per_plugin",
    "tests/integration/test_readme.py::test_first_script_runs_as_written",
    "tests/integration/test_readme.py::test_the_reliability_counts_are_what_the_suite_exercises",
    "tests/core/test_payloads.py",
]


def test_the_sdist_holds_what_its_tests_need_and_they_pass_from_it(tmp_path: Path) -> None:
    source = copy_project(REPO, tmp_path / "source")
    build = subprocess.run(
        [sys.executable, "-c", "import sys; from setuptools import build_meta; "
                               "print(build_meta.build_sdist(sys.argv[1]))", str(tmp_path / "dist")],
        cwd=source, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    archive = tmp_path / "dist" / build.stdout.strip().splitlines()[-1]
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        tar.extractall(tmp_path / "unpacked", filter="data")
    root = tmp_path / "unpacked" / archive.name.removesuffix(".tar.gz")
    for needed in ("tests/conftest.py", "tests/venvs.py", "tests/terminal.py", "core/hooks.md",
                   "examples/digits.py", "benchmarks/overhead.py"):
        assert f"{root.name}/{needed}" in names, f"the sdist lacks {needed}"
    assert any(n.startswith(f"{root.name}/tests/scripts/") for n in names)
    assert any(n.startswith(f"{root.name}/tests/packages/") for n in names)
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(site), str(root)], check=True, capture_output=True, timeout=300)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("HOOKFIT_", "PYTEST_", "PIP_"))},
           "PYTHONPATH": str(site), "PATH": f"{site / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    where = subprocess.run([sys.executable, "-c", "import json, hookfit; print(json.dumps(hookfit.__file__))"],
                           cwd=root, env=env, capture_output=True, text=True, check=True)
    assert json.loads(where.stdout).startswith(str(site)), where.stdout  # the sdist's copy, not this checkout
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *QUICK],
                           cwd=root, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout and "failed" not in tests.stdout
