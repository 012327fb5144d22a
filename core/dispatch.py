"""Every way hookfit calls an event, in one module, with pluggy's own call as the oracle.

A run calls its events through one :class:`Dispatch` (``loop.hooks``); the core, the built-in
plugins and any plugin that fires events use nothing else. It offers four kinds of call, all
built from one resolution of an event's implementations:

* ``loop.hooks.<event>(*args)``: what ``pm.hook.<event>(**kwargs)`` returns (a list of the
  non-``None`` results, or the first one for a first-result event); ``None`` instead of a
  callable when nothing implements the event, so a caller on the hot path pays one test. The
  loop's own per-batch events (``batch_start``, ``step_output``, ``batch_end``) ignore results.
* :meth:`Dispatch.call_all`: every implementation runs even if some raise; the errors are
  returned with the names of the plugins that raised them (``fit_end``, ``exception``).
* :meth:`Dispatch.call_each`: each implementation's own answer with its plugin's name
  (``save_state``, ``should_stop``).
* :meth:`Dispatch.gather`: both at once, every implementation's answer and every error, none
  skipped because another raised (``results``, asked after ``fit_end``).
* :meth:`Dispatch.call_plugin`: one plugin's implementation, inside the event's wrappers
  (``load_state``, where each plugin gets its own state).

How an event is called (resolved once per run, and again whenever the plugin manager reports a
change: a plugin registered or unregistered, a spec added, monitoring switched on or off):

* no implementation: nothing is called;
* only plain implementations and no call monitoring: their functions are called directly, in
  exactly pluggy's order, each with the arguments it asked for, collecting results as pluggy
  does. This is the hot path: a per-batch event with one implementation that takes every
  argument is one Python call;
* wrappers (``wrapper=True`` or ``hookwrapper=True``) or monitoring (tracing): pluggy's own
  call path, ``PluginManager._hookexec``, which is where ``HookCaller.__call__`` ends and where
  pluggy's tracing hooks in, so wrappers and tracers see an ordinary call.

Guards, without touching pluggy's objects: where an implementation must not end the call
(an observer plugin, which is switched off with one warning when it raises; any
implementation of ``fit_end`` and ``exception``), the dispatch calls a guarded function in its
place. On the direct path that is a closure; on pluggy's path it is a new ``HookImpl`` built
from the same plugin and options around the guarded function, handed to pluggy's call in
place of the registered one. The registered ``HookImpl`` objects are never changed.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Sequence, cast

import pluggy

from hookfit.manager import PluginManager

Call = Callable[..., Any]
CallAll = Callable[..., tuple[list[tuple[str, Any]], list[tuple[str, BaseException]]]]
CallEach = Callable[..., list[tuple[str, Any]]]
OnError = Callable[[BaseException], None]

__all__ = ["Dispatch", "HotPath"]


# -- building the calls ---------------------------------------------------------------------


def _adapter(function: Call, spec_args: Sequence[str], impl: pluggy.HookImpl) -> Call:
    """``function`` called positionally with the spec's arguments, passing only those the
    implementation asked for (keyword parameters with defaults by keyword, as pluggy does)."""
    if tuple(impl.argnames) == tuple(spec_args) and not impl.kwargnames:
        return function
    passed = [*impl.argnames, *(f"{k}={k}" for k in impl.kwargnames if k in spec_args)]
    source = f"lambda {', '.join(spec_args)}: function({', '.join(passed)})"
    # names are identifiers checked by pluggy; eval of a lambda source gives a function
    return cast(Call, eval(source, {"function": function}))


def _direct(functions: list[Call], results: bool, firstresult: bool) -> Call:
    """The functions called in order, results collected as pluggy collects them."""
    if len(functions) == 1 and (not results or firstresult):
        return functions[0]  # nothing to collect: its own return value is the answer

    if not results:

        def notify(*args: Any) -> None:
            for function in functions:
                function(*args)

        return notify

    if firstresult:

        def first(*args: Any) -> Any:
            for function in functions:
                result = function(*args)
                if result is not None:
                    return result
            return None

        return first

    def collect(*args: Any) -> list[Any]:
        out = []
        for function in functions:
            result = function(*args)
            if result is not None:
                out.append(result)
        return out

    return collect


def _guard(impl: pluggy.HookImpl, on_error: OnError) -> Call:
    """``impl``'s function such that an :class:`Exception` it raises goes to ``on_error``
    instead of out of the call; a wrapper then behaves as if it were absent."""
    if impl.wrapper:
        return _guard_wrapper(impl.function, on_error)
    if impl.hookwrapper:
        return _guard_hookwrapper(impl.function, on_error)
    function = impl.function

    @functools.wraps(function)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except Exception as error:
            on_error(error)
            return None

    return guarded


def _guard_wrapper(function: Call, on_error: OnError) -> Call:
    """A new-style wrapper (``wrapper=True``) whose own errors go to ``on_error``."""

    @functools.wraps(function)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            teardown = function(*args, **kwargs)
            next(teardown)
        except Exception as error:  # raised, or did not yield (StopIteration)
            on_error(error)
            return (yield)
        try:
            result = yield
        except BaseException as inner:  # an unguarded implementation inside raised
            try:
                teardown.throw(inner)
            except StopIteration as stop:
                return stop.value
            except BaseException as error:
                if error is not inner and isinstance(error, Exception):
                    on_error(error)
                    raise inner from None
                raise
            teardown.close()
            on_error(RuntimeError(f"wrapper {function.__qualname__} has a second yield"))
            raise
        try:
            teardown.send(result)
        except StopIteration as stop:
            return stop.value
        except Exception as error:
            on_error(error)
            return result
        teardown.close()
        on_error(RuntimeError(f"wrapper {function.__qualname__} has a second yield"))
        return result

    return guarded


def _guard_hookwrapper(function: Call, on_error: OnError) -> Call:
    """An old-style wrapper (``hookwrapper=True``) whose own errors go to ``on_error``."""

    @functools.wraps(function)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            teardown = function(*args, **kwargs)
            next(teardown)
        except Exception as error:
            on_error(error)
            yield
            return
        outcome = yield
        try:
            teardown.send(outcome)
        except StopIteration:
            return
        except Exception as error:
            on_error(error)
            return
        teardown.close()
        on_error(RuntimeError(f"hookwrapper {function.__qualname__} has a second yield"))

    return guarded


def _is_observer(plugin: object) -> bool:
    return getattr(plugin, "observer", False) is True


# -- one run's calls ------------------------------------------------------------------------


class HotPath:
    """What the loop reads for every batch: the resolved ``batch_start``, ``step_output``,
    ``batch_end`` and ``after_batch`` (``None`` when nothing implements them) and ``asks``, whether anything answers
    ``should_stop`` or ``agree_stop`` (so the loop must ask after each batch).

    A plain object with slots, updated in place whenever the plugins change: CPython
    specialises loads of its attributes, which it cannot do on :class:`Dispatch` (a class with
    ``__getattr__``), and five such loads a batch are measurable on a small model."""

    __slots__ = ("batch_start", "step_output", "batch_end", "after_batch", "asks")

    def __init__(self) -> None:
        self.batch_start: Call | None = None
        self.step_output: Call | None = None
        self.batch_end: Call | None = None
        self.after_batch: Call | None = None
        self.asks = False


class Dispatch:
    """The resolved events of one run, read as attributes (``loop.hooks.<event>``): a
    positional callable taking the spec's arguments in order, or ``None`` when nothing
    implements the event::

        if (call := loop.hooks.before_backward) is not None:
            call(loop, loss)

    An implementation that takes every argument of its event, in the spec's order, is called
    as it is; one that takes fewer goes through a small adapter (one call more per event).
    Observer plugins (``observer = True``) are guarded in every kind of call: one that raises
    is switched off for the rest of the run with one warning (see
    :meth:`hookfit.manager.PluginManager.silence`), and the call goes on without it.
    """

    NOTIFY = ("batch_start", "step_output", "batch_end", "after_batch")
    """The loop's per-batch events, whose results are ignored: resolved as soon as the
    plugins change, so the loop only reads an attribute per batch."""

    batch_start: Call | None
    step_output: Call | None
    batch_end: Call | None
    after_batch: Call | None

    def __init__(self, pm: PluginManager) -> None:
        self.pm = pm
        self.hot = HotPath()
        """The per-batch events as the loop reads them (:class:`HotPath`)."""
        self._resolved: set[str] = set()
        self._all: dict[str, CallAll | None] = {}
        self._each: dict[str, CallEach | None] = {}
        self.resolve()
        self._undo = pm.on_change(self.resolve)

    # -- resolution -----------------------------------------------------------------------
    def resolve(self) -> None:
        """Forget every resolution; the per-batch events are resolved again at once."""
        for name in self._resolved:
            self.__dict__.pop(name, None)
        self._resolved = set()
        self._all, self._each = {}, {}
        hot = self.hot
        for name in self.NOTIFY:
            call = self._compile(name, self._observer_wrap(name), results=False)
            self.__dict__[name] = call
            setattr(hot, name, call)
            self._resolved.add(name)
        hot.asks = bool(self.pm.hook.should_stop.get_hookimpls() or self.pm.hook.agree_stop.get_hookimpls())

    def __getattr__(self, name: str) -> Call | None:
        if name.startswith("_") or not self._declared(name):
            raise AttributeError(f"no hookfit event named {name!r}")
        call = self._compile(name, self._observer_wrap(name), results=True)
        self.__dict__[name] = call
        self._resolved.add(name)
        return call

    def _declared(self, name: str) -> bool:
        caller = getattr(self.pm.hook, name, None)
        return caller is not None and caller.has_spec()

    def _caller(self, name: str) -> pluggy.HookCaller:
        if not self._declared(name):
            raise AttributeError(f"no hookfit event named {name!r}")
        return cast(pluggy.HookCaller, getattr(self.pm.hook, name))  # pm.hook's attributes are HookCallers

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
        caller = self._caller(name)
        impls = list(caller.get_hookimpls() if impls is None else impls)
        if not impls:
            return None
        spec_args, firstresult = self._signature(caller)
        plain = not self.pm.monitors and not any(i.wrapper or i.hookwrapper for i in impls)
        if plain:  # pluggy calls the implementation list from its end to its start
            functions = [_adapter(wrap(i), spec_args, i) for i in reversed(impls)]
            return _direct(functions, results, firstresult)
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
    def call_all(self, name: str, *args: Any) -> list[tuple[str, BaseException]]:
        """Call every implementation of ``name`` with ``args`` (in the spec's order), none of
        them skipped because another raised, wrappers and tracing included. Returns the
        errors, each with the name of the plugin that raised it and a note saying so (an
        observer's error switches it off instead, as always)."""
        return self.gather(name, *args)[1]

    def gather(self, name: str, *args: Any) -> tuple[list[tuple[str, Any]], list[tuple[str, BaseException]]]:
        """What :meth:`call_all` does, also returning each implementation's own non-``None``
        answer with its plugin's name, in call order (wrappers answer nothing here): every
        implementation runs, ``(answers, errors)``."""
        if name not in self._all:
            self._all[name] = self._compile_all(name)
        call = self._all[name]
        if call is None:
            return [], []
        return call(*args)

    def _compile_all(self, name: str) -> CallAll | None:
        errors: list[tuple[str, BaseException]] = []
        answers: list[tuple[str, Any]] = []
        pm = self.pm

        def wrap(impl: pluggy.HookImpl) -> Call:
            plugin = impl.plugin_name
            if _is_observer(impl.plugin):
                function = self._observers(impl, name)
            else:
                def collect(error: BaseException) -> None:
                    error.add_note(f"hookfit: raised by {pm.describe(plugin)} in hook {name!r}")
                    errors.append((plugin, error))

                function = _guard(impl, collect)
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

        def all_of_them(*args: Any) -> tuple[list[tuple[str, Any]], list[tuple[str, BaseException]]]:
            try:
                call(*args)
                return answers[:], errors[:]
            finally:
                answers.clear()
                errors.clear()

        return all_of_them

    def call_each(self, name: str, *args: Any) -> list[tuple[str, Any]]:
        """Call ``name`` once (wrappers and tracing see one ordinary call) and return each
        implementation's own non-``None`` answer with its plugin's name, in call order."""
        if name not in self._each:
            self._each[name] = self._compile_each(name)
        call = self._each[name]
        if call is None:
            return []
        return call(*args)

    def _compile_each(self, name: str) -> CallEach | None:
        answers: list[tuple[str, Any]] = []

        def wrap(impl: pluggy.HookImpl) -> Call:
            function = self._observers(impl, name)
            if impl.wrapper or impl.hookwrapper:
                return function
            plugin = impl.plugin_name

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

        def each(*args: Any) -> list[tuple[str, Any]]:
            try:
                call(*args)
                return answers[:]
            finally:
                answers.clear()

        return each

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
