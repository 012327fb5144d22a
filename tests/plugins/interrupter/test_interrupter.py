"""The interrupter with real signals sent to a real training subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import hookfit


SCRIPT = r'''
import json, signal, sys, time
import hookfit

before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
ended = []

HOLD = "hold" in sys.argv  # batch 1 waits for a stop, then (pending) for a second signal
RETURN = "return" in sys.argv  # Interrupter(exit=False): fit() returns after a graceful stop

class Watch:
    name = "watch"
    @hookfit.hookimpl
    def batch_end(self, batch_idx):
        if batch_idx == 0 and not HOLD:
            print("TRAINING", flush=True)
    @hookfit.hookimpl
    def fit_end(self, loop):
        ended.append(loop.state.status)

def step(loop, batch):
    time.sleep(0.05)
    if HOLD and batch == 1:  # signalled inside this step, however late the signal comes
        print("TRAINING", flush=True)
        deadline = time.monotonic() + 30
        while loop.stop_requested is None and time.monotonic() < deadline:
            time.sleep(0.01)
        print("PENDING", flush=True)
        while loop.stop_requested is not None:
            time.sleep(0.01)

given = [Watch()]
if RETURN:
    from hookfit.plugins.interrupter import Interrupter
    given.append(Interrupter(exit=False))
loop = hookfit.Loop(step, list(range(10_000)), plugins=given)
try:
    state = loop.fit()
    outcome = "returned"
except KeyboardInterrupt:
    outcome = "KeyboardInterrupt"
restored = all(signal.getsignal(s) is h for s, h in before.items())
print(json.dumps({"outcome": outcome, "status": loop.state.status, "reason": loop.state.stop_reason,
                  "fit_end": ended, "restored": restored, "step": loop.state.step}), flush=True)
'''


def start(tmp_path: Path, *args: str, config: str | None = None) -> subprocess.Popen:
    """The script started with ``args`` (and ``config`` as the ``hookfit.toml`` beside it), once it trains."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    if config is not None:
        (tmp_path / "hookfit.toml").write_text(config)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")}
    env["HOOKFIT_PLUGINS"] = "interrupter"
    proc = subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=tmp_path)
    assert proc.stdout.readline().strip() == "TRAINING"
    return proc


def finish(proc: subprocess.Popen) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=60)
    return json.loads(out.strip().splitlines()[-1]), err


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.parametrize("signum, name", [(signal.SIGINT, "SIGINT"), (signal.SIGTERM, "SIGTERM")])
def test_one_signal_stops_gracefully(tmp_path: Path, signum: int, name: str) -> None:
    proc = start(tmp_path, "return")
    proc.send_signal(signum)
    result, err = finish(proc)
    assert result["outcome"] == "returned" and result["status"] == "interrupted"
    assert result["reason"] == name and result["fit_end"] == ["interrupted"]
    assert result["restored"] and proc.returncode == 0
    assert f"{name} received, stopping after this batch" in err


@pytest.mark.slow
@pytest.mark.fault
def test_an_extra_signal_from_hookfit_toml_stops_gracefully(tmp_path: Path) -> None:
    """``[plugins.interrupter] extra_signals = ["SIGUSR1"]`` for the discovered interrupter: a
    SIGUSR1 stops the run as a SIGTERM does (``exit = false``: ``fit()`` returns), and the
    handlers are put back at the end."""
    proc = start(tmp_path, config='[plugins.interrupter]\nextra_signals = ["SIGUSR1"]\nexit = false\n')
    proc.send_signal(signal.SIGUSR1)
    result, err = finish(proc)
    assert result["outcome"] == "returned" and result["status"] == "interrupted"
    assert result["reason"] == "SIGUSR1" and result["fit_end"] == ["interrupted"]
    assert result["restored"] and proc.returncode == 0, err
    assert "hookfit: SIGUSR1 received, stopping after this batch\n" in err, err


@pytest.mark.slow
@pytest.mark.fault
def test_second_sigint_aborts_after_fit_end(tmp_path: Path) -> None:
    proc = start(tmp_path, "hold")
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline().strip() == "PENDING"  # the first is pending, its batch not over
    proc.send_signal(signal.SIGINT)
    result, err = finish(proc)
    assert result["outcome"] == "KeyboardInterrupt" and result["status"] == "interrupted"
    assert result["fit_end"] == ["interrupted"] and result["restored"]
    assert "press Ctrl-C again to abort" in err


def test_interrupter_leaves_signal_handlers_alone_off_the_main_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    import signal
    import threading

    monkeypatch.setenv("HOOKFIT_PLUGINS", "interrupter")
    before = signal.getsignal(signal.SIGINT)
    seen, states = [], []

    class Look:
        @hookfit.hookimpl
        def batch_end(self, loop):
            seen.append(signal.getsignal(signal.SIGINT))
            if loop.state.step == 2:
                loop.request_stop("from the worker thread's step")

    worker = threading.Thread(target=lambda: states.append(hookfit.Loop(lambda l, b: None, range(5), plugins=[Look()]).fit()))
    worker.start()
    worker.join(30)
    assert states[0].status == "interrupted" and states[0].stop_reason == "from the worker thread's step"
    assert seen and all(handler is before for handler in seen)



@pytest.mark.fault
@pytest.mark.parametrize("rank, says_so", [(0, True), (1, False)])
def test_only_the_main_process_prints_that_a_signal_was_received(rank: int, says_so: bool,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Under torchrun every rank receives the Ctrl-C: each requests the stop (the ranks agree
    on it), and only the main process (rank 0, ``loop.is_main``) prints the line."""
    from hookfit.plugins.interrupter import Interrupter

    class Rank:  # what the distributed plugin does at configure under torchrun
        name = "rank"

        @hookfit.hookimpl
        def configure(self, loop):
            loop.state.rank, loop.state.world_size = rank, 2

    def step(loop, batch):
        if batch == 1:
            os.kill(os.getpid(), signal.SIGINT)  # handled on this (the main) thread

    before = signal.getsignal(signal.SIGINT)
    state = hookfit.Loop(step, list(range(6)), plugins=[Rank(), Interrupter(exit=False)]).fit()
    assert (state.status, state.stop_reason, state.step) == ("interrupted", "SIGINT", 2)
    assert signal.getsignal(signal.SIGINT) is before
    err = capsys.readouterr().err
    assert ("hookfit: SIGINT received, stopping after this batch; press Ctrl-C again to abort" in err) is says_so, err


@pytest.mark.bad_input
@pytest.mark.parametrize("value", ["no", 1, None])
def test_signals_is_checked_when_it_is_built(value) -> None:
    from hookfit.plugins.interrupter import Interrupter

    with pytest.raises(ValueError, match=rf"^interrupter: signals must be True or False, got {value!r}$"):
        Interrupter(signals=value)


SIGNALS_TO_STOP_ON = ("must be signal names or numbers, such as 'SIGUSR1' or 10, of signals to stop on "
                      r"\(not SIGKILL or SIGSTOP, which cannot be caught, nor SIGCHLD, SIGSEGV, SIGBUS, SIGFPE, "
                      r"SIGILL, SIGABRT, SIGWINCH, SIGURG or SIGCONT\)")


@pytest.mark.bad_input
@pytest.mark.parametrize("value, shown", [
    ("SIGFOO", "'SIGFOO'"), ("SIGKILL", "'SIGKILL'"), ("STOP", "'STOP'"), (signal.SIGKILL.value, "9"),
    ("SIGCHLD", "'SIGCHLD'"), ("SIGSEGV", "'SIGSEGV'"), ("ABRT", "'ABRT'"), (0, "0"), (999, "999"), (1.5, "1.5"),
    (True, "True"), ("SIGWINCH", "'SIGWINCH'"), ("urg", "'urg'"), ("SIGCONT", "'SIGCONT'"),
    ("SIGRTMIN+999", r"'SIGRTMIN\+999'"), ("SIGRTMAX+1", r"'SIGRTMAX\+1'"),
    (None, "None"), (["SIGUSR1", "SIGSTOP"], r"'SIGSTOP' \(in \['SIGUSR1', 'SIGSTOP'\]\)"),
    ([b"SIGUSR1"], r"b'SIGUSR1' \(in \[b'SIGUSR1'\]\)"),
])
def test_extra_signals_is_checked_when_it_is_built(value: Any, shown: str) -> None:
    """A name no signal has, a signal no process can catch or none that asks for a stop (a terminal's resize
    would have stopped the run), or anything but names and numbers: refused when the plugin is built, naming
    the option."""
    from hookfit.plugins.interrupter import Interrupter

    with pytest.raises(ValueError, match=rf"^interrupter: extra_signals {SIGNALS_TO_STOP_ON}, got {shown}$"):
        Interrupter(extra_signals=value)


@pytest.mark.bad_input
def test_extra_signals_in_hookfit_toml_is_checked_naming_the_file(tmp_path: Path) -> None:
    from hookfit.config import Config, ConfigError, build
    from hookfit.plugins.interrupter import Interrupter

    config = Config(path=tmp_path / "hookfit.toml", plugins={"interrupter": {"extra_signals": ["USR1", "KILL"]}})
    with pytest.raises(ConfigError, match=r"hookfit.toml \[plugins.interrupter\]: interrupter: extra_signals "
                                          rf"{SIGNALS_TO_STOP_ON}, got 'KILL' \(in \['USR1', 'KILL'\]\)$"):
        build(config, "interrupter", Interrupter)


@pytest.mark.bad_input
def test_extra_signals_without_signals_are_refused() -> None:
    """``signals=False`` installs no handler: an extra signal given with it would stop nothing, silently."""
    from hookfit.plugins.interrupter import Interrupter

    with pytest.raises(ValueError, match=r"^interrupter: extra_signals must be none with signals=False, which installs "
                                         r"no handler at all \(give signals=True to stop on them\), got 'SIGUSR1'$"):
        Interrupter(signals=False, extra_signals="SIGUSR1")
    assert Interrupter(signals=False).extra_signals == ()


@pytest.mark.parametrize("value, names", [("SIGUSR1", ("SIGUSR1",)), ("usr1", ("SIGUSR1",)),
                                          ("SIGRTMIN+2", ("SIGRTMIN+2",)), ("rtmax-1", (f"SIGRTMIN+{signal.SIGRTMAX - signal.SIGRTMIN - 1}",)),
                                          (int(signal.SIGUSR2), ("SIGUSR2",)),
                                          (["SIGUSR1", signal.SIGUSR1, "SIGTERM", "USR2"], ("SIGUSR1", "SIGUSR2"))])
def test_extra_signals_are_named_once_each(value: Any, names: tuple[str, ...]) -> None:
    """A name (``SIG`` optional, any case) or a number, or several; SIGINT and SIGTERM are handled anyway."""
    from hookfit.plugins.interrupter import Interrupter

    assert Interrupter(extra_signals=value).extra_signals == names


@pytest.mark.fault
@pytest.mark.parametrize("signum, name", [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT")])
@pytest.mark.parametrize("ending", ["exception", "fit_end"])
def test_a_signal_while_the_run_ends_requests_nothing_and_keeps_the_runs_own_outcome(
        ending: str, signum: int, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Under torchrun, the agent sends SIGTERM to the ranks still alive once one failed: it
    may come while this rank's run is failing (its ``exception`` hooks run) or in ``fit_end``.
    There is nothing left to stop: the run keeps its own error (or completes), and the line
    says the signal came while the run ended. It used to raise "request_stop() needs a running
    loop" from the handler, in place of the run's error."""
    from hookfit.plugins.interrupter import Interrupter

    class Signal:
        name = "signal"

        @hookfit.hookimpl
        def exception(self, loop, error):
            if ending == "exception":
                os.kill(os.getpid(), signum)  # handled on this (the main) thread, here

        @hookfit.hookimpl(tryfirst=True)  # before the interrupter puts the old handlers back
        def fit_end(self, loop):
            if ending == "fit_end":
                os.kill(os.getpid(), signum)

    def step(loop, batch):
        if ending == "exception" and batch == 2:
            raise ValueError("the step's own error")

    before = signal.getsignal(signum)
    loop = hookfit.Loop(step, list(range(4)), plugins=[Signal(), Interrupter()])
    if ending == "exception":
        with pytest.raises(ValueError, match="the step's own error"):
            loop.fit()
        status = "failed"
    else:
        loop.fit()
        status = "completed"
    assert (loop.state.status, loop.state.stopped_by) == (status, None)
    assert signal.getsignal(signum) is before
    err = capsys.readouterr().err
    hint = "; press Ctrl-C again to abort" if signum == signal.SIGINT else ""
    assert f"hookfit: {name} received while the run ends ({status}){hint}\n" in err, err
    assert "needs a running loop" not in err and "stopping after this batch" not in err, err


@pytest.mark.fault
def test_a_second_sigint_while_the_run_fails_aborts_and_fit_end_still_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """A failing run's ``exception`` hooks may take long (a checkpoint saved on failure): the
    first Ctrl-C says the run is ending, the second aborts them with ``KeyboardInterrupt``, and
    ``fit_end`` still runs, with the handlers put back and the run's own error kept as the
    abort's context."""
    from hookfit.plugins.interrupter import Interrupter

    ended: list[str] = []

    class Slow:
        name = "slow"

        @hookfit.hookimpl
        def exception(self, loop, error):
            os.kill(os.getpid(), signal.SIGINT)
            ended.append("said")
            os.kill(os.getpid(), signal.SIGINT)
            ended.append("not aborted")

        @hookfit.hookimpl
        def fit_end(self, loop):
            ended.append(loop.state.status)

    def step(loop, batch):
        raise ValueError("the step's own error")

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt, match="second SIGINT: aborting") as caught:
        hookfit.Loop(step, list(range(4)), plugins=[Slow(), Interrupter()]).fit()
    assert isinstance(caught.value.__context__, ValueError)
    assert ended == ["said", "failed"]
    assert signal.getsignal(signal.SIGINT) is before
    assert "hookfit: SIGINT received while the run ends (failed); press Ctrl-C again to abort" in capsys.readouterr().err


@pytest.mark.fault
def test_a_first_sigint_after_a_stop_asked_elsewhere_stops_gracefully(capsys: pytest.CaptureFixture[str]) -> None:
    """Under torchrun a rank's SIGINT may be handled after the stop another rank asked reached
    it (its main thread was inside a collective): the stop is already requested, and this
    process's first SIGINT is still a first one, not the second that aborts."""
    from hookfit.plugins.interrupter import Interrupter

    def step(loop, batch):
        if batch == 1:
            loop.request_stop("asked on another rank", by="distributed")
            os.kill(os.getpid(), signal.SIGINT)  # handled on this (the main) thread, here

    loop = hookfit.Loop(step, list(range(4)), plugins=[Interrupter(exit=False)])
    loop.fit()
    assert (loop.state.status, loop.state.stop_reason) == ("interrupted", "asked on another rank")
    assert loop.state.step == 2
    assert "hookfit: SIGINT received, stopping after this batch; press Ctrl-C again to abort" in capsys.readouterr().err


@pytest.mark.fault
@pytest.mark.parametrize("by", ["interrupter", "interrupter, early_stopping"])
def test_a_rank_whose_signal_comes_after_the_agreed_stop_it_asked_too_ends_as_signalled(
        by: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Under torchrun each rank gets the SIGINT, one after the other: the ranks may agree on
    the stop the first rank's signal asked (``stopped_by`` the interrupter) before this rank's
    own SIGINT is handled, in its ``fit_end``. That SIGINT is this process's first: it says so as
    a first one (not "while the run ends"), and ``fit()`` ends the process as the signal would,
    as on the rank that asked; a second one would abort."""
    from hookfit.plugins.interrupter import Interrupter

    class Late:
        name = "late"

        @hookfit.hookimpl(tryfirst=True)  # before the interrupter puts the old handlers back
        def fit_end(self, loop):
            os.kill(os.getpid(), signal.SIGINT)  # handled on this (the main) thread, here

    def step(loop, batch):
        if batch == 1:  # what the agreement of the ranks leaves on this one
            loop.request_stop("stop requested on rank 1: SIGINT", by=by)  # (the ranks' askers, joined)

    loop = hookfit.Loop(step, list(range(4)), plugins=[Late(), Interrupter()])
    with pytest.raises(KeyboardInterrupt, match="the run stopped gracefully"):
        loop.fit()
    assert (loop.state.status, loop.state.stopped_by, loop.state.step) == ("interrupted", by, 2)
    err = capsys.readouterr().err
    assert err.count("hookfit: SIGINT received, stopping after this batch; press Ctrl-C again to abort\n") == 1, err
    assert "while the run ends" not in err, err


@pytest.mark.fault
def test_a_ctrl_c_whose_line_cannot_be_written_still_stops_gracefully(monkeypatch: pytest.MonkeyPatch) -> None:
    """``python train.py 2>&1 | tee log``: Ctrl-C ends ``tee`` too, so the interrupter's line
    meets a broken pipe. The stop it asked stands: the run ends ``interrupted`` after the batch
    (its stop checkpoint written where one is configured), not ``failed`` by a BrokenPipeError."""
    from hookfit.plugins.interrupter import Interrupter

    class Gone:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    def step(loop, batch):
        if batch == 1:
            monkeypatch.setattr("sys.stderr", Gone())
            os.kill(os.getpid(), signal.SIGINT)  # handled on this (the main) thread, here

    state = hookfit.Loop(step, list(range(6)), plugins=[Interrupter(exit=False)]).fit()
    monkeypatch.undo()
    assert (state.status, state.stop_reason, state.step) == ("interrupted", "SIGINT", 2)


@pytest.mark.parametrize("rank", [0, 1])
def test_under_torchrun_only_rank_0_prints_the_keyboard_interrupt_that_every_rank_raises(
        rank: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank's ``fit()`` raises the ``KeyboardInterrupt`` of a graceful Ctrl-C; left uncaught,
    Python prints it through ``sys.excepthook``: on a rank other than 0 that one exception is not
    printed (rank 0 prints the same traceback), any other still is, and rank 0 keeps its hook."""
    from hookfit.plugins.interrupter import Interrupter

    printed: list[BaseException] = []

    def hook(kind: type[BaseException], error: BaseException, traceback: Any) -> None:
        printed.append(error)

    monkeypatch.setattr(sys, "excepthook", hook)

    class Rank:  # what the distributed plugin does at configure under torchrun
        name = "rank"

        @hookfit.hookimpl
        def configure(self, loop):
            loop.state.rank, loop.state.world_size = rank, 2

    def step(loop, batch):
        if batch == 1:
            os.kill(os.getpid(), signal.SIGINT)  # handled on this (the main) thread, here

    with pytest.raises(KeyboardInterrupt, match="the run stopped gracefully") as caught:
        hookfit.Loop(step, list(range(6)), plugins=[Rank(), Interrupter()]).fit()
    assert (sys.excepthook is hook) is (rank == 0)
    other = ValueError("another error")
    for error in (caught.value, other):
        sys.excepthook(type(error), error, error.__traceback__)
    assert printed == ([caught.value, other] if rank == 0 else [other])
