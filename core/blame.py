"""Where an error came from, for its message: a plugin's hook or a step function, found by
walking the error's traceback against the code of every registered implementation."""

from __future__ import annotations

import types
import warnings
from typing import TYPE_CHECKING, Any

from hookfit.manager import HookfitWarning
from hookfit.stopping import qualname

if TYPE_CHECKING:  # pragma: no cover
    from hookfit.run import Run

__all__ = ["warn_secondary", "where"]


def where(run: Run, error: BaseException) -> str:
    """A note saying where ``error`` was raised: by which plugin in which hook, or in which
    step function, at which epoch, stage and batch. Plugin code that a step calls
    (``loop.backward``, a managed optimizer's ``step()``) is the plugin's: the note names the
    plugin and the function, and the step that called it."""
    pm = run.pm
    owners: dict[Any, tuple[str, str]] = {}
    for caller in vars(pm.hook).values():
        for impl in caller.get_hookimpls():
            code = getattr(getattr(impl.function, "__func__", impl.function), "__code__", None)
            owners[code] = (impl.plugin_name, caller.name)
    steps = {getattr(s, "__code__", None): s for s in (run.train_step, run.val_step) if s}
    modules = _plugin_modules(pm, {getattr(s, "__module__", None) for s in steps.values()})
    state = run.state
    at = f"epoch {state.epoch}, stage {state.stage}, batch {state.batch_idx}"
    step = None
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if step is None and code in owners:
            plugin, hook = owners[code]
            return f"hookfit: raised by {pm.describe(plugin)} in hook {hook!r} ({at})"
        if step is None and code in steps:
            step = steps[code]
        elif step is not None and (owner := _owner(modules, tb.tb_frame.f_globals.get("__name__"))) is not None:
            return (f"hookfit: raised by {pm.describe(owner)} in {code.co_qualname}, called from step "
                    f"function {qualname(step)!r} ({at})")
        tb = tb.tb_next
    if step is not None:
        return f"hookfit: raised in step function {qualname(step)!r} ({at})"
    return f"hookfit: raised during the run ({at})"


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
        root = name.split(".")[0]  # "checkpoint.steps", a helper a plugin registered, is checkpoint's
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


def warn_secondary(error: BaseException, hook: str) -> None:
    """An error of ``hook`` while the run was already ending: a warning, never a replacement
    of the error that ended it."""
    notes = " ".join(getattr(error, "__notes__", []))
    warnings.warn(
        f"{hook} failed while the run was already ending: {type(error).__name__}: {error} {notes}".strip(),
        HookfitWarning,
        stacklevel=4,
    )
