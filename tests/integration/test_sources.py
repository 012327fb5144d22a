"""The rules the source keeps so that the code a newcomer reads is the code that runs, checked
on every file of the package (``core/``, ``plugins/``) and of the tests: small modules, optim
within its size, no code built from strings, no plugin registering a hidden helper, and
comments that state contracts rather than the tracker's history."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = ("core", "plugins")
MOST_LINES = 400
OPTIM_LINES = 1600


def files(*folders: str) -> list[Path]:
    """The Python files under ``folders`` of the repository (caches left out)."""
    found = [p for folder in folders for p in (REPO / folder).rglob("*.py") if "__pycache__" not in p.parts]
    assert found, f"no Python file under {folders}"
    return sorted(found)


def lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def matches(pattern: str, paths: list[Path]) -> list[str]:
    """``file:line: text`` of every line of ``paths`` that ``pattern`` finds."""
    rule = re.compile(pattern)
    return [f"{p.relative_to(REPO)}:{n}: {text.strip()}" for p in paths
            for n, text in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if rule.search(text)]


def test_no_module_of_the_package_is_over_400_lines() -> None:
    over = {str(p.relative_to(REPO)): n for p in files(*PACKAGE) if (n := lines(p)) > MOST_LINES}
    assert over == {}, f"modules over {MOST_LINES} lines: split them by concern"


def test_optim_is_under_1600_lines_in_all() -> None:
    total = sum(lines(p) for p in files("plugins/optim"))
    assert total < OPTIM_LINES, f"plugins/optim is {total} lines"


def test_no_code_is_built_from_strings_and_no_plugin_registers_a_helper() -> None:
    assert matches(r"(?<![.\w])(eval|exec)\(", files(*PACKAGE)) == []
    assert matches(r"\bpm\.register\(", files("plugins")) == []


def test_no_method_is_replaced_on_an_instance() -> None:
    """``mypy --strict`` (tests/integration/test_typing.py) refuses an assignment over a method,
    so one needs its error silenced: none is."""
    assert matches(r"method-assign", files(*PACKAGE)) == []


def test_no_issue_numbers_in_code_or_tests() -> None:
    assert matches(r"(?i)\bissues? #?\d+", files(*PACKAGE, "tests")) == []


NAMEDTUPLE = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}
"""Public API of every namedtuple, underscore and all."""


def private_names(tree: ast.Module) -> set[str]:
    """The ``_private`` names a module defines: its functions, classes and globals, and the
    attributes its classes set or define on ``self``/``cls``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


@pytest.mark.slow
def test_no_module_reads_another_modules_private_names() -> None:
    """A ``_private`` name of the package is read only in the module that defines it: never
    imported by another module (``from hookfit.x import _helper``), and never read as an
    attribute of another object (``plugin._due``) where only other modules define it."""
    trees = {p: ast.parse(p.read_text(encoding="utf-8")) for p in files(*PACKAGE)}
    own = {p: private_names(tree) for p, tree in trees.items()}
    everyone = set().union(*own.values())
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hookfit"):
                found += [f"{path.relative_to(REPO)}:{node.lineno}: imports {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
            elif (isinstance(node, ast.Attribute) and node.attr in everyone - own[path] - NAMEDTUPLE
                  and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: reads {ast.unparse(node)}")
    assert found == []
