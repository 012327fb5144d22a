"""Plugin discovery, selection and validation.

Order, which is part of the contract:

1. Plugins discovered through the ``hookfit`` entry-point group are registered first, sorted by
   entry-point name (so the order never depends on ``sys.path`` or install order).
2. Plugins given to ``Loop(plugins=[...])`` follow, in the order given. One whose name equals a
   discovered plugin's replaces it, at the discovered plugin's place in the order.

pluggy calls the implementations of an event from the last registered to the first, except that
``tryfirst``/``trylast`` move an implementation to the front or back and wrappers surround all
others. So a plugin given to ``Loop`` sees an event before the discovered ones, unless it asks
otherwise.

Selection: ``HOOKFIT_PLUGINS`` (comma-separated names) restricts discovered plugins to those
named (an empty value loads none); ``HOOKFIT_DISABLE_PLUGINS`` and ``Loop(disable=[...])`` switch
plugins off by name, given ones included. A disabled plugin is never imported, instantiated nor
registered, so disabling a broken plugin is the way around it. A name in either list
that matches no plugin is reported with a :class:`HookfitWarning`, so a typo does not pass
unnoticed.

Events that plugins declare (a ``hookspecs`` attribute naming a class or module of specs marked
with :data:`hookfit.hookspec`: the optim, metrics, checkpoint, distributed and tui plugins
declare the events they fire or answer) are added before any plugin is registered: those of
every built-in plugin, whether it is enabled, disabled, replaced by a plugin of the same name
given to ``Loop`` or shadowed by another distribution's entry point of that name (their spec
modules are imported, the plugins never instantiated), and those of every enabled plugin. So a
replacement fires the events of the built-in it replaces and its consumers still hear them.

Failure policy: an entry point that fails to import or to instantiate fails the run before any
event fires, with a :class:`PluginError` that names the entry point, its distribution and the
way to disable it. hookfit never drops a plugin the user installed without saying so.

Faults stay inside observers: a plugin whose class says ``observer = True`` (renderers, loggers,
any plugin that only watches the run) is switched off for the rest of the run when one of its
hooks raises, with one :class:`ObserverWarning` naming the plugin, its distribution, the hook
and the error; the run goes on and ``loop.state.silenced`` lists it. Every other plugin takes
part in training, and its errors fail the run. The guard is applied where events are called,
in :mod:`hookfit.dispatch`, wrappers included; the registered hook implementations are never
changed.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.metadata as metadata
import inspect
import os
import sys
import warnings
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Iterable, Mapping, Sequence

import pluggy

from hookfit import config, hookspecs

GROUP = "hookfit"
ENV_ONLY = "HOOKFIT_PLUGINS"
ENV_DISABLE = "HOOKFIT_DISABLE_PLUGINS"

hookimpl = pluggy.HookimplMarker("hookfit")
"""The marker for hook implementations: ``@hookfit.hookimpl`` on a function or method named
after an event of :mod:`hookfit.hookspecs` or one that a plugin declares."""


class HookfitWarning(UserWarning):
    """Base category of every warning hookfit issues."""


class PluginError(Exception):
    """A plugin cannot take part in a run: it does not import, or its hooks do not match."""


class StateMismatch(ValueError):
    """Saved plugin states do not match the run restoring them (``Run.load_plugin_states`` with
    ``strict``): ``missing`` names the plugins of the run with no saved state (new to it),
    ``extra`` the saved states no plugin of the run restores; ``detail`` says both in words.
    A plugin that restores states (the checkpoint plugin) catches it to say how to go on."""

    def __init__(self, detail: str, missing: list[str], extra: list[str]) -> None:
        super().__init__(f"{detail} (strict; pass strict=False to restore the rest)")
        self.detail = detail
        self.missing = missing
        self.extra = extra


class ObserverWarning(HookfitWarning):
    """An observer plugin raised and was switched off for the rest of the run."""


@dataclass(frozen=True)
class Silenced:
    """An observer that failed: which plugin, in which hook, with which error."""

    plugin: str
    description: str  # the plugin with its distribution
    hook: str
    error: BaseException


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
    declares: list[Any] = field(default_factory=list)
    """The event declarations (``hookspecs``) of this plugin, read when it is loaded (a
    disabled plugin is never imported; the built-ins' are added whatever their state, see
    :func:`builtin_events`)."""

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
    names = _packages().get(top)
    if not names:
        return None
    try:
        return f"{names[0]} {metadata.version(names[0])}"
    except metadata.PackageNotFoundError:
        return names[0]


@functools.lru_cache(maxsize=1)
def _packages() -> Mapping[str, list[str]]:
    return metadata.packages_distributions()


def split_names(text: str | None) -> list[str]:
    """Names from a comma-separated environment value, without blanks."""
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def plugin_name(plugin: Any) -> str:
    """The name of a plugin given as an object: its ``name`` attribute if it is a string,
    else its class name (a module's own name for a module)."""
    name = getattr(plugin, "name", None)
    if isinstance(name, str) and name:
        return name
    if inspect.ismodule(plugin):
        return plugin.__name__
    return type(plugin).__name__


def entry_points() -> list[metadata.EntryPoint]:
    """The ``hookfit`` entry points of every installed distribution, sorted by name.

    A distribution found twice on ``sys.path`` shows up once (the first one wins, as for
    imports). Two different distributions registering one name: the first on ``sys.path``
    wins and a :class:`HookfitWarning` names both."""
    return [ep for ep, _, _ in _discover(tuple(sys.path))]


@functools.lru_cache(maxsize=8)
def _discover(path: tuple[str, ...]) -> tuple[tuple[metadata.EntryPoint, str | None, str | None], ...]:
    """Entry points with their distribution's name and version, read once per ``sys.path``
    (reading package metadata costs milliseconds; a run should not pay it every ``fit()``)."""
    seen: dict[str, tuple[metadata.EntryPoint, str | None, str | None]] = {}
    for ep in metadata.entry_points(group=GROUP):
        dist = getattr(ep, "dist", None)
        entry = (ep, dist.name if dist else None, dist.version if dist else None)
        first = seen.setdefault(ep.name, entry)
        if first is not entry and first[1] != entry[1]:
            warnings.warn(
                f"two distributions register the hookfit plugin {ep.name!r}: "
                f"{first[1]} ({first[0].value}, used) and {entry[1]} ({ep.value}, "
                f"ignored); uninstall one",
                HookfitWarning,
                stacklevel=4,
            )
    return tuple(seen[name] for name in sorted(seen))


def refresh() -> None:
    """Forget what was discovered, after installing or removing a plugin in this process."""
    _discover.cache_clear()
    _builtin.cache_clear()
    _packages.cache_clear()
    importlib.invalidate_caches()


def _instantiate(obj: Any) -> Any:
    return obj() if inspect.isclass(obj) else obj


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
    return tuple((ep.name, specs) for ep in sorted(metadata.entry_points(group=GROUP), key=lambda e: e.name)
                 if getattr(getattr(ep, "dist", None), "name", None) == OWN for specs in _declared_by(ep))


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
    for ep, dist, _ in _discover(tuple(sys.path)):
        if dist != OWN:
            events += [(ep.name, specs) for specs in _declared_by(ep) if id(specs) not in known]
    return events


def collect(
    given: Sequence[Any] = (),
    disable: Iterable[str] = (),
    *,
    strict: bool = True,
    environ: dict[str, str] | None = None,
    configured: config.Config | None = None,
) -> list[PluginInfo]:
    """Every plugin the run would see, in registration order, enabled or not.

    Enabled entry points are imported and instantiated, with their options from the
    configuration file (:mod:`hookfit.config`; ``configured``, else the file of this process);
    disabled ones never are. With ``strict=False``
    (for listing) one that fails to load carries the error instead of raising.
    """
    env = os.environ if environ is None else environ
    if configured is None:
        configured = config.load(config.find(env))
    disabled = set(disable) | set(split_names(env.get(ENV_DISABLE)))
    only = split_names(env.get(ENV_ONLY)) if ENV_ONLY in env else None

    eps: dict[str, metadata.EntryPoint] = {}
    infos: list[PluginInfo] = []
    for ep, dist, version in _discover(tuple(sys.path)):
        eps[ep.name] = ep
        info = PluginInfo(name=ep.name, source="entry point", distribution=dist, version=version, value=ep.value)
        info.enabled = info.name not in disabled and (only is None or info.name in only)
        infos.append(info)

    by_name = {info.name: i for i, info in enumerate(infos)}
    given_names: set[str] = set()
    for plugin in given:
        plugin = _instantiate(plugin)
        name = plugin_name(plugin)
        if name in given_names:
            raise PluginError(
                f"two plugins given to Loop are both named {name!r}; give one a different "
                f"`name` attribute"
            )
        given_names.add(name)
        info = PluginInfo(
            name=name,
            source="given",
            value=f"{type(plugin).__module__}.{type(plugin).__qualname__}",
            enabled=name not in disabled,
            plugin=plugin,
        )
        info.declares = declared_events(plugin)
        if name in by_name:  # a replaced built-in's events stay declared (register_all)
            infos[by_name[name]] = info
        else:
            infos.append(info)

    known = {info.name for info in infos}
    for label, names in (("disabled", disabled), (ENV_ONLY, only or ())):
        for name in sorted(set(names) - known):
            _warn_unknown(name, label, known)
    for name in configured.plugins:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            raise config.ConfigError(
                f"{configured.where(name)}: no plugin named {name!r} is installed or given"
                f"{f' (did you mean {close[0]!r}?)' if close else ''}; known plugins: {', '.join(sorted(known))}"
            )
        if name in given_names:
            warnings.warn(f"{configured.where(name)} is not used: the plugin {name!r} given to "
                          f"Loop(plugins=[...]) wins over the file", HookfitWarning, stacklevel=4)

    for info in infos:
        if info.source != "entry point":
            continue
        if not info.enabled:  # never imported (a built-in's events are declared all the same)
            continue
        info.options = dict(configured.plugins.get(info.name, {}))
        info.config = configured.path if info.options else None
        try:
            loaded = eps[info.name].load()
            info.declares = declared_events(loaded)
            info.plugin = config.build(configured, info.name, loaded)
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


def _warn_unknown(name: str, label: str, known: set[str]) -> None:
    close = difflib.get_close_matches(name, sorted(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    warnings.warn(
        f"plugin name {name!r} ({label}) matches no installed or given plugin{hint} "
        f"Known plugins: {', '.join(sorted(known)) or 'none'}.",
        HookfitWarning,
        stacklevel=4,
    )


class PluginManager(pluggy.PluginManager):
    """pluggy's manager for the ``hookfit`` project, which also tells listeners when the set
    of implementations may have changed (so per-run dispatch can be resolved again) and
    whether hook calls are being monitored (tracing), in which case dispatch goes through
    pluggy's ordinary call path."""

    def __init__(self) -> None:
        super().__init__(GROUP)
        self.add_hookspecs(hookspecs)
        self.declared: list[tuple[str, Any]] = []
        """``(plugin name, hookspecs)`` of the events plugins declared, in the order added."""
        self.infos: dict[str, PluginInfo] = {}
        self.silenced: list[Silenced] = []
        self.monitors = 0
        self._listeners: list[Callable[[], None]] = []

    # -- change notification -------------------------------------------------------------
    def on_change(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener()`` after every change of plugins or specs; returns the undo."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def _changed(self) -> None:
        for listener in list(self._listeners):
            listener()

    def register(self, plugin: object, name: str | None = None) -> str | None:
        result = super().register(plugin, name)
        self._changed()
        return result

    def unregister(self, plugin: object | None = None, name: str | None = None) -> Any:
        result = super().unregister(plugin, name)
        self._changed()
        return result

    def add_hookspecs(self, module_or_class: ModuleType | type) -> None:
        super().add_hookspecs(module_or_class)
        if hasattr(self, "_listeners"):
            self._changed()

    def add_hookcall_monitoring(self, before: Any, after: Any) -> Callable[[], None]:
        undo = super().add_hookcall_monitoring(before, after)
        self.monitors += 1
        self._changed()

        def undo_and_notify() -> None:
            undo()
            self.monitors -= 1
            self._changed()

        return undo_and_notify

    # -- names for messages --------------------------------------------------------------
    def participants(self) -> list[str]:
        """The run's plugins as the user knows them, in registration order: discovered or
        given, enabled and registered (not switched off since, nor the helpers a plugin
        registers for itself, such as ``optim.batch_end``)."""
        return [name for name, info in self.infos.items() if info.enabled and self.get_plugin(name) is not None]

    def describe(self, name: str | None) -> str:
        """A plugin's name with its distribution, for error messages."""
        info = self.infos.get(name or "")
        return info.describe() if info else f"plugin {name!r}"

    def register_all(self, infos: Sequence[PluginInfo], strict: bool = True) -> None:
        """Register the enabled plugins in order; a hook with wrong arguments is an error
        naming the plugin, its distribution and the hook. With ``strict=False`` (listing) the
        error is kept on the plugin's info instead.

        Events that plugins declare (a ``hookspecs`` attribute naming a class or module of
        specs marked with :data:`hookfit.hookspec`) are added first, so every plugin is checked
        against them whatever the order: those of every built-in plugin, enabled or not
        (:func:`builtin_events`), and those of every enabled plugin. Each declaration is added once; two plugins declaring one event
        are an error naming the second."""
        sources = [(PluginInfo(name=name, source="entry point", distribution=OWN), [specs])
                   for name, specs in builtin_events()]
        sources += [(info, list(info.declares)) for info in infos]
        for info, declared in sources:
            if info.enabled and info.plugin is not None:
                declared += declared_events(info.plugin)
            for specs in declared:
                if any(specs is known for _, known in self.declared):
                    continue
                try:
                    self.add_hookspecs(specs)
                except ValueError as exc:
                    message = f"{info.describe()} declares events hookfit cannot add: {exc}"
                    if strict:
                        raise PluginError(message) from exc
                    info.error = message
                    continue
                self.declared.append((info.name, specs))
        for info in infos:
            self.infos[info.name] = info
            if not info.enabled or info.error is not None:
                continue
            try:
                self.register(info.plugin, name=info.name)
            except (pluggy.PluginValidationError, ValueError) as exc:
                # ValueError: the same object registered twice under two names
                info.error = "; ".join(str(exc).splitlines())
                if strict:
                    raise PluginError(f"{info.describe()} cannot be registered: {info.error}") from exc
                continue
            info.hooks = sorted(impl_names(self, info.plugin))

    # -- calling ---------------------------------------------------------------------------
    def execute(self, name: str, impls: Sequence[pluggy.HookImpl], kwargs: dict[str, Any],
                firstresult: bool) -> Any:
        """pluggy's own call of event ``name`` over ``impls``: the function
        ``HookCaller.__call__`` ends in, through which call monitoring (tracing) sees every
        call. :mod:`hookfit.dispatch` calls it when an event has wrappers or is monitored."""
        return self._hookexec(name, impls, kwargs, firstresult)

    # -- observers ------------------------------------------------------------------------
    def silence(self, name: str, hook: str, error: BaseException) -> None:
        """Switch an observer off for the rest of the run, with one warning naming it."""
        plugin = self.get_plugin(name)
        if plugin is None:  # already switched off (an error in another thread, say)
            return
        self.unregister(name=name)
        description = self.describe(name)
        self.silenced.append(Silenced(name, description, hook, error))
        warnings.warn(
            f"observer {description} failed in hook {hook!r} and is switched off for the rest of "
            f"the run: {type(error).__name__}: {error}",
            ObserverWarning,
            stacklevel=3,
        )

    def check_unknown_hooks(self, strict: bool = True) -> None:
        """Fail when a registered plugin implements an event no spec declares (a misspelt
        hook name), naming the plugin, its distribution, the hook and the closest event.
        With ``strict=False`` (listing) the error is kept on the plugin's info instead."""
        specs = sorted(n for n, c in vars(self.hook).items() if c.has_spec())
        for name, caller in sorted(vars(self.hook).items()):
            if caller.has_spec():
                continue
            for impl in caller.get_hookimpls():
                if impl.optionalhook:
                    continue
                close = difflib.get_close_matches(name, specs, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                message = (
                    f"{self.describe(impl.plugin_name)} implements hook {name!r}, which is "
                    f"not a hookfit event.{hint} Events: {', '.join(specs)}."
                )
                if strict:
                    raise PluginError(message)
                self.infos[impl.plugin_name].error = message


def impl_names(pm: pluggy.PluginManager, plugin: object) -> list[str]:
    """Names of the hooks a registered plugin implements."""
    return [caller.name for caller in (pm.get_hookcallers(plugin) or [])]


def build(given: Sequence[Any] = (), disable: Iterable[str] = ()) -> PluginManager:
    """The plugin manager of one run: discover, select, register and validate."""
    pm = PluginManager()
    pm.register_all(collect(given, disable))
    pm.check_unknown_hooks()
    return pm
