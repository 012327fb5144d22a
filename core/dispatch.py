"""Every way hookfit calls an event, with pluggy's own call as the oracle (the callables themselves are
built in :mod:`hookfit.calls`).

A run calls its events through one :class:`Dispatch` (``loop.hooks``); the core, the built-in
plugins and any plugin that fires events use nothing else. Every kind of call is built from one
resolution of an event's implementations:

* :meth:`Dispatch.handlers`: the implementations as plain callables in pluggy's call order, each
  called positionally with the spec's arguments (``for call in handlers.calls: call(loop,
  loss)``), as Ignite keeps its handler lists. The :class:`Handlers` is the same object for the
  whole run, its ``calls`` a tuple bound anew (never changed in place) when the plugins change, so
  a caller may take it once and iterate it for every batch, and a call in progress ends over the
  callables it began with; empty when nothing implements the event. The loop's own per-batch
  events are read so (:class:`PerBatch`, ``loop.hooks.per_batch``).
* ``loop.hooks.<event>(*args)``: what ``pm.hook.<event>(**kwargs)`` returns (a list of the
  non-``None`` results, or the first one for a first-result event); ``None`` instead of a
  callable when nothing implements the event. It takes the spec's arguments in order, by name as
  pluggy's call does, or both (:func:`hookfit.calls.by_name`).
* :meth:`Dispatch.call_all`: every implementation runs even if some raise; the errors are
  returned with the names of the plugins that raised them (``fit_end``, ``exception``).
* :meth:`Dispatch.call_each`: each implementation's own answer with its plugin's name
  (``save_state``, ``should_stop``).
* :meth:`Dispatch.gather`: both at once, every implementation's answer and every error, none
  skipped because another raised (``results``, asked after ``fit_end``).
* :meth:`Dispatch.call_plugin`: one plugin's implementation, inside the event's wrappers
  (``load_state``, where each plugin gets its own state).

How an implementation is called (resolved when the run starts, again after ``configure``, and
whenever the plugin manager reports a change: a plugin registered or unregistered, a spec added,
monitoring switched on or off):

* only plain implementations and no call monitoring: each function is called directly, in
  exactly pluggy's order; one that takes the spec's arguments in order is called as it is, one
  that takes fewer or others gets them picked from the positional arguments (one Python call more);
* wrappers (``wrapper=True`` or ``hookwrapper=True``) or monitoring (tracing): one callable that
  goes through pluggy's own call path, ``PluginManager.execute``, where ``HookCaller.__call__``
  ends and pluggy's tracing hooks in, so wrappers and tracers see an ordinary call.

Per-batch events only sometimes: a plugin that implements a per-batch event (``batch_start``,
``step_output``, ``batch_end``, ``after_batch``) but needs it only in some runs says which it takes
part in with a method ``batch_events(loop) -> Collection[str]``, asked at each resolution once the
run is configured (the run resolves again after ``fit_start`` and ``resume``); an implementation it
does not name is left out of every call of that event for the run (it costs nothing per batch). A
plugin whose answer changes mid-run calls :meth:`Dispatch.resolve`. A plugin without the method
takes part in every event it implements.

The guard, without touching pluggy's objects: where an implementation must not end the call (an
observer plugin, which is switched off with one warning when it raises; any implementation of
``fit_end`` and ``exception``), the dispatch calls a guarded function (:func:`_guard`) in its
place: on the direct path in the list itself, on pluggy's path inside a new ``HookImpl`` built from
the same plugin and options. The registered ``HookImpl`` objects are never changed.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Sequence, cast

import pluggy

from hookfit import blame
from hookfit.calls import adapter, by_name, direct
from hookfit.guard import guard as _guard
from hookfit.handlers import PER_BATCH, Call, Handlers, PerBatch, asked
from hookfit.manager import PluginManager

CallAll = Callable[..., tuple[list[tuple[str, Any]], list[tuple[str, BaseException]]]]

__all__ = ["Dispatch"]


def _is_observer(plugin: object) -> bool:
    return getattr(plugin, "observer", False) is True


# -- one run's calls ------------------------------------------------------------------------


class Dispatch:
    """The resolved events of one run (``loop.hooks``): handler lists (:meth:`handlers`), the
    loop's per-batch lists (:attr:`per_batch`), and each event as an attribute, a positional
    callable returning pluggy's result, or ``None`` when nothing implements it::

        if (call := loop.hooks.resume) is not None:
            call(loop, source)

    Observer plugins (``observer = True``) are guarded in every kind of call: one that raises
    is switched off for the rest of the run with one warning (see
    :meth:`hookfit.manager.PluginManager.silence`), and the call goes on without it.
    """

    def __init__(self, pm: PluginManager, run: Any = None) -> None:
        self.pm = pm
        self.run = run
        """The run whose plugins' ``batch_events`` are asked (``None``: none is asked)."""
        self.configured = False
        """Whether the run is configured: from then on ``batch_events`` answers are honoured."""
        self._lists: dict[str, Handlers] = {name: Handlers() for name in PER_BATCH}
        self.per_batch = PerBatch()
        """The loop's per-batch events as the loop reads them (:class:`PerBatch`)."""
        self._calls: dict[str, Call | None] = {}
        self._all: dict[str, CallAll | None] = {}
        self._each: dict[str, CallAll | None] = {}
        self.resolve()
        self._undo = pm.on_change(self.resolve)

    # -- resolution -----------------------------------------------------------------------
    def start(self) -> None:
        """The run is configured: resolve again, asking each plugin's ``batch_events``."""
        self.configured = True
        self.resolve()

    def resolve(self) -> None:
        """Resolve every event again: each :class:`Handlers` gets a new tuple, every other call
        is made anew when next asked for."""
        self._calls, self._all, self._each = {}, {}, {}
        for name, handlers in self._lists.items():
            handlers.calls = tuple(self._handlers(name)) if self._declared(name) else ()
        for name in PER_BATCH:
            setattr(self.per_batch, name, self._lists[name].calls)
        self.per_batch.asks = bool(self.pm.hook.should_stop.get_hookimpls() or self.pm.hook.agree_stop.get_hookimpls())

    def handlers(self, name: str) -> Handlers:
        """Event ``name``'s implementations, the same :class:`Handlers` for the whole run: its
        ``calls``, in pluggy's call order, each called positionally with the spec's arguments
        (``for call in handlers.calls: call(loop, loss)``), a new tuple when the plugins change
        (results are not collected: an event whose results matter is called as
        ``loop.hooks.<event>``)."""
        if name not in self._lists:
            self._caller(name)  # an unknown event is an AttributeError naming it
            self._lists[name] = Handlers()
            self._lists[name].calls = tuple(self._handlers(name))
        return self._lists[name]

    def _handlers(self, name: str) -> list[Call]:
        impls = self._impls(name)
        if not impls:
            return []
        if self._plain(impls):
            spec_args = self._signature(self._caller(name))[0]
            return [adapter(self._observers(i, name), spec_args, i) for i in reversed(impls)]
        return [self._through_pluggy(name, impls, self._observer_wrap(name))]

    def __getattr__(self, name: str) -> Call | None:
        if name.startswith("_") or not self._declared(name):
            raise AttributeError(f"no hookfit event named {name!r}")
        if name not in self._calls:
            call = self._compile(name, self._observer_wrap(name), results=True)
            self._calls[name] = None if call is None else by_name(call, name, self._signature(self._caller(name))[0])
        return self._calls[name]

    def _declared(self, name: str) -> bool:
        caller = getattr(self.pm.hook, name, None)
        return caller is not None and caller.has_spec()

    def _caller(self, name: str) -> pluggy.HookCaller:
        if not self._declared(name):
            raise AttributeError(f"no hookfit event named {name!r}")
        return cast(pluggy.HookCaller, getattr(self.pm.hook, name))  # pm.hook's attributes are HookCallers

    def _impls(self, name: str) -> list[pluggy.HookImpl]:
        """Event ``name``'s implementations in pluggy's order, less those a plugin's
        ``batch_events`` leaves out of a per-batch event."""
        impls = self._caller(name).get_hookimpls()
        if name not in PER_BATCH or not self.configured:
            return impls
        return [i for i in impls if getattr(i.plugin, "batch_events", None) is None
                or name in asked(i.plugin, self.run, self.pm.describe(i.plugin_name))]

    def _plain(self, impls: Iterable[pluggy.HookImpl]) -> bool:
        """Whether ``impls`` may be called directly (no wrapper, no call monitoring)."""
        return not self.pm.monitors and not any(i.wrapper or i.hookwrapper for i in impls)

    @staticmethod
    def _signature(caller: pluggy.HookCaller) -> tuple[tuple[str, ...], bool]:
        """The spec's argument names and whether it is a first-result event."""
        spec = caller.spec
        if spec is None:  # never: _caller returns declared events only
            raise AttributeError(f"no hookfit event named {caller.name!r}")
        return tuple(spec.argnames), bool(spec.opts.get("firstresult"))

    def _compile(
        self,
        name: str,
        wrap: Callable[[pluggy.HookImpl], Call],
        results: bool,
        impls: Iterable[pluggy.HookImpl] | None = None,
    ) -> Call | None:
        """One callable for event ``name`` over ``impls`` (default: all of them), calling
        ``wrap(impl)`` in each implementation's place; ``None`` when there is none."""
        impls = list(self._impls(name) if impls is None else impls)
        if not impls:
            return None
        spec_args, firstresult = self._signature(self._caller(name))
        if self._plain(impls):  # pluggy calls the implementation list from its end to its start
            functions = [adapter(wrap(i), spec_args, i) for i in reversed(impls)]
            return direct(functions, results, firstresult)
        return self._through_pluggy(name, impls, wrap)

    def _through_pluggy(self, name: str, impls: Iterable[pluggy.HookImpl],
                        wrap: Callable[[pluggy.HookImpl], Call]) -> Call:
        """``impls`` called through pluggy's own call path, each guarded as ``wrap`` says."""
        spec_args, firstresult = self._signature(self._caller(name))
        prepared = [i if (f := wrap(i)) is i.function else _replace(i, f) for i in impls]
        execute = self.pm.execute

        def through_pluggy(*args: Any) -> Any:
            return execute(name, prepared, dict(zip(spec_args, args)), firstresult)

        return through_pluggy

    def _observers(self, impl: pluggy.HookImpl, hook: str) -> Call:
        """The function to call for ``impl`` of event ``hook``: its own, or guarded if it is
        an observer's."""
        if not _is_observer(impl.plugin):
            return impl.function
        pm, name = self.pm, impl.plugin_name
        return _guard(impl, lambda error: pm.silence(name, hook, error))

    def _observer_wrap(self, name: str) -> Callable[[pluggy.HookImpl], Call]:
        return lambda impl: self._observers(impl, name)

    # -- the kinds of call ------------------------------------------------------------------
    def call_all(self, name: str, *args: Any, on_error: Callable[[BaseException], None] | None = None
                 ) -> list[tuple[str, BaseException]]:
        """Call every implementation of ``name`` with ``args`` (in the spec's order), none of
        them skipped because another raised, wrappers and tracing included. Returns the
        errors, each with the name of the plugin that raised it and a note saying so (an
        observer's error switches it off instead, as always); ``on_error`` is given each as it
        is caught, before the implementations after it run."""
        return self.gather(name, *args, on_error=on_error)[1]

    def gather(self, name: str, *args: Any, on_error: Callable[[BaseException], None] | None = None
               ) -> tuple[list[tuple[str, Any]], list[tuple[str, BaseException]]]:
        """What :meth:`call_all` does, also returning each implementation's own non-``None``
        answer with its plugin's name, in call order (wrappers answer nothing here): every
        implementation runs, ``(answers, errors)``."""
        if name not in self._all:
            self._all[name] = self._recording(name, catch=True)
        call = self._all[name]
        return ([], []) if call is None else call(*args, on_error=on_error)

    def call_each(self, name: str, *args: Any) -> list[tuple[str, Any]]:
        """Call ``name`` once (wrappers and tracing see one ordinary call) and return each
        implementation's own non-``None`` answer with its plugin's name, in call order."""
        if name not in self._each:
            self._each[name] = self._recording(name, catch=False)
        call = self._each[name]
        return [] if call is None else call(*args)[0]

    def _recording(self, name: str, catch: bool) -> CallAll | None:
        """One call of ``name`` that records each implementation's answer with its plugin's
        name and, with ``catch``, guards every implementation, recording its error with a note
        naming the plugin instead of letting it end the call."""
        errors: list[tuple[str, BaseException]] = []
        answers: list[tuple[str, Any]] = []
        told: list[Callable[[BaseException], None]] = []  # the call's on_error, if it has one
        pm = self.pm

        def wrap(impl: pluggy.HookImpl) -> Call:
            plugin = impl.plugin_name
            if catch and not _is_observer(impl.plugin):
                def collect(error: BaseException) -> None:
                    error.add_note(blame.hook_note(pm, error, plugin, name))
                    errors.append((plugin, error))
                    for tell in told:
                        tell(error)

                function = _guard(impl, collect)
            else:
                function = self._observers(impl, name)
            if impl.wrapper or impl.hookwrapper:
                return function

            @functools.wraps(impl.function)
            def record(*args: Any, **kwargs: Any) -> Any:
                result = function(*args, **kwargs)
                if result is not None:
                    answers.append((plugin, result))
                return result

            return record

        call = self._compile(name, wrap, results=False)
        if call is None:
            return None

        def recorded(*args: Any, on_error: Callable[[BaseException], None] | None = None
                     ) -> tuple[list[tuple[str, Any]], list[tuple[str, BaseException]]]:
            told[:] = [] if on_error is None else [on_error]
            try:
                call(*args)
                return answers[:], errors[:]
            finally:
                answers.clear()
                errors.clear()
                told.clear()

        return recorded

    def switched_off(self) -> list[str]:
        """The observers switched off so far, in the order they were."""
        return list(self.pm.switched_off)

    def call_switched_off(self, name: str, observers: list[str], *args: Any) -> None:
        """Call event ``name`` (a teardown: ``fit_end``) of each of ``observers``, switched off
        before it began (:meth:`switched_off`, taken before the event: one switched off during it
        got it, or failed in it): each alone, through pluggy's call path, guarded; its error is one
        more :class:`hookfit.errors.ObserverWarning` naming it."""
        pm = self.pm
        spec_args = self._signature(self._caller(name))[0]
        for observer in observers:
            impl = pm.switched_off[observer].get(name)
            if impl is None:
                continue
            guarded = _replace(impl, _guard(impl, functools.partial(pm.warn_switched_off, observer, name)))
            pm.execute(name, [guarded], dict(zip(spec_args, args)), False)

    def call_plugin(self, name: str, plugin: str, *args: Any) -> Any:
        """Call the implementation of ``name`` of the plugin registered as ``plugin`` (inside
        the event's wrappers, if any) and return its result; ``None`` if it has none."""
        impls = [i for i in self._caller(name).get_hookimpls()
                 if i.plugin_name == plugin or i.wrapper or i.hookwrapper]
        if not any(i.plugin_name == plugin and not (i.wrapper or i.hookwrapper) for i in impls):
            return None
        call = self._compile(name, self._observer_wrap(name), results=True, impls=impls)
        if call is None:  # never: impls holds the plugin's implementation
            return None
        result = call(*args)
        if self._signature(self._caller(name))[1]:  # first result
            return result
        return result[0] if result else None

    def plugins(self, name: str) -> list[str]:
        """The names of the plugins that implement ``name`` (wrappers excluded), in call
        order."""
        impls = self._caller(name).get_hookimpls()
        return [i.plugin_name for i in reversed(impls) if not (i.wrapper or i.hookwrapper)]

    def close(self) -> None:
        """Stop following plugin changes (the run is over)."""
        self._undo()


def _replace(impl: pluggy.HookImpl, function: Call) -> pluggy.HookImpl:
    """A new ``HookImpl`` of the same plugin, name and options around ``function`` (whose
    ``__wrapped__`` is the original, so pluggy reads the same argument names from it)."""
    return pluggy.HookImpl(impl.plugin, impl.plugin_name, function, impl.opts)
