"""hookfit's own warning category and errors, and what an observer that failed leaves."""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import os
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, ParamSpec, TypeVar

__all__ = ["ErrorCopy", "HookfitWarning", "ObserverWarning", "PluginError", "RefusedAnswer", "RefusedState", "Silenced", "StateMismatch", "UsageError", "forget_warnings", "keywords_named", "no_attribute", "user_level", "WHERE"]


LOGGING = ("log", "log_dict")
"""Other frameworks' logging calls on the object a step gets (Lightning's ``self.log``, ``self.log_dict``), which
:func:`no_attribute` answers with how hookfit reports instead."""


WHERE = {"epoch": "epoch", "step": "step", "batch_idx": "batch_idx", "stage": "stage", "status": "status",
         "global_step": "step", "current_epoch": "epoch"}
"""Names a step function may look for where a run is (Lightning's ``global_step`` and ``current_epoch``
among them), and the :class:`hookfit.State` field that holds it, which :func:`no_attribute` names."""


def no_attribute(self: object, name: str) -> NoReturn:
    """``__getattr__`` of :class:`hookfit.Loop`, :class:`hookfit.Run` and :class:`hookfit.State`, which type
    checkers do not see: the ``AttributeError`` Python raises for an attribute that is not there, saying for
    :data:`LOGGING`'s names that a step function reports by returning its values (README.md, "A first script"),
    and for :data:`WHERE`'s which field of ``loop.state`` holds it."""
    said = f"{type(self).__name__!r} object has no attribute {name!r}"
    if name in WHERE:
        state = "state" if "epoch" in getattr(type(self), "__dataclass_fields__", ()) else "loop.state"
        said += f": where the run is, is {state}: {state}.{WHERE[name]}"
    if name in LOGGING:
        said += (": hookfit has no logging call; a step function reports by returning its values, {'loss': loss, "
                 "'acc': acc} (README.md, 'A first script'), which the metrics plugin aggregates and every logger "
                 "writes")
    raise AttributeError(said, name=name, obj=self)


class HookfitWarning(UserWarning):
    """Base category of every warning hookfit issues."""


class PluginError(Exception):
    """A plugin cannot take part in a run: it does not import, or its hooks do not match."""


class UsageError(Exception):
    """An error that says its caller used the object raising it wrongly (named an optimizer a run
    has several of without saying which, passed what it cannot take). A plugin declares such an
    error by deriving from it, alongside the built-in it is (``class NoSingleOptimizer(UsageError,
    TypeError)``); raised by the plugin's code that a step function called, and by no other code
    below that call, its note blames the step function that made the call, naming the plugin
    and the function that refused it, not the plugin."""


class RefusedAnswer(TypeError):
    """A plugin's answer to an event that the plugin asking refuses (of a type it cannot take, under a name another
    value has): its note blames the implementation that answered (``implementation``, ``(plugin, hook)``,
    :func:`hookfit.blame.where`), not the plugin that asked."""

    def __init__(self, plugin: str, hook: str, message: str) -> None:
        super().__init__(message)
        self.implementation = (plugin, hook)

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled (a copy of a run's error, another process) with its own arguments, notes and attributes
        return type(self), (*self.implementation, str(self)), self.__dict__


class RefusedState(RefusedAnswer):
    """A plugin's ``save_state`` answer that no checkpoint could be read back with: its note blames that
    implementation, not the plugin whose save gathered it."""

    def __init__(self, plugin: str, message: str) -> None:
        super().__init__(plugin, "save_state", message)

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.implementation[0], str(self)), self.__dict__


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

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.detail, self.missing, self.extra), self.__dict__


class ObserverWarning(HookfitWarning):
    """An observer plugin raised and was switched off for the rest of the run."""


@dataclass(frozen=True)
class Silenced:
    """An observer that failed: which plugin, in which hook, with which error."""

    plugin: str
    description: str  # the plugin with its distribution
    hook: str
    error: BaseException


P = ParamSpec("P")
R = TypeVar("R")

LIGHTNING = {"accumulate_grad_batches": "accumulate", "gradient_clip_val": "clip_norm", "save_top_k": "keep_best",
             "dirpath": "dir", "every_n_train_steps": "every_n_steps", "ckpt_path": "resume",
             "lr_scheduler": "schedulers", "val_check_interval": "val_every_n_steps",
             "check_val_every_n_epoch": "val_every_n_epochs", "default_root_dir": "run_dir"}
"""Lightning's keyword arguments and hookfit's that do what they do, which :func:`keywords_named` names where
spelling alone would not find them (``gradient_clip_val`` is a norm: close to ``clip_value``, it is ``clip_norm``)."""


def keywords_named(function: Callable[P, R]) -> Callable[P, R]:
    """``function`` (a class's ``__init__``, a method) whose ``TypeError`` for an unknown keyword argument
    names the closest keyword it takes (``max_epoch`` → ``max_epochs``; Lightning's names by :data:`LIGHTNING`),
    as Python's own does not; one that takes ``**kwargs`` is returned as it is."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return function
    names = [p.name for p in parameters if p.kind in kinds][1:]
    owner = function.__qualname__.removesuffix(".__init__")

    @functools.wraps(function)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        for key in kwargs:
            if key not in names:
                if LIGHTNING.get(key) in names:
                    raise TypeError(f"{owner}() got an unexpected keyword argument {key!r}; did you mean "
                                    f"{LIGHTNING[key]!r}? (what Lightning calls {key})")
                close = difflib.get_close_matches(key, names, n=1)
                raise TypeError(f"{owner}() got an unexpected keyword argument {key!r}; "
                                + (f"did you mean {close[0]!r}?" if close
                                   else f"it takes {', '.join(names)}" if names else "it takes none"))
        return function(*args, **kwargs)
    return checked


def user_level(*also: str) -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the function that calls this: the first frame
    outside hookfit, pluggy and the folders ``also`` (torch's, say), so the warning names the
    script's line (its ``fit()``) rather than the plugin or the event call it came through."""
    return _outside(sys._getframe(1), also)[1]


def _outside(frame: types.FrameType, also: tuple[str, ...]) -> tuple[types.FrameType, int]:
    """The first frame from ``frame`` outwards that is outside hookfit, pluggy and ``also``, and
    how many frames out it is (1: ``frame`` itself)."""
    inside = (os.path.dirname(__file__), *(os.path.dirname(getattr(sys.modules.get(name), "__file__", None) or "")
                                           for name in ("hookfit.plugins", "pluggy")), *also)
    inside = (*(folder + os.sep for folder in inside if folder), contextlib.__file__)  # (the loop's scopes)
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return frame, level


def forget_warnings(*steps: Any) -> None:
    """Forget which of hookfit's warnings (every category deriving from :class:`HookfitWarning`)
    were shown, so that each is shown once a run rather than once a process: called as a run
    starts (``fit()``, ``validate()``). Python's ``"default"`` action shows a warning once per
    text, category and line of the module it points at, and hookfit's point at the script's
    ``fit()`` line or a step function's line (:func:`user_level`), the same lines for every run
    of a sweep's loop. This drops those entries from the ``__warningregistry__`` of every module
    loaded, of the code that called ``fit()`` and of the ``steps``' code; nothing else: other
    categories' entries, a ``"module"`` action's (line 0: once per module, as asked) and the
    filters themselves stay, so ``"ignore"``, ``"error"``, ``"once"`` (once a process) and
    ``"always"`` act as before."""
    spaces = [_own_dict(module) for module in list(sys.modules.values()) if isinstance(module, types.ModuleType)]
    spaces += [_outside(sys._getframe(1), ())[0].f_globals, *(_namespace(step) for step in steps)]
    registries = (space.get("__warningregistry__") for space in spaces if isinstance(space, dict))
    for registry in {id(r): r for r in registries if isinstance(r, dict)}.values():
        for key in list(registry):
            if (isinstance(key, tuple) and len(key) == 3 and isinstance(key[1], type)
                    and issubclass(key[1], HookfitWarning) and key[2] != 0):
                registry.pop(key, None)


def _own_dict(module: types.ModuleType) -> Any:
    """``module``'s dict, read without loading a lazily imported module (``importlib.util.LazyLoader``
    loads it at the first attribute read, ``__dict__`` included)."""
    try:
        return object.__getattribute__(module, "__dict__")
    except AttributeError:  # a module type of C whose dict object's lookup does not find (cffi's Lib)
        return getattr(module, "__dict__", None)


def _namespace(function: Any) -> dict[str, Any]:
    """The globals of the code ``function`` runs (through a bound method, a ``functools.partial``,
    decorators that wrap), or ``{}``."""
    while isinstance(function, functools.partial):
        function = function.func
    try:
        function = inspect.unwrap(getattr(function, "__func__", function))
    except ValueError:  # a __wrapped__ chain that loops
        pass
    space = getattr(function, "__globals__", None)
    return space if isinstance(space, dict) else {}
