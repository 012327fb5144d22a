"""Events of the dashboard, and the renderer role: what a plugin that shows a run to a person
does, whether it is the built-in ``tui`` (the dashboard) or ``console``, or a replacement.

The renderer role. A renderer only watches the run; what it must do, all of it:

* Declare ``observer = True`` (a class attribute). An observer's error never fails the run: the
  core switches the observer off with one :class:`~hookfit.HookfitWarning` naming it, and the
  run goes on. A renderer does not change the run's set-up, the model, the data or the
  position; it may ask for a stop (``loop.request_stop("q pressed in the dashboard")``, from any
  thread) and nothing else.
* Off rank 0 of a distributed run every observer is unregistered (only the main process shows
  the run), unless it asks to run on every rank (see the distributed role): a renderer that
  reads ``loop.is_main`` itself is not needed.
* Who owns the terminal: a renderer that draws a full-screen interface answers
  ``claim_output(loop)`` with its name (from the environment alone: is stdout an interactive
  terminal?) and takes the terminal at ``fit_start``; a plain-text renderer asks
  ``loop.hooks.claim_output(loop)`` at its ``fit_start`` and stays silent when someone answers.
  A full-screen renderer gives the terminal back in every outcome: at ``fit_end`` (which runs
  after a failure too), from an ``atexit`` handler, on ``SIGTERM``/``SIGHUP``, before a debugger
  (``breakpoint()``) takes it; what the run prints meanwhile is kept (the dashboard writes it to
  ``loop.run_dir / "output.log"`` and shows it afterwards). A renderer that cannot start warns
  once and leaves the terminal to plain output.
* What it reads, and from where (nothing else is needed):

  - ``fit_start(loop)``: ``loop.max_epochs``, ``loop.max_steps``, ``loop.val_every_n_epochs``,
    ``loop.val_step`` (validation or not), ``loop.model`` (a summary:
    :func:`hookfit.plugins.support.summary.summarize`), ``loop.run_dir`` (main process), ``loop.smoke``.
  - ``stage_start(loop, stage)`` / ``stage_end(stage)``: which stage runs (a validation due at a
    step runs inside the training stage); ``len()`` of ``loop.train_data``/the validation data
    where it has one.
  - ``metrics_update(loop, stage, metrics)`` and ``epoch_metrics(loop, stage, metrics)`` (the
    metrics role): every value shown comes from these :class:`~hookfit.payloads.MetricsSnapshot`
    s: progress (``batches``, ``total``, rates, ``eta``), values, learning rates, the epoch's
    history, and which value is best (``metrics.best``: the directions the user configured;
    never guessed from a name). Without a metrics plugin a renderer shows the start and the end.
  - ``resumed(info)``, ``step_skipped(step)`` (optim), ``checkpoint_saved(path, reason, step)``
    (checkpoint): marks on the curves (and, at the end of a run that did not complete, the checkpoint
    to resume from: :mod:`hookfit.plugins.support.resumable`); declared by their plugins and registered in every run, so
    a renderer implements them with ``@hookfit.hookimpl(optionalhook=True)`` only for events of
    plugins that are not built in.
  - ``loop.optimizers`` at ``fit_start``, ``resumed`` and ``fit_end``: each optimizer's steps attempted
    (:func:`hookfit.plugins.support.skips.attempted`), the share of skipped steps said over them as the
    console says it (:func:`hookfit.plugins.support.skips.worst`: an optimizer's skips over its own steps,
    an accumulation window one step); the dashboard reads them from its own thread too once a step was skipped.
  - ``stop_requested(request)``: may come from any thread (a signal handler, a UI thread): quick,
    thread-safe, no collective operation.
  - ``fit_end(loop)``: ``loop.state``: ``status`` (``completed``, ``interrupted``, ``failed``),
    ``stop_reason``, ``stopped_by``, ``elapsed``, ``time_split`` (where the time went:
    :class:`~hookfit.payloads.TimeSplit`). A renderer that keeps its final screen
    ("persistent") holds it here, until the user leaves or a termination signal comes.

* Speed: hook implementations run on the training thread; a renderer hands the snapshot over
  (snapshots are never changed after publication) and draws elsewhere, at a bounded rate. It
  implements no per-batch event unless it must (the console's ``every_n_batches``): progress
  between publications comes from reading ``loop.state``'s counters (``stage``, ``epoch``,
  ``batch_idx``, ``step``) from the renderer's own thread on its own tick, which a renderer may
  do at any time (plain attributes, each read whole; a value may be one batch old).

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
