"""Which plugins a run has: the ``hookfit`` entry points of the installed distributions, the
plugins given to ``Loop``, their selection (``HOOKFIT_PLUGINS``, ``HOOKFIT_DISABLE_PLUGINS``,
``Loop(disable=...)``), their options from ``hookfit.toml`` and the events they declare. The
order and the policies are :mod:`hookfit.manager`'s, which registers what :func:`collect`
returns."""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.metadata as metadata
import inspect
import os
import sys
import warnings
from collections.abc import Iterable, Sequence
from typing import Any, Callable, NamedTuple

from hookfit import config
from hookfit.clashes import REPLACES, Found, Replacement, canonical, choose
from hookfit.errors import HookfitWarning, PluginError, user_level
from hookfit import plugininfo
from hookfit.plugininfo import PluginInfo as PluginInfo  # also this module's name for it

GROUP = "hookfit"
ENV_ONLY = "HOOKFIT_PLUGINS"
ENV_DISABLE = "HOOKFIT_DISABLE_PLUGINS"


def split_names(text: str | None) -> list[str]:
    """Names from a comma-separated environment value, without blanks."""
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def plugin_name(plugin: Any, discovered: Iterable[metadata.EntryPoint] = ()) -> str:
    """The name of a plugin given as an object: its ``name`` attribute if it is a string; else
    the name of the one entry point of ``discovered`` that names this very object, or else its
    class (so that it replaces the plugin discovered there); else its class name (a module's
    own name for a module)."""
    name = getattr(plugin, "name", None)
    if isinstance(name, str) and name:
        return name
    for named in (plugin, type(plugin)):
        naming = list({ep.name: None for ep in discovered if _imported(ep) is named})
        if len(naming) == 1:
            return naming[0]
        if naming:  # several name it: none of them is chosen over the others
            break
    if inspect.ismodule(plugin):
        return plugin.__name__
    return type(plugin).__name__


def _imported(ep: metadata.EntryPoint) -> Any:
    """What ``ep`` names if its module is imported already, else ``None``: never imports (an
    object given to ``Loop`` comes from a module that is imported)."""
    target: Any = sys.modules.get(ep.module)
    for part in ep.attr.split(".") if ep.attr else ():
        target = getattr(target, part, None)
    return target


def entry_points() -> list[metadata.EntryPoint]:
    """The ``hookfit`` entry points of every installed distribution, sorted by name.

    A distribution found twice on ``sys.path`` shows up once (the first one wins, as for
    imports). Two different distributions registering one name is a clash: the first on
    ``sys.path`` wins and a :class:`HookfitWarning` names both, unless one of them replaces
    the other's plugin on purpose. A distribution says so in the ``hookfit.replaces``
    entry-point group, one entry per plugin it replaces, named as the plugin and whose value is
    the distribution whose plugin it replaces (``hookfit`` for a built-in)::

        [project.entry-points.hookfit]
        checkpoint = "my_package:MyCheckpoint"

        [project.entry-points."hookfit.replaces"]
        checkpoint = "hookfit"

    Its plugin then wins over that one wherever it sits on ``sys.path``, without a warning;
    ``hookfit plugins`` shows what it replaced (:attr:`PluginInfo.replaces`). Any other clash
    of that name (a third distribution, one not named there) still warns, naming the plugin
    used, the first on ``sys.path``, a replacement counting at the place of what it replaces
    if that is earlier (:func:`hookfit.clashes.choose`)."""
    return [found.ep for found in _discover(tuple(sys.path))]


class _Scan(NamedTuple):
    plugins: tuple[Found, ...]  # every hookfit entry point, shadowed ones too, replaces unset
    replacements: frozenset[Replacement]


@functools.lru_cache(maxsize=8)
def _scan(path: tuple[str, ...]) -> _Scan:
    """The entry points of both groups, each with its distribution's name and version, read once
    per ``sys.path`` in one pass over the distributions, parsing each one's metadata once
    (``ep.dist.name`` and ``.version`` parse it on every call, a millisecond for a long one)."""
    named: dict[int, tuple[str | None, str | None]] = {}

    def name_and_version(ep: metadata.EntryPoint) -> tuple[str | None, str | None]:
        dist = getattr(ep, "dist", None)
        if dist is None:
            return None, None
        if id(dist) not in named:  # the entry points of one distribution share its object
            meta = dist.metadata
            named[id(dist)] = meta["Name"], meta["Version"]
        return named[id(dist)]

    every = metadata.entry_points()
    plugins = tuple(Found(ep, *name_and_version(ep), None) for ep in every.select(group=GROUP))
    replacements = frozenset((canonical(name_and_version(ep)[0]), ep.name, canonical(ep.value.strip()))
                             for ep in every.select(group=REPLACES))
    return _Scan(plugins, replacements)


@functools.lru_cache(maxsize=8)
def _discover(path: tuple[str, ...]) -> tuple[Found, ...]:
    """The entry points that count, with what each replaces on purpose, once per ``sys.path``."""
    scan = _scan(path)
    named: dict[str, list[Found]] = {}
    for entry in scan.plugins:
        named.setdefault(entry.ep.name, []).append(entry)
    return tuple(choose(name, named[name], scan.replacements) for name in sorted(named))


def refresh() -> None:
    """Forget what was discovered, after installing or removing a plugin in this process."""
    _scan.cache_clear()
    _discover.cache_clear()
    _builtin.cache_clear()
    plugininfo.packages.cache_clear()
    importlib.invalidate_caches()


def inert(plugin: Any, chosen: bool, loop: Any = None) -> str | None:
    """The plugin's answer to the listing's question (``hookfit plugins``): ``None`` when it
    takes part in a run, else what turns it on, in a few words. A plugin answers with a
    method ``inert(chosen: bool) -> str | None``, where ``chosen`` says whether the user chose
    it (:attr:`PluginInfo.chosen`); one without the method takes part whenever it is enabled.
    A run asks too, before its ``configure`` (:func:`hookfit.manager.leave_inert`), with
    itself as ``loop``, which a method with a second parameter, ``inert(chosen, loop)``, is
    given (``None`` for the listing): the answer of a plugin whose part depends on the run (a
    smoke run, an evaluation). An answer that is neither ``None`` nor a string, or a method
    that raises, is reported as the plugin's own error."""
    method = getattr(plugin, "inert", None)
    if not callable(method):
        return None
    asks_run = loop is not None and len(inspect.signature(method).parameters) > 1
    answer = method(chosen, loop) if asks_run else method(chosen)
    if answer is not None and not isinstance(answer, str):
        raise TypeError(f"plugin {plugin_name(plugin)!r}: inert(chosen) must return None or a string, "
                        f"got {type(answer).__name__}")
    return answer


def _instantiate(obj: Any) -> Any:
    return obj() if inspect.isclass(obj) else obj


def check_given(plugins: Sequence[Any]) -> None:
    """Refuse, naming its place, an element of ``Loop(plugins=[...])`` given where a plugin belongs by
    mistake: a plugin's name, a number, a list, an optimizer, a module of the model or a torchmetrics metric,
    with no function marked ``@hookfit.hookimpl``. ``None`` elements are left out. (Another object without
    hooks is a plugin others find by name, ``loop.pm.get_plugin(name)``.)"""
    import torch  # (loaded by now: the loop's modules import it)

    for i, plugin in enumerate(plugins):
        torch_object = isinstance(plugin, (torch.nn.Module, torch.optim.Optimizer))
        stray = torch_object or (
            type(plugin).__module__ == "builtins" and not inspect.ismodule(plugin) and not inspect.isclass(plugin))
        if plugin is None or not stray or declared_events(plugin) or any(_marked(plugin, n) for n in dir(plugin)):
            if plugin is not None and type(plugin).__hash__ is None:  # pluggy keys its plugins by the objects
                raise TypeError(f"plugins[{i}], a {type(plugin).__name__}, is unhashable, and a plugin must be "
                                f"hashable (a @dataclass that compares by value is not: give it @dataclass(eq=False))")
            continue
        hint = ("give a model to Loop(model=...), optimizers to Loop(optimizers=...), and have the step return "
                "a torchmetrics metric (README.md, the metrics plugin)") if torch_object else (
                "a plugin is an object, class or module with functions marked @hookfit.hookimpl")
        if isinstance(plugin, str):
            named = [found.ep for found in _discover(tuple(sys.path)) if found.ep.name == plugin]
            made = "()" if named and inspect.isclass(named[0].load()) else ""
            hint = (f"give the plugin object ({named[0].value.replace(':', '.')}{made}), or choose plugins by name "
                    f"in hookfit.toml ([plugins.{plugin}]) or {ENV_ONLY}") if named else (
                    f"installed plugins are chosen by name in hookfit.toml or {ENV_ONLY}")
        text = repr(plugin)
        shown = type(plugin).__name__ + ("" if "\n" in text else f" {text if len(text) <= 60 else text[:57] + '...'}")
        raise TypeError(f"plugins[{i}] is not a plugin: {shown} implements no hookfit event; {hint}")


def _marked(plugin: Any, name: str) -> bool:
    """Whether attribute ``name`` of ``plugin`` is a function marked ``@hookfit.hookimpl`` (read without
    running a property; a static or class method's function)."""
    found = inspect.getattr_static(plugin, name, None)
    return hasattr(getattr(found, "__func__", found), "hookfit_impl")  # pluggy's mark: "<project>_impl"


def declared_events(plugin: Any) -> list[Any]:
    """The events a plugin declares for others: its ``hookspecs`` attribute (a class or module
    of functions marked with :data:`hookfit.hookspec`) as a list, empty when it has none.
    ``plugin`` is a plugin object, its class, or a module."""
    specs = getattr(plugin, "hookspecs", None)
    return [] if specs is None else [specs]


OWN = "hookfit"
"""The distribution whose entry points are the built-in plugins."""


def _declared_by(ep: metadata.EntryPoint) -> list[Any]:
    """What a plugin's entry point declares (imported, never instantiated). One that fails to
    import declares nothing: it fails the run where it is enabled, and disabling it is the way
    around it."""
    try:
        return declared_events(ep.load())
    except Exception:
        return []


@functools.lru_cache(maxsize=8)
def _builtin(path: tuple[str, ...]) -> tuple[tuple[str, Any], ...]:
    return tuple((ep.name, specs) for ep in builtin_entry_points() for specs in _declared_by(ep))


def builtin_entry_points() -> list[metadata.EntryPoint]:
    """The entry points of hookfit's own distribution (the built-in plugins), sorted by name,
    whether each is enabled, disabled or replaced by another distribution's of its name."""
    return sorted((f.ep for f in _scan(tuple(sys.path)).plugins if f.distribution == OWN), key=lambda e: e.name)


def builtin_events() -> list[tuple[str, Any]]:
    """``(plugin name, hookspecs)`` for every built-in plugin (an entry point of hookfit's own
    distribution) that declares events: added to every run whether that plugin is enabled,
    disabled, replaced by a plugin given to ``Loop`` or shadowed by another distribution's
    entry point of the same name, so a replacement fires them and their consumers hear them."""
    return list(_builtin(tuple(sys.path)))


def discovered_events() -> list[tuple[str, Any]]:
    """``(plugin name, hookspecs)`` for every installed plugin that declares events, in
    entry-point order: the built-ins' (:func:`builtin_events`) and those of other
    distributions (imported here: what ``hookfit hooks`` lists under each plugin)."""
    events = builtin_events()
    known = {id(specs) for _, specs in events}
    for found in _discover(tuple(sys.path)):
        if found.distribution != OWN:
            events += [(found.ep.name, specs) for specs in _declared_by(found.ep) if id(specs) not in known]
    return events


def collect(
    given: Sequence[Any] = (),
    disable: Iterable[str] = (),
    *,
    strict: bool = True,
    environ: dict[str, str] | None = None,
    configured: config.Config | None = None,
    load: Callable[[PluginInfo], bool] | None = None,
) -> list[PluginInfo]:
    """Every plugin the run would see, in registration order, enabled or not.

    Enabled entry points are imported and instantiated, with their options from the
    configuration file (:mod:`hookfit.config`; ``configured``, else the file of this process);
    disabled ones never are, nor those ``load`` refuses (listed as enabled or not, without a
    plugin: what the command line asks, which needs only the commands of some). With ``strict=False``
    (for listing) one that fails to load carries the error instead of raising.
    """
    env = os.environ if environ is None else environ
    if configured is None:
        configured = config.load(config.find(env))
    by_loop, by_env = set(disable), set(split_names(env.get(ENV_DISABLE)))
    disabled = by_loop | by_env
    only = split_names(env.get(ENV_ONLY)) if ENV_ONLY in env else None

    def disabled_by(name: str, discovered: bool) -> str | None:
        if name in by_loop:
            return "Loop(disable=[...])"
        if name in by_env:
            return f"{ENV_DISABLE}={env.get(ENV_DISABLE)}"
        if discovered and only is not None and name not in only:
            return f"{ENV_ONLY}={env.get(ENV_ONLY)} (not listed there)"
        if configured is not None and configured.plugins.get(name, {}).get("enabled") is False:
            return f"{configured.where(name)} enabled = false"
        return None

    eps: dict[str, metadata.EntryPoint] = {}
    infos: list[PluginInfo] = []
    for ep, dist, version, replaces in _discover(tuple(sys.path)):
        eps[ep.name] = ep
        info = PluginInfo(name=ep.name, source="entry point", distribution=dist, version=version, value=ep.value,
                          replaces=replaces)
        info.disabled_by = disabled_by(info.name, True)
        info.enabled = info.disabled_by is None
        info.chosen = info.enabled and info.name in configured.plugins
        infos.append(info)

    by_name = {info.name: i for i, info in enumerate(infos)}
    given_names: set[str] = set()
    every = [found.ep for found in _scan(tuple(sys.path)).plugins]  # a clash's ignored one names its class too
    for plugin in given:
        built, plugin = inspect.isclass(plugin), _instantiate(plugin)
        name = plugin_name(plugin, every)
        if name in given_names:
            raise PluginError(
                f"two plugins given to Loop are both named {name!r}; give one a different "
                f"`name` attribute"
            )
        given_names.add(name)
        value = f"{type(plugin).__module__}.{type(plugin).__qualname__}"
        if name in by_loop:  # one call both gives and disables it: which one is meant is not ours to guess
            raise PluginError(f"Loop(disable=[...]) names {name!r}, and the plugin {value} given to Loop(plugins="
                              f"[...]) is named {name!r}: leave it out of plugins=[...] or out of disable=[...] (to switch it "
                              f"off without editing the script: {ENV_DISABLE}={name})")
        off = disabled_by(name, False)
        info = PluginInfo(name=name, source="given", value=value, enabled=off is None, plugin=plugin, built=built,
                          chosen=True, disabled_by=off)
        if off is not None:  # the operator's switch (the environment, the file) wins over the script
            table = name in configured.plugins and "enabled = false" not in off
            warnings.warn(f"{info.describe()} does not run: {off} disables it"
                          f"{f'; {configured.where(name)} is not used either' if table else ''}",
                          HookfitWarning, stacklevel=user_level())
        else:  # its table, if any, fills in the options the code did not pass it
            info.options = config.fill_in(configured, name, plugin)
            info.config = configured.path if info.options else None
        info.declares = declared_events(plugin)
        if name in by_name:  # a replaced built-in's events stay declared (register_all)
            infos[by_name[name]] = info
        else:
            infos.append(info)

    known = {info.name for info in infos}
    by_module = {ep.module.rpartition(".")[2]: name for name, ep in eps.items()}  # csv_log: the plugin csv
    for label, names in (("disabled", disabled), (ENV_ONLY, only or ())):
        for name in sorted(set(names) - known):
            _warn_unknown(name, label, known, by_module)
    for name in configured.plugins:
        if name not in known:
            close = _closest(name, known, by_module)
            raise config.ConfigError(
                f"{configured.where(name)}: no plugin named {name!r} is installed or given"
                f"{f' (did you mean {close!r}?)' if close else ''}; known plugins: {', '.join(sorted(known))}"
            )

    for info in infos:
        if info.source != "entry point" or (load is not None and not load(info)):
            continue
        if not info.enabled:  # never imported (a built-in's events are declared all the same), but for
            if info.distribution == OWN and set(configured.plugins.get(info.name, ())) - {"enabled"}:
                config.warn_unused(configured, info.name, eps[info.name].load())  # a typo in a built-in's table
            continue
        info.options = dict(configured.plugins.get(info.name, {}))
        info.config = configured.path if info.chosen else None
        try:
            loaded = eps[info.name].load()
            info.declares = declared_events(loaded)
            info.plugin, info.built = config.build(configured, info.name, loaded), inspect.isclass(loaded)
        except config.ConfigError as exc:  # the file's fault, not the plugin's: name the file
            info.error = str(exc)
            if strict:
                raise
        except Exception as exc:
            info.error = f"{type(exc).__name__}: {exc}"
            if strict:
                raise PluginError(
                    f"{info.describe()} failed to load: {info.error}. Fix or uninstall "
                    f"{info.distribution}, or disable the plugin with {ENV_DISABLE}={info.name}."
                ) from exc
    return infos


def _closest(name: str, known: set[str], by_module: dict[str, str]) -> str | None:
    """The plugin ``name`` most likely meant: the one whose module it names, else the closest name."""
    if by_module.get(name) in known:
        return by_module[name]
    return next(iter(difflib.get_close_matches(name, sorted(known), n=1)), None)


def _warn_unknown(name: str, label: str, known: set[str], by_module: dict[str, str]) -> None:
    hint = f"; did you mean {close!r}?" if (close := _closest(name, known, by_module)) else ""
    warnings.warn(f"plugin name {name!r} ({label}) matches no installed or given plugin{hint} Known plugins: "
                  f"{', '.join(sorted(known)) or 'none'}.", HookfitWarning, stacklevel=user_level())
