"""``hookfit show`` and ``hookfit compare``: runs looked at again from their folders (the
``tui`` plugin adds both through the ``add_commands`` event; the files are read with
:mod:`hookfit.tools.runs`).

``hookfit show [RUN]`` (default: the newest training run, :func:`hookfit.tools.runs.find`)
rebuilds the dashboard from the run's ``metrics.jsonl``: the same table, curves, progress and
summary, read-only (``q`` or Esc leaves; nothing is sent to the run). On a run that is still
going (another terminal, torchrun, the background) it follows the file as the run writes it,
until ``q``. With ``--text``, without an interactive terminal, or without urwid (then saying in
one line what to install) it prints the plain-text summary and curves that a finished run
prints; that needs no urwid. Progress is counted as the run counted it (steps when its
``max_steps``, in ``run.jsonl``, ended it first), and a finished run shows where it ended: its
last step, epoch and metrics (its end lines; its steps as ``hookfit runs`` counts them, a line saying
where ``metrics.jsonl`` stops when a full disk cut it short), and the warnings the run recorded (``run.jsonl``'s
``"warning"`` lines, a line each with its step; a training's own, not those of an evaluation in its
folder). A run folder resumed into is timed over all its fits (the clock, the time lines), the
summary adding the last one's.

``hookfit compare`` is :mod:`hookfit.plugins.tui.compare`'s.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Protocol, Sequence

from hookfit.tools import jsonlines, runs
from hookfit.payloads import MetricsSnapshot, ResumeInfo, TimeSplit, Value
from hookfit.plugins.tui.model import DashboardModel
from hookfit.plugins.tui.warned import more, said

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only (urwid is imported when drawn)
    from hookfit.plugins.tui.dashboard import Dashboard

SHOW_KEYS = (("q leave", "q leave"), ("tab/←→ metric", "tab metric"), ("n/p table", "n/p table"),
             ("w window", "w"), ("l log scale", "l"), ("? help", "? help"))


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``show`` and ``compare`` subcommands."""
    from hookfit.plugins.tui.compare import add_compare

    p = commands.add_parser("show", help="look at a run again: its dashboard, or live while it runs")
    p.add_argument("source", nargs="?", metavar="RUN", help="a run folder or a run name under runs/ (default: the "
                   "newest training run; a folder of evaluations alone is shown where it is named)")
    p.add_argument("--text", action="store_true", help="print the text summary even on a terminal")
    p.set_defaults(run=_show)
    add_compare(commands)


# -- a run's rows as the dashboard's messages -------------------------------------------------


def snapshot(row: dict[str, Any], max_epochs: int, final: bool,
             directions: Mapping[str, str] | None = None) -> MetricsSnapshot:
    """A metrics row (:meth:`MetricsSnapshot.row`) as the snapshot it was written from (epoch
    means as every value: a row keeps no other), with the directions of the log's ``"best"``
    line (``stage/name`` -> ``"min"``/``"max"``) that concern its stage."""
    values = {k: Value(float(v), float(v), float(v)) for k, v in row.items()
              if k not in runs.ROW_FIELDS and k != "total" and not k.startswith("lr_") and isinstance(v, (int, float))}
    lr = {k[3:]: float(v) for k, v in row.items() if k.startswith("lr_") and isinstance(v, (int, float))}
    batches = int(row.get("batches", 0))
    given = row.get("total")  # (rows without it: the stage's length is the follower's to find)
    total = given if isinstance(given, int) and not isinstance(given, bool) and given > 0 else None
    stage = str(row.get("stage", "train"))
    best = {name: mode for name, mode in (directions or {}).items() if name.startswith(f"{stage}/")}
    return MetricsSnapshot(
        stage=stage, epoch=int(row.get("epoch", 1)) - 1, max_epochs=max_epochs,
        step=int(row.get("step", 0)), batches=batches, total=total, samples=int(row.get("samples", 0)),
        elapsed=float(row.get("time", 0.0)), values=values, lr=lr, final=final,
        best={name.split("/", 1)[1]: mode for name, mode in best.items()})


def time_split(recorded: dict[str, Any]) -> dict[str, TimeSplit]:
    """The ``time_split`` of a ``run.jsonl`` end line as the payloads it was written from."""
    out = {}
    for stage, parts in recorded.items():
        if isinstance(parts, dict):
            out[stage] = TimeSplit(stage, float(parts.get("data", 0.0)), float(parts.get("step", 0.0)),
                                   float(parts.get("plugins", 0.0)), int(parts.get("batches", 0)))
    return out


def fit_ends(lines: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The ``"end"`` lines of a ``run.jsonl`` that end a ``fit()``, in order (one more with each resume); an
    evaluation's (:func:`hookfit.tools.runs.fit_lines`) is not one, unless the folder holds evaluations alone."""
    lines = list(lines)
    ends = [line for line in runs.fit_lines(lines) if line.get("event") == "end"]
    return ends or [line for line in lines if line.get("event") == "end"]


def fit_times(ends: Sequence[Mapping[str, Any]]) -> tuple[dict[str, TimeSplit], dict[str, TimeSplit]]:
    """Where the time of the fits that ``ends`` end went, per stage: over them all (a resumed
    run's earlier fits too: what the dashboard shows), and as the text summary says it, a line
    each: that too, and where there were several fits, the last one's (stage names
    ``"train (3 fits)"``, ``"train (last fit)"``)."""
    splits = [time_split(end["time_split"]) for end in ends if isinstance(end.get("time_split"), dict)]
    whole: dict[str, TimeSplit] = {}
    for fit in splits:
        for stage, part in fit.items():
            whole[stage] = whole[stage] + part if stage in whole else part
    last = time_split(ends[-1]["time_split"]) if ends and isinstance(ends[-1].get("time_split"), dict) else {}
    if len(splits) < 2:
        return whole, whole
    said: dict[str, TimeSplit] = {}
    for stage, split in whole.items():
        said[f"{stage} (all)"] = replace(split, stage=f"{stage} ({len(splits)} fits)")
        if stage in last:
            said[f"{stage} (last)"] = replace(last[stage], stage=f"{stage} (last fit)")
    return whole, said


class Receiver(Protocol):
    """What a :class:`Follower` feeds: a dashboard's model, or :class:`Messages`."""

    finished: bool

    def receive(self, kind: str, *args: Any) -> None: ...


class Messages:
    """The messages a :class:`Follower` sends, kept (``kept``) to be handed to a dashboard later."""

    def __init__(self) -> None:
        self.finished = False
        self.kept: list[tuple[Any, ...]] = []

    def receive(self, kind: str, *args: Any) -> None:
        self.kept.append((kind, *args))


def earlier(folder: Path, info: ResumeInfo, max_epochs: int) -> list[tuple[Any, ...]]:
    """The messages that draw what a run resumed from ``info`` had done before, as ``hookfit show``
    draws it from the folder's ``metrics.jsonl`` (:func:`hookfit.tools.runs.followed`): its rows,
    checkpoints and resumes up to ``info.step``, neither an earlier fit's end nor this resume's own line
    (written there before this is read, or after). For the dashboard of the run that goes on from there."""
    messages = Messages()
    follower = Follower(folder, messages, max_epochs)
    for row in runs.followed(runs.read_metrics(folder / "metrics.jsonl")):
        step = row.get("step")
        if row.get("event") == "end" or jsonlines.count(step) and step > info.step or (
                row.get("event") == "resume" and (row.get("from"), step) == (info.source, info.step)):
            continue
        follower.feed(row)
    return messages.kept


class Follower:
    """Feeds a dashboard from a run folder's ``metrics.jsonl``, from the start and then as it
    grows (complete lines only)."""

    def __init__(self, folder: Path, dashboard: Receiver, max_epochs: int) -> None:
        self.path = folder / "metrics.jsonl"
        self.dashboard, self.max_epochs = dashboard, max_epochs
        self.offset = self.step = 0
        self.ended: dict[str, Any] | None = None
        self.resumed: ResumeInfo | None = None  # the last resume line's; resumes: each checkpoint's
        self.resumes: dict[str, ResumeInfo] = {}
        self.fitted = False  # a fit's line was read (runs.followed: Loop.validate()'s lines after it are not the run's)
        self.directions: dict[str, str] = {}  # the log's last "best" line
        self.before = 0.0  # seconds of the fits that ended before (a resumed run's earlier ones)
        self.totals: dict[str, int] = {}  # stage -> the most batches an epoch of it had

    def poll(self) -> bool:
        """Read what was added since the last call; whether anything was. An evaluation's lines
        (``Loop.validate()``) are left out once a fit's were read, as :func:`runs.followed` does."""
        data = runs.read_bytes(self.path, offset=self.offset)  # a regular file of the run only, bounded
        if data is None:
            return False
        end = data.rfind(b"\n")
        if end < 0:
            return False
        rows = [row for _, raw in jsonlines.objects(data[:end])[0] if (row := runs.checked(raw)) is not None]
        rows = runs.followed(rows) if self.offset == 0 else rows  # as hookfit runs reads it (then: as it comes)
        self.offset += end + 1
        self.fitted = self.fitted or not all(row.get("evaluation") for row in rows)  # (damaged values left out)
        for row in rows:
            if not (row.get("evaluation") and self.fitted):
                self.feed(row)
        return True

    def feed(self, row: dict[str, Any]) -> None:
        event, dash = row.get("event"), self.dashboard
        if event in ("epoch", "step"):
            stage = str(row.get("stage", "train"))
            if stage == "train" or event == "epoch":
                # A row gives the batches done; a stage's length is its longest epoch's, unless
                # the row says it (a stage a stop cut short has fewer batches than it has).
                given, done = row.get("total"), int(row.get("batches", 0))
                longest = self.totals[stage] = max(self.totals.get(stage, 0), done)
                total = int(given) if isinstance(given, int) and given > 0 else longest
                dash.receive("stage", stage, int(row.get("epoch", 1)) - 1, total or None)
            snap = snapshot(row, self.max_epochs, event == "epoch", self.directions)
            if event == "epoch":  # (a stage a stop cut short: never the best epoch)
                dash.receive("epoch", snap, not row.get("stopped"))
                dash.receive("stage_end", str(row.get("stage", "train")))
            else:
                dash.receive("update", snap)
            self.step = int(row.get("step", self.step))
        elif event == "checkpoint":
            step = row.get("step")
            if isinstance(step, int) and not isinstance(step, bool):
                dash.receive("checkpoint", step, str(row.get("reason", "")))
        elif event == "best":
            self.directions = runs.directions([row])
        elif event == "resume":
            self.resumed = ResumeInfo(str(row.get("from")), int(row.get("epoch", 1)) - 1, int(row.get("step", 0)),
                                      int(row.get("batch", 0)), "train")
            self.resumes[self.resumed.source] = self.resumed
            dash.receive("resumed", self.resumed)
        elif event == "end":  # the clock says the whole run's time, as hookfit runs does: every fit's
            self.ended = row
            _skipped(dash, row)
            step, epoch, seconds = row.get("step"), row.get("epoch"), row.get("time")
            self.before += float(seconds) if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) else 0.0
            dash.receive("end", str(row.get("status")), row.get("reason"), True, row.get("by"),
                         self.before, step if isinstance(step, int) else None,
                         epoch - 1 if isinstance(epoch, int) else None)
            dash.finished = True


def _skipped(dash: Receiver, row: Mapping[str, Any]) -> None:
    """The count of skipped steps an end line gives (``"skipped": N``), if it gives one."""
    skipped = row.get("skipped")
    if isinstance(skipped, int) and not isinstance(skipped, bool) and skipped > 0:
        dash.receive("skipped_total", skipped)


def recorded_warnings(folder: Path) -> list[str]:
    """The warnings the run recorded in ``run.jsonl`` (its ``"warning"`` lines, :mod:`hookfit.runwarnings`)
    along its current history, a line each as the dashboard's summary says them (:func:`said`),
    with the step they came at, and a ``"warnings_dropped"`` line's count of more. A training run's
    are its fits' alone: an evaluation (``Loop.validate()``) in its folder records its own, which are
    not the training's (:func:`hookfit.tools.runs.fit_lines`); a folder of evaluations alone shows theirs."""
    lines = runs.current(runs.read_jsonl(folder / "run.jsonl"))
    fits = runs.fit_lines(lines)
    out = []
    for line in fits if any(line.get("event") == "run" for line in fits) else lines:
        event = line.get("event")
        if event == "warning":
            step = line.get("step")
            text = said(str(line.get("category", "Warning")), str(line.get("message", "")),
                        f"step {step}" if jsonlines.count(step) else "")
            out.append(f"warning: {text}")
        elif event == "warnings_dropped" and jsonlines.count(line.get("count")):
            out.append(f"warning: {more(line['count'])}")
    return out


def _limits(folder: Path) -> tuple[int, int | None]:
    """``max_epochs`` and ``max_steps`` of the run's last start of a fit (``run.jsonl``; an
    evaluation's, ``Loop.validate()``, trains nothing); without one, the epochs its metrics reached."""
    starts = [r for r in runs.fit_lines(runs.read_jsonl(folder / "run.jsonl")) if r.get("event") == "run"]
    given = starts[-1].get("max_epochs") if starts else None
    steps = starts[-1].get("max_steps") if starts else None
    steps = steps if isinstance(steps, int) and steps > 0 else None
    if isinstance(given, int) and given > 0:
        return given, steps
    epochs = [int(r.get("epoch", 1)) for r in runs.epoch_rows(folder)]
    return max(epochs, default=1), steps


def _dashboard(folder: Path, draw: bool = True) -> tuple[DashboardModel, Follower, runs.RunInfo, dict[str, bool]]:
    """The dashboard of the run in ``folder`` (``draw``: one that urwid draws, else its model
    alone), its follower, the run, and the flag ``leave`` its keys set (``q``, Esc)."""
    info = runs.load(folder)
    holder: dict[str, bool] = {}
    max_epochs, max_steps = _limits(folder)
    kind: type[DashboardModel] = DashboardModel
    if draw:
        from hookfit.plugins.tui.dashboard import Dashboard

        kind = Dashboard
    dash = kind(max_epochs, None, on_stop=lambda: holder.update(leave=True),
                on_leave=lambda: holder.update(leave=True), max_steps=max_steps)
    dash.keys, dash.evaluation = SHOW_KEYS, info.evaluation
    follower = Follower(folder, dash, dash.max_epochs)
    follower.poll()
    ends = fit_ends(runs.read_jsonl(folder / "run.jsonl"))
    whole, _ = fit_times(ends)
    if whole:  # every fit's time, as the clock counts
        dash.receive("time", whole)
    if ends and not dash.skipped:
        _skipped(dash, ends[-1])
    if follower.ended is None and info.status != "running":
        dash.receive("end", info.status, info.reason, True, None, info.duration)
    if warned := recorded_warnings(folder):  # the log pane, as the run's dashboard showed them
        dash.receive("log", warned)
    return dash, follower, info, holder


def _show(args: argparse.Namespace) -> int:
    try:
        folder = runs.find(args.source)
    except FileNotFoundError as error:
        print(f"hookfit show: {error}", file=sys.stderr)
        return 2
    from hookfit.plugins.tui.terminal import NO_URWID, interactive_terminal

    reason = interactive_terminal()
    if args.text or reason is not None:
        if reason == NO_URWID and not args.text:
            print(f"hookfit show: no dashboard: {reason}; the text summary follows", file=sys.stderr)
        model, follower, info, _ = _dashboard(folder, draw=False)
        _print_summary(folder, model, follower, info)
        return 0
    from hookfit.plugins.tui.dashboard import Dashboard

    dash, follower, info, leave = _dashboard(folder)
    assert isinstance(dash, Dashboard)  # (draw=True)
    _interactive(dash, follower, leave, live=info.status == "running")
    _print_summary(folder, dash, follower, runs.load(folder))
    return 0


def _print_summary(folder: Path, dash: DashboardModel, follower: Follower, info: runs.RunInfo) -> None:
    from hookfit.plugins.tui.text import summary, terminal_width

    ended = follower.ended or {}
    _, times = fit_times(fit_ends(runs.read_jsonl(folder / "run.jsonl")))  # (a followed run may have ended since)
    resumed = follower.resumes.get((info.evaluated if info.evaluation else info.resumed_from) or "")  # (runs' rule)
    logged = ended.get("step", follower.step)
    steps = info.steps if info.steps is not None and not info.evaluation else logged  # (runs': the core's end line)
    warned = recorded_warnings(folder)
    state = SimpleNamespace(status="completed" if info.status == "evaluated" else info.status, stop_reason=info.reason,
                            elapsed=info.duration, step=steps,
                            stopped_by=ended.get("by"), resumed_from=resumed, time_split=times or dash.time_split,
                            evaluation=info.evaluation)
    print(f"run {folder}")
    print("\n".join(summary(dash, state, warned=[*unlogged(follower, logged, steps, warned), *warned],
                            width=terminal_width())))


def unlogged(follower: Follower, logged: int, steps: int, warned: Sequence[str]) -> list[str]:
    """A line saying that ``metrics.jsonl`` stops short of the run's ``steps`` (``run.jsonl``'s end
    line counts them), at ``logged`` (a full disk: its writes failed), when it does and has no end
    line; the table and curves below are then of the steps it holds alone."""
    if follower.ended is not None or not isinstance(logged, int) or logged >= steps:
        return []
    why = "; the warning below says why" if any("metrics.jsonl" in line for line in warned) else ""
    if not follower.path.exists():
        return [f"metrics not recorded: the run folder has no metrics.jsonl (the run made {steps} steps){why}"]
    if not logged:
        return [f"metrics not recorded: metrics.jsonl holds none of the run's {steps} steps{why}"]
    return [f"metrics recorded up to step {logged} of {steps}: metrics.jsonl holds nothing later{why}"]


def _interactive(dash: Dashboard, follower: Follower, leave: dict[str, bool], live: bool) -> None:
    """The dashboard on this terminal until ``q``/Esc/Ctrl-C (``leave``); ``live``: follow the
    file."""
    import signal

    import urwid

    from hookfit.plugins.tui.dashboard import PALETTE

    screen = urwid.display.raw.Screen(bracketed_paste_mode=False, focus_reporting=False)
    screen.register_palette(PALETTE)
    screen.set_input_timeouts(max_wait=0.25)
    previous = signal.signal(signal.SIGINT, lambda *_: leave.update(leave=True))
    screen.start()
    try:
        size = None
        idle = 0
        while not leave.get("leave"):
            current = screen.get_cols_rows()
            if current != size:
                size = current
                screen.clear()
            screen.draw_screen(size, dash.render(size))
            keys = screen.get_input(raw_keys=False)
            idle = 0 if keys else idle + 1
            if idle >= 2:  # a lone Esc: take what is pending as complete
                keys, _ = screen.parse_input(None, None, screen.get_available_raw_input(), wait_for_more=False)
            for key in keys:
                if key in ("q", "esc", "ctrl c") and not dash.show_help:
                    leave["leave"] = True
                elif isinstance(key, str):
                    dash.keypress(key)
            if live and follower.ended is None:
                follower.poll()
    finally:
        screen.stop()
        signal.signal(signal.SIGINT, previous)
