"""Per-run dispatch of the per-batch events.

Calling ``pm.hook.X(**kwargs)`` costs about a microsecond of bookkeeping even when nothing
implements ``X`` (see ``shared/notes/hot-path-facts.md``); done for four events a batch it would
cost a small model several percent. So when a run starts, each per-batch event is resolved once:

* no implementation: the attribute is ``None`` and the loop skips the call;
* only plain implementations: a function that calls them directly, in exactly pluggy's order,
  passing each the subset of arguments it asked for, and collecting non-``None`` results as
  pluggy does (the first one for a ``firstresult`` event);
* anything pluggy does beyond that (wrappers, call monitoring or tracing): a function that goes
  through pluggy's ordinary call path, so plugins always get plain pluggy semantics.

Whenever the plugin manager reports a change (a plugin registered or unregistered, a spec
added, monitoring switched), the events are resolved again.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Sequence

import pluggy

from hookfit.manager import PluginManager

Call = Callable[..., Any]


def _adapter(function: Call, spec_args: Sequence[str], impl_args: Sequence[str]) -> Call:
    """``function`` called positionally with the spec's arguments, passing only its own."""
    if tuple(impl_args) == tuple(spec_args):
        return function
    source = f"lambda {', '.join(spec_args)}: function({', '.join(impl_args)})"
    return eval(source, {"function": function})  # names are identifiers checked by pluggy


def _direct(functions: list[Call], results: bool | str, firstresult: bool) -> Call:
    if len(functions) == 1 and (not results or results == "answer" or firstresult):
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


def _through_pluggy(caller: pluggy.HookCaller, spec_args: Sequence[str]) -> Call:
    names = tuple(spec_args)

    def call(*args: Any) -> Any:
        return caller(**dict(zip(names, args)))

    return call


def resolve(pm: PluginManager, name: str, results: bool | Literal["answer"]) -> Call | None:
    """A positional callable for event ``name``, or ``None`` when nothing implements it.

    With ``results`` false the callable's return value is meaningless (events whose results
    the loop ignores); with it true the callable returns what ``pm.hook.<name>`` would; with
    ``"answer"`` a single implementation's own return value (``None`` included), or what
    ``pm.hook.<name>`` would when there are several (a list), so one answer needs no list.
    """
    caller: pluggy.HookCaller = getattr(pm.hook, name)
    impls = caller.get_hookimpls()
    if not impls:
        return None
    assert caller.spec is not None, name
    spec_args = caller.spec.argnames
    plain = not pm.monitors and not any(i.hookwrapper or i.wrapper for i in impls)
    if not plain:
        return _through_pluggy(caller, spec_args)  # always a list (or the first result)
    # pluggy calls the implementation list from its end to its start.
    functions = [_adapter(i.function, spec_args, i.argnames) for i in reversed(impls)]
    return _direct(functions, results, bool(caller.spec.opts.get("firstresult")))


class Dispatch:
    """Resolved events of one run, read as attributes (``loop.hooks.<event>``): a positional
    callable, or ``None`` when nothing implements the event.

    The loop's own per-batch events ignore results: ``batch_start(loop, batch, batch_idx)``,
    ``step_output(loop, output, batch)``, ``batch_end(loop, output, batch, batch_idx)``. Any
    other event, ``should_stop(loop)`` included, returns what ``pm.hook.<event>`` would
    (a list of non-``None`` results, or the first one for a first-result event), so plugins
    that fire events on the hot path (``before_backward``...) get the same zero-cost dispatch::

        if (call := loop.hooks.before_backward) is not None:
            call(loop, loss)

    ``stop_answer(loop)`` is ``should_stop`` as the loop asks it after each batch: one
    implementation's own answer, or the list of several's answers.

    An implementation that takes every argument of its event, in the spec's order, is called
    as it is; one that takes fewer goes through a small adapter (one call more per event).
    """

    NOTIFY = ("batch_start", "step_output", "batch_end")

    batch_start: Call | None
    step_output: Call | None
    batch_end: Call | None
    should_stop: Call | None
    stop_answer: Call | None

    def __init__(self, pm: PluginManager) -> None:
        self.pm = pm
        self._resolved: set[str] = set()
        self.resolve()
        self._undo = pm.on_change(self.resolve)

    def resolve(self) -> None:
        """Forget every resolution; the per-batch events are resolved again at once."""
        for name in self._resolved:
            self.__dict__.pop(name, None)
        self._resolved = set()
        for name in self.NOTIFY:
            self.__dict__[name] = resolve(self.pm, name, results=False)
            self._resolved.add(name)
        self.stop_answer = resolve(self.pm, "should_stop", results="answer")

    def __getattr__(self, name: str) -> Call | None:
        if name.startswith("_") or not hasattr(self.pm.hook, name):
            raise AttributeError(f"no hookfit event named {name!r}")
        call = resolve(self.pm, name, results=True)
        self.__dict__[name] = call
        self._resolved.add(name)
        return call

    def close(self) -> None:
        """Stop following plugin changes (the run is over)."""
        self._undo()
