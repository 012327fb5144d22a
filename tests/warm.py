"""Warm interpreters for the suite's child processes and for the ranks of its ``torchrun`` jobs.

A child's first seconds go to importing ``torch`` and ``torch._dynamo`` (every optimizer imports
it): about 2.9 CPU-seconds a process before its first batch. The suite starts several hundred
such processes, and on two cores those seconds were most of its time. So each pytest worker
keeps one **zygote** (:func:`start`, from ``conftest.py``): an interpreter that has imported
torch, torch._dynamo and NumPy and done nothing else (no tensor operation ran in it, so no OpenMP
thread pool exists that a fork would break). A child is a fork of it that starts as
``python [-u] [-B] script|-m module|-c code ARGS`` would start: ``sys.argv``, ``sys.orig_argv``,
``__main__`` and its absolute ``__file__``, ``sys.path[0]``, fresh standard streams on the
descriptors it was given, the environment, working folder and umask, default signal handlers, a
new session when asked, ``OMP_NUM_THREADS``, ``PYTHONFAULTHANDLER``; and it ends as the
interpreter ends (non-daemon threads joined, ``atexit`` run, streams flushed, an uncaught
exception's traceback from the script's own frames, an uncaught ``KeyboardInterrupt`` a death by
SIGINT). Two ways in:

* :class:`Popen` / :func:`run`, for the tests' own ``[sys.executable, script, ...]`` children:
  the zygote forks twice and the middle process exits while this process is a child subreaper
  (``PR_SET_CHILD_SUBREAPER``), so the child is this process's own: its ``pid``, signals,
  ``kill()``, ``wait()`` and exit status are a child's.
* ``PYTHON_EXEC``, for ``torchrun``'s ranks (``torch.distributed.run`` starts each with
  ``$PYTHON_EXEC -u script ...``): a stdlib-only **relay** started with ``-IS`` (about 30 ms)
  hands its command line, environment and standard streams to the zygote, forwards the
  signals it receives to the rank, and ends as the rank ended (the same code, or killed by the
  same signal). If the relay is killed with SIGKILL, the zygote kills the rank.

What differs from a fresh interpreter, by design: the modules the zygote imported are in
``sys.modules`` before the script imports them, and a relayed rank is not its relay's child.
A child whose environment differs from the zygote's in what is read once as an interpreter
starts or imports torch (``PYTHON*``, ``LD_*``, ``TORCH*``, ``OMP_*``, ``TMPDIR``, ``HOME`` ...;
:data:`STARTUP`), or whose command line is any other, starts fresh, as does every child while
the zygote is not (yet) listening. ``tests/integration/test_warm_children.py`` runs one script
both ways and compares what a test can observe.

The packaging tests and the README's blocks use their own virtual environments' interpreters
(``venvs.clean_env`` drops ``PYTHON_EXEC``), and the terminal tests start their processes in
tmux: those start fresh. ``HOOKFIT_TEST_FRESH=1`` starts every process of a run fresh.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys

_SOCKET: list[str] = []  # this worker's zygote's socket, once started
_ZYGOTE: list[subprocess.Popen] = []  # and its process
FRESH: list[str] = []  # why the children the zygote did not start started fresh
STARTED_ENV: dict[str, str] = {}  # this process's environment when it started its zygote
STARTUP = re.compile(r"(PYTHON|LD_|LC_|LANG|TORCH|PYTORCH|OMP_|GOMP_|KMP_|MKL_|OPENBLAS|NUMPY|CUDA"
                     r"|(TMPDIR|TEMP|TMP|HOME|USER|LOGNAME)$)")  # (tempfile and site read these once)
"""Variables read while an interpreter starts or imports torch: a child whose values of these
differ from the zygote's runs fresh, except those of :data:`LATE`."""
LATE = {"PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONFAULTHANDLER", "OMP_NUM_THREADS", "PYTHON_EXEC",
        "TORCHINDUCTOR_CACHE_DIR",  # set by importing torch._dynamo, read when compiling
        "KMP_DUPLICATE_LIB_OK"}  # set by a package the suite imports; Intel OpenMP's, not in this torch
LATE_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_")  # torchrun's, read when the process group starts
PR_SET_CHILD_SUBREAPER = 36
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT, signal.SIGWINCH)


def _startup_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items()
            if STARTUP.match(k) and k not in LATE and not k.startswith(LATE_PREFIXES)}


# -- the relay: what torchrun starts ---------------------------------------------------------

def relay(real: str, path: str) -> None:
    """``python [-u] [-B] script ...`` through the zygote listening at ``path``, or the real
    interpreter ``real`` when it cannot."""
    argv = sys.argv[1:]
    if _command(argv) is None:
        os.execv(real, [real, *argv])
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:  # the zygote is not listening (yet, or any more)
        os.execv(real, [real, *argv])
    umask = os.umask(0)
    os.umask(umask)
    import json

    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "umask": umask,
                          "session": os.getsid(0) == os.getpid()}).encode()
    fds = [fd for fd in (0, 1, 2) if _open(fd)]
    socket.send_fds(conn, [b"%d %s\n" % (len(request), ",".join(map(str, fds)).encode()) + request], fds)
    reader = conn.makefile("rb")
    first = reader.readline().decode().split()
    if first[:1] == ["fresh"]:  # the zygote says this one must start fresh
        conn.close()
        os.execv(real, [real, *argv])
    pid = int(first[1])
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, frame: _forward(pid, signum))
    line = reader.readline().decode().split()
    if line[:1] != ["status"]:
        raise SystemExit(f"{sys.argv[0]}: the zygote went away while rank process {pid} ran")
    status = int(line[1])
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status))


def _forward(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _command(argv: list[str]) -> tuple[set[str], str, str, list[str]] | None:
    """``(flags, kind, target, args)`` for ``[-u] [-B] script|-m module|-c code ARGS``, else None."""
    flags: set[str] = set()
    i = 0
    while i < len(argv) and argv[i] in ("-u", "-B"):
        flags.add(argv[i])
        i += 1
    if i >= len(argv):
        return None
    if argv[i] in ("-m", "-c"):
        if i + 1 >= len(argv):
            return None
        return flags, argv[i], argv[i + 1], argv[i + 2:]
    if argv[i].startswith("-"):
        return None
    return flags, "script", argv[i], argv[i + 1:]


# -- the zygote -------------------------------------------------------------------------------

def serve(path: str) -> None:
    """Import what every rank imports, listen on ``path``, and fork a rank for each relay."""
    import json
    import selectors
    import traceback

    before = dict(os.environ)
    import numpy  # noqa: F401
    import torch
    import torch._dynamo  # noqa: F401  (every optimizer imports it: Optimizer.add_param_group)

    added = {k: v for k, v in os.environ.items() if k not in before}  # TORCHINDUCTOR_CACHE_DIR
    encoding = sys.stdout.encoding, sys.stdout.errors, sys.stdin.errors
    startup = _startup_env(before)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # relays connect only once it listens
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(null, fd)
    os.close(null)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    ranks: dict[int, socket.socket] = {}  # pid -> its relay's connection

    def closed_all() -> None:  # in a rank: nothing of the zygote's stays open
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        selector.close()
        listener.close()
        os.close(wake_r)
        os.close(wake_w)
        for other in ranks.values():
            other.close()

    while True:
        for key, _ in selector.select():
            if key.data == "accept":
                conn, _ = listener.accept()
                fds = []
                try:
                    head, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
                    first, _, body = head.partition(b"\n")
                    size, names = first.split(b" ")
                    while len(body) < int(size):
                        more = conn.recv(1 << 16)
                        if not more:
                            raise EOFError("the relay went away")
                        body += more
                    request = json.loads(body)
                except Exception:  # not a relay's request: say so in the log, serve the next
                    traceback.print_exc()
                    conn.close()
                    for fd in fds:
                        os.close(fd)
                    continue
                theirs = _startup_env(request["env"])
                if theirs != startup or _command(request["argv"]) is None:
                    differ = sorted(k for k in {*theirs, *startup} if theirs.get(k) != startup.get(k))
                    why = f"differs in {', '.join(differ)}" if differ else "a command line it does not take"
                    conn.sendall(f"fresh {why}\n".encode())
                    conn.close()
                    for fd in fds:
                        os.close(fd)
                    continue
                request["env"] = {**added, **request["env"]}  # as those imports set them
                given = dict(zip((int(n) for n in names.split(b",") if n), fds))
                if request.get("adopt"):  # a child of the test's process: fork twice, the middle one exits
                    read, write = os.pipe()
                    middle = os.fork()
                    if middle == 0:
                        pid = os.fork()
                        if pid == 0:
                            os.close(read)
                            os.close(write)
                            conn.close()
                            closed_all()
                            _become(request, given, encoding, torch)
                        os.write(write, b"%d" % pid)
                        os._exit(0)
                    os.close(write)
                    pid = int(os.read(read, 64) or b"0")
                    os.close(read)
                    try:
                        os.waitpid(middle, 0)  # gone: its child is now the test process's
                    except ChildProcessError:
                        pass
                    for fd in fds:
                        os.close(fd)
                    conn.sendall(b"pid %d\n" % pid)
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    conn.close()
                    closed_all()
                    _become(request, given, encoding, torch)
                for fd in fds:
                    os.close(fd)
                conn.sendall(b"pid %d\n" % pid)
                ranks[pid] = conn
                selector.register(conn, selectors.EVENT_READ, pid)
            elif key.data == "child":
                os.read(wake_r, 512)
                while True:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    conn = ranks.pop(pid, None)
                    if conn is not None:
                        if conn in selector.get_map():
                            selector.unregister(conn)
                        try:
                            conn.sendall(b"status %d\n" % status)
                        except OSError:
                            pass
                        conn.close()
            else:  # a relay's connection: readable only when the relay is gone
                pid = key.data
                if not key.fileobj.recv(1):
                    selector.unregister(key.fileobj)
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


def _become(request: dict, fds: dict[int, int], encoding: tuple[str, str, str], torch) -> None:
    """In the fork: start as ``python ARGV`` would, run it, and exit as the interpreter does."""
    import atexit
    import builtins
    import importlib.machinery
    import io
    import runpy
    import threading
    import traceback
    import types

    code = 1
    interrupted = False
    try:
        if request["session"]:
            os.setsid()
        for target in (0, 1, 2):
            if target in fds:
                os.dup2(fds[target], target)
                os.close(fds[target])
            else:
                os.close(target)
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update(request["env"])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        flags, kind, target, args = _command(request["argv"])
        sys.orig_argv = [sys.executable, *request["argv"]]
        unbuffered = "-u" in flags or bool(os.environ.get("PYTHONUNBUFFERED"))
        sys.dont_write_bytecode = "-B" in flags or bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
        if os.environ.get("OMP_NUM_THREADS", "").isdigit():
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed()  # a fresh interpreter seeds NumPy from the OS (random reseeds at fork)
        out_encoding, out_errors, in_errors = encoding

        def stream(fd: int, write: bool, errors: str, line: bool) -> io.TextIOWrapper:
            raw = io.FileIO(fd, "w" if write else "r", closefd=False)
            buffered = raw if write and unbuffered else (io.BufferedWriter(raw) if write else io.BufferedReader(raw))
            return io.TextIOWrapper(buffered, encoding=out_encoding, errors=errors,
                                    line_buffering=line or (write and raw.isatty()),
                                    write_through=write and unbuffered)

        sys.stdin = sys.__stdin__ = stream(0, False, in_errors, False) if 0 in fds else None
        sys.stdout = sys.__stdout__ = stream(1, True, out_errors, False) if 1 in fds else None
        sys.stderr = sys.__stderr__ = stream(2, True, "backslashreplace", True) if 2 in fds else None
        if os.environ.get("PYTHONFAULTHANDLER"):
            import faulthandler

            faulthandler.enable(all_threads=True)
        if kind == "script":  # as the interpreter runs a script: __file__ absolute, argv[0] as given
            sys.argv = [target, *args]
            sys.path[0] = os.path.dirname(os.path.realpath(target))
            path = os.path.abspath(target)
            main = types.ModuleType("__main__")
            main.__dict__.update(__file__=path, __cached__=None, __builtins__=builtins, __spec__=None,
                                 __loader__=importlib.machinery.SourceFileLoader("__main__", path))
            sys.modules["__main__"] = main
            with io.open_code(path) as source:
                exec(compile(source.read(), path, "exec"), main.__dict__)
        elif kind == "-m":
            sys.argv = ["-m", *args]
            sys.path[0] = os.getcwd()
            runpy._run_module_as_main(target, alter_argv=True)
        else:
            sys.argv = ["-c", *args]
            sys.path[0] = ""
            main = types.ModuleType("__main__")
            main.__dict__.update(__builtins__=builtins, __spec__=None, __loader__=importlib.machinery.BuiltinImporter)
            sys.modules["__main__"] = main
            exec(compile(target, "<string>", "exec"), main.__dict__)
        code = 0
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code & 0xFF
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException as error:  # as the interpreter reports an uncaught exception
        interrupted = isinstance(error, KeyboardInterrupt)
        tb = error.__traceback__
        while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__)
                                  or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
            tb = tb.tb_next
        try:
            sys.excepthook(type(error), error.with_traceback(tb), tb)
        except BaseException:
            traceback.print_exception(error)
        code = 1
    try:
        threading._shutdown()  # the interpreter joins non-daemon threads, then runs atexit
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    for name in ("stdout", "stderr"):
        try:
            stream_ = getattr(sys, name)
            if stream_ is not None:
                stream_.flush()
        except BaseException:
            code = code or 120
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


# -- for the suite ------------------------------------------------------------------------------

class Popen(subprocess.Popen):
    """:class:`subprocess.Popen` whose ``[sys.executable, [-u] [-B] script|-m module|-c code, ...]``
    starts warm: forked by this worker's zygote as a child of this process (so ``pid``,
    signals, ``wait`` and the exit status are a child's own), set up as that command starts.
    Anything else, or what the zygote says must start fresh, is started as ``subprocess.Popen``
    starts it."""

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group):
        argv = None if isinstance(args, (str, bytes, os.PathLike)) else [os.fspath(a) for a in args]
        pid = None
        if (argv and argv[0] == sys.executable and not shell and executable is None and preexec_fn is None
                and not pass_fds and gid is None and gids is None and uid is None and process_group in (None, -1)
                and _command(argv[1:]) is not None):
            pid = _adopt(argv[1:], os.environ if env is None else env, cwd, umask, start_new_session,
                         ((0, p2cread), (1, c2pwrite), (2, errwrite)))
        if pid is None:
            return super()._execute_child(
                args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags, shell,
                p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, restore_signals, gid, gids, uid, umask,
                start_new_session, process_group)
        self.pid = pid
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)


def _adopt(argv: list[str], env, cwd, umask: int, session: bool, streams) -> int | None:
    """The pid of a warm ``python ARGV``, now this process's child, or None (start it fresh)."""
    import ctypes
    import json

    if not _SOCKET:
        return None
    path = _SOCKET[0]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(120)  # a zygote that stopped answering fails the test (TimeoutError), never hangs it
    try:
        conn.connect(path)
    except OSError as error:
        FRESH.append(f"{argv[:2]}: the zygote does not listen ({error}; it has "
                     f"{'ended' if _ZYGOTE and _ZYGOTE[0].poll() is not None else 'not ended'})")
        return None
    if umask < 0:
        umask = os.umask(0)
        os.umask(umask)
    fds = {target: fd if fd != -1 else target for target, fd in streams}
    fds = {target: fd for target, fd in fds.items() if _open(fd)}
    request = json.dumps({"argv": argv, "env": {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()},
                          "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(), "umask": umask,
                          "session": bool(session), "adopt": True}).encode()
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # the zygote's grandchild becomes ours when its parent exits
    try:
        with conn:
            socket.send_fds(conn, [b"%d %s\n" % (len(request), ",".join(map(str, fds)).encode()) + request],
                            list(fds.values()))
            answer = conn.makefile("rb").readline().decode().split()
    finally:
        prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
    if answer[:1] != ["pid"]:
        FRESH.append(f"{argv[:2]}: {' '.join(answer[1:]) or 'the zygote did not answer'}")
        return None
    return int(answer[1])


def ready(timeout: float = 300) -> bool:
    """Wait until this worker's zygote listens (True), or it ended or ``timeout`` passed (False)."""
    import time

    if not _SOCKET or not _ZYGOTE:
        return False
    end = time.monotonic() + timeout
    while not os.path.exists(_SOCKET[0]):
        if _ZYGOTE[0].poll() is not None or time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def run(*popenargs, input=None, capture_output: bool = False, timeout: float | None = None, check: bool = False,
        **kwargs) -> subprocess.CompletedProcess:
    """:func:`subprocess.run` with :class:`Popen`."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with Popen(*popenargs, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        except BaseException:
            process.kill()
            raise
        code = process.poll()
    if check and code:
        raise subprocess.CalledProcessError(code, process.args, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(process.args, code, stdout, stderr)


def start(folder: str) -> tuple[subprocess.Popen, dict[str, str]]:
    """Start a zygote listening in ``folder``; ``(its process, the variables that make torchrun's
    ranks use it)``. The zygote imports for a few seconds; children started before it listens
    start fresh."""
    path = os.path.join(folder, "zygote")
    launcher = os.path.join(folder, "python")
    with open(launcher, "w") as f:
        f.write(f"#!{sys.executable} -IS\nimport sys\nsys.path.insert(0, {os.path.dirname(__file__)!r})\n"
                f"import warm\nwarm.relay({sys.executable!r}, {path!r})\n")
    os.chmod(launcher, 0o755)
    log = open(os.path.join(folder, "zygote.log"), "wb")
    process = subprocess.Popen([sys.executable, __file__, "--serve", path], stdin=subprocess.DEVNULL,
                               stdout=log, stderr=log)
    log.close()
    STARTED_ENV.clear()
    STARTED_ENV.update(os.environ)
    _SOCKET[:] = [path]
    _ZYGOTE[:] = [process]
    return process, {"PYTHON_EXEC": launcher}


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    serve(sys.argv[2])
