"""hookfit.tools.demo: ``hookfit demo`` trains a real classifier with the discovered plugins."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO
from terminal import Terminal, term  # noqa: F401 - term: the tmux fixture


@pytest.mark.slow
def test_hookfit_demo_learns_the_digits_with_the_built_in_plugins(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")}
    done = subprocess.run([sys.executable, "-m", "hookfit.tools.cli", "demo", "--epochs", "3"], cwd=tmp_path, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    plugins = re.search(r"^hookfit start .* plugins=(\S+)", out, re.M).group(1).split(",")
    assert {"optim", "metrics", "console", "interrupter", "checkpoint"} <= set(plugins)
    assert "demo" in plugins and "RunFolder" not in plugins, plugins  # (the demo's own, named as plugins are)
    accuracy = float(re.search(r"stage=valid metric=accuracy last=([\d.]+)", out).group(1))
    assert accuracy > 0.85, out
    assert 'hookfit end status=completed reason="max_epochs=3 reached"' in out
    [log] = tmp_path.glob("runs/demo/*/metrics.jsonl")  # the run named demo, where it was started
    folder = log.parent.relative_to(tmp_path)
    assert f"hookfit demo: this run's files are in {folder}; look at it again with: hookfit show {folder}" in out


@pytest.mark.slow
def test_the_demo_on_a_terminal_without_urwid_says_why_there_is_no_dashboard(term: Terminal) -> None:
    """Urwid not installed (the import blocked by tests/scripts/tui_no_urwid.py: a
    throw-away venv would still see the suite's urwid), on a real terminal (tmux)."""
    term.launch(sys.executable, REPO / "tests" / "scripts" / "tui_no_urwid.py", "-m", "hookfit", "demo",
                "--epochs", "1", env="HOOKFIT_PLUGINS=console,interrupter,metrics,optim,tui")
    code, flags, text = term.wait_exit(timeout=180)
    assert code == 0, text
    term.assert_restored(flags)
    said = [line for line in text.splitlines() if "no dashboard" in line]
    assert len(said) == 1 and said[0].endswith(
        "HookfitWarning: tui: no dashboard: urwid is not installed (pip install urwid, or the tui extra: pip install "
        "'hookfit[tui]'); the console prints instead (HOOKFIT_NO_TUI=1 leaves the dashboard out without this "
        "warning)"), text
    assert 'hookfit end status=completed reason="max_epochs=1 reached"' in text  # the console printed the run
