"""The terminal the dashboard runs in: whether there is one to use, and the capture of what the
run prints while the dashboard is up (kept in the run's ``output.log``)."""

from __future__ import annotations

import collections
import faulthandler
import importlib.util
import os
import select
import sys
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from hookfit.errors import user_level
from hookfit.files import FileWarning

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

ENV_OFF = "HOOKFIT_NO_TUI"
OUTPUT_LOG = "output.log"
"""The file in the run folder that keeps what the run printed while the dashboard was up."""
NO_URWID = "urwid is not installed (pip install urwid, or the tui extra: pip install 'hookfit[tui]')"
"""What :func:`interactive_terminal` answers on a terminal where urwid cannot be imported."""
UNDER_TORCHRUN = ("torchrun's worker processes do not own the terminal (it starts them in a process group of their "
                  "own)")
"""What it answers in a worker of ``torchrun`` started from a terminal."""


def interactive_terminal() -> str | None:
    """``None`` when a dashboard can run here, else the reason it cannot."""
    if os.environ.get(ENV_OFF):
        return f"{ENV_OFF} is set"
    if os.environ.get("CI"):
        return "CI is set"
    term = os.environ.get("TERM", "")
    if not term or term == "dumb":
        return f"TERM is {term or 'unset'}"
    for name, stream in (("stdin", sys.stdin), ("stdout", sys.stdout)):
        try:
            if stream is None or not stream.isatty():
                return f"{name} is not a terminal"
        except (AttributeError, ValueError):
            return f"{name} is not a terminal"
    try:
        if os.tcgetpgrp(sys.stdout.fileno()) != os.getpgrp():
            return UNDER_TORCHRUN if os.environ.get("TORCHELASTIC_RUN_ID") else "the process runs in the background"
    except OSError:
        return "the terminal's process group is unknown"
    if threading.current_thread() is not threading.main_thread():
        return "fit() does not run on the main thread"
    try:
        found = importlib.util.find_spec("urwid") is not None
    except (ImportError, ValueError):  # a parent package or a module entry that cannot be imported
        found = False
    return None if found else NO_URWID


def without_terminal(plugin: object, chosen: bool, loop: object = None) -> str | None:
    """The dashboard's answer to :func:`hookfit.discovery.inert` for a run (``loop``), before its ``configure``:
    merely discovered, it takes no part where no terminal shows it (output piped, CI, ``TERM`` unset), and the
    run's start line does not list it; on a terminal it cannot draw on (no urwid, a ``torchrun`` worker) it stays,
    to say so at ``fit_start``. ``hookfit plugins`` (no ``loop``: its own output is not a run's) lists it active."""
    reason = interactive_terminal()
    if chosen or loop is None or reason is None or reason in (NO_URWID, UNDER_TORCHRUN):
        return None
    return f"a terminal to draw on (here {reason})"


def output_file(loop: Run, owner: str) -> Path | None:
    """``<run_dir>/output.log`` on the main process; ``None`` (with one ``FileWarning``)
    when the run folder cannot be created."""
    if not loop.is_main:
        return None
    try:
        return loop.run_dir / OUTPUT_LOG
    except OSError as error:
        warnings.warn(f"{owner}: could not create the run folder for {OUTPUT_LOG} "
                      f"({type(error).__name__}: {error}); the output shows on the terminal "
                      f"afterwards, without the file", FileWarning, stacklevel=user_level())
        return None


class OutputCapture:
    """File descriptors 1 and 2 redirected into a pipe while the dashboard is up, so ``print``,
    logging, warnings, C libraries and child processes cannot scribble over it.

    A daemon thread reads the pipe as output arrives and, for each chunk, in this order:
    appends it to ``path`` (the run's ``output.log``; written and in the kernel at once, so a
    ``kill -9`` loses nothing printed before it was read), keeps it for the replay, and splits
    it into lines for the log pane (:meth:`lines`). Nothing a program prints ever waits for a
    disk: a full disk or a read-only folder only stops the file (the first error is kept in
    ``failed``; :meth:`warn_failure` reports it once with a :class:`hookfit.files.FileWarning`,
    from a thread that does not read the pipe), and ``print`` never raises because of it.

    ``terminal`` is a writable copy of the original stdout for the screen to draw on. While the
    capture is up, ``faulthandler`` writes fatal errors (a segmentation fault, an abort) to a
    copy of the original stderr, the real terminal; the previous setting (off, or on standard
    error) comes back with :meth:`restore`. :meth:`suspend` and :meth:`resume` give the
    terminal back for a while (a debugger) and take it again. :meth:`restore` puts the
    descriptors back, waits for what was printed before, and writes it to the terminal (the
    last ``replay_limit`` bytes, with a line naming the file for the rest). Idempotent.
    """

    replay_limit = 4 << 20

    def __init__(self, path: str | os.PathLike[str] | None = None, owner: str = "tui") -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self.path = Path(path) if path is not None else None
        self.owner = owner
        self.failed: OSError | None = None
        self._warned = False
        self._file: int | None = None
        self._kept = bytearray()  # for the replay; frozen once restore() has drained the pipe
        self._dropped = 0
        self._partial = b""
        self._lines: collections.deque[str] = collections.deque(maxlen=1000)
        self._drained = threading.Event()
        self._frozen = False
        self._lock = threading.Lock()
        self._pump_done = False
        opened: list[int] = []
        try:
            self._saved: tuple[int, int] | None = (os.dup(1), os.dup(2))
            opened.extend(self._saved)
            self._read, self._write = os.pipe()
            opened += [self._read, self._write]
            self._wake_read, self._wake_write = os.pipe()
            opened += [self._wake_read, self._wake_write]
            os.set_blocking(self._read, False)
            self._fault = os.dup(self._saved[1])
            opened.append(self._fault)
            self.terminal: TextIO | None = os.fdopen(os.dup(self._saved[0]), "w", encoding="utf-8", errors="replace")
        except BaseException:
            for fd in opened:
                os.close(fd)
            raise
        self._thread = threading.Thread(target=self._pump, name="hookfit-tui-output", daemon=True)
        self._thread.start()
        self._fault_before = faulthandler.is_enabled()
        # the current thread only: the alternate screen has no scrollback, and a short report
        # keeps its first line ("Fatal Python error: ...") on screen
        faulthandler.enable(file=self._fault, all_threads=False)
        os.dup2(self._write, 1)
        os.dup2(self._write, 2)
        self.suspended = False

    # -- the pipe's reader (its own thread) ------------------------------------------------------
    def _pump(self) -> None:
        """Read the pipe until its end (every writer gone); drain it when restore() asks."""
        read, wake = self._read, self._wake_read
        poll = select.poll()  # (not select(): a process may hold more than 1024 descriptors)
        poll.register(read, select.POLLIN)
        poll.register(wake, select.POLLIN)
        try:
            while True:
                ready = {fd for fd, _ in poll.poll()}
                if read in ready and not self._take_available():
                    break  # end of file: no writer left
                if wake in ready:
                    os.read(wake, 64)
                    ended = not self._take_available()  # everything printed before restore()
                    self._frozen = True
                    self._drained.set()
                    if ended:
                        break
        finally:
            self._frozen = True
            self._drained.set()
            self._close_file()
            with self._lock:
                self._pump_done = True
                for fd in (self._read, self._wake_read, self._wake_write):
                    os.close(fd)

    def _take_available(self) -> bool:
        """Read until the pipe is empty; ``False`` at its end."""
        while True:
            try:
                data = os.read(self._read, 65536)
            except BlockingIOError:
                return True
            except InterruptedError:
                continue
            if not data:
                return False
            try:
                self._take(data)
            except Exception:  # noqa: BLE001 - never stop reading: writers would block on a full pipe
                pass

    def _take(self, data: bytes) -> None:
        if self.path is not None and self.failed is None:
            self._append(self.path, data)
        if not self._frozen:
            kept = self._kept
            kept += data
            if len(kept) > self.replay_limit:
                cut = len(kept) - self.replay_limit
                newline = kept.find(b"\n", cut)
                cut = newline + 1 if 0 <= newline < cut + 4096 else cut
                del kept[:cut]
                self._dropped += cut
            text = self._partial + data
            end = text.rfind(b"\n") + 1
            if end == 0 and len(text) < 65536:
                self._partial = text
                return
            end = end or len(text)
            self._partial = text[end:]
            lines = text[:end].decode("utf-8", errors="replace").splitlines()
            self._lines.extend(line for line in lines if line.strip())

    def _append(self, path: Path, data: bytes) -> None:
        """The run's file policy (as :class:`hookfit.files.RunFile`), without the warning,
        which this thread cannot give: it would be written into the pipe it reads."""
        try:
            if self._file is None:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._file = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            view = memoryview(data)
            while view:
                view = view[os.write(self._file, view):]
        except OSError as error:
            self.failed = error
            self._close_file()

    def _close_file(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            try:
                os.close(file)
            except OSError:
                pass

    # -- for the dashboard ----------------------------------------------------------------------
    def lines(self) -> list[str]:
        """The complete, non-blank lines printed since the last call (a partial last line
        waits for its end, unless 64 KiB came without one)."""
        out = []
        pop = self._lines.popleft
        while self._lines:
            out.append(pop())
        return out

    def warn_failure(self) -> None:
        """Warn once (``FileWarning``) if the file failed; call it from a thread other than the
        pipe's reader (the warning may be printed into the pipe)."""
        if self.failed is None or self._warned:
            return
        self._warned = True
        error = self.failed
        warnings.warn(
            f"{self.owner}: could not write {self.path} ({type(error).__name__}: {error}); it is "
            f"left as it is and training goes on without it (the output still shows in the log "
            f"pane and on the terminal afterwards)",
            FileWarning,
            stacklevel=user_level(),
        )

    def suspend(self) -> None:
        """Give descriptors 1 and 2 back to the terminal for a while (a debugger's prompt)."""
        if self._saved is not None and not self.suspended:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(self._saved[0], 1)
            os.dup2(self._saved[1], 2)
            self.suspended = True

    def resume(self) -> None:
        """Capture again after :meth:`suspend`."""
        if self._saved is not None and self.suspended:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(self._write, 1)
            os.dup2(self._write, 2)
            self.suspended = False

    def restore(self, timeout: float = 5.0) -> None:
        """Put file descriptors 1 and 2 back and replay what was captured."""
        if self._saved is None:
            return
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)
        for fd in self._saved:
            os.close(fd)
        self._saved = None
        self.suspended = False
        with self._lock:  # ask the reader to drain what was printed so far
            if not self._pump_done:
                try:
                    os.write(self._wake_write, b"x")
                except OSError:
                    pass
        self._drained.wait(timeout)
        # The reader goes on until no child process (a data loader's worker, say) holds a copy
        # of the pipe, so late output still reaches the file and nobody writes to a closed pipe.
        os.close(self._write)
        self._restore_faulthandler()
        if self.terminal is not None:
            self.terminal.close()
            self.terminal = None
        self._replay()

    def _restore_faulthandler(self) -> None:
        if self._fault_before:
            faulthandler.enable(file=2, all_threads=True)  # (standard error)
        else:
            faulthandler.disable()
        os.close(self._fault)

    def _replay(self) -> None:
        captured = bytes(self._kept)
        self._kept = bytearray()
        if self._dropped:
            where = f"in {self.path}" if self.path is not None and self.failed is None else "not kept"
            captured = (f"[hookfit: the first {self._dropped} bytes the run printed are {where}]\n".encode()
                        + captured)
        view = memoryview(captured)
        while view:
            try:
                view = view[os.write(1, view):]
            except InterruptedError:
                continue
            except OSError:
                break  # the terminal is gone: nothing to show it on
