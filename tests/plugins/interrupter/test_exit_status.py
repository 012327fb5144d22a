"""A run stopped by a signal ends its process as the signal would, after the graceful stop:
real signals sent to a real training subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = r'''
import json, sys, time
import torch
import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.interrupter import Interrupter

exit_, catch = sys.argv[1] == "exit", sys.argv[2] == "catch"
options = {"extra_signals": sys.argv[3]} if len(sys.argv) > 3 else {}  # a signal's name

class Watch:
    name = "watch"
    @hookfit.hookimpl
    def batch_end(self, batch_idx):
        if batch_idx == 0:
            print("TRAINING", flush=True)
    @hookfit.hookimpl
    def fit_end(self, loop):
        print("FIT_END " + loop.state.status, flush=True)

def step(loop, batch):
    time.sleep(0.01)

model = torch.nn.Linear(2, 1)
loop = hookfit.Loop(step, list(range(100_000)), model=model, run_dir="run",
                    plugins=[Watch(), Checkpoint(every_n_epochs=None), Interrupter(exit=exit_, **options)])
try:
    state = loop.fit()
    print("RETURNED " + json.dumps({"status": state.status, "reason": state.stop_reason}), flush=True)
except KeyboardInterrupt as error:
    if not catch:
        raise
    print("CAUGHT " + json.dumps({"error": str(error), "status": loop.state.status}), flush=True)
finally:
    print("FINALLY", flush=True)
'''


def run(tmp_path: Path, signum: int, *args: str) -> tuple[int, list[str], str]:
    """The script started with ``args``, signalled once it trained a batch, and waited for:
    its exit status, its stdout's lines and its stderr."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")}
    env["HOOKFIT_PLUGINS"] = "interrupter,checkpoint"
    proc = subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=tmp_path)
    try:
        line = proc.stdout.readline().strip()
        assert line == "TRAINING", line + proc.stderr.read()
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out.splitlines(), err


def ended_gracefully(tmp_path: Path, lines: list[str], name: str) -> None:
    """fit_end ran, an interrupt checkpoint was written and run.jsonl has its end line."""
    assert "FIT_END interrupted" in lines, lines
    assert list((tmp_path / "run" / "checkpoints").glob("*.pt")), "no checkpoint written at the stop"
    records = [json.loads(line) for line in (tmp_path / "run" / "run.jsonl").read_text().splitlines()]
    assert records[-1]["event"] == "end" and records[-1]["status"] == "interrupted"
    assert records[-1]["reason"] == name


@pytest.mark.slow
@pytest.mark.fault
def test_sigint_ends_the_process_as_an_unhandled_sigint_would(tmp_path: Path) -> None:
    code, lines, err = run(tmp_path, signal.SIGINT, "exit", "plain")
    assert code == -signal.SIGINT, err  # killed by SIGINT: a shell says 130
    ended_gracefully(tmp_path, lines, "SIGINT")
    assert "RETURNED" not in " ".join(lines) and "FINALLY" in lines
    assert "KeyboardInterrupt: SIGINT: the run stopped gracefully" in err, err


@pytest.mark.slow
@pytest.mark.fault
def test_sigterm_ends_the_process_with_status_143(tmp_path: Path) -> None:
    code, lines, err = run(tmp_path, signal.SIGTERM, "exit", "plain")
    assert code == 128 + signal.SIGTERM == 143, err
    ended_gracefully(tmp_path, lines, "SIGTERM")
    assert "RETURNED" not in " ".join(lines) and "FINALLY" in lines


@pytest.mark.slow
@pytest.mark.fault
def test_an_extra_signal_stops_gracefully_and_ends_the_process_with_128_plus_its_number(tmp_path: Path) -> None:
    """SLURM's early warning (``#SBATCH --signal=USR1@90``) with ``Interrupter(extra_signals="SIGUSR1")``:
    the stop is SIGTERM's, checkpoint and all, and the process ends with status 138, as a shell
    reports one killed by SIGUSR1."""
    code, lines, err = run(tmp_path, signal.SIGUSR1, "exit", "plain", "SIGUSR1")
    assert code == 128 + signal.SIGUSR1 == 138, err
    ended_gracefully(tmp_path, lines, "SIGUSR1")
    assert "RETURNED" not in " ".join(lines) and "FINALLY" in lines
    assert "hookfit: SIGUSR1 received, stopping after this batch\n" in err, err


@pytest.mark.slow
@pytest.mark.fault
def test_without_extra_signals_a_sigusr1_is_left_to_what_the_process_had(tmp_path: Path) -> None:
    """The interrupter handles SIGINT and SIGTERM only unless told more: a SIGUSR1 takes its
    default action, which ends the process at once, killed by it, with no graceful stop."""
    code, lines, err = run(tmp_path, signal.SIGUSR1, "exit", "plain")
    assert code == -signal.SIGUSR1, err
    assert not any(line.startswith("FIT_END") for line in lines) and "received" not in err, err


@pytest.mark.slow
@pytest.mark.fault
def test_a_script_catches_the_keyboard_interrupt_after_the_graceful_stop(tmp_path: Path) -> None:
    code, lines, err = run(tmp_path, signal.SIGINT, "exit", "catch")
    assert code == 0, err
    ended_gracefully(tmp_path, lines, "SIGINT")
    caught = json.loads(next(line for line in lines if line.startswith("CAUGHT "))[len("CAUGHT "):])
    assert caught["status"] == "interrupted" and caught["error"].startswith("SIGINT: the run stopped gracefully")
    assert lines.index("FIT_END interrupted") < lines.index(next(line for line in lines if line.startswith("CAUGHT")))


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.parametrize("signum, name", [(signal.SIGINT, "SIGINT"), (signal.SIGTERM, "SIGTERM")])
def test_exit_false_returns_the_interrupted_state(tmp_path: Path, signum: int, name: str) -> None:
    code, lines, err = run(tmp_path, signum, "return", "plain")
    assert code == 0, err
    ended_gracefully(tmp_path, lines, name)
    returned = json.loads(next(line for line in lines if line.startswith("RETURNED "))[len("RETURNED "):])
    assert returned == {"status": "interrupted", "reason": name}


def test_exit_is_checked_when_it_is_built() -> None:
    from hookfit.plugins.interrupter import Interrupter

    with pytest.raises(ValueError, match=r"^interrupter: exit must be True, False or None, got 'no'$"):
        Interrupter(exit="no")


@pytest.mark.fault
@pytest.mark.parametrize("signum, raised", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, SystemExit)])
def test_fit_raises_once_the_run_is_over(signum: int, raised: type[BaseException]) -> None:
    """In the process: ``fit()`` raises after every ``fit_end`` and ``results``, with the
    run's state as it would have returned it."""
    import hookfit
    from hookfit.plugins.interrupter import Interrupter

    seen: list[str] = []

    class Late:
        name = "late"

        @hookfit.hookimpl(trylast=True)
        def fit_end(self, loop):
            seen.append("fit_end " + loop.state.status)

        @hookfit.hookimpl
        def results(self, loop):
            seen.append("results")

    def step(loop, batch):
        if batch == 1:
            os.kill(os.getpid(), signum)  # handled on this (the main) thread

    before = signal.getsignal(signum)
    loop = hookfit.Loop(step, list(range(6)), plugins=[Late(), Interrupter()])
    with pytest.raises(raised) as caught:
        loop.fit()
    if raised is SystemExit:
        assert caught.value.code == 143
    assert seen == ["fit_end interrupted", "results"]
    assert (loop.state.status, loop.state.stop_reason, loop.state.step) == ("interrupted", signal.Signals(signum).name, 2)
    assert signal.getsignal(signum) is before


@pytest.mark.fault
def test_a_real_time_signal_ends_the_process_with_its_own_status() -> None:
    """``extra_signals`` takes any signal number, real-time ones included (SIGRTMIN+2, named so): the run's end
    said so with ``signal.Signals(signum)``, which has no member for it, and failed the run instead."""
    import hookfit
    from hookfit.plugins.interrupter import Interrupter

    signum = signal.SIGRTMIN + 2

    def step(loop, batch):
        if batch == 1:
            os.kill(os.getpid(), signum)

    before = signal.getsignal(signum)
    loop = hookfit.Loop(step, list(range(6)), plugins=[Interrupter(extra_signals=int(signum))])
    with pytest.raises(SystemExit) as caught:
        loop.fit()
    assert caught.value.code == 128 + signum
    assert (loop.state.status, loop.state.stop_reason) == ("interrupted", "SIGRTMIN+2")
    assert signal.getsignal(signum) is before


@pytest.mark.fault
def test_a_second_extra_signal_or_a_sigterm_after_it_changes_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    """As a second SIGTERM: the stop the first asked goes on, and the process ends with the
    first one's status (SLURM sends SIGTERM at the time limit, after the early SIGUSR1); the
    handlers are the ones before the run again."""
    import hookfit
    from hookfit.plugins.interrupter import Interrupter

    seen: list[Any] = []

    class Ending:
        name = "ending"

        @hookfit.hookimpl
        def fit_end(self, loop):
            seen.append(loop.stop_requested)

    def step(loop, batch):
        seen.append(signal.getsignal(signal.SIGUSR1))
        if batch == 1:
            for signum in (signal.SIGUSR1, signal.SIGUSR1, signal.SIGTERM):
                os.kill(os.getpid(), signum)  # handled on this (the main) thread

    before = {signum: signal.getsignal(signum) for signum in (signal.SIGUSR1, signal.SIGTERM)}
    interrupter = Interrupter(extra_signals=["USR1"])
    assert interrupter.extra_signals == ("SIGUSR1",)
    loop = hookfit.Loop(step, list(range(6)), plugins=[Ending(), interrupter])
    with pytest.raises(SystemExit) as caught:
        loop.fit()
    assert caught.value.code == 128 + signal.SIGUSR1
    assert (loop.state.status, loop.state.stop_reason, loop.state.step) == ("interrupted", "SIGUSR1", 2)
    assert seen[:2] == [interrupter._on_signal] * 2 and len(seen) == 3
    assert (seen[2].reason, seen[2].ends_process) == ("SIGUSR1", True)  # the request the first one asked
    assert {signum: signal.getsignal(signum) for signum in before} == before
    err = capsys.readouterr().err
    assert err.count("hookfit: SIGUSR1 received, stopping after this batch\n") == 2, err
    assert "hookfit: SIGTERM received, stopping after this batch\n" in err and "Ctrl-C" not in err, err


def test_the_interrupter_leaves_other_signals_alone_unless_told() -> None:
    import hookfit
    from hookfit.plugins.interrupter import Interrupter

    seen: list[Any] = []
    before = signal.getsignal(signal.SIGUSR1)
    hookfit.Loop(lambda loop, batch: seen.append(signal.getsignal(signal.SIGUSR1)), [0, 1],
                 plugins=[Interrupter()]).fit()
    assert seen == [before, before] and Interrupter().extra_signals == ()


def test_a_stop_asked_otherwise_returns() -> None:
    """Only a stop asked by a signal ends the process: a run stopped by anyone else returns."""
    import hookfit
    from hookfit.plugins.interrupter import Interrupter

    def step(loop, batch):
        if batch == 1:
            loop.request_stop("enough")

    state = hookfit.Loop(step, list(range(6)), plugins=[Interrupter()]).fit()
    assert (state.status, state.stop_reason) == ("interrupted", "enough")


def test_end_with_raises_once_the_run_is_over_and_the_runs_own_error_wins() -> None:
    """The core's side (``hookfit.loop.end_with``): the first error asked is raised after
    ``results``; a run that fails raises its own; anything but an exception is refused."""
    import hookfit
    from hookfit.loop import end_with

    order: list[str] = []

    class Ends:
        name = "ends"

        @hookfit.hookimpl
        def fit_end(self, loop):
            end_with(loop, SystemExit(3))
            end_with(loop, SystemExit(4))  # the first one asked wins
            order.append("fit_end")

        @hookfit.hookimpl
        def results(self, loop):
            order.append("results")

    with pytest.raises(SystemExit) as raised:
        hookfit.Loop(lambda loop, batch: None, [0, 1], plugins=[Ends()]).fit()
    assert raised.value.code == 3 and order == ["fit_end", "results"]

    def failing(loop, batch):
        raise ValueError("the step's own error")

    with pytest.raises(ValueError, match="the step's own error"):
        hookfit.Loop(failing, [0, 1], plugins=[Ends()]).fit()
    with pytest.raises(TypeError, match="^end_with: error must be an exception, got int$"):
        end_with(None, 3)  # type: ignore[arg-type]


RANK_1 = r'''
import os, signal
import hookfit
from hookfit.plugins.interrupter import Interrupter

class Rank:  # what the distributed plugin does at configure under torchrun: this process is rank 1 of 2
    name = "rank"
    @hookfit.hookimpl
    def configure(self, loop):
        loop.state.rank, loop.state.world_size = 1, 2

def step(loop, batch):
    if batch == 1:
        os.kill(os.getpid(), signal.SIGINT)

hookfit.Loop(step, list(range(6)), plugins=[Rank(), Interrupter()]).fit()
'''


@pytest.mark.slow
def test_a_rank_other_than_0_ends_as_signalled_without_printing_rank_0s_traceback_again(tmp_path: Path) -> None:
    """Under torchrun rank 0 prints the ``KeyboardInterrupt`` every rank raises after a graceful
    Ctrl-C; another rank, the exception left uncaught, ends killed by SIGINT as well, silently."""
    script = tmp_path / "rank1.py"
    script.write_text(RANK_1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")}
    env["HOOKFIT_PLUGINS"] = "interrupter"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=120)
    assert done.returncode == -signal.SIGINT, done.stderr  # killed by SIGINT: a shell says 130
    assert "KeyboardInterrupt" not in done.stderr and "Traceback" not in done.stderr, done.stderr
