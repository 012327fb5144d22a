"""hookfit: a small PyTorch training loop whose every feature is a pluggy plugin.

Public names: :class:`Loop`, :class:`State`, the :data:`hookimpl` marker for plugins,
:class:`PluginError` and the :class:`HookfitWarning` category. Events are declared, with what
they mean, in :mod:`hookfit.hookspecs`.
"""

from hookfit.loop import Loop, State
from hookfit.manager import HookfitWarning, PluginError, hookimpl

__all__ = ["Loop", "State", "hookimpl", "PluginError", "HookfitWarning"]
__version__ = "0.1.0"
