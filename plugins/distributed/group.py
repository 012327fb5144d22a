"""distributed's process group: made once per job, kept for every later run of the job.

A script may run a ``Loop`` after a ``Loop`` under one ``torchrun`` (train, then ``validate()``
a test set on a new ``Loop``). The plugin initialises the default process group at the first run that
needs one, from ``torchrun``'s environment, and every later run reuses it: a gloo group cannot
be made again in the same job (its peers' ports are gone: ``connectFullMesh ... Connection
refused``). A group the script initialised itself is the script's: the plugin uses it and never
destroys it. The group the plugin made is destroyed

* at the job's end, by an :mod:`atexit` handler registered when it was made (before the
  interpreter finalizes, so no gloo worker thread outlives it), or
* when the script asks, with :func:`shutdown` (on every process, at the same point: it waits
  for the others first), for instance before it initialises a group of its own, or
* at once when a run fails (``exception``), so that the other processes' next collective
  operation fails instead of waiting for the timeout (the job is over then: torchrun ends it).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import importlib
import os
import sys
from typing import Any

__all__ = ["ENV_TIMEOUT", "init", "owned", "shutdown", "timeout_seconds", "timeout_text"]

ENV_TIMEOUT = "HOOKFIT_DIST_TIMEOUT"

_owned = False  # the default group is the one this module initialised
_exit_registered = False


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def owned() -> bool:
    """Whether the default process group exists and was made by hookfit's distributed plugin
    (not by the script), so that hookfit destroys it."""
    global _owned
    dist = _dist()
    if _owned and not (dist.is_available() and dist.is_initialized()):
        _owned = False  # destroyed by someone else meanwhile
    return _owned


def init(backend: str, timeout: datetime.timedelta) -> None:
    """Initialise the default process group from ``torchrun``'s environment (``env://``); it
    is hookfit's, destroyed at the job's end or by :func:`shutdown`."""
    global _owned, _exit_registered
    # torch.distributed.nn.functional's collectives take ``group=group.WORLD`` as a default
    # argument, evaluated when the module is first imported: imported after the group exists
    # (DTensor imports it, so every FSDP run does), its functions keep the group alive after
    # destroy_process_group(), with gloo's threads, until the interpreter finalizes, where a
    # thread still running can abort a finished process. Imported first, the default is None.
    import torch.distributed.nn.functional  # noqa: F401

    _dist().init_process_group(backend=backend, timeout=timeout)
    _owned = True
    if not _exit_registered:
        _exit_registered = True
        atexit.register(_at_exit)


def shutdown() -> bool:
    """Destroy the process group that hookfit's distributed plugin initialised, now rather than
    at the job's end; ``False`` (and nothing done) when there is none: no group, or one the
    script initialised itself, which stays the script's.

    A collective call: every process calls it at the same point, after the job's last run
    (never during one); it waits for the others (a barrier) so that none leaves while another
    still sends. A run after it would need a new group, which gloo cannot make again in the
    same job: keep the group until the last run."""
    if not owned():
        return False
    dist = _dist()
    dist.barrier()
    destroy()
    return True


def destroy() -> None:
    """Destroy hookfit's process group at once, without waiting for the other processes (a
    failed run, the job's end); nothing when the group is not hookfit's."""
    global _owned
    if owned():
        _owned = False
        _dist().destroy_process_group()
        _release()


def _release() -> None:
    """Free the destroyed group now, so that gloo's threads end here and not while the
    interpreter finalizes (where a thread still running can abort a finished process). The
    group lives on while anything refers to it: DTensor's caches of sharding decisions refer to
    the device meshes of every FSDP run, which refer to the group, and a finished run's objects
    in reference cycles wait for the collector. (A model the script still holds keeps its own
    mesh, and the group, until the script drops it.)"""
    if "torch.distributed.tensor" in sys.modules:  # (an FSDP run: DTensor is in use)
        try:
            debug = importlib.import_module("torch.distributed.tensor.debug")
        except ImportError:  # pragma: no cover - a torch without it: the group lives to the end
            debug = None
        clear = getattr(debug, "_clear_sharding_prop_cache", None)  # torch's: the Python and C++ caches
        if callable(clear):
            clear()
    gc.collect()


def _at_exit() -> None:
    # no barrier: a process whose peers failed or hang must still be able to leave
    destroy()


def timeout_seconds(default: float) -> float:
    """Seconds a collective operation waits for the other processes: ``HOOKFIT_DIST_TIMEOUT``
    when set (a positive number, else ``ValueError``), else ``default`` (``Distributed(timeout=...)``)."""
    text = os.environ.get(ENV_TIMEOUT)
    if not text:
        return default
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"distributed: {ENV_TIMEOUT}={text!r} is not a positive number of seconds")
    return seconds


def timeout_text(default: float) -> str:
    """The timeout for a message, with where it is set: ``"300 s (HOOKFIT_DIST_TIMEOUT or ...)"``."""
    try:
        seconds = f"{timeout_seconds(default):g}"
    except ValueError:
        seconds = f"{default:g}"
    return f"{seconds} s ({ENV_TIMEOUT} or Distributed(timeout=...))"
