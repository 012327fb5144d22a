"""``hookfit new-plugin``: the generated package installs, is discovered and its test passes.

The package is installed (editable, as its README says) into a temporary virtual environment of
its own (tests/venvs.py), never into the one running the suite."""

from __future__ import annotations

import json
import os
import shlex
from importlib import metadata
import subprocess
import sys
from pathlib import Path

import pytest
from venvs import Venv, assert_not_in_running_env, venv  # noqa: F401 (venv: a fixture)

pytestmark = pytest.mark.slow


def run(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOOKFIT_", "PIP_")) and k != "PYTHONPATH"}
    result = subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_new_plugin_installs_is_discovered_and_its_test_passes(tmp_path: Path, venv: Venv) -> None:
    made = run(sys.executable, "-m", "hookfit.tools.cli", "new-plugin", "epoch_log", "--dir", str(tmp_path), cwd=tmp_path)
    root = tmp_path / "hookfit-epoch-log"
    assert f"created {root}" in made.stdout
    readme = (root / "README.md").read_text()
    assert "pypi.org" not in readme and "http" not in readme  # no page that does not exist
    # exactly the generated README's command, with its dependencies checked, offline: it
    # installs next to the installed hookfit (which the package index does not have)
    command = next(shlex.split(line.split("#")[0]) for line in readme.splitlines() if "pip install" in line)
    assert command[:2] == ["pip", "install"]
    venv.pip(*command[1:], "--no-index", cwd=root)  # into the temporary venv only
    assert f'"hookfit>={metadata.version("hookfit")}"' in (root / "pyproject.toml").read_text()
    try:
        assert_not_in_running_env("hookfit-epoch-log", "hookfit_epoch_log")
        listing = json.loads(venv.run("-m", "hookfit.tools.cli", "plugins", "--json", cwd=tmp_path).stdout)
        row = next(r for r in listing if r["name"] == "epoch_log")
        assert row["distribution"] == "hookfit-epoch-log" and row["enabled"] and row["hooks"] == ["epoch_end"]
        tests = venv.run("-m", "pytest", "-q", "-p", "no:cacheprovider", cwd=root)
        assert "2 passed" in tests.stdout
    finally:
        venv.uninstall("hookfit-epoch-log")  # inside the temporary venv
    after = json.loads(venv.run("-m", "hookfit.tools.cli", "plugins", "--json", cwd=tmp_path).stdout)
    assert "epoch_log" not in [r["name"] for r in after]
    assert_not_in_running_env("hookfit-epoch-log", "hookfit_epoch_log")


@pytest.mark.bad_input
def test_new_plugin_refuses_bad_names_and_existing_folders(tmp_path: Path) -> None:
    bad = run(sys.executable, "-m", "hookfit.tools.cli", "new-plugin", "Bad-Name", "--dir", str(tmp_path), cwd=tmp_path, check=False)
    assert bad.returncode == 2 and "must be lowercase letters" in bad.stderr
    run(sys.executable, "-m", "hookfit.tools.cli", "new-plugin", "twice", "--dir", str(tmp_path), cwd=tmp_path)
    again = run(sys.executable, "-m", "hookfit.tools.cli", "new-plugin", "twice", "--dir", str(tmp_path), cwd=tmp_path, check=False)
    assert again.returncode == 2 and "already exists" in again.stderr


@pytest.mark.bad_input
def test_new_plugin_refuses_a_built_in_s_name_saying_how_to_name_it_or_replace_the_built_in(tmp_path: Path) -> None:
    from hookfit.tools import scaffold

    refused = run(sys.executable, "-m", "hookfit.tools.cli", "new-plugin", "optim", "--dir", str(tmp_path), cwd=tmp_path,
                  check=False)
    assert refused.returncode == 2 and not list(tmp_path.iterdir()), refused.stdout + refused.stderr
    said = " ".join(refused.stderr.split())
    assert "'optim' is the name of a built-in plugin (hookfit.plugins.optim:Optim)" in said
    assert "every run warns" in said and "another name (hookfit new-plugin my_optim)" in said
    assert "hookfit new-plugin optim --replaces" in said
    assert '[project.entry-points."hookfit.replaces"] optim = "hookfit"' in said
    built_ins = {ep.name for ep in metadata.distribution("hookfit").entry_points if ep.group == "hookfit"}
    assert set(scaffold.builtins()) == built_ins and {"optim", "checkpoint", "metrics", "console", "tui"} <= built_ins
    for name in sorted(built_ins):
        with pytest.raises(ValueError, match=rf"^'{name}' is the name of a built-in plugin"):
            scaffold.create(name, tmp_path)
    with pytest.raises(ValueError, match=r"'epoch_log' is no built-in plugin's name, so there is nothing to replace"):
        scaffold.create("epoch_log", tmp_path, replaces=True)
    assert not list(tmp_path.iterdir())


def test_a_package_made_to_replace_a_built_in_replaces_it_without_a_clash_warning(tmp_path: Path, venv: Venv) -> None:
    made = run(sys.executable, "-m", "hookfit.tools.cli", "new-plugin", "csv", "--replaces", "--dir", str(tmp_path),
               cwd=tmp_path)
    root = tmp_path / "hookfit-csv"
    assert f"created {root}" in made.stdout
    assert '[project.entry-points."hookfit.replaces"]\ncsv = "hookfit"\n' in (root / "pyproject.toml").read_text()
    venv.pip("install", "--no-build-isolation", "-e", ".[test]", "--no-index", cwd=root)
    try:
        assert_not_in_running_env("hookfit-csv", "hookfit_csv")
        listed = venv.run("-W", "error", "-m", "hookfit.tools.cli", "plugins", "--json", cwd=tmp_path)
        row = next(r for r in json.loads(listed.stdout) if r["name"] == "csv")
        assert row["distribution"] == "hookfit-csv" and row["value"] == "hookfit_csv:CsvPlugin"
        assert row["replaces"].startswith("hookfit ") and row["replaces"].endswith("(hookfit.plugins.csv_log:CSVLogger)")
        assert "two distributions" not in listed.stderr
        tests = venv.run("-m", "pytest", "-q", "-p", "no:cacheprovider", cwd=root)
        assert "3 passed" in tests.stdout  # its own check that no clash warning is given, among them
    finally:
        venv.uninstall("hookfit-csv")
    assert_not_in_running_env("hookfit-csv", "hookfit_csv")


@pytest.mark.parametrize("name, observer", [("checkpoint", False), ("console", True), ("mine", True)])
def test_a_replacement_takes_the_built_in_s_part_observer_or_not(tmp_path: Path, name: str, observer: bool) -> None:
    """`new-plugin checkpoint --replaces` made an observer: a checkpoint role that a failing save switched
    off with a warning instead of failing the run. A replacement is an observer as its built-in is."""
    from hookfit.tools import scaffold

    root = scaffold.create(name, tmp_path, replaces=name != "mine")
    source = (root / "src" / f"hookfit_{name}" / "__init__.py").read_text()
    assert f"    observer = {observer}\n" in source
    if name == "checkpoint":
        assert "As the built-in checkpoint it replaces, it takes part in training." in source


def test_the_generated_plugin_says_it_takes_part_in_every_run_and_its_inert_line_works(tmp_path: Path) -> None:
    """A newcomer's package takes part in every run on the machine: its module and README say so, and the module's
    commented inert() method, uncommented, keeps a run that did not choose it out."""
    import importlib.util
    import re
    import textwrap

    from hookfit import discovery
    from hookfit.tools import scaffold

    root = scaffold.create("mine", tmp_path)
    assert "takes part in every run of the environment" in (root / "README.md").read_text()
    source = (root / "src" / "hookfit_mine" / "__init__.py").read_text()
    assert "takes part in every run of this environment" in source
    commented = re.search(r"\n    # (def inert.*\n)    # (.*\n)", source)
    assert commented is not None, source
    method = textwrap.indent(commented[1] + "    " + commented[2], "    ")
    (tmp_path / "uncommented_mine.py").write_text(source.replace(commented[0], "\n" + method))
    spec = importlib.util.spec_from_file_location("uncommented_mine", tmp_path / "uncommented_mine.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    plugin = next(c for c in vars(module).values() if getattr(c, "name", None) == "mine")()
    assert discovery.inert(plugin, True) is None
    assert discovery.inert(plugin, False) == "given to Loop(plugins=[...]), or a [plugins.mine] table in hookfit.toml"
