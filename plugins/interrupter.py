"""interrupter: SIGINT and SIGTERM (and the signals ``extra_signals`` names) become graceful stop requests.

* First SIGINT (Ctrl-C) or SIGTERM: ``loop.request_stop("SIGINT")`` (or ``"SIGTERM"``) and a
  line on stderr saying what happens (from the main process only, ``loop.is_main``: under
  ``torchrun`` every rank receives the signal and requests the stop, one line says so; in a
  Jupyter kernel, where the interrupt button sends the SIGINT, it says to interrupt again); the
  run stops at the next boundary (after the current batch) and ends ``interrupted``. Stopping
  itself is the core's: this plugin only turns signals into requests, like any other plugin or
  the step function may.
* A SIGINT while a stop is already pending (from a signal, the dashboard's ``q`` or anything
  else) aborts at once with ``KeyboardInterrupt`` (``fit_end`` still runs, with status
  ``interrupted``).
* A signal while the run is already ending (it failed and its ``exception`` hooks run, or
  ``fit_end`` runs) requests nothing, since there is nothing left to stop: the run's own error
  stays the one raised. Except under ``torchrun`` when the run ends by the stop another rank's
  signal asked (the ranks agreed on it before this rank's signal came, the same Ctrl-C): that
  signal is this process's first, said as one, and the process ends as a signalled one. The first says so (a SIGINT: interrupt again to abort); a second SIGINT
  aborts. Under ``torchrun`` this is the agent's SIGTERM to the ranks still alive after one
  failed.
* Handlers are installed at ``fit_start`` only on the main thread and the previous ones are put
  back at ``fit_end``, so a notebook or a host application keeps its own.
* The signals are the main process's: a Ctrl-C or a job scheduler's SIGTERM reaches the whole
  process group, ``DataLoader`` workers included. While the handlers are on, the workers of the
  run's ``DataLoader`` objects (``num_workers > 0``, training and validation data) ignore both
  (:class:`Shielded`, their ``worker_init_fn`` for the run; the loader's own runs after it), so
  they keep feeding the batch the stop waits for, and the main process ends them as it ends
  the stage; once the run is over a SIGTERM ends a worker at once again, as torch's handler
  does (Python's exit terminates the workers a run left, then joins them). A forked worker is
  shielded from the fork on (the handler it inherited knows it by the loader's code on its
  stack); one still starting under spawn or forkserver is not shielded yet: torch's handler
  ends it, and the run fails. Any other child forked during the run takes the signal as it
  would have without the handlers it inherited.
* A run stopped by a signal ends its process the way the signal unhandled would, once the
  stop is graceful and over (the last batch, the checkpoint, ``fit_end``, ``results`` and
  ``run.jsonl``'s end line): ``fit()`` then raises ``KeyboardInterrupt`` for SIGINT (exit
  status 130 where the script does not catch it) and ``SystemExit(143)`` for SIGTERM, so a
  shell, a job scheduler or ``torchrun`` tells an interrupted run from a finished one.
  ``Interrupter(exit=False)`` makes ``fit()`` return the interrupted run's state instead; in a
  Jupyter kernel it returns unless given ``exit=True`` (the kernel keeps running either way). Under ``torchrun`` every rank
  raises it, and only rank 0's traceback is printed: on the other ranks the
  ``KeyboardInterrupt`` left uncaught ends the process as it would (killed by SIGINT) without
  printing the same lines again (a wrapper of ``sys.excepthook`` passes every other exception
  on); a script that catches it gets it on every rank.
* ``Interrupter(extra_signals=("SIGUSR1",))`` (names, with or without ``SIG``, or numbers; or
  ``extra_signals = ["SIGUSR1"]`` in ``hookfit.toml``'s ``[plugins.interrupter]``) makes more
  signals graceful stops: a job scheduler's early warning before its kill (SLURM's
  ``#SBATCH --signal=USR1@90``). Each is a SIGTERM under another name: the stop request
  (``loop.request_stop("SIGUSR1")``, one that ends the process), the line on stderr, the
  workers shielded from it while the run is on (a forked worker's inherited handler too), and
  ``fit()`` raising ``SystemExit(128 + signum)`` once the run is over (138 for SIGUSR1), unless
  ``exit=False``; handlers put back at ``fit_end``. As after a SIGTERM, a second one (or a
  SIGTERM after it, SLURM's at the time limit) changes nothing: the stop goes on and the
  process ends with the first signal's status; only a second SIGINT aborts. A signal the
  process cannot catch (SIGKILL, SIGSTOP) or that asks for no stop (SIGCHLD, a child's end;
  SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, the process's own faults; SIGWINCH, SIGURG, SIGCONT, which a
  terminal, a socket or job control send in passing) is refused when the plugin is built, as is an extra
  signal with ``signals=False``. A real-time signal is named ``"SIGRTMIN+2"``, as shown. Once the run is over a shielded worker takes an extra signal as it did before it was
  shielded.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

from hookfit import hookimpl
from hookfit.config import records_options
from hookfit.loop import end_with
from hookfit.plugins.support import flag, option_error
from hookfit.plugins.support.options import is_int

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run


@records_options
class Interrupter:
    """Turns SIGINT and SIGTERM into stop requests; a second SIGINT aborts. ``signals=False``
    installs no handlers. ``exit=True``: a run stopped by a signal makes ``fit()`` raise once it
    is over, ``KeyboardInterrupt`` for SIGINT and ``SystemExit(143)`` for SIGTERM, so the process
    ends as the signal would have ended it; ``exit=False`` has ``fit()`` return the interrupted
    run's state; the default, ``None``, is ``True`` in a script and ``False`` in a Jupyter kernel
    (a notebook's interrupt stops the cell's run, not the cells after it). ``extra_signals`` (default none): more
    signals that stop the run as SIGTERM does, by name (``"SIGUSR1"`` or ``"USR1"``) or number,
    one or several; ``fit()`` then raises ``SystemExit(128 + signum)``. ``self.extra_signals``
    holds their names."""

    name = "interrupter"

    def __init__(self, signals: bool = True, exit: bool | None = None,
                 extra_signals: str | int | Iterable[str | int] = ()) -> None:
        self.signals = flag(self.name, "signals", signals)
        self.exit = flag(self.name, "exit", exit, none=True)
        self._extra = _extra_signals(self.name, "extra_signals", extra_signals)  # SIGINT and SIGTERM left out
        self.extra_signals: tuple[str, ...] = tuple(_signal_name(signum) for signum in self._extra)
        if self._extra and not self.signals:
            raise option_error(self.name, "extra_signals", extra_signals, "be none with signals=False, which installs "
                               "no handler at all (give signals=True to stop on them)")
        self._previous: dict[int, Any] = {}
        self._loop: Run | None = None
        self._ending_said = False  # a signal came while the run was ending, and was said
        self._stopped_by: int | None = None  # the signal that asked this run to stop
        self._pid = os.getpid()  # the process whose handlers these are (a forked child inherits them)
        self._shielded: list[tuple[Any, Any]] = []  # (DataLoader, its own worker_init_fn) for the run
        self._running: list[Any] = []  # events set while the run is on, one a start method (see Shielded)

    @hookimpl
    def fit_start(self, loop: Run) -> None:
        self._loop = loop
        if self.signals and threading.current_thread() is threading.main_thread():
            self._pid = os.getpid()
            for signum in (signal.SIGINT, signal.SIGTERM, *self._extra):
                self._previous[signum] = signal.signal(signum, self._on_signal)
            running: dict[int, Any] = {}  # by the loader's start method's context (events go to its workers)
            for loader in _loaders(loop.train_data, loop.val_data):
                context = _context(loader)
                if id(context) not in running:
                    running[id(context)] = context.Event()
                    running[id(context)].set()
                self._shielded.append((loader, loader.worker_init_fn))
                loader.worker_init_fn = Shielded(loader.worker_init_fn, running[id(context)], self._extra)
            self._running = list(running.values())

    @hookimpl(trylast=True)  # last: what the other plugins do at the end is done before the process ends
    def fit_end(self, loop: Run) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        for loader, init in self._shielded:
            loader.worker_init_fn = init
        self._shielded.clear()
        # the run is over: a SIGTERM ends its workers again (Python's exit), an extra signal does what it did before
        for running in self._running:
            running.clear()
        self._running = []
        stopped_by, self._stopped_by = self._stopped_by, None
        self._loop, self._ending_said = None, False
        if stopped_by is not None and loop.state.status == "interrupted" and (
                not _in_kernel() if self.exit is None else self.exit):
            ending = _ending(stopped_by)
            if not loop.is_main:  # under torchrun: rank 0 prints the traceback every rank has
                _Unprinted.install(ending)
            end_with(loop, ending)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        loop = self._loop
        name = _signal_name(signum)
        if loop is None:  # pragma: no cover - handlers exist only while a loop is set
            return
        if os.getpid() != self._pid:  # a child forked during the run
            if _forked_by_a_loader(frame):  # a worker its Shielded init has not reached yet: shielded already
                # (an extra signal as a SIGTERM: ignored while the run is on, then the worker's end)
                if signum != signal.SIGINT and not any(running.is_set() for running in self._running):
                    os._exit(0)
                return
            signal.signal(signum, self._previous.get(signum) or signal.SIG_DFL)  # as without the handler it inherited
            os.kill(os.getpid(), signum)
            return
        # "second": this process's own second signal; a stop another rank or plugin asked
        # first (under torchrun a rank's signal may land after the agreed stop) is not one
        if signum == signal.SIGINT and (self._stopped_by is not None or self._ending_said):
            raise KeyboardInterrupt(f"second {name}: aborting")
        state = loop.state
        askers = (state.stopped_by or "").split(", ")  # (several askers are joined: "interrupter, early_stopping")
        if state.status == "interrupted" and loop.pm.get_name(self) in askers and self._stopped_by is None:
            # under torchrun: the ranks agreed on the stop another rank's signal asked before this
            # rank's own (the same Ctrl-C) came; it is this process's first, and ends it as such
            self._stopped_by = signum
            self._say(loop, signum, f"hookfit: {name} received, stopping after this batch")
            return
        if state.status != "running":  # ending: nothing to stop, the run's error stays its own
            self._say(loop, signum, f"hookfit: {name} received while the run ends ({loop.state.status})")
            self._ending_said = True
            return
        # the core honours it; the event tells the dashboard; a SIGTERM (or an extra signal) is a
        # scheduler's: the process ends after. A second one while the stop is pending asks nothing more.
        loop.request_stop(name, ends_process=signum != signal.SIGINT)
        if self._stopped_by is None:
            self._stopped_by = signum
        self._say(loop, signum, f"hookfit: {name} received, stopping after this batch")

    @staticmethod
    def _say(loop: Run, signum: int, line: str) -> None:
        if loop.is_main:  # under torchrun every rank gets the signal: one line is enough
            again = "interrupt the kernel again" if _in_kernel() else "press Ctrl-C again"
            hint = f"; {again} to abort" if signum == signal.SIGINT else ""
            try:
                print(f"{line}{hint}", file=sys.stderr, flush=True)
            except (OSError, ValueError):  # stderr gone (the `| tee` a Ctrl-C also ended, closed): the stop stands
                pass


class Shielded:
    """A ``DataLoader``'s ``worker_init_fn`` during a run with the interrupter's handlers: while the
    event ``running`` is set the worker ignores SIGINT, SIGTERM and the ``extra`` signals (the
    process group's: the main process stops the run and ends its workers); once it is cleared
    (``fit_end``) a SIGTERM ends the worker at once, as torch's own handler does for its parent's
    (Python's exit terminates its daemonic children, then joins them), and an extra signal goes
    to what the worker had for it before (put back, then the signal sent again). Then the
    loader's own ``init`` runs. Python handlers, not ignored dispositions or blocked signals: a
    program the worker starts gets neither. Picklable as the loader's own ``init`` is (the spawn
    and forkserver start methods)."""

    def __init__(self, init: Callable[[int], Any] | None, running: Any, extra: Iterable[int] = ()) -> None:
        self.init, self.running, self.extra = init, running, tuple(extra)
        self._previous: dict[int, Any] = {}  # an extra signal's handler before this one, in the worker

    def __call__(self, worker_id: int) -> None:
        signal.signal(signal.SIGINT, self._signalled)
        signal.signal(signal.SIGTERM, self._signalled)
        for signum in self.extra:
            self._previous[signum] = signal.signal(signum, self._signalled)
        if self.init is not None:
            self.init(worker_id)

    def _signalled(self, signum: int, frame: FrameType | None) -> None:
        if self.running.is_set():
            return
        if signum == signal.SIGTERM:
            os._exit(0)
        if signum in self._previous:
            previous = self._previous.pop(signum)
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
            os.kill(os.getpid(), signum)


def _forked_by_a_loader(frame: FrameType | None) -> bool:
    """Whether this forked child is a data loader's worker (torch's ``DataLoader``, torchdata's): on the
    stack it inherited, the code that started the process (the first frame outside ``multiprocessing``
    beyond its innermost fork) is a loader's iterator starting its workers (its ``__init__``), not a
    ``Pool`` a dataset or a worker made, nor a plain ``os.fork()``."""
    while frame is not None and frame.f_globals.get("__name__") != "multiprocessing.popen_fork":
        frame = frame.f_back
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith("multiprocessing."):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_name == "__init__" and str(
        frame.f_globals.get("__name__", "")).startswith(("torch.utils.data.", "torchdata."))


# signals no run stops on: those no process can catch, a child's end, the process's own faults, and those a terminal
# or socket sends in passing (a window resized, urgent data, a job continued)
_REFUSED = tuple(getattr(signal, name) for name in ("SIGKILL", "SIGSTOP", "SIGCHLD", "SIGSEGV", "SIGBUS", "SIGFPE",
                                                   "SIGILL", "SIGABRT", "SIGWINCH", "SIGURG", "SIGCONT")
                 if hasattr(signal, name))


def _extra_signals(plugin: str, option: str, value: Any) -> tuple[int, ...]:
    """The signal numbers ``value`` names (a name, with or without ``SIG``, or a number; or an
    iterable of them), in order, once each, SIGINT and SIGTERM left out (handled anyway); a bad
    one (an unknown name, one of :data:`_REFUSED`) is :func:`option_error`, naming it."""
    must = ("be signal names or numbers, such as 'SIGUSR1' or 10, of signals to stop on (not SIGKILL or SIGSTOP, "
            "which cannot be caught, nor SIGCHLD, SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGWINCH, SIGURG or "
            "SIGCONT)")
    items: Any = (value,) if isinstance(value, (str, int)) else value
    try:
        items = list(items)
    except TypeError:
        raise option_error(plugin, option, value, must) from None
    out: list[int] = []
    for item in items:
        signum = _signal_number(item)
        if signum is None or signum in _REFUSED:
            raise option_error(plugin, option, value, must,
                               shown=None if item is value else f"{item!r} (in {value!r})")
        if signum not in (signal.SIGINT, signal.SIGTERM, *out):
            out.append(signum)
    return tuple(out)


def _signal_number(item: Any) -> int | None:
    """The number of the signal ``item`` names (``"SIGUSR1"``, ``"usr1"``, ``"SIGRTMIN+2"``, ``10``), else ``None``."""
    if isinstance(item, str):
        name = item.strip().upper()
        name = name if name.startswith("SIG") else "SIG" + name
        if (real_time := re.fullmatch(r"SIGRT(MIN|MAX)([+-]\d+)", name)) and hasattr(signal, "SIGRTMIN"):
            signum = getattr(signal, "SIGRT" + real_time[1]) + int(real_time[2])
            return signum if signal.SIGRTMIN <= signum <= signal.SIGRTMAX else None
        try:
            return int(signal.Signals[name])
        except KeyError:
            return None
    if is_int(item) and item in signal.valid_signals():
        return int(item)
    return None


def _signal_name(signum: int) -> str:
    """``"SIGUSR1"``; a real-time signal without a name of its own as ``"SIGRTMIN+2"``."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"SIGRTMIN+{signum - signal.SIGRTMIN}" if hasattr(signal, "SIGRTMIN") else f"signal {signum}"


def _context(loader: Any) -> Any:
    """The multiprocessing context that starts ``loader``'s workers (torch turns a name given into one)."""
    import multiprocessing

    return loader.multiprocessing_context or multiprocessing.get_context()


def _loaders(*data: Any) -> Iterator[Any]:
    """The ``DataLoader`` objects with workers among ``data`` (a validation's sets by name included)."""
    from torch.utils.data import DataLoader

    for item in data:
        for one in item.values() if isinstance(item, Mapping) else (item,):
            if isinstance(one, DataLoader) and one.num_workers > 0 and not isinstance(one.worker_init_fn, Shielded):
                yield one


def _ending(signum: int) -> BaseException:
    """What ``fit()`` raises after a graceful stop asked by ``signum``: what Python makes of
    the signal unhandled (``KeyboardInterrupt`` for SIGINT: exit status 130 when uncaught), or
    an exit with 128 + the signal's number (143 for SIGTERM), as a shell reports a process
    ended by it."""
    if signum == signal.SIGINT:
        return KeyboardInterrupt("SIGINT: the run stopped gracefully (Interrupter(exit=False) returns instead)")
    return SystemExit(128 + signum)


class _Unprinted:
    """``sys.excepthook`` of a rank other than 0 that ends as a signal asked (:func:`_ending`):
    that exception, left uncaught, is not printed (rank 0 prints the same); any other goes to
    the hook this one wraps (torch's, which prefixes the rank, or Python's)."""

    def __init__(self, error: BaseException, hook: Any) -> None:
        self.error, self.hook = error, hook

    def __call__(self, kind: type[BaseException], error: BaseException, traceback: TracebackType | None) -> None:
        if error is not self.error:
            self.hook(kind, error, traceback)

    @classmethod
    def install(cls, error: BaseException) -> None:
        """Leave ``error`` unprinted: one wrapper a process, for the ending of its latest run."""
        hook = sys.excepthook
        if isinstance(hook, cls):
            hook.error = error
        else:
            sys.excepthook = cls(error, hook)


def _in_kernel() -> bool:
    """Whether this process is a Jupyter kernel (ipykernel's application is running), where a
    SIGINT comes from the notebook's interrupt button, not from Ctrl-C."""
    app = sys.modules.get("ipykernel.kernelapp")
    return app is not None and bool(app.IPKernelApp.initialized())
