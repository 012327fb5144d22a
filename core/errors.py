"""hookfit's own warning category and errors, and what an observer that failed leaves."""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass

__all__ = ["ErrorCopy", "HookfitWarning", "ObserverWarning", "PluginError", "Silenced", "StateMismatch", "UsageError", "user_level"]


class HookfitWarning(UserWarning):
    """Base category of every warning hookfit issues."""


class PluginError(Exception):
    """A plugin cannot take part in a run: it does not import, or its hooks do not match."""


class UsageError(Exception):
    """An error that says its caller used the object raising it wrongly (named an optimizer a run
    has several of without saying which, passed what it cannot take). A plugin declares such an
    error by deriving from it, alongside the built-in it is (``class NameOne(UsageError,
    TypeError)``); raised by the plugin's code that a step function called, and by no other code
    below that call, its note blames the step function that made the call, naming the plugin
    and the function that refused it, not the plugin."""


class ErrorCopy(Exception):
    """What a failed run's state keeps (``State.error``) in place of an exception whose class
    cannot be made again, even without its ``__init__``: its message is the class's full name
    and the exception's text, and it has the exception's ``__notes__``."""


class StateMismatch(ValueError):
    """Saved plugin states do not match the run restoring them (``Run.load_plugin_states`` with
    ``strict``): ``missing`` names the plugins of the run with no saved state (new to it),
    ``extra`` the saved states no plugin of the run restores; ``detail`` says both in words.
    A plugin that restores states (the checkpoint plugin) catches it to say how to go on."""

    def __init__(self, detail: str, missing: list[str], extra: list[str]) -> None:
        super().__init__(f"{detail} (strict; pass strict=False to restore the rest)")
        self.detail = detail
        self.missing = missing
        self.extra = extra


class ObserverWarning(HookfitWarning):
    """An observer plugin raised and was switched off for the rest of the run."""


@dataclass(frozen=True)
class Silenced:
    """An observer that failed: which plugin, in which hook, with which error."""

    plugin: str
    description: str  # the plugin with its distribution
    hook: str
    error: BaseException


def user_level(*also: str) -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the function that calls this: the first frame
    outside hookfit, pluggy and the folders ``also`` (torch's, say), so the warning names the
    script's line (its ``fit()``) rather than the plugin or the event call it came through."""
    inside = (os.path.dirname(__file__), *(os.path.dirname(getattr(sys.modules.get(name), "__file__", None) or "")
                                           for name in ("hookfit.plugins", "pluggy")), *also)
    inside = (*(folder + os.sep for folder in inside if folder), contextlib.__file__)  # (the loop's scopes)
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level
