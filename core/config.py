"""Plugin options from a file: configuring discovered plugins without editing the script.

The file is TOML: ``HOOKFIT_CONFIG=path.toml``, else a ``hookfit.toml`` next to the script
(the folder of ``sys.argv[0]``; in a Jupyter kernel, of the notebook the run is named after), else
one in the current folder, a ``pyproject.toml`` with a
``[tool.hookfit]`` table counting as one there (:func:`find`; ``hookfit
plugins --script scripts/train.py`` lists what that script's run would read). Its only table is ``plugins``
(``[tool.hookfit.plugins.<name>]`` in a ``pyproject.toml``), one table per plugin, whose keys are the
keyword arguments of the plugin's constructor::

    [plugins.early_stopping]
    monitor = "valid/loss"
    patience = 5

    [plugins.checkpoint]
    every_n_steps = 500

Options are passed to the constructor, which checks them as it checks options given in code.
A plugin the file names that is neither installed nor given, an option the constructor does
not take, a value the constructor refuses, or a file that is not valid TOML is a
:class:`ConfigError` naming the file, the plugin and what it accepts.

A plugin given in code (``Loop(plugins=[Optim(schedulers=sched)])``) takes the options of its table
that the code did not pass it, the code's winning option by option, as Hydra's
``instantiate(cfg, **kwargs)`` does (:func:`fill_in`): the object given is constructed again, in place,
with both. An option the code passes too is not used, with a warning naming it. That needs the
arguments the code passed: a class decorated with :func:`records_options` (every built-in plugin's)
keeps them; the table of another plugin given in code is not used, with a warning naming each option
and how to pass it. ``enabled = false`` in its table switches a given plugin off, as
``HOOKFIT_DISABLE_PLUGINS`` does (with a warning naming it, :func:`hookfit.discovery.collect`). A disabled
plugin's table is not used; a built-in's is still checked, and an option it does not take is
warned about.

A table turns its plugin on: a plugin that is inert when merely discovered (``csv``,
``tensorboard``, ``profile``, ``mlflow``, ``wandb``) takes part in a run whose file has a table
for it, even an empty one. ``enabled`` is an option of every table: ``enabled = false``
disables the plugin (it is never imported, and ``hookfit plugins`` says the file did it);
``enabled = true`` is passed to a plugin whose constructor takes ``enabled`` and otherwise only
names the plugin.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["ENV_CONFIG", "FILE_NAME", "Config", "ConfigError", "accepted", "build", "checked", "fill_in", "find",
           "given_options", "load", "options_of", "records_options", "warn_unused"]

ENV_CONFIG = "HOOKFIT_CONFIG"
FILE_NAME = "hookfit.toml"
PYPROJECT = "pyproject.toml"  # its [tool.hookfit] table is such a file's contents


class ConfigError(ValueError):
    """The configuration file is wrong: it names the file, the plugin and what was wrong."""


@dataclass(frozen=True)
class Config:
    """What a configuration file says: ``path`` (``None`` without a file) and ``plugins``,
    plugin name -> its options."""

    path: Path | None = None
    plugins: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def where(self, name: str) -> str:
        """``hookfit.toml [plugins.name]`` (``pyproject.toml [tool.hookfit.plugins.name]``), for messages."""
        return f"{self.path} [{_prefix(self.path)}plugins.{name}]"


def _prefix(path: Path | None) -> str:
    return "tool.hookfit." if path is not None and path.name == PYPROJECT else ""


def _read(path: Path) -> dict[str, Any]:
    """The TOML file's contents (a ``pyproject.toml``'s ``[tool.hookfit]`` table), or a :class:`ConfigError`."""
    import tomllib  # here, not at the top: a run without the file does not import the parser

    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: cannot be read: {error}") from error
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from error
    if path.name != PYPROJECT:
        return data
    tool = data.get("tool", {}).get("hookfit", {}) if isinstance(data.get("tool"), dict) else {}
    if not isinstance(tool, dict):
        raise ConfigError(f"{path}: [tool.hookfit] must be a table, holding [tool.hookfit.plugins.<name>]")
    return tool


def find(environ: Mapping[str, str] | None = None, folder: Path | None = None,
         script: str | os.PathLike[str] | None = None) -> Path | None:
    """The configuration file of a run, by one rule for runs and for ``hookfit plugins``:
    ``HOOKFIT_CONFIG`` (which must exist); else ``hookfit.toml`` in the script's folder (the
    run's script, ``sys.argv[0]``, or in a Jupyter kernel the notebook that names the run:
    :func:`hookfit.records.kernel_notebook`; or ``script`` given to the listing); else in the current
    folder (a ``pyproject.toml`` with a ``[tool.hookfit]`` table counting as one); else ``None``.
    ``folder`` looks in that one folder only."""
    env = os.environ if environ is None else environ
    named = env.get(ENV_CONFIG)
    if named:
        path = Path(named)
        if not path.is_file():
            raise ConfigError(f"{ENV_CONFIG}={named}: no such file")
        return path
    if folder is not None:
        folders = [folder]
    else:
        if script is None and "ipykernel" in sys.modules:  # a Jupyter kernel: sys.argv[0] is ipykernel's launcher
            from hookfit.records import kernel_notebook  # (it imports torch: a kernel's alone)

            script = kernel_notebook()
        if script is None and sys.argv and sys.argv[0] not in ("", "-c", "-m"):
            script = sys.argv[0]
        here = Path(script) if script is not None else None
        folders = [here.parent] if here is not None and here.is_file() else []
        folders.append(Path.cwd())
    for where in folders:
        if (where / FILE_NAME).is_file():
            return where / FILE_NAME
        if (where / PYPROJECT).is_file() and _ours(where / PYPROJECT):
            return where / PYPROJECT
    return None


def _ours(pyproject: Path) -> bool:
    """Whether ``pyproject`` holds a ``[tool.hookfit]`` table; one that cannot be read is another tool's
    concern, unless it names the table (then its error is this run's)."""
    try:
        return bool(_read(pyproject))
    except ConfigError:
        if "[tool.hookfit" in pyproject.read_text(encoding="utf-8", errors="replace"):
            raise
        return False


def load(path: Path | None) -> Config:
    """Read and check the file's shape (its options are checked against each plugin later)."""
    if path is None:
        return Config()
    data, prefix = _read(path), _prefix(path)
    if prefix and not data:  # (a pyproject.toml named by HOOKFIT_CONFIG or --config)
        raise ConfigError(f"{path}: no [tool.hookfit] table, [tool.hookfit.plugins.<name>] with each plugin's options")
    other = sorted(set(data) - {"plugins"})
    if other:
        raise ConfigError(f"{path}: unknown table(s) {', '.join(repr(prefix + t) for t in other)}; the file has one "
                          f"table, [{prefix}plugins.<name>], with each plugin's options")
    plugins = data.get("plugins", {})
    if not isinstance(plugins, dict) or not all(isinstance(options, dict) for options in plugins.values()):
        raise ConfigError(f"{path}: '{prefix}plugins' must hold one table per plugin, like [{prefix}plugins.checkpoint]")
    return Config(path, plugins)


def accepted(factory: Any) -> dict[str, Any] | None:
    """The keyword options ``factory`` takes, with their defaults (``inspect.Parameter.empty``
    for none); ``None`` if it takes any keyword (``**kwargs``) or cannot be inspected."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return {p.name: p.default for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def build(config: Config, name: str, factory: Any) -> Any:
    """``factory(**options)`` for the plugin ``name`` with the file's options, checked first
    (:func:`checked`); a value it refuses is a :class:`ConfigError` naming the file and the plugin."""
    options = checked(config, name, factory)
    if not inspect.isclass(factory):  # a module or an object: used as it is
        return factory
    if not options:
        return factory()
    try:
        return factory(**options)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{config.where(name)}: {error}") from error


def checked(config: Config, name: str, factory: Any) -> dict[str, Any]:
    """The file's options for the plugin ``name`` as ``factory`` takes them (``enabled`` dropped
    where it is only hookfit's switch); an option ``factory`` does not take is a
    :class:`ConfigError` naming the file, the plugin and the options it accepts."""
    options = dict(config.plugins.get(name, {}))
    if "enabled" in options and not _takes(factory, "enabled"):  # hookfit's own switch (see the module)
        if not isinstance(options["enabled"], bool):
            raise ConfigError(f"{config.where(name)}: enabled must be true or false, got {options['enabled']!r}")
        del options["enabled"]
    if not inspect.isclass(factory):
        if options:
            raise ConfigError(f"{config.where(name)}: plugin {name!r} is not a class ({type(factory).__name__}) "
                              f"and takes no options")
        return options
    known = accepted(factory)
    unknown = sorted(set(options) - set(known)) if known is not None else []
    if known is not None and unknown:
        raise ConfigError(
            f"{config.where(name)}: plugin {name!r} has no option {', '.join(map(repr, unknown))}; "
            f"its options are: {', '.join(known) or 'none'}"
        )
    return options


def warn_unused(config: Config, name: str, factory: Any) -> None:
    """The table of a disabled plugin whose class imports safely (hookfit's own): an option it
    does not take is warned about now, not on the day the plugin is enabled and the run fails."""
    from hookfit.errors import HookfitWarning, user_level

    try:
        checked(config, name, factory)
    except ConfigError as error:
        warnings.warn(f"{error} (the plugin is disabled in this run; enabled, this fails it)",
                      HookfitWarning, stacklevel=user_level())


def _takes(factory: Any, option: str) -> bool:
    """Whether ``factory`` (a plugin's class) takes the keyword ``option`` (or any keyword)."""
    if not inspect.isclass(factory):
        return False
    known = accepted(factory)
    return known is None or option in known


def options_of(plugin: Any, given: Mapping[str, Any], built: bool = True) -> dict[str, tuple[Any, str]]:
    """Each constructor option of ``plugin``'s class with the value it was built with and
    where that came from: ``"file"`` (``given``, the file's options) or ``"default"``, when hookfit
    built it from its class (``built``); else (an object an entry point or ``Loop`` gave, made by
    someone else's call) the object's attribute of the option's name, ``"object"``. Options whose
    value is not known (no default and not in the file; no such attribute) are left out."""
    known = accepted(type(plugin)) if not inspect.ismodule(plugin) else None
    out: dict[str, tuple[Any, str]] = {}
    for name, default in (known or {}).items():
        if not built:  # (an attribute of the object itself, not a computed property's value)
            if name in getattr(plugin, "__dict__", {}):
                out[name] = (plugin.__dict__[name], "object")
        elif name in given:
            out[name] = (given[name], "file")
        elif default is not inspect.Parameter.empty:
            out[name] = (default, "default")
    return out


Plugin = TypeVar("Plugin", bound=type)


def records_options(cls: Plugin) -> Plugin:
    """Class decorator: each instance keeps, in its ``given_options`` attribute, the constructor
    arguments its call passed, by name (:func:`given_options`), so that a ``hookfit.toml`` table fills
    in those the code did not pass (:func:`fill_in`). Only a call of this very class is recorded: a
    subclass with a constructor of its own records nothing unless it is decorated too. A keyword the
    constructor does not take is refused with the closest one it does (:func:`~hookfit.errors.keywords_named`)."""
    from hookfit.errors import keywords_named

    init: Callable[..., None] = keywords_named(getattr(cls, "__init__"))  # (mypy: not through an instance of type)
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if getattr(type(self), "__init__") is not __init__:  # a subclass's constructor called this one
            return
        bound = signature.bind(self, *args, **kwargs).arguments
        given: dict[str, Any] = {}
        for index, (name, value) in enumerate(bound.items()):
            kind = signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                return  # (values without names: none to fill in around)
            if kind is inspect.Parameter.VAR_KEYWORD:
                given.update(value)
            elif index:  # (not self)
                given[name] = value
        self.given_options = given

    setattr(cls, "__init__", __init__)  # (the class's own: mypy refuses assigning a method)
    return cls


def given_options(plugin: Any) -> dict[str, Any] | None:
    """The constructor arguments the code passed ``plugin``, by name (:func:`records_options`); ``None``
    where its class does not record them."""
    given = getattr(plugin, "__dict__", {}).get("given_options")
    return dict(given) if isinstance(given, dict) else None


def fill_in(config: Config, name: str, plugin: Any) -> dict[str, Any]:
    """Give ``plugin`` (named ``name``, given in code) the options of its table that the code did not pass
    it: ``plugin`` is constructed again, in place, with the arguments the code passed and those (checked as
    :func:`build` checks them), unless it holds them already (its ``file_options``, given to an earlier run of
    the process); returns them. An option the code passed too is not used, with one warning
    naming it. A plugin whose class does not record the arguments it was given (:func:`given_options`)
    takes none, with one warning naming each option and how to pass it."""
    from hookfit.errors import HookfitWarning, user_level

    table = {key: value for key, value in config.plugins.get(name, {}).items() if key != "enabled"}
    given = given_options(plugin)
    if given is None:
        if table:
            shown = ", ".join(f"{key}={value!r}" for key, value in table.items())
            warnings.warn(f"{config.where(name)} is not used: the plugin {name!r} ({type(plugin).__qualname__}) is "
                          f"given to Loop(plugins=[...]) and its class does not record the arguments the code passes "
                          f"it, so the file cannot fill in the others; pass them in code, {type(plugin).__name__}"
                          f"({shown}, ...), or decorate the class with @hookfit.config.records_options",
                          HookfitWarning, stacklevel=user_level())
        return {}
    options = checked(config, name, type(plugin))
    unused = sorted(set(options) & set(given))
    if unused:
        warnings.warn(f"{config.where(name)}: {', '.join(f'{key} = {options[key]!r}' for key in unused)} not used: "
                      f"the {type(plugin).__name__} given to Loop(plugins=[...]) is passed "
                      f"{', '.join(f'{key}={_short(given[key])}' for key in unused)} in code, which wins over the "
                      f"file (leave it out of the code to take the file's)", HookfitWarning, stacklevel=user_level())
    added = {key: value for key, value in options.items() if key not in given}
    if added != plugin.__dict__.get("file_options", {}):  # (an object given to an earlier run: that run's file's)
        try:
            type(plugin).__init__(plugin, **given, **added)
        except (TypeError, ValueError) as error:
            raise ConfigError(f"{config.where(name)}: {error}") from error
        plugin.given_options, plugin.file_options = given, added  # what the code passed stays the code's
    return added


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 and "\n" not in text else f"<{type(value).__name__}>"
