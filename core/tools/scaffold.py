"""``hookfit new-plugin NAME``: write a complete, installable plugin package to start from."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "hookfit-{dash}"
version = "0.1.0"
description = "A hookfit plugin: {name}."
readme = "README.md"
requires-python = ">=3.11"
# The hookfit this package was made next to (hookfit is not on the package index: install this
# package into the environment that has hookfit, where this requirement is already met).
dependencies = ["hookfit>={version}"]

[project.optional-dependencies]
test = ["pytest>=8"]

# This table is what makes hookfit find the plugin once the package is installed.
[project.entry-points.hookfit]
{name} = "hookfit_{name}:{cls}"

[tool.setuptools.packages.find]
where = ["src"]
"""

MODULE = '''\
"""hookfit plugin ``{name}``: records the global step at the end of every epoch.

Replace the hook below with what your plugin should do. Every event, with its arguments and
what a plugin may do there, is listed by ``hookfit hooks``.
"""

from __future__ import annotations

from typing import Any

from hookfit import hookimpl


class {cls}:
    """Keeps ``(epoch, global step)`` for each finished epoch in :attr:`history`."""

    name = "{name}"
    # An observer only watches the run: if one of its hooks raises, hookfit switches it off
    # with a warning and training goes on. Set it to False if the run depends on this plugin.
    observer = True

    def __init__(self) -> None:
        self.history: list[tuple[int, int]] = []

    @hookimpl
    def epoch_end(self, loop: Any, epoch: int) -> None:
        """Fires once per completed epoch; ``loop.state`` says where the run is."""
        self.history.append((epoch, loop.state.step))
'''

TEST = '''\
"""Tests for the {name} plugin, with hookfit's pytest plugin (hookfit.testing)."""

from hookfit import discovery

from hookfit_{name} import {cls}

pytest_plugins = ["hookfit.testing"]


def test_it_records_every_epoch(hookfit_run):
    plugin = {cls}()
    loop = hookfit_run(plugin, max_epochs=3)
    assert loop.state.status == "completed"
    assert plugin.history == [(0, 4), (1, 8), (2, 12)]


def test_the_installed_package_registers_it():
    assert "{name}" in [ep.name for ep in discovery.entry_points()]
'''

README = """\
# hookfit-{dash}

A hookfit plugin named `{name}`, made by `hookfit new-plugin` next to hookfit {version}.

Install it into the environment where hookfit is installed: this package depends on hookfit,
which is not on the package index, so pip must find it already there. With pytest and
setuptools in that environment too, nothing is downloaded (`--no-index` works offline):

    pip install --no-build-isolation -e ".[test]"   # hookfit finds it at once: `hookfit plugins` lists it
    python -m pytest                                # its tests, with hookfit's pytest plugin

Disable it for one run with `HOOKFIT_DISABLE_PLUGINS={name}`, or `Loop(disable=["{name}"])`.
"""


def create(name: str, directory: Path) -> Path:
    """Write the package ``hookfit-<name>`` under ``directory``; return its folder."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ValueError(f"plugin name {name!r} must be lowercase letters, digits and underscores, starting with a letter")
    root = Path(directory) / f"hookfit-{name.replace('_', '-')}"
    if root.exists():
        raise FileExistsError(f"{root} already exists; choose another --dir or name")
    values = {"name": name, "dash": name.replace("_", "-"), "version": metadata.version("hookfit"),
              "cls": "".join(part.capitalize() for part in name.split("_")) + "Plugin"}
    files = {
        "pyproject.toml": PYPROJECT,
        "README.md": README,
        f"src/hookfit_{name}/__init__.py": MODULE,
        f"tests/test_{name}.py": TEST,
    }
    for relative, template in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(template.format(**values))
    return root
