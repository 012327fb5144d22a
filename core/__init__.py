"""hookfit: a small PyTorch training loop whose every feature is a pluggy plugin.

Public names: :class:`Loop`, :class:`State`, the :data:`hookimpl` marker for plugins, the
:data:`hookspec` marker for events a plugin declares for other plugins,
:class:`PluginError` and the :class:`HookfitWarning` category. Events are declared, with what
they mean, in :mod:`hookfit.hookspecs`.

``Loop`` and ``State`` are imported on first use, so a plugin module that only needs
``hookimpl`` (and ``hookfit plugins``) does not pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hookfit.hookspecs import hookspec
from hookfit.manager import HookfitWarning, ObserverWarning, PluginError, hookimpl

if TYPE_CHECKING:  # pragma: no cover
    from hookfit.loop import Loop, State

__all__ = ["Loop", "State", "hookimpl", "hookspec", "PluginError", "HookfitWarning", "ObserverWarning"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("Loop", "State"):
        from hookfit import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'hookfit' has no attribute {name!r}")
