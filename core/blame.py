"""Where an error came from, for its message: a plugin's hook or a step function, found by
walking the error's traceback against the code of every registered implementation."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from hookfit.manager import HookfitWarning
from hookfit.stopping import qualname

if TYPE_CHECKING:  # pragma: no cover
    from hookfit.run import Run

__all__ = ["warn_secondary", "where"]


def where(run: Run, error: BaseException) -> str:
    """A note saying where ``error`` was raised: by which plugin in which hook, or in which
    step function, at which epoch, stage and batch."""
    pm = run.pm
    owners: dict[Any, tuple[str, str]] = {}
    for caller in vars(pm.hook).values():
        for impl in caller.get_hookimpls():
            code = getattr(getattr(impl.function, "__func__", impl.function), "__code__", None)
            owners[code] = (impl.plugin_name, caller.name)
    steps = {getattr(s, "__code__", None): s for s in (run.train_step, run.val_step) if s}
    state = run.state
    at = f"epoch {state.epoch}, stage {state.stage}, batch {state.batch_idx}"
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code in owners:
            plugin, hook = owners[code]
            return f"hookfit: raised by {pm.describe(plugin)} in hook {hook!r} ({at})"
        if code in steps:
            return f"hookfit: raised in step function {qualname(steps[code])!r} ({at})"
        tb = tb.tb_next
    return f"hookfit: raised during the run ({at})"


def warn_secondary(error: BaseException, hook: str) -> None:
    """An error of ``hook`` while the run was already ending: a warning, never a replacement
    of the error that ended it."""
    notes = " ".join(getattr(error, "__notes__", []))
    warnings.warn(
        f"{hook} failed while the run was already ending: {type(error).__name__}: {error} {notes}".strip(),
        HookfitWarning,
        stacklevel=4,
    )
