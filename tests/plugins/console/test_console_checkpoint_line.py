"""An interrupted run ends its console output with the checkpoint to continue from (the newest
one the checkpoint role announced, ``checkpoint_saved``) and how to resume; a completed run and
an interrupted run without a checkpoint print no such line; a failed run names the
checkpoint before its failure."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.console import Console

LINE = re.compile(r'^hookfit checkpoint reason=(\S+) path=(\S+) resume="run again with Loop\(\.\.\., '
                  r'resume=<this path>\)"$')


def _run(folder: Path, stop_at: int | None, plugins: list[Any], resume: str | None = None) -> tuple[Any, list[str]]:
    """Three batches an epoch, two epochs; a stop asked at step ``stop_at`` (inside epoch 2)."""
    def step(loop: Any, batch: Any) -> dict[str, Any]:
        if loop.state.step == stop_at:
            loop.request_stop("enough")
        return {"loss": torch.tensor(1.0)}

    stream = io.StringIO()
    state = hookfit.Loop(step, [0, 1, 2], model=torch.nn.Linear(1, 1), max_epochs=2, run_dir=folder, resume=resume,
                         plugins=[*plugins, Console(stream=stream, interval=None)]).fit()
    return state, stream.getvalue().splitlines()


def test_an_interrupted_run_ends_with_the_checkpoint_to_resume_from(tmp_path: Path) -> None:
    state, lines = _run(tmp_path, 4, [Checkpoint()])
    assert state.status == "interrupted"
    match = LINE.match(lines[-1])
    assert match, lines[-1]
    reason, path = match.groups()
    assert reason == "interrupt" and Path(path).is_file() and Path(path).absolute().parent == tmp_path / "checkpoints"
    assert Path(path).absolute() == Path(state.results["last_checkpoint"])  # what resume="latest" takes
    assert sum(line.startswith("hookfit checkpoint ") for line in lines) == 1

    resumed, lines = _run(tmp_path, None, [Checkpoint()], resume="latest")
    assert resumed.status == "completed" and resumed.step == 6
    assert not any(line.startswith("hookfit checkpoint ") for line in lines), lines


def test_an_interrupted_run_without_a_checkpoint_names_none(tmp_path: Path) -> None:
    state, lines = _run(tmp_path, 4, [])
    assert state.status == "interrupted"
    assert lines[-1].startswith("hookfit time ") and not any("checkpoint" in line for line in lines), lines


def test_a_failed_run_ends_with_the_checkpoint_before_the_failure_not_its_own(tmp_path: Path) -> None:
    """A step that raises in epoch 2 after epoch 1's checkpoint: the console's last line names that one, what
    ``resume="latest"`` takes; the ``failed-*`` file ``on_failure`` writes (never taken) is not named."""
    def step(loop: Any, batch: Any) -> dict[str, Any]:
        if loop.state.step == 4:
            raise RuntimeError("boom")
        return {"loss": torch.tensor(1.0)}

    stream = io.StringIO()
    with pytest.raises(RuntimeError, match="boom"):
        hookfit.Loop(step, [0, 1, 2], model=torch.nn.Linear(1, 1), max_epochs=2, run_dir=tmp_path,
                     plugins=[Checkpoint(on_failure=True, background=False), Console(stream=stream, interval=None)]
                     ).fit()
    lines = stream.getvalue().splitlines()
    match = LINE.match(lines[-1])
    assert match, lines
    reason, path = match.groups()
    assert reason == "epoch" and Path(path).name.startswith("epoch0001") and Path(path).is_file()
    assert [p.name.startswith("failed-") for p in (tmp_path / "checkpoints").iterdir() if p.suffix == ".pt"].count(
        True) == 1  # (written, and not the one named)
    assert sum(line.startswith("hookfit checkpoint ") for line in lines) == 1


def test_a_resumed_run_that_fails_before_its_own_checkpoint_names_the_one_it_resumed_from(tmp_path: Path) -> None:
    """Resumed from epoch 1's checkpoint of an earlier run folder, the run fails at its first batch: the
    checkpoint to resume from is still that one (what state.results['last_checkpoint'] says too)."""
    first, _ = _run(tmp_path / "a", None, [Checkpoint(every_n_epochs=1)])
    source = next((tmp_path / "a" / "checkpoints").glob("epoch0001*.pt"))

    def step(loop: Any, batch: Any) -> None:
        raise RuntimeError("boom")

    stream = io.StringIO()
    with pytest.raises(RuntimeError, match="boom"):
        hookfit.Loop(step, [0, 1, 2], model=torch.nn.Linear(1, 1), max_epochs=2, run_dir=tmp_path / "b",
                     resume=str(source), plugins=[Checkpoint(), Console(stream=stream, interval=None)]).fit()
    lines = stream.getvalue().splitlines()
    match = LINE.match(lines[-1])
    assert match, lines
    assert match.group(1) == "resumed" and Path(match.group(2)).absolute() == source


def test_the_checkpoint_to_resume_from_is_named_alike_however_the_run_folder_was_given(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run folder given relative and one given absolute (as a sharded checkpoint's path always
    is), both inside the current folder: both lines name the checkpoint relative to it."""
    monkeypatch.chdir(tmp_path)  # (where the run starts: its lines are read there)
    named = []
    for folder in (Path("runs/given-relative"), tmp_path / "runs" / "given-absolute"):
        state, lines = _run(folder, 4, [Checkpoint()])
        match = LINE.match(lines[-1])
        assert state.status == "interrupted" and match, lines
        named.append(match.group(2))
    relative, absolute = named
    assert Path(relative).parent == Path("runs/given-relative/checkpoints") and Path(relative).is_file(), relative
    assert absolute == relative.replace("given-relative", "given-absolute"), named
