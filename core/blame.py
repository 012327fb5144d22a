"""Where an error came from, for its message: a plugin's hook or a step function, found by
walking the error's traceback against the code of every registered implementation."""

from __future__ import annotations

import dis
import functools
import inspect
import re
import types
import warnings
from typing import TYPE_CHECKING, Any

from hookfit.config import Config
from hookfit.discovery import ENV_DISABLE
from hookfit.errors import HookfitWarning, RefusedAnswer, UsageError, user_level
from hookfit.stopping import qualname

if TYPE_CHECKING:  # pragma: no cover
    from hookfit.run import Run

__all__ = ["hook_note", "warn_secondary", "where"]


def where(run: Run, error: BaseException) -> str:
    """A note saying where ``error`` was raised: by the training or validation data (the
    loop's fetch of which batch), by which plugin in which hook, or in which step function, at
    which epoch, stage and batch (epochs and batches counted from 1, as the console's ``batch=``; a
    ``stage_start`` before the stage's first batch, a ``stage_end`` after its last). A hook
    implementation that raised inside another plugin's hook (an event that plugin fires, as metrics
    fires ``epoch_metrics`` from its ``stage_end``) is the one blamed, and the hook it was called
    from is named. Plugin code that a step calls (``loop.backward``, a managed optimizer's ``step()``) is the plugin's: the
    note names the plugin and the function, and the step that called it; unless the error is a
    :class:`~hookfit.errors.UsageError` raised within that plugin's code, which says the step
    called it wrongly: then the step is blamed, and the plugin's function that refused named; or
    it was raised by a hook implementation that code called (an event it fired, as a managed
    ``step()`` fires ``before_optimizer_step``): then that implementation is blamed, the plugin
    code and the step named as where it was called from. An error of none of them before the
    first epoch began says the run was refused where hookfit raised it (a run folder another live
    process holds), else that it raised before the first epoch began (a ``len()`` of the data). A plugin's
    error at ``configure`` or ``fit_start`` that names an option the configuration file gave it names that file's table."""
    pm = run.pm
    owners = _owners(pm)
    config = run.config  # the steps as given (named in messages), and as wrapped (wrap_step), which run
    steps = {_code(w): g or w for w, g in ((run.train_step, config.train_step), (run.val_step, config.val_step)) if w}
    own = {_code(s) for s in (config.train_step, config.val_step) if s}
    wrapper = None  # the frame of a plugin's wrapper of the step (loop.wrap_step), until the step's own
    modules = _plugin_modules(pm, {getattr(s, "__module__", None) for s in steps.values()})
    state = run.state
    at = (f"epoch {state.epoch + 1}, stage {state.stage}, batch {state.batch_idx + 1}" if state.stage is not None
          else f"epoch {state.epoch + 1}, outside a stage")  # epochs and batches as the console counts them, from 1
    step = None
    hooks: list[tuple[str, str]] = []  # the hook implementations on the way, outermost first
    fetch = None  # the loop's innermost frame, where it was fetching a batch
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if step is None and code in owners:
            if not _thrown_into(tb):
                hooks.append(owners[code])
        elif not hooks and step is None and code in steps:
            step, wrapper = steps[code], (None if code in own or None in own else tb)  # (None: a step unseen)
        elif wrapper is not None and code in own:  # the step itself, inside its wrapper
            wrapper = None
        elif not hooks and step is not None and (owner := _owner(modules, tb.tb_frame.f_globals.get("__name__"))):
            if isinstance(error, UsageError) and _core_raised(tb):  # (hookfit's own check refused what the step did)
                return f"hookfit: raised in step function {qualname(step)!r} ({at})"
            if isinstance(error, UsageError) and _within(modules, owner, tb):
                return (f"hookfit: raised in step function {qualname(step)!r}, which called {pm.describe(owner)} "
                        f"wrongly: {code.co_qualname} refused the call ({at})")
            called = f"{pm.describe(owner)} in {code.co_qualname}, called from step function {qualname(step)!r}"
            if inner := _innermost(owners, tb.tb_next):  # an event that plugin code fired
                return f"{_hook_note(pm, inner, inner)}, called from {called} ({at})"
            return f"hookfit: raised by {called} ({at})"
        if not hooks and step is None and tb.tb_frame.f_globals.get("__name__") in _LOOP:
            fetch = _fetching(tb, state.epoch + 1)
        tb = tb.tb_next
    if hooks:  # a plugin's answer refused (RefusedAnswer) blames that plugin's implementation
        inner = error.implementation if isinstance(error, RefusedAnswer) else hooks[-1]
        outer, batch = hooks[0][1], state.batch_idx + 1
        if outer in _BETWEEN:  # (state.stage still names the stage before)
            at = f"epoch {state.epoch + 1}, outside a stage"
        elif outer == "stage_start":  # no batch drawn yet (a resumed stage starts at its next batch)
            first = f"batch {batch}" if batch > 1 else "its first batch"
            at = f"epoch {state.epoch + 1}, stage {state.stage}, before {first}"
        elif outer == "stage_end":
            at = f"epoch {state.epoch + 1}, stage {state.stage}, after batch {batch}, its last"
        return f"{_hook_note(pm, hooks[0], inner)} ({at}){_from_file(pm, error, *inner)}"
    if wrapper is not None:
        owner = _owner(modules, wrapper.tb_frame.f_globals.get("__name__"))
        return (f"hookfit: raised in the step wrapper {wrapper.tb_frame.f_code.co_qualname!r}"
                f"{f' of {pm.describe(owner)}' if owner else ''} (loop.wrap_step), around step function "
                f"{qualname(step)!r} ({at})")
    if step is not None:
        return f"hookfit: raised in step function {qualname(step)!r} ({at})"
    if fetch is not None:
        return f"hookfit: {fetch}"
    if not run.started:  # (configure, the claim of the run folder, the checks and the resume before the first epoch)
        last = error.__traceback__
        while last is not None and last.tb_next is not None:
            last = last.tb_next
        name = "" if last is None else str(last.tb_frame.f_globals.get("__name__", ""))
        if name == "hookfit" or name.startswith("hookfit."):  # raised by hookfit itself: it refused the run
            return "hookfit: the run was refused before it began (no epoch had started)"
        return "hookfit: raised before the run's first epoch began"  # (the user's data, a library it called)
    return f"hookfit: raised during the run ({at})"


def hook_note(pm: Any, error: BaseException, plugin: str, hook: str) -> str:
    """The note of an error that ``plugin``'s implementation of ``hook`` let out (a guard that
    calls each implementation on its own, as ``fit_end``'s does): that implementation, or the
    innermost implementation of another hook it called (an event it fires), which is then the
    one blamed, with ``plugin`` and ``hook`` named as where it was called from; an answer refused
    (:class:`~hookfit.errors.RefusedAnswer`) blames the implementation that gave it."""
    owners = _owners(pm)
    inner = (error.implementation if isinstance(error, RefusedAnswer)
             else _innermost(owners, error.__traceback__) or (plugin, hook))
    return _hook_note(pm, (plugin, hook), inner)


def _hook_note(pm: Any, outer: tuple[str, str], inner: tuple[str, str]) -> str:
    note = f"hookfit: raised by {pm.describe(inner[0])} in hook {inner[1]!r}"
    if inner != outer:
        note += f", called from {pm.describe(outer[0])} in its hook {outer[1]!r}"
    return note


def _from_file(pm: Any, error: BaseException, plugin: str, hook: str) -> str:
    """For an error of ``plugin``'s ``configure`` or ``fit_start`` (where a plugin checks its options against
    the run) that names an option the configuration file gave it (``monitor='valid/loss' needs validation``):
    the file's table, those options, and the way to run without them that does not edit the script; else
    nothing (an error the options did not cause, as a torn checkpoint given to ``resume``, is not the file's)."""
    info = getattr(pm, "infos", {}).get(plugin)
    if hook not in ("configure", "fit_start") or info is None or info.config is None:
        return ""
    given = {option: value for option, value in info.options.items() if option != "enabled"}
    if not any(re.search(rf"(?<![\w/\\.]){re.escape(option)}(?![\w/\\]|\.\w)", str(error)) for option in given):
        return ""  # (a word alone: not part of another word or of a path)
    options = ", ".join(f"{option}={value!r}" for option, value in given.items())
    way = (f"switch the plugin off for this run: Loop(disable=[{plugin!r}]) or {ENV_DISABLE}={plugin}"
           if info.source == "entry point" else "pass the option in the code, which wins over the file")
    return f"; its options {options} come from {Config(info.config).where(plugin)}: change them there, or {way}"


def _owners(pm: Any) -> dict[Any, tuple[str, str]]:
    """The code of every registered hook implementation -> (its plugin's name, the hook)."""
    owners: dict[Any, tuple[str, str]] = {}
    for caller in vars(pm.hook).values():
        for impl in caller.get_hookimpls():
            code = getattr(getattr(impl.function, "__func__", impl.function), "__code__", None)
            owners[code] = (impl.plugin_name, caller.name)
    return owners


_BETWEEN = frozenset({"configure", "fit_start", "resume", "resumed", "epoch_start", "epoch_end", "after_epoch",
                      "fit_end", "results"})
"""The events the loop fires outside any stage: an error of one is placed at its epoch alone."""

_LOOP = ("hookfit.training", "hookfit.replay")
"""The modules of the loop's stage function (:func:`hookfit.training.run_stage`) and of the iterator it makes
(:func:`hookfit.replay.iterate`): their frames in a traceback say whether the loop was fetching a batch when the
error came."""


def _fetching(tb: types.TracebackType, epoch: int) -> str | None:
    """What the loop's frame ``tb`` was doing with the data when the error passed through it,
    in words, or ``None`` when it was not fetching: the stage function's ``for`` statement
    taking the next batch (``FOR_ITER``), making the stage's iterator (``iterate``), or
    looking for a batch after the last one it ran (``_more``). Read from the frame alone: the
    loop does no work for it."""
    frame, name = tb.tb_frame, tb.tb_frame.f_code.co_name
    local = frame.f_locals
    stage = local.get("stage", "train") if name == "run_stage" else ("train" if local.get("train", True) else "valid")
    data = "the training data" if stage == "train" else "the validation data"
    done = "trained" if stage == "train" else "validated"
    code = frame.f_code.co_code
    if name == "run_stage" and 0 <= tb.tb_lasti < len(code) and dis.opname[code[tb.tb_lasti]] == "FOR_ITER":
        index, start = local.get("batch_idx", -1) + 1, local.get("start", 0)  # (from 0, said from 1)
        ran = (f"batches {start + 1}-{index} {done}" if index - 1 > start else
               f"batch {start + 1} {done}" if index - 1 == start else f"no batch {done} yet")
        return (f"raised by {data} when the loop fetched batch {index + 1}, fetch {index - start + 1} of the "
                f"stage ({ran}) (epoch {epoch}, stage {stage})")
    if name == "iterate":
        start = local.get("start", 0)
        what = f"skipping the {start} batch(es) already done" if start else "making its iterator (iter(data))"
        return f"raised by {data} when the loop was {what} (epoch {epoch}, stage {stage})"
    if name == "_more":
        index = local.get("batch_idx", -1) + 1
        return (f"raised by {data} when the loop fetched batch {index + 1} to see whether the stage had more "
                f"batches after the max_steps limit (epoch {epoch}, stage {stage})")
    return None


def _plugin_modules(pm: Any, scripts: set[str | None]) -> dict[str, str]:
    """Module name or package prefix -> plugin name: a plugin's own module and, when its
    module sits in a package of its own (``hookfit.plugins.optim``), every module of that
    package. A module that holds a step function too (a script defining its plugin) is left
    out: its code is the script's, unless it is a hook implementation."""
    modules: dict[str, str] = {}
    packages: dict[str, set[str]] = {}
    for name, plugin in pm.list_name_plugin():
        if plugin is None:
            continue
        module = plugin.__name__ if isinstance(plugin, types.ModuleType) else type(plugin).__module__
        if module in scripts:
            continue
        root = name.split(".")[0]  # "tool.part", a helper plugin "tool" registered, is "tool"'s
        modules.setdefault(module, root)
        if "." in module:
            packages.setdefault(module.rsplit(".", 1)[0] + ".", set()).add(root)
    for prefix, names in packages.items():
        if len(names) == 1:  # a package that holds one plugin only is that plugin's
            modules.setdefault(prefix, names.pop())
    return modules


def _owner(modules: dict[str, str], module: str | None) -> str | None:
    if not module:
        return None
    if module in modules:
        return modules[module]
    prefix = module
    while "." in prefix:
        prefix = prefix.rsplit(".", 1)[0]
        if prefix + "." in modules:
            return modules[prefix + "."]
    return None


def _code(function: Any) -> Any:
    """The code a step function runs: a function's, a ``functools.partial``'s function's, a callable
    object's ``__call__``'s; ``None`` when none is found."""
    while isinstance(function, functools.partial):
        function = function.func
    code = getattr(function, "__code__", None)
    return code if code is not None else getattr(getattr(type(function), "__call__", None), "__code__", None)


def _innermost(owners: dict[Any, tuple[str, str]], tb: types.TracebackType | None) -> tuple[str, str] | None:
    """The innermost hook implementation (its plugin and hook) from ``tb`` on, if any."""
    inner = None
    while tb is not None:
        inner = owners.get(tb.tb_frame.f_code, inner)
        tb = tb.tb_next
    return inner


def _thrown_into(tb: types.TracebackType) -> bool:
    """Whether the error passed through frame ``tb`` only because it was thrown into it: a wrapper
    (``wrapper=True``) waiting at its ``yield`` while the implementations it wraps ran, one of which
    raised. The frame next in the traceback was then not called by it: it called nothing that failed."""
    after = tb.tb_next
    return after is not None and after.tb_frame.f_back is not tb.tb_frame and bool(
        tb.tb_frame.f_code.co_flags & inspect.CO_GENERATOR)


def _within(modules: dict[str, str], owner: str, tb: types.TracebackType | None) -> bool:
    """Whether every frame from ``tb`` to where the error was raised is code of plugin ``owner``."""
    while tb is not None:
        if _owner(modules, tb.tb_frame.f_globals.get("__name__")) != owner:
            return False
        tb = tb.tb_next
    return True


def _core_raised(tb: types.TracebackType) -> bool:
    """Whether the innermost frame from ``tb`` on, where the error was raised, is the core's (``hookfit.*``, no plugin)."""
    while tb.tb_next is not None:
        tb = tb.tb_next
    module = str(tb.tb_frame.f_globals.get("__name__", ""))
    return module.startswith("hookfit.") and not module.startswith("hookfit.plugins.")


def warn_secondary(error: BaseException, hook: str, when: str = "while the run was already ending") -> None:
    """An error of ``hook`` while the run was already ending (or ``when``, another error having ended
    it): a warning, never a replacement of the error that ended it."""
    notes = "; ".join(getattr(error, "__notes__", []))
    warnings.warn(
        f"{hook} failed {when}: {type(error).__name__}: {error}" + (f" ({notes})" if notes else ""),
        HookfitWarning,
        stacklevel=user_level(),
    )
