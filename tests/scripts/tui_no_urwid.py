"""Run a program as if urwid were not installed: ``python tui_no_urwid.py -m MODULE ARGS...`` or
``python tui_no_urwid.py SCRIPT ARGS...``.

The test environment has urwid (the ``test`` extra), and a throw-away venv of the suite's kind
(``tests/venvs.py``) sees the running environment's packages, urwid included; so instead of a
venv this blocks the import: a finder at the front of ``sys.meta_path`` refuses ``urwid`` and its
submodules the way a missing package is refused (``ModuleNotFoundError``), before any other finder
is asked. Everything else runs as it would.
"""

from __future__ import annotations

import importlib.abc
import runpy
import sys
from types import ModuleType
from typing import Sequence


class NoUrwid(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> None:
        if fullname == "urwid" or fullname.startswith("urwid."):
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


sys.meta_path.insert(0, NoUrwid())
for name in [n for n in sys.modules if n == "urwid" or n.startswith("urwid.")]:
    del sys.modules[name]
if sys.argv[1] == "-m":
    sys.argv = [sys.argv[2], *sys.argv[3:]]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
