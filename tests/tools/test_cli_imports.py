"""The ``hookfit`` commands that read files start without importing torch, and without urwid
where they draw nothing: ``--help``, a mistyped command, ``runs``, ``show`` (off a terminal) and
``compare``, with every built-in plugin installed and enabled, each in a process of its own."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.metrics_log import MetricsLog
from hookfit.plugins.optim import Optim
from conftest import make_dist, mse_step

PROBE = """\
import json, sys
from hookfit.tools import cli
try:
    code = cli.main(sys.argv[2:])
except SystemExit as exit:
    code = exit.code
with open(sys.argv[1], "w") as out:
    json.dump({"code": code, "imported": sorted(m for m in ("torch", "urwid") if m in sys.modules)}, out)
"""


@pytest.fixture(scope="module")
def run_folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    for name in ("first", "second"):
        model = torch.nn.Linear(2, 1)
        data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(3)]
        loop = hookfit.Loop(mse_step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                            max_epochs=2, run_dir=root / name,
                            plugins=[Optim(), Metrics(), MetricsLog(), Checkpoint()])
        assert loop.fit().status == "completed"
    return root


def command(tmp_path: Path, *argv: str) -> dict[str, object]:
    """``hookfit ARGV`` in a fresh process that discovers every installed plugin (the suite's
    ``HOOKFIT_*`` settings removed): its exit status and which of torch and urwid it imported."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")}
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-c", PROBE, str(report), *argv], cwd=tmp_path, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and report.exists(), done.stderr
    result: dict[str, object] = json.loads(report.read_text())
    result["stderr"] = done.stderr
    return result


@pytest.mark.parametrize("argv, code", [
    (["--help"], 0),
    (["nothing"], 2),
    (["runs", "{runs}"], 0),
    (["runs", "{runs}", "--json"], 0),
    (["show", "{runs}/second"], 0),
    (["show", "{runs}/second", "--text"], 0),
    (["compare", "{runs}/first", "{runs}/second"], 0),
    (["show", "--help"], 0),
    (["export", "--help"], 0),
], ids=lambda value: " ".join(value) if isinstance(value, list) else None)
def test_commands_that_read_files_import_neither_torch_nor_urwid(run_folders: Path, tmp_path: Path,
                                                                 argv: list[str], code: int) -> None:
    done = command(tmp_path, *(arg.format(runs=run_folders) for arg in argv))
    assert done["code"] == code, done["stderr"]
    assert done["imported"] == [], f"hookfit {' '.join(argv)} imported {done['imported']}"


@pytest.mark.slow
def test_a_command_that_needs_torch_still_has_it(run_folders: Path, tmp_path: Path) -> None:
    """``hookfit export`` reads a checkpoint with torch: the command that needs it imports it."""
    done = command(tmp_path, "export", str(run_folders / "second"), str(tmp_path / "model.pt"))
    assert done["code"] == 0, done["stderr"]
    assert "torch" in done["imported"]  # type: ignore[operator]
    assert set(torch.load(tmp_path / "model.pt")) == {"weight", "bias"}


def test_the_builtins_named_command_functions_add_what_their_plugins_add_commands_adds() -> None:
    """The ``hookfit.commands`` entry points of hookfit stand for its plugins' ``add_commands``:
    every built-in's commands, with the same arguments, and none for a plugin that adds none."""
    from hookfit import discovery
    from hookfit.tools import plugin_commands

    named = plugin_commands.declared()[discovery.OWN]
    for ep in discovery.builtin_entry_points():
        by_hook = argparse.ArgumentParser(add_help=False).add_subparsers()
        loaded = ep.load()
        add = getattr(loaded() if isinstance(loaded, type) else loaded, "add_commands", None)
        if add is not None:
            add(by_hook)
        by_name = argparse.ArgumentParser(add_help=False).add_subparsers()
        if ep.name in named:
            named[ep.name].load()(by_name)
        assert list(by_name.choices) == list(by_hook.choices), ep.name
        for command, parser in by_hook.choices.items():
            assert by_name.choices[command].format_help() == parser.format_help(), (ep.name, command)
    assert set(named) == {"checkpoint", "tui"}


def test_a_distribution_that_names_its_command_functions_is_not_imported_for_the_command_line(
        tmp_path: Path) -> None:
    """A plugin whose distribution names its command function in ``hookfit.commands`` adds its
    command without its module being imported; disabled, its command is not there."""
    site = make_dist(tmp_path / "site", "my-tools", {"hello": "hello_plugin:Hello"},
                     {"hello_plugin": "raise ImportError('hello_plugin imported')\n",
                      "hello_commands": "def add(commands):\n"
                                        "    p = commands.add_parser('hello', help='say hello')\n"
                                        "    p.set_defaults(run=lambda args: print('hello') or 0)\n"})
    listed = site / "my_tools-1.2.3.dist-info" / "entry_points.txt"
    listed.write_text(listed.read_text() + "\n[hookfit.commands]\nhello = hello_commands:add\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")}
    env.update(PYTHONPATH=str(site), HOOKFIT_PLUGINS="hello")
    done = subprocess.run([sys.executable, "-m", "hookfit", "hello"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, "hello\n"), done.stderr
    env["HOOKFIT_DISABLE_PLUGINS"] = "hello"
    done = subprocess.run([sys.executable, "-m", "hookfit", "hello"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "invalid choice: 'hello'" in done.stderr, done.stderr


def test_the_names_imported_on_first_use_are_listed_before_it() -> None:
    """``dir()`` of a package whose public names load on first use lists them (a notebook's tab completion),
    in a process that has not used them yet."""
    probe = ("import json, hookfit.plugins.tui as t, hookfit.plugins.checkpoint as c, hookfit.plugins.support as s; "
             "print(json.dumps(['TuiRenderer' in dir(t), 'Checkpoint' in dir(c), 'unwrap_model' in dir(s), "
             "'Checkpoint' in vars(c)]))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert json.loads(done.stdout) == [True, True, True, False], done.stdout  # listed, not imported yet
