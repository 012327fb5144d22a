"""The modules a step function reads from outside itself, as Python finds them when it runs: the
``torch.nn.Module`` objects in its closure cells and in the globals its code loads by name (its nested
functions, lambdas and comprehensions included), those of the helper functions of its own module that it
reads there (followed a few calls deep), and those held one level down, as an item of a ``dict``, ``list``
or ``tuple`` or an attribute of a plain object found so (``models["teacher"]``, ``cfg.teacher``). A bound
method's instance, a callable object or a module written as the step (its ``forward``) is read as
``self``; a ``functools.partial``'s arguments as its arguments. What the step reaches only through its
arguments (``loop.model``) is not found. A plugin may take this to tell a step's own state from the run's:
the checkpoint plugin warns of a module the step changes that no checkpoint holds."""

from __future__ import annotations

import dis
import functools
import inspect
import types
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

__all__ = ["Referenced", "held_modules", "referenced_modules"]

DEPTH = 3
"""How many calls deep the helper functions of the step's module are followed."""


class Referenced(NamedTuple):
    """A module a step function reads: ``name`` as its code reads it (``"teacher"``,
    ``"models['teacher']"``, ``"self.teacher"``), ``where`` it is read from (``"closure"``, ``"global"``,
    ``"self"`` or ``"argument"``) and by which function (``reader``: the step or a helper of its
    module), and the ``module``."""

    name: str
    where: str
    reader: str
    module: torch.nn.Module


def referenced_modules(step: Any, skip: tuple[Any, ...] = ()) -> list[Referenced]:
    """The modules ``step`` reads from outside itself (see the module's docstring), each object once, in the
    order found; ``skip``: objects neither taken nor looked into (the run's plugins, whose state their own
    ``save_state`` keeps)."""
    seen: dict[int, Referenced] = {}
    skipped = {id(value) for value in skip}
    for referenced in _read(step, skipped, set(), DEPTH):
        if id(referenced.module) not in seen and id(referenced.module) not in skipped:
            seen[id(referenced.module)] = referenced
    return list(seen.values())


def held_modules(value: Any) -> list[torch.nn.Module]:
    """``value`` if it is a module, else the modules it holds one level down (as items of a ``dict``, ``list`` or
    ``tuple``, as attributes of a plain object: a plugin's), each once."""
    found = {id(referenced.module): referenced.module for referenced in _held("", value, "", "", set())}
    return list(found.values())


def _read(step: Any, skipped: set[int], followed: set[int], depth: int) -> Iterator[Referenced]:
    """What ``step`` (a function, a method, a partial, a callable object or a module) reads."""
    while isinstance(step, functools.partial):
        reader = _name(step.func)
        for index, value in enumerate(step.args):
            yield from _held(f"argument {index}", value, "argument", reader, skipped)
        for key, value in step.keywords.items():
            yield from _held(key, value, "argument", reader, skipped)
        step = step.func
    function, instance = step, getattr(step, "__self__", None)
    if inspect.ismethod(step):
        function = step.__func__
    elif not inspect.isfunction(step) and callable(step):  # a callable object, a module written as the step
        instance = step
        function = type(step).forward if isinstance(step, torch.nn.Module) else type(step).__call__
    if instance is not None and not isinstance(instance, types.ModuleType):
        yield from _attributes("self", instance, "self", _name(function), skipped)
    yield from _code(function, skipped, followed, depth)


def _code(function: Any, skipped: set[int], followed: set[int], depth: int) -> Iterator[Referenced]:
    """What ``function``'s closure cells and the globals its code loads hold (and the functions it wraps:
    ``functools.wraps``'s ``__wrapped__``), and the helper functions of its module among them."""
    try:
        functions = [function, inspect.unwrap(function)] if inspect.isfunction(function) else []
    except ValueError:  # a __wrapped__ chain that loops
        functions = [function]
    for function in functions:
        if id(function) in followed:
            continue
        followed.add(id(function))
        reader, space = _name(function), function.__globals__
        values = [(name, cell.cell_contents, "closure") for name, cell in
                  zip(function.__code__.co_freevars, function.__closure__ or ()) if _filled(cell)]
        values += [(name, space[name], "global") for name in _global_names(function.__code__) if name in space]
        for name, value, where in values:
            if inspect.isfunction(value) and value.__globals__ is space and depth > 1:
                yield from _code(value, skipped, followed, depth - 1)  # a helper of the step's own module
            else:
                yield from _held(name, value, where, reader, skipped)


def _held(name: str, value: Any, where: str, reader: str, skipped: set[int]) -> Iterator[Referenced]:
    """``value`` if it is a module, else the modules it holds one level down."""
    if id(value) in skipped:
        return
    if isinstance(value, torch.nn.Module):
        yield Referenced(name, where, reader, value)
    elif isinstance(value, (dict, list, tuple)):
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            if isinstance(item, torch.nn.Module) and id(item) not in skipped:
                yield Referenced(f"{name}[{key!r}]", where, reader, item)
    elif not isinstance(value, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)):
        yield from _attributes(name, value, where, reader, skipped)


def _attributes(name: str, value: Any, where: str, reader: str, skipped: set[int]) -> Iterator[Referenced]:
    """The modules among ``value``'s attributes (a module's children)."""
    if id(value) in skipped:
        return
    attributes: Any = dict(value.named_children()) if isinstance(value, torch.nn.Module) else getattr(value, "__dict__", None)
    for key, item in (attributes.items() if isinstance(attributes, dict) else ()):
        if isinstance(item, torch.nn.Module) and id(item) not in skipped:
            yield Referenced(f"{name}.{key}", where, reader, item)


def _global_names(code: types.CodeType) -> Iterator[str]:
    """The names ``code`` loads as globals, its nested code's (lambdas, comprehensions) included."""
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME") and isinstance(instruction.argval, str):
            yield instruction.argval
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _global_names(constant)


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a cell whose variable is not assigned yet
        return False
    return True


def _name(function: Any) -> str:
    return getattr(function, "__qualname__", None) or type(function).__name__
