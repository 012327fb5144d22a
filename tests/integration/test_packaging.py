"""``pip install .`` (not editable) gives a working package, plugins and command."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO



@pytest.mark.slow
def test_regular_install_has_package_plugins_and_command(tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".venv", ".git", "runs", "build", "*.egg-info", "__pycache__"))
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(source)],
        check=True, capture_output=True, timeout=300,
    )
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")},
           "PYTHONPATH": str(target)}
    probe = (
        "import json, hookfit, hookfit.plugins.optim as o;"
        "print(json.dumps([hookfit.__file__, o.__file__]))"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout
    assert all(path.startswith(str(target)) for path in json.loads(out))
    script = target / "bin" / "hookfit"
    listing = subprocess.run([sys.executable, str(script), "plugins", "--json"], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0, listing.stderr
    names = {row["name"]: row for row in json.loads(listing.stdout)}
    assert {"optim", "metrics", "console", "interrupter"} <= set(names)
    assert names["optim"]["distribution"] == "hookfit" and names["optim"]["enabled"]


@pytest.mark.slow
def test_urwid_and_torch_are_imported_only_when_needed(tmp_path: Path) -> None:
    """``import hookfit`` and the pytest plugin import no torch (a plugin module that needs only
    ``hookimpl`` stays light); a run without a terminal never imports urwid."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")}
    probe = (
        "import sys, hookfit, hookfit.testing\n"
        "print('torch' in sys.modules)\n"
        "import hookfit\n"
        "hookfit.Loop(lambda loop, b: None, [1], run_dir='run').fit()\n"
        "print('urwid' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "False", "import hookfit / hookfit.testing imported torch"
    assert lines[-1] == "False", "a run without a terminal imported urwid"


def test_requires_python_is_no_lower_than_what_the_code_uses() -> None:
    """hookfit imports ``tomllib`` and uses ``BaseException.add_note`` (Python 3.11): a lower
    ``requires-python`` would let pip install a package that does not import."""
    import ast
    import re
    import tomllib

    root = REPO
    spec = tomllib.loads((root / "pyproject.toml").read_text())["project"]["requires-python"]
    minimum = tuple(int(part) for part in re.fullmatch(r">=\s*(\d+)\.(\d+)", spec).groups())
    needs = set()
    for path in [*(root / "core").rglob("*.py"), *(root / "plugins").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import) and any(a.name == "tomllib" for a in node.names):
                needs.add(("tomllib", path.name))
            if isinstance(node, ast.Attribute) and node.attr == "add_note":
                needs.add(("add_note", path.name))
    assert needs, "the check looks for nothing: update it"
    assert minimum >= (3, 11), f"requires-python {spec!r}, but the code uses {sorted(needs)} (3.11+)"
    assert sys.version_info[:2] >= minimum
