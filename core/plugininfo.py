"""What hookfit knows about one plugin, enabled or not (:class:`PluginInfo`): what
:mod:`hookfit.discovery` finds and the manager registers, and how messages name it."""

from __future__ import annotations

import functools
import importlib.metadata as metadata
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PluginInfo:
    """What hookfit knows about one plugin, enabled or not."""

    name: str
    source: str  # "entry point" or "given"
    distribution: str | None = None
    version: str | None = None
    value: str | None = None  # the entry point's "module:attr", or the given object's type
    enabled: bool = True
    plugin: Any = None
    error: str | None = None
    hooks: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)  # given by the configuration file
    config: Any = None  # the file's path when it gave options
    chosen: bool = False
    """Whether the user chose it: given to ``Loop(plugins=[...])``, or named by a table of the
    configuration file (``[plugins.<name>]``, even empty): what turns on a plugin that is inert
    when merely discovered (see :func:`hookfit.discovery.inert`)."""
    built: bool = False
    """Whether hookfit made ``plugin`` from a class (with the file's options), not given an object."""
    disabled_by: str | None = None
    """What disabled it (``None`` while enabled): ``Loop(disable=[...])``,
    ``HOOKFIT_DISABLE_PLUGINS``, ``HOOKFIT_PLUGINS`` (not listed there) or the configuration
    file's ``enabled = false``."""
    replaces: str | None = None
    """The plugin of the same name that this one replaces on purpose (its distribution declares it:
    :func:`hookfit.discovery.entry_points`), as ``hookfit 0.3.0 (hookfit.plugins.checkpoint:Checkpoint)``."""
    declares: list[Any] = field(default_factory=list)
    """The event declarations (``hookspecs``) of this plugin, read when it is loaded (a
    disabled plugin is never imported; the built-ins' are added whatever their state, see
    :func:`hookfit.discovery.builtin_events`)."""

    def describe(self) -> str:
        """``plugin 'name' (distribution 1.0, entry point mod:attr)`` for messages; a plugin
        given to ``Loop`` is named with the distribution its module comes from, if any."""
        if self.source == "entry point":
            where = f"{self.distribution} {self.version}, entry point {self.value}"
        else:
            dist = _distribution_of(self.value or "")
            where = f"{dist}, {self.value}, given to Loop" if dist else f"{self.value}, given to Loop"
        return f"plugin {self.name!r} ({where})"


def _distribution_of(qualified: str) -> str | None:
    """``name version`` of the installed distribution that holds the module of ``qualified``
    (``package.module.Class``), or ``None`` (a script's own class)."""
    top = qualified.split(".", 1)[0]
    names = packages().get(top)
    if not names:
        return None
    try:
        return f"{names[0]} {metadata.version(names[0])}"
    except metadata.PackageNotFoundError:
        return names[0]


@functools.lru_cache(maxsize=1)
def packages() -> Mapping[str, list[str]]:
    """The distributions that hold each top-level package, read once (until
    :func:`hookfit.discovery.refresh`)."""
    return metadata.packages_distributions()
