"""tui: a live training dashboard in the terminal, drawn with urwid, optionally persistent.

Panels: a metrics table (train last / running / the mean of the training epoch so far, of the
validation so far: the running epoch's, not the previous one's; every metric, validation-only
ones included, paged with ``n``/``p`` and saying which of how many it shows when they do not
fit), a Braille plot of any metric over steps with train and valid series (full history or a
recent window, downsampled by min/max per bucket; its axis reaches the metric's last step, with
``×`` where the values were NaN or infinite and ``!`` at every skipped step), progress of the
stage and of the run with rate and ETA (validation time included; counted in steps when
``max_steps`` ends the run first; 100 % and no ETA once it completed), a log pane with whatever
the run printed (and where a resumed run continues from: the ``resumed`` event; the table and
curves of a run that continues its folder's records start with what its ``metrics.jsonl`` holds from
before, as ``hookfit show`` draws them), a status line
(``mostly skipped`` when an optimizer skipped more than half of the steps it attempted, as the console's
``hookfit skipped`` line counts them) and the keys. Values that are not
finite show as ``nan``/``inf`` in the warning colour, never as the dash of "no value yet"; the
end screen and the summary say how many optimizer steps were skipped and why (the optim
plugin's ``step_skipped`` event). The layout holds at any size from 40x12 up: every text whole
or ellipsized, the key help always on its line (see :mod:`hookfit.plugins.tui.dashboard`).
``q`` asks
for a graceful stop with ``loop.request_stop``, which the core honours whatever other plugins
are installed; the dashboard knows no other plugin.

How it stays out of training's way: the training thread only appends the snapshots the metrics
plugin publishes (a few per second) to a queue; a daemon UI thread drains it, reads keys, follows
resizes, reads the run's counters (``loop.state``: stage, epoch, batch, step: plain attribute
reads, so the bars follow the batches without a per-batch hook) and redraws when something
changed, at most ``fps`` times a second (every ``PROGRESS_EVERY`` seconds for the bars alone),
and otherwise once a second for the clock (a frame costs about 5 ms of Python at 120x40, time
the training thread waits for the interpreter lock: five frames a second would take 2.5 % of
it). urwid's screen is started and stopped on the main thread, which also owns the signal
handlers (urwid's own SIGWINCH/SIGTSTP handling is not installed: the UI thread polls the size,
and Ctrl-Z is ignored while the dashboard is up).

Output: file descriptors 1 and 2 are redirected into a pipe while the dashboard is up, so
``print``, logging, C libraries and child processes cannot scribble over it. Warnings are kept
apart (``warnings.showwarning`` is the dashboard's until the terminal is restored, in every
outcome, and during a debugger's hold): one line each in the log pane, with the file and line of
the user's code they point at or the hookfit module that issued them, and listed again in the
summary (:mod:`hookfit.plugins.tui.warned`). A daemon
thread reads the pipe and appends everything to ``<run_dir>/output.log`` at once (so a ``kill
-9`` loses nothing that was printed), feeds the log pane, and keeps it for the replay: it is
written back to the terminal once the terminal is restored. The file follows the run's file
policy (:mod:`hookfit.files`): a full disk or a read-only folder warns once with a
``FileWarning`` and only the file is lost; a ``print`` never waits for a disk or raises because
of one. Fatal errors (a segmentation fault, an abort) reach the real terminal: ``faulthandler``
writes to a copy of the original stderr while the dashboard is up, and its previous setting
(off, or on standard error) comes back afterwards.

Debugging: ``breakpoint()`` (or anything that calls ``sys.breakpointhook``) while the dashboard
is up gives the terminal to the debugger: the UI thread parks, the screen is stopped and the
descriptors go back to the terminal before the previous hook (pdb) runs. The dashboard comes
back once the debugger lets go of the thread that called it (``continue`` in pdb; checked at
the next publication of metrics or stage, so the training thread pays nothing per batch), or
at once when no debugger took over (``PYTHONBREAKPOINT=0``). A debugger that keeps tracing
(pdb with breakpoints set) keeps the dashboard away until the end of the run.

Persistent mode (``TuiRenderer(persistent=True)`` or ``HOOKFIT_TUI_PERSISTENT=1``): when the run
ends, however it ends, the final dashboard stays with a banner until ``q``, Esc or Ctrl-C; its
clock stops at the end of the run, and the duration shown there and in the summary is the
run's own (``loop.state.elapsed``, which the hold does not add to). In both modes a plain-text
summary (status, where the run resumed from, the output file, metrics table and curves) is
printed to the normal terminal after it is restored, so the result stays in the scrollback; it
fits the terminal's width as the dashboard does, from 40 columns (see :func:`summary`).

It starts only on an interactive terminal: stdin and stdout are TTYs, ``TERM`` is set and not
``dumb``, ``CI`` and ``HOOKFIT_NO_TUI`` are unset, the process is in the terminal's foreground
process group, ``fit()`` runs on the main thread and urwid can be imported. Otherwise it steps
aside and the console renderer prints instead (through the ``claim_output`` event); on a
terminal where only urwid is missing it says so first, in one ``HookfitWarning`` naming what to
install, and in a ``torchrun`` worker started from a terminal (torchrun puts its workers in a
process group of their own) the main process says why. If the process is killed with
SIGKILL (or dies of a fatal signal) no code can run to restore the terminal: ``reset`` (or
``stty sane``) fixes it, and ``output.log`` keeps what the run printed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hookfit.plugins.tui.terminal import ENV_OFF, OutputCapture, interactive_terminal

if TYPE_CHECKING:  # pragma: no cover
    from hookfit.plugins.tui.renderer import ENV_PERSISTENT, TuiRenderer, summary

__all__ = ["ENV_OFF", "ENV_PERSISTENT", "OutputCapture", "TuiRenderer", "interactive_terminal", "summary"]


def __getattr__(name: str) -> Any:
    """The renderer's names, imported on first use (the renderer imports torch): ``hookfit
    show`` and ``hookfit compare`` read files through the package's other modules alone."""
    if name not in ("ENV_PERSISTENT", "TuiRenderer", "summary"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.renderer"), name)


def __dir__() -> list[str]:
    """The public names with the module's own, those imported on first use included (tab completion)."""
    return sorted({*globals(), *__all__})
