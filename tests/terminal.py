"""A real terminal for the end-to-end tests of the dashboard and the run commands: tmux on a
private socket per test (:class:`Terminal`, the ``term`` fixture).

Each test writes a small training script, runs it in a detached 100x30 tmux session (without
``CI`` and ``HOOKFIT_*`` from the test's environment, with ``TERM=xterm-256color``), reads the
screen with ``capture-pane``, types with ``send-keys`` and, after the process exits, reads the
exit code and the terminal's ``stty`` flags the shell prints. Screens are polled with deadlines,
not fixed sleeps, so a loaded machine only makes the tests slower.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable

import pytest

TMUX = shutil.which("tmux") or "/usr/bin/tmux"
if not os.path.exists(TMUX):  # pragma: no cover - tmux is part of the test environment
    pytest.skip("tmux is not installed", allow_module_level=True)

DEADLINE = 30.0  # seconds to wait for a screen; generous: the machine may be busy
PRINTED = "SCRIPT PRINTED THIS LINE DURING THE RUN"
HOLD_BANNER = "press q, Esc or Ctrl-C to leave"
STATUS_LINE = "hookfit │ train"
STTY = re.compile(r"STTY: ((?:-?(?:echo|icanon|isig)[ \t]*){3})")

# argv: steps, seconds per step, mode ("ok", "raise", "segv": a fatal error in step 5, "raise-saved": "raise"
# with a checkpoint every 2 steps, or "debug": breakpoint() in step 3), result path.
# Writes <result>.pid at start, <result>.fit_end from a plugin's fit_end, and the result JSON
# after fit() returned or raised.
SCRIPT = r'''
import json, os, signal, sys, time
import torch
import hookfit
from hookfit.plugins.checkpoint import Checkpoint

steps, delay, mode, out = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
with open(out + ".pid", "w") as f:
    f.write(str(os.getpid()))
before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
ended = []

class Watch:
    name = "watch"
    @hookfit.hookimpl
    def batch_end(self, batch_idx):
        if batch_idx == 2:
            print("SCRIPT PRINTED THIS LINE DURING THE RUN", flush=True)
    @hookfit.hookimpl
    def fit_end(self, loop):
        ended.append(loop.state.status)
        with open(out + ".fit_end", "w") as f:
            f.write(loop.state.status)

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(steps)]

def train_step(loop, batch):
    x, y = batch
    time.sleep(delay)
    if mode in ("raise", "raise-saved") and loop.state.step == 5:
        raise RuntimeError("boom from the step")
    if mode == "segv" and loop.state.step == 5:
        import faulthandler
        faulthandler._sigsegv()
    if mode == "preempt" and loop.state.step == 5:
        loop.request_stop("preempted by the scheduler", ends_process=True)
    if mode == "debug" and loop.state.step == 3:
        breakpoint()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    return {"loss": loss, "accuracy": 0.5}

loop = hookfit.Loop(train_step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                    run_dir=os.path.join(os.path.dirname(out), "run"), plugins=[Watch()] + (
                        [Checkpoint(every_n_steps=2, background=False)] if mode == "raise-saved" else []))
outcome = "returned"
try:
    try:
        loop.fit()
    except KeyboardInterrupt:
        outcome = "KeyboardInterrupt"
finally:
    restored = all(signal.getsignal(s) is h for s, h in before.items())
    with open(out, "w") as f:
        json.dump({"outcome": outcome, "status": loop.state.status, "reason": loop.state.stop_reason,
                   "fit_end": ended, "restored": restored, "step": loop.state.step}, f)
'''


# The built-in plugins only: another package's plugin installed in the same environment (a test
# may install one for a while) must not change what these runs load.
PLUGINS = "console,interrupter,metrics,optim,tui"


def clean_env() -> dict[str, str]:
    """The test's environment without CI, HOOKFIT_* and an enclosing tmux; TERM set."""
    env = {k: v for k, v in os.environ.items()
           if k != "CI" and not k.startswith("HOOKFIT_") and k not in ("TMUX", "TMUX_PANE")}
    env["TERM"] = "xterm-256color"
    env["HOOKFIT_PLUGINS"] = PLUGINS
    return env


class Terminal:
    """One tmux server on a private socket with one 100x30 session."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.socket = f"hookfit-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.result = tmp_path / "result.json"
        self.started = False
        self.socket_path: str | None = None

    def tmux(self, *args: str) -> str:
        done = subprocess.run([TMUX, "-f", "/dev/null", "-L", self.socket, *args], capture_output=True,
                              text=True, env=clean_env(), timeout=20)
        if done.returncode != 0:
            raise RuntimeError(f"tmux {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout

    def kill(self) -> None:
        """Stop this test's tmux server (only it) and remove its socket file."""
        if self.started:
            subprocess.run([TMUX, "-L", self.socket, "kill-server"], capture_output=True, env=clean_env(), timeout=20)
            self.started = False
        if self.socket_path and os.path.basename(self.socket_path) == self.socket:
            Path(self.socket_path).unlink(missing_ok=True)

    # -- running the training script ------------------------------------------------------------
    def train(self, steps: int, delay: float, mode: str = "ok", persistent: bool = False,
              plugins: str = PLUGINS) -> None:
        script = self.tmp / "train.py"
        script.write_text(SCRIPT)
        extra = "HOOKFIT_TUI_PERSISTENT=1" if persistent else ""
        self.launch(sys.executable, script, steps, delay, mode, self.result,
                    env=f"HOOKFIT_PLUGINS={plugins} {extra}")

    def launch(self, *argv: object, env: str = "", unset: tuple[str, ...] = ()) -> None:
        """Run ``argv`` in the tmux session, in the test's folder, with ``TERM`` set, ``CI``,
        ``HOOKFIT_*`` and the ``unset`` variables removed and ``env`` (``NAME=value ...``)
        added; afterwards the shell prints the exit code and the terminal's modes, then waits."""
        names = [k for k in os.environ if k == "CI" or k.startswith(("HOOKFIT_", *unset))]
        removed = " ".join(f"-u {shlex.quote(k)}" for k in names)
        command = " ".join(shlex.quote(str(a)) for a in argv)
        run = self.tmp / "run.sh"
        # the shell is in the python process's group: Ctrl-C reaches it too, and must not end it
        # (a trap with a command leaves the child's SIGINT at its default)
        run.write_text(
            "trap : INT\n"
            f"cd {shlex.quote(str(self.tmp))}\n"
            f"env {removed} TERM=xterm-256color {env} {command}\n"
            'echo "EXIT=$?"\n'
            "echo \"STTY: $(stty -a | tr ' ;' '\\n\\n' | grep -E '^-?(echo|icanon|isig)$' | tr '\\n' ' ')\"\n"
            "sleep 300\n"
        )
        self.started = True
        self.tmux("new-session", "-d", "-s", "main", "-x", "100", "-y", "30", f"/bin/sh {shlex.quote(str(run))}")
        self.socket_path = self.flag("socket_path")

    def pid(self) -> int:
        path = Path(str(self.result) + ".pid")
        self.wait_until(lambda: path.exists() and path.read_text().strip() != "", "the script's pid file")
        return int(path.read_text())

    # -- looking and typing ----------------------------------------------------------------------
    def screen(self, history: bool = False) -> str:
        return self.tmux("capture-pane", "-p", "-J", "-t", "main", *(["-S", "-"] if history else []))

    def flag(self, name: str) -> str:
        return self.tmux("display", "-p", "-t", "main", f"#{{{name}}}").strip()

    def alternate(self) -> bool:
        return self.flag("alternate_on") == "1"

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "main", *keys)

    def wait_until(self, ready: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
        end = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > end:
                raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; screen:\n"
                                     + self.screen(history=True))
            time.sleep(0.1)

    def wait_for(self, *texts: str, timeout: float = DEADLINE) -> str:
        """The visible screen, once it shows every one of ``texts``."""
        shown: list[str] = [""]

        def ready() -> bool:
            shown[0] = self.screen()
            return all(t in shown[0] for t in texts)

        self.wait_until(ready, " and ".join(repr(t) for t in texts), timeout)
        return shown[0]

    def wait_dashboard(self) -> str:
        """The dashboard once the first metrics and the line the script printed are on it."""
        return self.wait_for(STATUS_LINE, "accuracy", "it/s", PRINTED)

    def wait_exit(self, timeout: float = 60.0) -> tuple[int, set[str], str]:
        """After the script exited: its exit code, the terminal's lflags and the whole pane."""
        text: list[str] = [""]

        def ready() -> bool:
            text[0] = self.screen(history=True)
            return re.search(STTY, text[0]) is not None

        self.wait_until(ready, "the script to exit", timeout)
        code = int(re.search(r"EXIT=(\d+)", text[0]).group(1))
        flags = set(re.search(STTY, text[0]).group(1).split())
        return code, flags, text[0]

    def outcome(self) -> dict:
        return json.loads(self.result.read_text())

    def assert_restored(self, flags: set[str]) -> None:
        assert not self.alternate(), "the alternate screen is still on"
        assert flags == {"echo", "icanon", "isig"}, f"terminal modes not restored: {flags}"
        assert self.flag("cursor_flag") == "1", "the cursor is still hidden"
        assert self.flag("mouse_any_flag") == "0", "mouse tracking is still on"


@pytest.fixture
def term(tmp_path: Path):
    terminal = Terminal(tmp_path)
    try:
        yield terminal
    finally:
        terminal.kill()


def after(text: str, first: str, then: str) -> bool:
    return first in text and then in text and text.index(first) < text.index(then)


# -- the dashboard ------------------------------------------------------------------------------
