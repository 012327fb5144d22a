"""One training batch with the default plugins, traced as it runs: the functions of hookfit that
run for it are exactly those core/loop.md lists (file, line and name; the opening of the
generated core/hooks.md), in at most 8 files and 15 functions, so a newcomer who reads that list
reads the code that runs."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

import hookfit
from hookfit.plugins.metrics import Metrics
from hookfit.run import Run

ROOT = Path(__file__).resolve().parents[2]
LISTED = re.compile(r"^\s+((?:core|plugins)/[\w/]+\.py):(\d+)\s+([\w.]+)", re.M)


def documented() -> set[tuple[str, int, str]]:
    """The functions the hooks reference's trace of one batch names (core/loop.md, its source)."""
    text = (ROOT / "core" / "loop.md").read_text()
    section = text.split("One training batch, traced", 1)[1].split("\n\n", 2)[1]  # the block after it
    return {(path, int(line), name) for path, line, name in LISTED.findall(section)}


def step(loop: Any, batch: Any) -> torch.Tensor:
    x, y = batch
    loss = torch.nn.functional.mse_loss(loop.model(x), y)
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    return loss


def traced_batch(tmp_path: Path) -> dict[tuple[str, int, str], int]:
    """The hookfit functions called while the default stack runs the fourth training batch of
    the second epoch (the first epoch watches for gradients made outside loop.backward), a batch
    that publishes no metrics and stores no time split (both are timed, every half second)."""
    root = str(Path(hookfit.__file__).resolve().parents[1]) + os.sep
    package = (root + "core" + os.sep, root + "plugins" + os.sep)  # hookfit's own code, nothing else
    calls: dict[tuple[str, int, str], int] = {}

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(package):
            key = (os.path.relpath(code.co_filename, root), code.co_firstlineno, code.co_qualname)
            calls[key] = calls.get(key, 0) + 1

    class Probe:
        name = "probe"

        @hookfit.hookimpl(tryfirst=True)
        def batch_start(self, loop: Any, batch: Any, batch_idx: int) -> None:  # every argument: no adapter
            on = loop.state.epoch == 1 and batch_idx == 3
            sys.setprofile(profile if on else None)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(6)]
    try:
        hookfit.Loop(step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
                     max_epochs=2, run_dir=tmp_path / "run", plugins=[Probe(), Metrics(interval=1e9)]).fit()
    finally:
        sys.setprofile(None)
    return calls


def test_one_batch_runs_the_functions_the_reference_lists_and_no_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HOOKFIT_PLUGINS")  # the default stack: every discovered plugin
    monkeypatch.setattr(Run, "TIME_SPLIT_INTERVAL", 1e9)
    running = set(traced_batch(tmp_path))
    listed = documented()
    loop = {entry for entry in listed if entry[2] == "run_stage"}  # the frame the batch runs in
    assert [(path, name) for path, _, name in loop] == [("core/training.py", "run_stage")]
    (_, line, _), = loop
    assert (ROOT / "core" / "training.py").read_text().splitlines()[line - 1].startswith("def run_stage(")
    assert running - listed == set(), "runs for a batch but the trace in core/loop.md does not name it"
    assert listed - loop - running == set(), "named by the trace in core/loop.md but does not run for a batch"
    files = {path for path, _, _ in listed}
    assert len(files) <= 8 and len(listed) <= 15, (files, listed)
