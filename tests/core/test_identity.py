"""Runs that cannot be mistaken for each other: a run's identity is its script's
path, not its file name; two processes never write one run folder; an evaluation leaves the
run it reads as it was; a killed smoke run's temporary folder does not stay. Real
subprocesses, real ``kill -9``."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit.data import Batches
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim
from hookfit.locks import LOCK

from conftest import TESTS, mse_step
from hookfit.errors import ObserverWarning
import warm

SCRIPT = TESTS / "scripts" / "identity_train.py"
SMOKE = {"HOOKFIT_PLUGINS": "smoke"}  # the plugin that makes smoke runs, beside those the script gives


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HOOKFIT_RESUME", "HOOKFIT_SMOKE", "JPY_SESSION_NAME")}
    return {**env, **extra}


def _start(script: Path, cwd: Path, out: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    return warm.Popen([sys.executable, str(script), str(out), *args], cwd=cwd, env=_env(**env),
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run(script: Path, cwd: Path, *args: str, **env: str) -> tuple[dict, str]:
    out = cwd / f"out-{time.monotonic_ns()}.json"
    process = _start(script, cwd, out, *args, **env)
    _, err = process.communicate(timeout=180)
    assert process.returncode == 0, err
    return json.loads(out.read_text()), err


def _wait_for(path: Path, process: subprocess.Popen[str], timeout: float = 120) -> None:
    """Until ``path`` exists (the child reached its hold), failing at once if the child died."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None:
            pytest.fail(f"the child ended ({process.returncode}) before {path.name}: {process.stderr.read()}")
        assert time.monotonic() < deadline, f"no {path} after {timeout} s"
        time.sleep(0.05)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project with two scripts of one file name: experiments/a/train.py and experiments/b/train.py."""
    for which in ("a", "b"):
        folder = tmp_path / "experiments" / which
        folder.mkdir(parents=True)
        shutil.copy(SCRIPT, folder / "train.py")
    return tmp_path


# -- identity ------------------------------------------------------------------------------

def test_two_scripts_of_one_file_name_never_share_latest(project: Path) -> None:
    """Run from the project root, a/train.py and b/train.py are both named ``train`` (their
    folders under runs/train/), but b's "latest" never takes a's checkpoint; b's own is taken,
    and the line on stderr says which."""
    a = project / "experiments" / "a" / "train.py"
    b = project / "experiments" / "b" / "train.py"
    a1, _ = _run(a, project, "--epochs", "2")
    assert a1["name"] == "train" and Path(a1["run_dir"]).parent == project / "runs" / "train"
    assert a1["identity"] == str(a.resolve())
    b1, err = _run(b, project, "--epochs", "1", HOOKFIT_RESUME="latest")
    assert b1["resumed_from"] is None and b1["step"] == 4, err  # a fresh start: a's run is not b's
    assert b1["run_dir"] != a1["run_dir"] and "took" not in err
    b2, err = _run(b, project, "--epochs", "2", HOOKFIT_RESUME="latest")
    assert b2["resumed_from"] is not None and Path(b2["resumed_from"]).parent.parent == Path(b1["run_dir"])
    assert b2["run_dir"] == b1["run_dir"] and b2["step"] == 8
    said = [line for line in err.splitlines() if "resume='latest' took" in line]
    assert len(said) == 1 and b2["resumed_from"] in said[0] and str(b.resolve()) in said[0], err
    records = [json.loads(line) for line in (Path(a1["run_dir"]) / "run.jsonl").read_text().splitlines()]
    assert records[0]["identity"] == str(a.resolve())  # stored in run.jsonl, and listed by hookfit runs --json
    from hookfit.tools import runs

    assert runs.load(Path(b1["run_dir"])).identity == str(b.resolve())


def test_a_run_written_before_identities_is_found_as_before(project: Path) -> None:
    """A run folder whose run.jsonl records no identity (hookfit before this change) is a
    candidate for "latest" of any script of its name, as it always was."""
    a = project / "experiments" / "a" / "train.py"
    a1, _ = _run(a, project, "--epochs", "1")
    log = Path(a1["run_dir"]) / "run.jsonl"
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    for line in lines:
        line.pop("identity", None)
        line.pop("mode", None)
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    b1, err = _run(project / "experiments" / "b" / "train.py", project, "--epochs", "2", HOOKFIT_RESUME="latest")
    assert b1["resumed_from"] is not None and b1["run_dir"] == a1["run_dir"], err


# -- one process a folder ------------------------------------------------------------------

@pytest.mark.fault
def test_a_second_process_on_a_live_run_folder_is_refused_and_kill_9_leaves_no_stale_lock(tmp_path: Path) -> None:
    """A live run holds its folder: a second process given the same run_dir, and one resuming
    "latest" into it, are refused at start, naming the live process's pid and host, and write
    nothing there. After a kill -9 of the first, a third takes the folder at once."""
    run_dir = tmp_path / "shared"
    hold = tmp_path / "hold"
    hold.mkdir()
    first = _start(SCRIPT, tmp_path, tmp_path / "first.json", "--run-dir", str(run_dir), "--epochs", "2",
                   "--hold", str(hold))
    try:
        _wait_for(hold / "ready", first)
        before = sorted(p.name for p in run_dir.rglob("*"))
        for resume in ("", "latest"):
            second = _start(SCRIPT, tmp_path, tmp_path / "second.json", "--run-dir", str(run_dir),
                            HOOKFIT_RESUME=resume)
            _, err = second.communicate(timeout=180)
            assert second.returncode != 0, err
            assert f"pid {first.pid} on host {socket.gethostname()}" in err and str(run_dir) in err, err
            assert not (tmp_path / "second.json").exists()
        assert sorted(p.name for p in run_dir.rglob("*")) == before
        assert len((run_dir / "run.jsonl").read_text().splitlines()) == 1  # the refused ones wrote nothing
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=60)
    third, err = _run(SCRIPT, tmp_path, "--run-dir", str(run_dir), "--epochs", "1")
    assert third["status"] == "completed" and third["run_dir"] == str(run_dir), err


HELD_BY_WORKERS = """
import os, sys, time
from pathlib import Path
import torch
import hookfit
from torch.utils.data import DataLoader, Dataset

run_dir, hold = Path(sys.argv[1]), Path(sys.argv[2])

class Blocking(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        (hold / f"worker-{os.getpid()}").touch()
        while i >= 2 and not (hold / "release").exists():  # the workers stay busy past their parent
            time.sleep(0.05)
        return torch.zeros(2)

def step(loop, batch):
    (hold / "ready").touch()

loader = DataLoader(Blocking(), batch_size=None, num_workers=2, multiprocessing_context="fork")
from hookfit.plugins.checkpoint import Checkpoint
hookfit.Loop(step, loader, model=torch.nn.Linear(2, 1), run_dir=run_dir, max_epochs=1,
             plugins=[Checkpoint(background=False)]).fit()
"""


@pytest.mark.fault
def test_kill_9_leaves_no_lock_held_by_the_data_loader_workers_it_orphans(tmp_path: Path) -> None:
    """The lock goes with the process that took it: forked DataLoader workers that outlive a kill -9
    of their parent (until they next look for it) do not keep a resumed run out of the folder."""
    from hookfit.locks import FolderLock

    run_dir, hold = tmp_path / "run", tmp_path / "hold"
    hold.mkdir()
    script = tmp_path / "held.py"
    script.write_text(HELD_BY_WORKERS)
    first = warm.Popen([sys.executable, str(script), str(run_dir), str(hold)], env=_env(),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers: list[int] = []
    try:
        _wait_for(hold / "ready", first)
        assert (run_dir / LOCK).is_file()
        workers = [int(p.name.split("-")[1]) for p in hold.glob("worker-*")]
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)  # (its pipes stay open in the workers)
        lock = FolderLock(run_dir, "resumed run")
        lock.acquire()  # not FolderInUse: the workers hold none of it
        assert lock.held
        for pid in workers:
            os.kill(pid, 0)  # the orphaned workers were alive while the lock was taken
        lock.release()
    finally:
        (hold / "release").touch()
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if first.poll() is None:
            first.kill()
    assert len(workers) == 2


@pytest.mark.fault
def test_a_second_process_resuming_latest_of_a_live_run_is_refused(tmp_path: Path) -> None:
    """Without run_dir: the first run (an epoch done, then held) is found by a second process's
    resume="latest", which would continue in the first's folder: refused, naming the live one;
    the first then ends with its own final checkpoint intact."""
    hold = tmp_path / "hold"
    hold.mkdir()
    script = tmp_path / "train.py"
    shutil.copy(SCRIPT, script)
    _run(script, tmp_path, "--epochs", "1")  # a checkpoint for "latest"
    first = _start(script, tmp_path, tmp_path / "first.json", "--epochs", "3", "--hold", str(hold),
                   HOOKFIT_RESUME="latest")
    try:
        _wait_for(hold / "ready", first)
        second = _start(script, tmp_path, tmp_path / "second.json", "--epochs", "3", HOOKFIT_RESUME="latest")
        _, err = second.communicate(timeout=180)
        assert second.returncode != 0 and f"pid {first.pid}" in err, err
        (hold / "go").write_text("")
        _, err = first.communicate(timeout=180)
        assert first.returncode == 0, err
    finally:
        if first.poll() is None:
            first.kill()
    done = json.loads((tmp_path / "first.json").read_text())
    assert done["step"] == 12 and done["status"] == "completed"
    assert (Path(done["run_dir"]) / "checkpoints" / "epoch0003-step000000012.pt").is_file()


@pytest.mark.slow
@pytest.mark.fault
def test_a_killed_smoke_runs_folder_is_removed_by_the_next_smoke_run(tmp_path: Path) -> None:
    """A smoke run killed with -9 cannot remove its temporary folder; the next smoke run does,
    and leaves a live smoke run's folder alone."""
    tmp, hold = tmp_path / "tmp", tmp_path / "hold"
    tmp.mkdir()
    hold.mkdir()
    first = _start(SCRIPT, tmp_path, tmp_path / "first.json", "--hold", str(hold), HOOKFIT_SMOKE="1", TMPDIR=str(tmp),
                   **SMOKE)
    try:
        _wait_for(hold / "ready", first)
        folder = Path((hold / "ready").read_text())
        assert folder.parent == tmp and folder.is_dir()
        _run(SCRIPT, tmp_path, HOOKFIT_SMOKE="1", TMPDIR=str(tmp), **SMOKE)  # while the first is alive
        assert folder.is_dir()
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=60)
    assert folder.is_dir()  # killed: nothing removed it
    done, err = _run(SCRIPT, tmp_path, HOOKFIT_SMOKE="1", TMPDIR=str(tmp), **SMOKE)
    assert "hookfit smoke: completed" in err
    assert not folder.exists() and list(tmp.glob("hookfit-smoke-*")) == []


# -- read-only uses ------------------------------------------------------------------------

def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != LOCK}


def _loop(**kwargs: object) -> hookfit.Loop:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(40, 4, generator=g), torch.randn(40, 1, generator=g)

    def step(loop, batch):
        loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    def val_step(loop, batch):
        return {"loss": torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])}

    return hookfit.Loop(step, Batches(x, y, batch_size=10), val_step=val_step, val_data=Batches(x, y, batch_size=20),
                        model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1), name="evaluated",
                        plugins=[Optim(), Metrics(), Checkpoint(background=False, keep_last=1)], **kwargs)


def test_validate_resume_latest_leaves_the_training_run_as_it_was(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """An evaluation of the training's latest checkpoint changes nothing in the training's folder
    (run.jsonl, metrics.jsonl, checkpoints: keep_last=1 prunes nothing there), and the run
    commands still say how the training ended."""
    from hookfit.tools import runs

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOOKFIT_PLUGINS", "metrics_log")
    _loop(max_epochs=2).fit()
    (folder,) = (tmp_path / "runs" / "evaluated").iterdir()
    (folder / "checkpoints" / "epoch0009-step000000036.pt").write_bytes(
        (folder / "checkpoints" / "epoch0002-step000000008.pt").read_bytes())  # one keep_last=1 would prune
    before = _snapshot(folder)
    info = runs.load(folder)
    state = _loop(max_epochs=2).validate(resume=folder / "checkpoints" / "epoch0002-step000000008.pt")
    assert state.status == "completed"
    state = _loop(max_epochs=2).validate(resume="latest")
    assert state.status == "completed" and state.resumed_from is not None
    assert _snapshot(folder) == before
    assert runs.load(folder) == info and info.status == "completed"


def test_the_folder_asked_for_after_a_run_is_not_locked_for_the_next_run(tmp_path: Path) -> None:
    """``loop.run.run_dir`` read after ``fit()`` (a run that wrote nothing there) gave the
    folder a lock that nothing released, so the next run in that folder, in the same process,
    was refused as "in use by another live process" (its own pid)."""
    import hookfit

    class Writes:
        name = "writes"

        @hookfit.hookimpl
        def fit_start(self, loop):
            (loop.run_dir / "mine.txt").write_text("x")

    folder = tmp_path / "run"
    first = hookfit.Loop(lambda loop, batch: None, [1, 2], run_dir=folder, plugins=[])
    assert first.fit().status == "completed"
    assert first.run.run_dir == folder and not (folder / "run.jsonl").exists()  # no run recorded after it
    state = hookfit.Loop(lambda loop, batch: None, [1, 2], run_dir=folder, plugins=[Writes()]).fit()
    assert state.status == "completed" and (folder / "mine.txt").exists()


class Ends:
    """The status of every run at its fit_end, after every other plugin's."""

    name = "ends"

    def __init__(self) -> None:
        self.statuses: list[str] = []

    @hookfit.hookimpl(trylast=True)
    def fit_end(self, loop) -> None:
        self.statuses.append(loop.state.status)


@pytest.mark.fault
def test_a_fit_in_a_live_runs_folder_is_refused_at_its_start_not_by_an_observer_switched_off(tmp_path: Path) -> None:
    """A fit given (or resuming into) a folder a live process holds: TensorBoard, an observer, was the first
    to use it at fit_start and was switched off with a warning that read as a crash, before the checkpoint
    plugin failed the run. The run claims a folder that has a lock file at its start: refused once, as
    the run's error, every fit_end run, nothing written there."""
    from hookfit.locks import FolderInUse, FolderLock
    from hookfit.plugins.tensorboard import TensorBoard

    model = torch.nn.Linear(1, 1)
    data = [(torch.ones(2, 1), torch.ones(2, 1))]
    ends = Ends()

    def fit(**options: Any) -> hookfit.State:
        return hookfit.Loop(mse_step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                            max_epochs=1, run_dir=tmp_path, plugins=[TensorBoard(), Optim(), Metrics(),
                            Checkpoint(background=False), ends], **options).fit()

    fit()
    before = sorted((p.name, p.stat().st_size) for p in tmp_path.rglob("*") if p.name != LOCK)
    held = FolderLock(tmp_path, "another run")
    held.acquire()
    try:
        for resume in (None, "latest"):
            with warnings.catch_warnings():
                warnings.simplefilter("error", ObserverWarning)
                with pytest.raises(FolderInUse, match=f"{tmp_path} is in use by another live process"):
                    fit(resume=resume)
    finally:
        held.release()
    assert ends.statuses == ["completed", "failed", "failed"]
    assert sorted((p.name, p.stat().st_size) for p in tmp_path.rglob("*") if p.name != LOCK) == before


@pytest.mark.fault
def test_an_evaluation_in_a_live_runs_folder_is_refused_not_an_observer_switched_off(tmp_path: Path) -> None:
    """``Loop.validate(resume=...)`` given the run_dir of a run still going (its lock held): the
    first plugin to write there was an observer (metrics_log), whose error switched it off with an
    ObserverWarning that read as a crash, and the evaluation went on. The evaluation claims its
    folder at its start: refused, naming the folder and the live process, every fit_end run."""
    from hookfit.plugins.metrics_log import MetricsLog
    from hookfit.locks import FolderInUse, FolderLock

    model = torch.nn.Linear(1, 1)
    data = [(torch.ones(2, 1), torch.ones(2, 1))]
    ends = Ends()

    def loop(*more: Any, **options: Any) -> hookfit.Loop:
        return hookfit.Loop(mse_step, data, val_step=lambda loop, b: {"loss": torch.tensor(1.0)}, val_data=data,
                            model=model, max_epochs=1, run_dir=tmp_path,
                            plugins=[Optim(), Metrics(), MetricsLog(), Checkpoint(background=False), *more], **options)

    loop(optimizers=torch.optim.SGD(model.parameters(), lr=0.1)).fit()
    before = (tmp_path / "metrics.jsonl").read_text()
    held = FolderLock(tmp_path, "another run")
    held.acquire()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", ObserverWarning)
            with pytest.raises(FolderInUse, match=f"{tmp_path} is in use by another live process"):
                loop(ends).validate(resume="latest")
    finally:
        held.release()
    assert ends.statuses == ["failed"] and (tmp_path / "metrics.jsonl").read_text() == before
