"""The subcommands of ``hookfit`` that plugins add (the ``add_commands`` event), and why a
built-in plugin's command is missing where that plugin is disabled or replaced."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence


def add(sub: argparse._SubParsersAction[argparse.ArgumentParser], given: Sequence[Any]) -> list[Any]:
    """The subcommands that the enabled plugins add (``add_commands``); returns the plugins'
    :class:`hookfit.discovery.PluginInfo`, empty when the configuration file is bad."""
    from hookfit import config, discovery, manager

    try:
        configured = config.load(config.find(script=""))
    except config.ConfigError as error:
        print(f"hookfit: {error} (plugin commands are not available)", file=sys.stderr)
        return []
    infos = discovery.collect(given, strict=False, configured=configured)
    pm = manager.PluginManager()
    pm.register_all(infos, strict=False)
    pm.hook.add_commands(commands=sub)
    return infos


def missing(command: str, infos: Sequence[Any]) -> str | None:
    """Why ``hookfit COMMAND`` is not there when it is the command of a built-in plugin that
    this environment disabled or replaced (``hookfit export`` is the built-in checkpoint's: it
    reads that plugin's files), else ``None``. A plugin holding the role adds a command of that
    name itself, through ``add_commands``, when it has one."""
    from hookfit import discovery

    held = {info.name: info for info in infos}
    for ep in discovery.builtin_entry_points():
        info = held.get(ep.name)
        if info is not None and info.enabled and info.distribution == discovery.OWN:
            continue  # registered: its commands are there
        scratch = argparse.ArgumentParser(add_help=False).add_subparsers()
        try:
            loaded = ep.load()
            plugin = loaded() if isinstance(loaded, type) else loaded
            add = getattr(plugin, "add_commands", None)
            if callable(add):
                add(scratch)
        except Exception:  # a built-in that cannot load adds nothing to explain
            continue
        if command not in scratch.choices:
            continue
        if info is None or not info.enabled:
            why = f"which is disabled ({info.disabled_by if info is not None else 'not found'})"
        else:
            why = f"and {info.describe()} holds that role here and adds no {command!r} command"
        return (f"hookfit {command}: this is the command of hookfit's built-in plugin {ep.name!r}, {why}; "
                f"a plugin replacing {ep.name!r} adds its own {command!r} through the add_commands event "
                f"when it has one (see 'hookfit plugins')")
    return None
