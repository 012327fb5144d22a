"""tui: a live training dashboard in the terminal, drawn with urwid, optionally persistent.

Panels: a metrics table (train last / running / epoch mean, valid), a Braille plot of any
metric over steps with train and valid series (full history or a recent window, downsampled by
min/max per bucket), progress of the stage and of the run with rate and ETA (validation time
included), a log pane with whatever the run printed, a status line and the keys. ``q`` asks
for a graceful stop with ``loop.request_stop``, which the core honours whatever other plugins
are installed; the dashboard knows no other plugin.

How it stays out of training's way: the training thread only appends the snapshots the metrics
plugin publishes (a few per second) to a queue; a daemon UI thread drains it, reads keys, follows
resizes and redraws when something changed, at most ``fps`` times a second, and otherwise once a
second for the clock (a frame costs about 5 ms of Python at 120x40, time the training thread
waits for the interpreter lock: five frames a second would take 2.5 % of it). urwid's screen is started and stopped on the
main thread, which also owns the signal handlers (urwid's own SIGWINCH/SIGTSTP handling is not
installed: the UI thread polls the size, and Ctrl-Z is ignored while the dashboard is up).

Output: file descriptors 1 and 2 are redirected to a temporary file while the dashboard is up,
so ``print``, logging, warnings and C libraries cannot scribble over it; the lines show in the
log pane and everything is written back to the terminal once it is restored.

Persistent mode (``TuiRenderer(persistent=True)`` or ``HOOKFIT_TUI_PERSISTENT=1``): when the run
ends, however it ends, the final dashboard stays with a banner until ``q``, Esc or Ctrl-C. In
both modes a plain-text summary (metrics table and curves) is printed to the normal terminal
after it is restored, so the result stays in the scrollback.

It starts only on an interactive terminal: stdin and stdout are TTYs, ``TERM`` is set and not
``dumb``, ``CI`` and ``HOOKFIT_NO_TUI`` are unset, the process is in the terminal's foreground
process group and ``fit()`` runs on the main thread. Otherwise it steps aside and the console
renderer prints instead (through the ``claim_output`` event). If the process is killed with
SIGKILL no code can run to restore the terminal: ``reset`` (or ``stty sane``) fixes it.
"""

from hookfit.plugins.tui.renderer import ENV_PERSISTENT, TuiRenderer, summary
from hookfit.plugins.tui.terminal import ENV_OFF, OutputCapture, interactive_terminal

__all__ = ["ENV_OFF", "ENV_PERSISTENT", "OutputCapture", "TuiRenderer", "interactive_terminal", "summary"]
