"""The subcommands of ``hookfit`` that plugins add (the ``add_commands`` event), and why a
built-in plugin's command is missing where that plugin is disabled or replaced.

A distribution may name, in the entry-point group ``hookfit.commands``, under a plugin's name, a
function ``add(commands)`` that adds that plugin's commands as its ``add_commands`` does; one
that names any is taken at its word for all of its plugins, which are then not imported to
build the command line (hookfit's own name ``show``, ``compare`` and ``export`` there, so
``hookfit --help``, ``show`` and ``compare`` import neither torch nor the other plugins). The
plugins of other distributions, and those given to :func:`hookfit.tools.cli.main`, are imported
and asked through ``add_commands``."""

from __future__ import annotations

import argparse
import functools
import importlib.metadata as metadata
import sys
from typing import Any, Callable, Sequence

import pluggy

GROUP = "hookfit.commands"

Adders = dict[str | None, dict[str, metadata.EntryPoint]]
"""The ``hookfit.commands`` entry points by distribution name, then plugin name."""


def declared() -> Adders:
    """The functions that add plugins' commands, as their distributions name them (``GROUP``)."""
    adders: Adders = {}
    for ep in metadata.entry_points(group=GROUP):
        dist = getattr(ep, "dist", None)
        adders.setdefault(dist.metadata["Name"] if dist is not None else None, {})[ep.name] = ep
    return adders


def add(sub: argparse._SubParsersAction[argparse.ArgumentParser], given: Sequence[Any],
        owners: dict[str, str] | None = None) -> list[Any]:
    """The subcommands that the enabled plugins add: the plugins given and those of
    distributions that name no command functions through ``add_commands`` (imported, as a run
    imports them), then the others through their named functions; returns the plugins'
    :class:`hookfit.discovery.PluginInfo`. A configuration file that is bad (not TOML, a table
    naming a plugin not installed) is said in one line on stderr and left out here, so ``--help``
    and the commands that read old runs work while it is being fixed. ``owners`` (if given) is
    filled with the plugin (its description) that added each command."""
    from hookfit import config, discovery, manager

    adders = declared()

    def collect(configured: config.Config) -> list[discovery.PluginInfo]:
        return discovery.collect(given, strict=False, configured=configured,
                                 load=lambda info: info.distribution not in adders)

    try:
        infos = collect(config.load(config.find(script="")))
    except config.ConfigError as error:  # (not TOML, a table naming no installed plugin): the commands stay
        print(f"hookfit: {error} (the commands are added as if there were no such file)", file=sys.stderr)
        infos = collect(config.Config())
    pm = manager.PluginManager()  # the loop's and the command line's events: no plugin's own are needed here
    for info in infos:
        if info.enabled and info.plugin is not None and info.error is None:
            try:
                pm.register(info.plugin, name=info.name)
            except (pluggy.PluginValidationError, ValueError) as error:  # listed by 'hookfit plugins'
                info.error = str(error)
    named = [(info, adder) for info in reversed(infos)  # in the order pluggy calls discovered plugins
             if info.enabled and info.plugin is None and info.source == "entry point"
             and (adder := _adder(info.name, adders.get(info.distribution))) is not None]
    owners = {} if owners is None else owners
    owners.update(dict.fromkeys(sub.choices, "hookfit itself"))
    for info, adder in named:  # hookfit's own first: a plugin cannot take show, compare or export
        if info.distribution == discovery.OWN:
            _take(sub, owners, info.describe(), adder)
    by_name = {info.name: info for info in infos}
    for impl in reversed(pm.hook.add_commands.get_hookimpls()):  # pluggy's call order
        _take(sub, owners, by_name[impl.plugin_name].describe() if impl.plugin_name in by_name
              else f"plugin {impl.plugin_name!r}",
              functools.partial(_call, pm, impl))
    for info, adder in named:
        if info.distribution != discovery.OWN:
            _take(sub, owners, info.describe(), adder)
    return infos


def _call(pm: Any, impl: pluggy.HookImpl, commands: Any) -> None:
    """One plugin's ``add_commands`` alone, through pluggy's call path."""
    pm.execute("add_commands", [impl], {"commands": commands}, False)


def _take(sub: argparse._SubParsersAction[argparse.ArgumentParser], owners: dict[str, str], plugin: str,
          add: Callable[[Any], None]) -> None:
    """Let one plugin (``plugin``: its description) add its commands; ``owners`` says who added each
    command so far. A plugin whose ``add_commands`` raises, or adds a command whose name is taken,
    adds none: one line on stderr names it, its error or the name and who has it, and the rest of
    the command line works (as a plugin that cannot be built adds none; ``hookfit plugins`` lists
    the plugins and their errors)."""
    choices, shown = dict(sub.choices), list(sub._choices_actions)
    try:
        add(sub)
    except Exception as error:  # (argparse's ArgumentError "conflicting subparser" for a name taken)
        taken = [n for n in owners if isinstance(error, argparse.ArgumentError) and str(error).endswith(f": {n}")]
        sub.choices.clear()
        sub.choices.update(choices)
        sub._choices_actions[:] = shown
        why = (f"adds the command {taken[0]!r}, which {owners[taken[0]]} adds" if taken
               else f"failed in add_commands: {type(error).__name__}: {error}")
        print(f"hookfit: {plugin} {why}; its commands are left out", file=sys.stderr)
        return
    owners.update(dict.fromkeys((n for n in sub.choices if n not in owners), plugin))


def _adder(name: str, named: dict[str, metadata.EntryPoint] | None) -> Callable[[Any], None] | None:
    """The function that adds the commands of plugin ``name`` of a distribution that names
    ``named`` (``None``: one that names none), or ``None`` when it adds none."""
    ep = (named or {}).get(name)
    return None if ep is None else ep.load()


def missing(command: str, infos: Sequence[Any]) -> str | None:
    """Why ``hookfit COMMAND`` is not there when it is the command of a built-in plugin that
    this environment disabled or replaced (``hookfit export`` is the built-in checkpoint's: it
    reads that plugin's files), else ``None``. A plugin holding the role adds a command of that
    name itself, through ``add_commands``, when it has one."""
    from hookfit import discovery

    held = {info.name: info for info in infos}
    named = declared().get(discovery.OWN)
    for ep in discovery.builtin_entry_points():
        info = held.get(ep.name)
        if info is not None and info.enabled and info.distribution == discovery.OWN:
            continue  # registered: its commands are there
        scratch = argparse.ArgumentParser(add_help=False).add_subparsers()
        try:
            add = _adder(ep.name, named) if named is not None else _hook_of(ep)
            if add is not None:
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


def _hook_of(ep: metadata.EntryPoint) -> Callable[[Any], None] | None:
    """The ``add_commands`` of the plugin ``ep`` names (imported and made), if it has one."""
    loaded = ep.load()
    plugin = loaded() if isinstance(loaded, type) else loaded
    add = getattr(plugin, "add_commands", None)
    return add if callable(add) else None
