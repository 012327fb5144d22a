"""The run's plugin manager: registration in a stated order, validation, observers' faults.
Which plugins there are is :mod:`hookfit.discovery`'s.

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
named (an empty value loads none); it never drops a plugin given to ``Loop``.
``HOOKFIT_DISABLE_PLUGINS``, ``Loop(disable=[...])`` and a file's ``enabled = false`` switch
discovered plugins off by name. The environment and the file (the operator's switches, outside the
script) switch off a plugin given to ``Loop`` too, with a :class:`HookfitWarning` naming it and
what disabled it; ``Loop(disable=[...])`` naming a plugin the same call gives is a
:class:`PluginError`. A disabled discovered plugin is never imported, instantiated nor
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
and the error; the run goes on and ``loop.state.silenced`` lists it. It still gets ``fit_end``
(unless that is where it failed), so it can release what it holds; an error there is one more
warning. Every other plugin takes
part in training, and its errors fail the run. The guard is applied where events are called,
in :mod:`hookfit.dispatch`, wrappers included; the registered hook implementations are never
changed.
"""

from __future__ import annotations

import difflib
import inspect
import re
import warnings
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Any, Callable

import pluggy

from hookfit import hookspecs
from hookfit.tools import hookspecs as command_events
from hookfit.discovery import GROUP, OWN, PluginInfo, builtin_events, collect, declared_events, inert
from hookfit.errors import HookfitWarning, ObserverWarning, PluginError, Silenced, user_level

hookimpl = pluggy.HookimplMarker("hookfit")
"""The marker for hook implementations: ``@hookfit.hookimpl`` on a function or method named
after an event of :mod:`hookfit.hookspecs` or one that a plugin declares."""


class PluginManager(pluggy.PluginManager):
    """pluggy's manager for the ``hookfit`` project, which also tells listeners when the set
    of implementations may have changed (so per-run dispatch can be resolved again) and
    whether hook calls are being monitored (tracing), in which case dispatch goes through
    pluggy's ordinary call path."""

    def __init__(self) -> None:
        super().__init__(GROUP)
        self.add_hookspecs(hookspecs)
        self.add_hookspecs(command_events)  # add_commands: the command line's, outside runs
        self.declared: list[tuple[str, Any]] = []
        """``(plugin name, hookspecs)`` of the events plugins declared, in the order added."""
        self.infos: dict[str, PluginInfo] = {}
        self.silenced: list[Silenced] = []
        self.switched_off: dict[str, dict[str, pluggy.HookImpl]] = {}
        """The observers switched off, by name, each with its hook implementations by event (as
        registered: ``specname`` included): :meth:`hookfit.dispatch.Dispatch.call_switched_off`
        still gives them ``fit_end``."""
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
        registers for itself)."""
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
                info.error = "; ".join(str(exc).splitlines()) + self._arguments_hint(info.plugin, str(exc))
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
    def _arguments_hint(self, plugin: object, error: str) -> str:
        """What the implementation pluggy refused (``error`` names its hook) asks for that its event
        does not give, with the event's arguments."""
        refused = re.search(r"for hook '(\w+)'", error)
        for attr in [refused[1]] if refused else dir(plugin):
            caller = getattr(self.hook, attr, None)
            if self.parse_hookimpl_opts(plugin, attr) is None or caller is None or caller.spec is None:
                continue
            given = caller.spec.argnames
            for parameter in inspect.signature(getattr(plugin, attr)).parameters.values():
                name, variadic = parameter.name, parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
                if not variadic and parameter.default is parameter.empty and name not in given:  # (pluggy's rule)
                    close = difflib.get_close_matches(name, given, n=1)
                    return (f". The event {attr}({', '.join(given)}) gives no {name!r}"
                            f"{f'; did you mean {close[0]!r}?' if close else '.'} An implementation takes any of "
                            "those arguments, by name, in any order")
        return ""

    def refuse(self, name: str, hook: str, error: BaseException) -> None:
        """Plugin ``name``'s answer to ``hook`` is refused with ``error``: raised where the plugin takes part
        in training, an observer switched off instead (:meth:`silence`)."""
        if getattr(self.get_plugin(name), "observer", False) is not True:
            raise error
        self.silence(name, hook, error)

    def silence(self, name: str, hook: str, error: BaseException) -> None:
        """Switch an observer off for the rest of the run, with one warning naming it."""
        plugin = self.get_plugin(name)
        if plugin is None:  # already switched off (an error in another thread, say)
            return
        self.switched_off[name] = {caller.name: impl for caller in self.get_hookcallers(plugin) or ()
                                   for impl in caller.get_hookimpls() if impl.plugin is plugin}
        self.unregister(name=name)
        description = self.describe(name)
        self.silenced.append(Silenced(name, description, hook, error))
        warnings.warn(
            f"observer {description} failed in hook {hook!r} and is switched off for the rest of "
            f"the run: {type(error).__name__}: {error}",
            ObserverWarning,
            stacklevel=user_level(),
        )

    def warn_switched_off(self, name: str, hook: str, error: BaseException) -> None:
        """An observer switched off earlier failed again in ``hook`` (its teardown): one warning."""
        warnings.warn(f"observer {self.describe(name)}, switched off earlier, failed in hook {hook!r} too: "
                      f"{type(error).__name__}: {error}", ObserverWarning, stacklevel=user_level())

    def check_unknown_hooks(self, strict: bool = True) -> None:
        """Fail when a registered plugin implements an event no spec declares (a misspelt
        hook name), naming the plugin, its distribution, the hook and the closest event.
        With ``strict=False`` (listing) the error is kept on the plugin's info instead."""
        specs = sorted(n for n, c in vars(self.hook).items() if c.has_spec())
        for name, caller in sorted(vars(self.hook).items()):
            if caller.has_spec():
                continue
            for impl in caller.get_hookimpls():
                close = difflib.get_close_matches(name, specs, n=1)
                if impl.optionalhook:  # another plugin's event, maybe absent: unless it looks misspelt
                    if strict and difflib.get_close_matches(name, specs, n=1, cutoff=0.85):
                        warnings.warn(f"{self.describe(impl.plugin_name)} implements {name!r} (optionalhook=True), "
                                      f"which no plugin of this run declares, so it is never called. Did you mean "
                                      f"{close[0]!r}?", HookfitWarning, stacklevel=user_level())
                    continue
                hint = f" Did you mean {close[0]!r}?" if close else ""
                message = (
                    f"{self.describe(impl.plugin_name)} implements hook {name!r}, which is "
                    f"not a hookfit event.{hint} Events: {', '.join(specs)}." + ("" if close else
                    " An event another plugin declares is one while that plugin is in the run: an implementation "
                    "for a run that may lack it says @hookfit.hookimpl(optionalhook=True).")
                )
                if strict:
                    raise PluginError(message)
                self.infos[impl.plugin_name].error = message


def warn_unmarked(pm: PluginManager) -> None:
    """Warn, once per plugin, about its methods named for an event but not marked
    ``@hookfit.hookimpl``: pluggy never calls them, and nothing else would say so."""
    events = {name for name, caller in vars(pm.hook).items() if caller.has_spec()}
    for name, plugin in pm.list_name_plugin():
        marked = set(impl_names(pm, plugin))
        unmarked = sorted(e for e in events - marked if inspect.isroutine(getattr(type(plugin), e, None)))
        if unmarked:
            warnings.warn(f"{pm.describe(name)} has methods named for events and not marked @hookfit.hookimpl, so "
                          f"hookfit never calls them: {', '.join(unmarked)}; mark them, or rename them",
                          HookfitWarning, stacklevel=user_level())


def chosen(pm: pluggy.PluginManager, plugin: object) -> bool:
    """Whether the user chose ``plugin`` for this run: given to ``Loop(plugins=[...])``, named by
    a ``[plugins.<name>]`` table of the configuration file (even empty), or registered by hand
    (not through discovery). What a plugin that is inert when merely discovered passes to its
    own ``inert(chosen)`` (see :func:`hookfit.discovery.inert`). The plugin is found as the object
    it is, not by a ``name`` attribute: a discovered plugin is named by its entry point."""
    infos: dict[str, PluginInfo] = getattr(pm, "infos", {})
    info = next((info for info in infos.values() if info.plugin is plugin), None)
    return True if info is None else bool(info.chosen)


def leave_inert(pm: PluginManager, loop: object) -> PluginManager:
    """Before the run's ``configure``: unregister every plugin that is inert merely discovered,
    not chosen (:func:`chosen`) and answering :func:`hookfit.discovery.inert` for this run
    with what would turn it on; ``pm``. None of its hooks is called then, not even ``fit_end``
    after a ``configure`` that failed. A plugin the user chose that would do nothing decides at
    its own ``configure`` (where it may say so)."""
    for plugin in list(pm.get_plugins()):
        if not chosen(pm, plugin) and inert(plugin, False, loop) is not None:
            pm.unregister(plugin)
    return pm


def impl_names(pm: pluggy.PluginManager, plugin: object) -> list[str]:
    """Names of the hooks a registered plugin implements."""
    return [caller.name for caller in (pm.get_hookcallers(plugin) or [])]


def build(given: Sequence[Any] = (), disable: Iterable[str] = ()) -> PluginManager:
    """The plugin manager of one run: discover, select, register and validate."""
    pm = PluginManager()
    pm.register_all(collect(given, disable))
    pm.check_unknown_hooks()
    warn_unmarked(pm)
    return pm
