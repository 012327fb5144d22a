"""``hookfit new-plugin NAME``: write a complete, installable plugin package to start from.

A built-in plugin's name is refused unless the package is to replace that built-in
(``replaces=True``): a package registering a built-in's name without declaring so clashes with
the built-in, with a warning at every run (:func:`hookfit.discovery.entry_points`). A
replacement's ``pyproject.toml`` declares it in the ``hookfit.replaces`` entry-point group, so
its plugin wins without a warning and ``hookfit plugins`` says what it replaced."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

from hookfit import discovery

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
{replaces}
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
    # with a warning and training goes on. Set it to False if the run depends on this plugin.{observer_note}
    observer = {observer}

    # Installed, it takes part in every run of this environment, every script's fit(), unless it
    # implements inert(): to wait until a run chooses it (given to Loop(plugins=[...]) or named by a
    # [plugins.{name}] table in hookfit.toml), uncomment this (README: "Each plugin's state"):
    # def inert(self, chosen: bool) -> str | None:
    #     return None if chosen else "given to Loop(plugins=[...]), or a [plugins.{name}] table in hookfit.toml"

    def __init__(self) -> None:
        self.history: list[tuple[int, int]] = []

    @hookimpl
    def epoch_end(self, loop: Any, epoch: int) -> None:
        """Fires once per completed epoch; ``loop.state`` says where the run is."""
        self.history.append((epoch, loop.state.step))
'''

TEST = '''\
"""Tests for the {name} plugin, with hookfit's pytest plugin (hookfit.testing)."""
{replaces_import}
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
{replaces_test}'''

REPLACES = """
# Its plugin replaces hookfit's built-in plugin {name} ({builtin}) on purpose:
# it wins without the warning an undeclared clash of names gives; `hookfit plugins` says so.
[project.entry-points."hookfit.replaces"]
{name} = "hookfit"
"""

REPLACES_TEST = '''

def test_it_replaces_the_built_in_without_a_clash_warning():
    discovery.refresh()  # discover again, watching for the warning a clash gives
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = [ep.value for ep in discovery.entry_points() if ep.name == "{name}"]
    assert found == ["hookfit_{name}:{cls}"]
'''

README = """\
# hookfit-{dash}

A hookfit plugin named `{name}`, made by `hookfit new-plugin` next to hookfit {version}.

Install it into the environment where hookfit is installed: this package depends on hookfit,
which is not on the package index, so pip must find it already there. With pytest and
setuptools in that environment too, nothing is downloaded (`--no-index` works offline):

    pip install --no-build-isolation -e ".[test]"   # hookfit finds it at once: `hookfit plugins` lists it
    python -m pytest                                # its tests, with hookfit's pytest plugin

Once installed it takes part in every run of the environment (every script's `fit()`), unless
its class implements `inert(chosen)` (see the comment in its module); disable it for one run with
`HOOKFIT_DISABLE_PLUGINS={name}`, or `Loop(disable=["{name}"])`.
{replaces_readme}"""

REPLACES_README = """
It replaces hookfit's built-in plugin `{name}` (`{builtin}`), as its `pyproject.toml`
declares in the `hookfit.replaces` entry points: every run uses this one in its place, and
`hookfit plugins` says what it replaced. Whatever runs needed the built-in for is now this plugin's to
do (`hookfit hooks` lists the events and the roles). Uninstall it to get the built-in back.
"""


def builtins() -> dict[str, str]:
    """The built-in plugins: name -> ``"module:Class"`` (hookfit's own ``hookfit`` entry points)."""
    return {ep.name: ep.value for ep in discovery.builtin_entry_points()}


def _observes(target: str) -> bool:
    """Whether the built-in ``"module:Class"`` is an observer (``observer = True``)."""
    import importlib

    module, _, attribute = target.partition(":")
    return getattr(getattr(importlib.import_module(module), attribute), "observer", False) is True


def create(name: str, directory: Path, replaces: bool = False) -> Path:
    """Write the package ``hookfit-<name>`` under ``directory``; return its folder.

    ``name`` must not be a built-in plugin's unless ``replaces`` is true, and then it must be
    one: the package declares that it replaces that built-in (see the module documentation)."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ValueError(f"plugin name {name!r} must be lowercase letters, digits and underscores, starting with a letter")
    known = builtins()
    if name in known and not replaces:
        raise ValueError(
            f"{name!r} is the name of a built-in plugin ({known[name]}): a package registering it clashes with the "
            f"built-in, and every run warns, naming both. Give yours another name (hookfit new-plugin my_{name}), "
            f"or, to replace the built-in on purpose, hookfit new-plugin {name} --replaces, which declares it in the "
            f"package's pyproject.toml: [project.entry-points.\"hookfit.replaces\"] {name} = \"hookfit\" (README: "
            f"Replacing a built-in plugin)")
    if replaces and name not in known:
        raise ValueError(f"{name!r} is no built-in plugin's name, so there is nothing to replace; the built-ins are "
                         f"{', '.join(sorted(known))}")
    root = Path(directory) / f"hookfit-{name.replace('_', '-')}"
    if root.exists():
        raise FileExistsError(f"{root} already exists; choose another --dir or name")
    values = {"name": name, "dash": name.replace("_", "-"), "version": metadata.version("hookfit"),
              "cls": "".join(part.capitalize() for part in name.split("_")) + "Plugin", "builtin": known.get(name)}
    parts = {"replaces": REPLACES, "replaces_test": REPLACES_TEST, "replaces_readme": REPLACES_README,
             "replaces_import": "\nimport warnings\n"}
    values.update({key: part.format(**values) if replaces else "" for key, part in parts.items()})
    observer = True if not replaces else _observes(known[name])  # a replacement takes the built-in's part
    values["observer"] = str(observer)
    values["observer_note"] = "" if not replaces else (
        f"\n    # As the built-in {name} it replaces, it {'only watches' if observer else 'takes part in training'}.")
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
