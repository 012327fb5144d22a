"""Events of the dashboard: who owns the terminal.

Declared by :class:`hookfit.plugins.tui.TuiRenderer` (its ``hookspecs`` attribute) and added to
every run whether ``tui`` is enabled, disabled or replaced. The dashboard declares
``claim_output`` because it is what the dashboard offers: taking the terminal over. A plain
renderer (the console, or one of another package) asks it and stays silent when a full-screen
interface answers; a dashboard of another package answers it the same way, and the console
need not know it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hookfit import hookspec

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run


@hookspec(firstresult=True)
def claim_output(loop: Run) -> str | None:
    """Asked by plain-text renderers (the console) at ``fit_start``: does a plugin take over
    the terminal for this run?

    A renderer that will draw a full-screen interface (the dashboard) returns its name; the
    console then stays silent. First result: the first non-``None`` answer is the owner.
    Implementations must decide from the environment alone (is this an interactive
    terminal?), not from the order in which plugins start. Return ``None`` to leave the
    terminal to plain output.
    """
