"""End to end: the example third-party plugin package, installed with a real pip.

examples/hookfit-example-plugin is copied to a temporary folder, installed (not editable) into a
temporary virtual environment of its own (tests/venvs.py: it sees the running environment's
packages, the running environment never sees it), exercised through fresh interpreters of that
environment (a run and ``hookfit plugins --json``), and uninstalled there again. Nothing is
imported in this process: entry-point discovery is only trustworthy in an interpreter started
after the install.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
from pathlib import Path

import pytest
from venvs import Venv, assert_not_in_running_env, venv  # noqa: F401 (venv: a fixture)
from conftest import REPO

pytestmark = pytest.mark.slow

PACKAGE = REPO / "examples" / "hookfit-example-plugin"
DIST = "hookfit-example-plugin"
NAME = "example_counter"
MODULE = "hookfit_example_plugin"
TIMEOUT = 300

# A run of 5 batches x 2 epochs; prints what the test checks as one JSON line.
RUN = f"""
import json, sys
import hookfit

state = hookfit.Loop(lambda loop, batch: {{"value": batch}}, list(range(5)), max_epochs=2).fit()
module = sys.modules.get({MODULE!r})
print(json.dumps({{
    "status": state.status,
    "step": state.step,
    "module_file": getattr(module, "__file__", None),
}}))
"""


def _canonical(name: str | None) -> str | None:
    return None if name is None else re.sub(r"[-_.]+", "-", name).lower()


def _plugins(venv: Venv, cwd: Path, **extra: str) -> dict[str, dict]:
    out = venv.run("-m", "hookfit.tools.cli", "plugins", "--json", cwd=cwd, timeout=TIMEOUT, **extra).stdout
    rows = json.loads(out)
    return {row["name"]: row for row in rows}


def _fit(venv: Venv, cwd: Path, **extra: str) -> dict:
    out = venv.run("-c", RUN, cwd=cwd, timeout=TIMEOUT, **extra).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_example_package_installs_runs_disables_and_uninstalls(tmp_path: Path, venv: Venv) -> None:
    # their metadata, not importlib.util.find_spec(): on Python < 3.12 asking the import system
    # for "pip" turns setuptools' distutils shim off in this process for good, and a later
    # `import setuptools` (inductor's, in another test of this worker) then fails its assert
    for needed in ("pip", "setuptools"):
        try:
            importlib.metadata.distribution(needed)
        except importlib.metadata.PackageNotFoundError:
            pytest.fail(f"{needed} is not installed; this test installs a package with a real pip")
    work = tmp_path / "cwd"  # neither the repo nor the package source is on sys.path from here
    work.mkdir()
    source = tmp_path / "hookfit-example-plugin"
    shutil.copytree(
        PACKAGE, source, ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__")
    )

    before = _plugins(venv, work)
    assert NAME not in before, f"{DIST} is already installed; uninstall it before running this test"

    venv.install(source, copy=False)  # into the temporary venv only
    try:
        assert_not_in_running_env(DIST, MODULE)

        # -- discovered, listed, enabled, with its hooks ---------------------------------------
        row = _plugins(venv, work)[NAME]
        assert _canonical(row["distribution"]) == DIST
        assert row["version"] == "0.1.0"
        assert row["source"] == "entry point"
        assert row["value"] == f"{MODULE}:ExampleCounter"
        assert row["enabled"] is True
        assert row["error"] is None
        assert row["hooks"] == ["batch_end", "epoch_start", "fit_end", "fit_start", "stage_start"]

        # -- a run fires its hooks and it writes its summary -----------------------------------
        out = tmp_path / "out" / "counts.json"
        result = _fit(venv, work, HOOKFIT_EXAMPLE_OUT=str(out))
        assert result["status"] == "completed"
        assert result["step"] == 10
        # the installed copy was imported, not the source in the repository or in tmp_path
        module_file = Path(result["module_file"]).resolve()
        assert PACKAGE not in module_file.parents and source not in module_file.parents
        assert module_file.is_relative_to(venv.site_packages.resolve())
        lines = out.read_text(encoding="utf-8").splitlines()
        assert len(lines) == 1
        summary = json.loads(lines[0])
        assert summary == {
            "plugin": NAME,
            "status": "completed",
            "stop_reason": "max_epochs=2 reached",
            "epochs": 2,
            "steps": 10,
            "batches": {"train": 10},
            "skipped": {"train": 0},
            "stages": {"train": 2},
        }

        # -- disabled: listed as such, never imported, writes nothing --------------------------
        row = _plugins(venv, work, HOOKFIT_DISABLE_PLUGINS=NAME)[NAME]
        assert row["enabled"] is False
        assert row["error"] is None
        assert row["hooks"] == []
        out_disabled = tmp_path / "out" / "disabled.json"
        result = _fit(venv, work, HOOKFIT_EXAMPLE_OUT=str(out_disabled), HOOKFIT_DISABLE_PLUGINS=NAME)
        assert result["status"] == "completed"
        assert result["module_file"] is None  # a disabled plugin is never imported
        assert not out_disabled.exists()
    finally:
        venv.uninstall(DIST)  # inside the temporary venv
    assert_not_in_running_env(DIST, MODULE)

    # -- gone after uninstalling, and hookfit still works without it ---------------------------
    assert not venv.has(DIST)
    after = _plugins(venv, work)
    assert NAME not in after
    assert sorted(after) == sorted(before)
    assert _fit(venv, work)["status"] == "completed"
