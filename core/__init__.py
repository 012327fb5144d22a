"""hookfit: a small PyTorch training loop whose every feature is a pluggy plugin.

Public names: :class:`Loop` (configuration and ``fit()``), :class:`Run` (one ``fit()``: what
step functions and hooks receive as ``loop``), :func:`seed_everything`, :class:`State`, :class:`StopRequest`, the
:data:`hookimpl` marker for plugins, the :data:`hookspec` marker for events a plugin declares
for other plugins, :class:`PluginError`, :class:`StateMismatch` and the :class:`HookfitWarning` category. The loop's
events are declared, with what they mean, in :mod:`hookfit.hookspecs`, the events of a plugin in
that plugin's own ``hookspecs`` (all of them in ``core/hooks.md``); the payloads they carry in
:mod:`hookfit.payloads`.

``Loop`` and ``Run`` are imported on first use, so a plugin module that only needs
``hookimpl`` and the payload types (and ``hookfit plugins``) does not pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hookfit.hookspecs import hookspec
from hookfit.errors import HookfitWarning, ObserverWarning, PluginError, StateMismatch
from hookfit.manager import hookimpl
from hookfit.payloads import StopRequest
from hookfit.state import State

if TYPE_CHECKING:  # pragma: no cover
    from hookfit.loop import Loop
    from hookfit.reproducibility import seed_everything
    from hookfit.run import Run

__all__ = ["Loop", "Run", "State", "StopRequest", "seed_everything", "hookimpl", "hookspec", "PluginError",
           "StateMismatch", "HookfitWarning", "ObserverWarning"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "Loop":
        from hookfit.loop import Loop

        return Loop
    if name == "Run":
        from hookfit.run import Run

        return Run
    if name == "seed_everything":
        from hookfit.reproducibility import seed_everything

        return seed_everything
    raise AttributeError(f"module 'hookfit' has no attribute {name!r}")
