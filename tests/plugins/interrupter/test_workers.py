"""A signal to the whole process group (a terminal's Ctrl-C, a job scheduler's SIGTERM) while a
``DataLoader`` has workers: the run stops gracefully, as a signal to the main process alone does.
Real subprocesses, real signals, real workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

CHILD = r'''
import multiprocessing, os, signal, sys, time
import torch
from torch.utils.data import DataLoader, TensorDataset
import hookfit
from hookfit.plugins.checkpoint import Checkpoint

go = sys.argv[1]
watched = signal.Signals[sys.argv[3]] if len(sys.argv) > 3 else signal.SIGTERM  # the signal the test sends
x = torch.arange(64.0).reshape(32, 2)

def init(worker_id):  # what the worker does with the signal, for the test to read
    handler = signal.getsignal(watched)
    with open(f"init-{os.getpid()}", "w") as out:
        out.write(getattr(handler, "__qualname__", repr(handler)))

loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, num_workers=2, worker_init_fn=init,
                    multiprocessing_context=sys.argv[2])

def step(loop, batch):
    loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    if loop.state.step == 3:
        print("WORKERS " + " ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
        while not os.path.exists(go):  # the test signals the group, then lets the batch go on
            time.sleep(0.01)
    return loss

if __name__ == "__main__":  # (spawn's workers import this file)
    model = torch.nn.Linear(2, 1)
    hookfit.Loop(step, loader, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.01), max_epochs=2,
                 run_dir="run", plugins=[Checkpoint(background=False, every_n_epochs=None)]).fit()
'''


def handled(pid: int, folder: Path) -> bool:
    """Whether worker ``pid`` has dealt with the signal: gone (torch's handler kills a worker on
    SIGTERM) or shielded (its ``worker_init_fn`` saw the interrupter's handler)."""
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return True
    return state == "Z" or (folder / f"init-{pid}").read_text() == "Shielded._signalled"


EXTRA = '[plugins.interrupter]\nextra_signals = ["SIGUSR1"]\n'  # hookfit.toml: SIGUSR1 stops the run too


def start(folder: Path, source: str, *args: str, plugins: str = "interrupter,optim",
          signum: int | None = None) -> subprocess.Popen[str]:
    """``source`` run as ``train.py ARGS`` in its own session in ``folder``, with the ``plugins`` discovered
    and, for a SIGUSR1 (``signum``), a hookfit.toml that makes it a stop (:data:`EXTRA`)."""
    (folder / "train.py").write_text(source)
    if signum == signal.SIGUSR1:
        (folder / "hookfit.toml").write_text(EXTRA)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")}
    env["HOOKFIT_PLUGINS"] = plugins
    return subprocess.Popen([sys.executable, "train.py", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=folder, start_new_session=True)


@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1],
                         ids=["SIGTERM", "SIGINT", "SIGUSR1"])
@pytest.mark.slow
def test_a_signal_to_the_process_group_stops_the_run_gracefully_with_dataloader_workers(
        tmp_path: Path, signum: int, method: str) -> None:
    """The group's signal reaches the workers too. Before, torch's SIGTERM handler killed them and
    the main process failed inside the step (``DataLoader worker ... is killed by signal``): no
    checkpoint of the stop, exit status 1, the step function blamed; a Ctrl-C was announced once
    by the main process and once by every worker (each ran the handler it inherited). Now the
    workers ignore both while the run is on, the batch ends, the stop is checkpointed and the
    process ends as the signal would. A SIGUSR1 the interrupter is told to stop on
    (``extra_signals``, SLURM's early warning) is a SIGTERM under another name: before, its
    default action killed the main process and the workers."""
    go, name = tmp_path / "go", signal.Signals(signum).name
    proc = start(tmp_path, CHILD, str(go), method, name, signum=signum)
    try:
        line = proc.stdout.readline().split()
        assert line[:1] == ["WORKERS"] and len(line) == 3, line + [proc.stderr.read()]
        os.killpg(proc.pid, signum)
        said = proc.stderr.readline()
        assert said.startswith(f"hookfit: {name} received"), said
        workers = [int(pid) for pid in line[1:]]
        deadline = time.monotonic() + 60
        while not all(handled(pid, tmp_path) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.01)  # (a condition: each worker is gone or shielded)
        go.touch()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = said + err
    assert "killed by signal" not in err and "RuntimeError" not in err, err
    assert err.count(f"hookfit: {name} received") == 1, err
    assert proc.returncode == (-signal.SIGINT if signum == signal.SIGINT else 128 + signum), err
    assert signum != signal.SIGTERM or proc.returncode == 143
    records = [json.loads(line) for line in (tmp_path / "run" / "run.jsonl").read_text().splitlines()]
    assert (records[-1]["event"], records[-1]["status"], records[-1]["reason"]) == ("end", "interrupted", name)
    assert [p.name for p in (tmp_path / "run" / "checkpoints").glob("*.pt")] == ["epoch0001-step000000004.pt"]


ENDINGS = r'''
import os, signal, sys, torch, hookfit
from torch.utils.data import DataLoader, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

how = sys.argv[1]
x = torch.randn(32, 2)
kind = StatefulDataLoader if how == "persistent-stateful" else DataLoader
loader = kind(TensorDataset(x, x), batch_size=4, num_workers=2, persistent_workers=how == "persistent-stateful")

def step(loop, batch):
    if how in ("raises", "raises-caught"):
        raise ValueError("a bug in the step")
    if how == "aborted" and loop.state.step == 2:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, Ctrl-C: abort
        os.kill(os.getpid(), signal.SIGINT)
    return torch.zeros(())

try:
    hookfit.Loop(step, loader, max_epochs=1, run_dir="run").fit()
except ValueError:
    if how != "raises-caught":
        raise
print("ENDED", flush=True)
'''


@pytest.mark.parametrize("how, status", [("raises", 1), ("raises-caught", 0), ("aborted", -signal.SIGINT),
                                         ("persistent-stateful", 0)])
@pytest.mark.slow
def test_a_process_whose_dataloader_workers_are_shielded_still_ends(tmp_path: Path, how: str, status: int) -> None:
    """The workers a run leaves alive at its end (a failed step's traceback holds the iterator, an
    abort, torchdata's StatefulDataLoader keeping its persistent workers) are ended by Python's
    exit, with a SIGTERM from the main process that a shielded worker still obeys: the process
    ends with its status instead of waiting for them forever (as it did while the workers
    ignored every SIGTERM)."""
    script = tmp_path / "ends.py"
    script.write_text(ENDINGS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")}
    env["HOOKFIT_PLUGINS"] = "interrupter"
    proc = subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=tmp_path, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)  # (a hang fails here)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == status, out + err
    assert ("ENDED" in out) == (status == 0), out + err


STARTING = r'''
import os, signal, sys
import torch
from torch.utils.data import DataLoader, TensorDataset
import hookfit
from hookfit.plugins.checkpoint import Checkpoint

x = torch.arange(64.0).reshape(32, 2)
valid = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, num_workers=2,
                   multiprocessing_context="fork")

def signal_the_group_once():  # in a child, right after the fork: the worker is still starting
    try:
        os.close(os.open("signalled", os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return
    os.killpg(0, signal.Signals[sys.argv[1]])

def step(loop, batch):
    loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    if loop.state.step == 3:  # the validation after step 4 forks its workers
        os.register_at_fork(after_in_child=signal_the_group_once)
    return loss

def check(loop, batch):
    return {"loss": torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])}

model = torch.nn.Linear(2, 1)
hookfit.Loop(step, [(x[i:i + 4], x[i:i + 4].sum(1, keepdim=True)) for i in range(0, 32, 4)], val_step=check,
             val_data=valid, val_every_n_steps=4, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
             max_epochs=2, run_dir="run", plugins=[Checkpoint(background=False, every_n_epochs=None)]).fit()
'''


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_sigterm_to_the_group_while_a_forked_worker_starts_stops_the_run_gracefully(tmp_path: Path,
                                                                                     signum: int) -> None:
    """A job scheduler's SIGTERM that reaches a fork-started worker before its ``worker_init_fn``
    shields it: the handler the worker inherited sees the loader's code on its stack and ignores it,
    as the shield does. Before, it re-sent the signal unhandled: the worker died, the run failed
    (``DataLoader worker ... exited unexpectedly``, status 1, no checkpoint of the stop). An extra
    signal (``extra_signals``) is ignored there as a SIGTERM is."""
    name = signal.Signals(signum).name
    proc = start(tmp_path, STARTING, name, signum=signum)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert (tmp_path / "signalled").exists(), err
    assert "exited unexpectedly" not in err and "killed by signal" not in err, err
    assert proc.returncode == 128 + signum, err
    assert signum != signal.SIGTERM or proc.returncode == 143
    records = [json.loads(line) for line in (tmp_path / "run" / "run.jsonl").read_text().splitlines()]
    assert (records[-1]["event"], records[-1]["status"], records[-1]["reason"]) == ("end", "interrupted", name)
    assert list((tmp_path / "run" / "checkpoints").glob("*.pt")), err


def test_a_shielded_worker_takes_an_extra_signal_as_before_once_the_run_is_over() -> None:
    """``Shielded`` in this process standing for a worker: while the run is on an extra signal is
    ignored; once it is over the handler the worker had before is put back and gets the signal."""
    import threading

    from hookfit.plugins.interrupter import Shielded

    got: list[int] = []
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
    before = signal.getsignal(signal.SIGUSR1)
    running = threading.Event()
    running.set()
    try:
        Shielded(None, running, (signal.SIGUSR1,))(0)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert got == [] and signal.getsignal(signal.SIGUSR1) is not before
        running.clear()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert got == [signal.SIGUSR1] and signal.getsignal(signal.SIGUSR1) is before
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


FORKS = r'''
import multiprocessing, os, sys, time
import torch
from torch.utils.data import DataLoader, Dataset
import hookfit

def wait():
    open("alive", "w").close()  # running its own code: a signal from now on is not lost to the fork's reset
    while True:
        time.sleep(0.05)

class Spawner(Dataset):  # a dataset that starts a process of its own as it loads a sample
    child = None

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if Spawner.child is None:
            Spawner.child = multiprocessing.get_context("fork").Process(target=wait, daemon=True)
            Spawner.child.start()
            print("CHILD", Spawner.child.pid, flush=True)
        return torch.zeros(1)

def step(loop, batch):
    if loop.state.step == 1:
        while not os.path.exists("go"):  # the test signals the child, then lets the batch go on
            time.sleep(0.01)
        Spawner.child.join(60)
        print("EXIT", Spawner.child.exitcode, flush=True)

hookfit.Loop(step, DataLoader(Spawner(), batch_size=2), max_epochs=1, run_dir="run").fit()
'''


@pytest.mark.slow
def test_a_process_a_dataset_forks_during_the_run_takes_a_signal_as_without_the_handlers(tmp_path: Path) -> None:
    """Only a loader's own workers are shielded: a process the dataset starts while loading a sample
    (no workers: in the main process) dies of a SIGTERM as it would without the run, where it exited
    with status 0 (taken for a worker at the run's end)."""
    proc = start(tmp_path, FORKS, plugins="interrupter")
    try:
        line = proc.stdout.readline().split()
        assert line[:1] == ["CHILD"], line + [proc.stderr.read()]
        deadline = time.monotonic() + 60
        while not (tmp_path / "alive").exists() and time.monotonic() < deadline:
            time.sleep(0.01)  # (a condition: the child runs its own code; CPython drops a signal that comes
            # between the fork and the child's reset of its signal state)
        os.kill(int(line[1]), signal.SIGTERM)
        (tmp_path / "go").touch()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert f"EXIT {-signal.SIGTERM}" in out, out + err
