"""``hookfit show`` and ``hookfit compare``: runs looked at again from their folders (the
``tui`` plugin adds both through the ``add_commands`` event; the files are read with
:mod:`hookfit.tools.runs`).

``hookfit show [RUN]`` rebuilds the dashboard from the run's ``metrics.jsonl``: the same
table, curves, progress and summary, read-only (``q`` or Esc leaves; nothing is sent to the
run). On a run that is still going (another terminal, torchrun, the background) it follows
the file as the run writes it, until ``q``. Without an interactive terminal it prints the
plain-text summary and curves that a finished run prints.

``hookfit compare RUN RUN...`` draws one metric of several runs in one plot (each run's curve
ends in its number; in colour on a terminal) and a table of their final and best values.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Mapping

from hookfit.tools import runs
from hookfit.payloads import MetricsSnapshot, ResumeInfo, TimeSplit, Value

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only (urwid is imported when drawn)
    from hookfit.plugins.tui.dashboard import Dashboard

SHOW_KEYS = " q leave · tab/←→ metric · w window · l log scale · ? help"
COLOURS = ("36", "33", "35", "32", "34", "31", "96", "93")  # ANSI foregrounds, one per run


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``show`` and ``compare`` subcommands."""
    p = commands.add_parser("show", help="look at a run again: its dashboard, or live while it runs")
    p.add_argument("source", nargs="?", metavar="RUN",
                   help="a run folder or a run name under runs/ (default: the newest run)")
    p.add_argument("--text", action="store_true", help="print the text summary even on a terminal")
    p.set_defaults(run=_show)
    p = commands.add_parser("compare", help="one metric of several runs in one plot, with their final and best values")
    p.add_argument("runs", nargs="+", help="run folders (or run names under runs/)")
    p.add_argument("--metric", help="stage/name, such as valid/loss (default: valid/loss, else train/loss)")
    p.add_argument("--mode", choices=("min", "max"), help="which value of the metric is best, where the runs' "
                                                          "logs do not say (default: the logs', min for loss)")
    p.add_argument("--width", type=int, default=None, help="plot columns (default: the terminal's)")
    p.add_argument("--height", type=int, default=14, help="plot rows")
    p.add_argument("--log", choices=("auto", "on", "off"), default="auto",
                   help="log-scale y axis (auto: when the values span more than two orders of magnitude)")
    p.set_defaults(run=_compare)


# -- a run's rows as the dashboard's messages -------------------------------------------------


def snapshot(row: dict[str, Any], max_epochs: int, final: bool,
             directions: Mapping[str, str] | None = None) -> MetricsSnapshot:
    """A metrics row (:meth:`MetricsSnapshot.row`) as the snapshot it was written from (epoch
    means as every value: a row keeps no other), with the directions of the log's ``"best"``
    line (``stage/name`` -> ``"min"``/``"max"``) that concern its stage."""
    values = {k: Value(float(v), float(v), float(v)) for k, v in row.items()
              if k not in runs.ROW_FIELDS and not k.startswith("lr_") and isinstance(v, (int, float))}
    lr = {k[3:]: float(v) for k, v in row.items() if k.startswith("lr_") and isinstance(v, (int, float))}
    batches = int(row.get("batches", 0))
    stage = str(row.get("stage", "train"))
    best = {name: mode for name, mode in (directions or {}).items() if name.startswith(f"{stage}/")}
    return MetricsSnapshot(
        stage=stage, epoch=int(row.get("epoch", 1)) - 1, max_epochs=max_epochs,
        step=int(row.get("step", 0)), batches=batches, total=batches, samples=int(row.get("samples", 0)),
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


class Follower:
    """Feeds a dashboard from a run folder's ``metrics.jsonl``, from the start and then as it
    grows (complete lines only)."""

    def __init__(self, folder: Path, dashboard: Dashboard, max_epochs: int) -> None:
        self.path = folder / "metrics.jsonl"
        self.dashboard = dashboard
        self.max_epochs = max_epochs
        self.offset = 0
        self.ended: dict[str, Any] | None = None
        self.resumed: ResumeInfo | None = None
        self.step = 0
        self.directions: dict[str, str] = {}  # the log's last "best" line

    def poll(self) -> bool:
        """Read what was added since the last call; whether anything was."""
        import json

        try:
            with open(self.path, "rb") as file:
                file.seek(self.offset)
                data = file.read()
        except FileNotFoundError:
            return False
        end = data.rfind(b"\n")
        if end < 0:
            return False
        self.offset += end + 1
        for line in data[:end].decode("utf-8", "replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                self.feed(row)
        return True

    def feed(self, row: dict[str, Any]) -> None:
        event, dash = row.get("event"), self.dashboard
        if event in ("epoch", "step"):
            if row.get("stage") == "train" or event == "epoch":
                dash.receive("stage", str(row.get("stage", "train")), int(row.get("epoch", 1)) - 1,
                             int(row.get("batches", 0)) or None)
            dash.receive("epoch" if event == "epoch" else "update",
                         snapshot(row, self.max_epochs, event == "epoch", self.directions))
            if event == "epoch":
                dash.receive("stage_end", str(row.get("stage", "train")))
            self.step = int(row.get("step", self.step))
        elif event == "best":
            self.directions = runs.directions([row])
        elif event == "resume":
            self.resumed = ResumeInfo(str(row.get("from")), int(row.get("epoch", 1)) - 1, int(row.get("step", 0)),
                                      int(row.get("batch", 0)), "train")
            dash.receive("resumed", self.resumed)
        elif event == "end":
            self.ended = row
            dash.receive("end", str(row.get("status")), row.get("reason"), True, row.get("by"),
                         float(row.get("time", 0.0)))
            dash.finished = True


def _max_epochs(folder: Path) -> int:
    starts = [r for r in runs.read_jsonl(folder / "run.jsonl") if r.get("event") == "run"]
    given = starts[-1].get("max_epochs") if starts else None
    if isinstance(given, int) and given > 0:
        return given
    epochs = [int(r.get("epoch", 1)) for r in runs.epoch_rows(folder)]
    return max(epochs, default=1)


def _dashboard(folder: Path) -> tuple[Dashboard, Follower, runs.RunInfo, dict[str, bool]]:
    """The dashboard of the run in ``folder``, its follower, the run, and the flag ``leave``
    its keys set (``q``, Esc)."""
    from hookfit.plugins.tui.dashboard import Dashboard

    info = runs.load(folder)
    holder: dict[str, bool] = {}
    dash = Dashboard(_max_epochs(folder), None, on_stop=lambda: holder.update(leave=True),
                     on_leave=lambda: holder.update(leave=True))
    dash.keys = SHOW_KEYS
    follower = Follower(folder, dash, dash.max_epochs)
    follower.poll()
    ends = [r for r in runs.read_jsonl(folder / "run.jsonl") if r.get("event") == "end"]
    if ends and isinstance(ends[-1].get("time_split"), dict):
        dash.receive("time", time_split(ends[-1]["time_split"]))
    if follower.ended is None and info.status != "running":
        dash.receive("end", info.status, info.reason, True, None, info.duration)
    return dash, follower, info, holder


def _show(args: argparse.Namespace) -> int:
    try:
        folder = runs.find(args.source)
    except FileNotFoundError as error:
        print(f"hookfit show: {error}", file=sys.stderr)
        return 2
    dash, follower, info, leave = _dashboard(folder)
    from hookfit.plugins.tui.terminal import interactive_terminal

    if args.text or interactive_terminal() is not None:
        _print_summary(folder, dash, follower, info)
        return 0
    _interactive(dash, follower, leave, live=info.status == "running")
    _print_summary(folder, dash, follower, runs.load(folder))
    return 0


def _print_summary(folder: Path, dash: Dashboard, follower: Follower, info: runs.RunInfo) -> None:
    from hookfit.plugins.tui.renderer import summary

    ended = follower.ended or {}
    state = SimpleNamespace(status=info.status, stop_reason=info.reason, elapsed=info.duration or 0.0,
                            step=ended.get("step", follower.step), stopped_by=ended.get("by"),
                            resumed_from=follower.resumed, time_split=dash.time_split)
    print(f"run {folder}")
    print("\n".join(summary(dash, state)))


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


# -- compare -----------------------------------------------------------------------------------


def _compare(args: argparse.Namespace) -> int:
    from hookfit.plugins.tui.plot import text_plot

    folders = []
    for source in args.runs:
        try:
            folders.append(runs.find(source))
        except FileNotFoundError as error:
            print(f"hookfit compare: {error}", file=sys.stderr)
            return 2
    rows = {folder: runs.epoch_rows(folder) for folder in folders}
    metric = args.metric or next((m for m in (runs.default_metric(r) for r in rows.values()) if m), None)
    if metric is None:
        print("hookfit compare: these runs have no metrics (no metrics.jsonl epochs)", file=sys.stderr)
        return 2
    if "/" not in metric:
        metric = f"train/{metric}"
    curves = {folder: runs.series(r, metric) for folder, r in rows.items()}
    missing = [str(f) for f, points in curves.items() if not points]
    if len(missing) == len(folders):
        names = sorted({n for r in rows.values() for n in runs.metric_names(r)})
        print(f"hookfit compare: no run has {metric}; they have: {', '.join(names) or 'nothing'}", file=sys.stderr)
        return 2
    colour = sys.stdout.isatty() and os.environ.get("NO_COLOR") is None
    width = args.width or max(20, min(120, _columns() - 14))
    series = {f"{i}": [(float(s), v, v) for s, _, v in points] for i, points in enumerate(curves.values(), 1)}
    values = [v for points in curves.values() for _, _, v in points]
    log = args.log == "on" or (args.log == "auto" and _spans_decades(values))
    if log and min(values) <= 0:
        log = False
    print(f"{metric} over steps{' (log scale)' if log else ''}")
    for line in text_plot(series, width=width, height=max(3, args.height), log=log, marks=True,
                          colours=COLOURS if colour else None):
        print(line)
    table = [("#", "RUN", "STATUS", "EPOCHS", "STEPS", "FINAL", "BEST")]
    infos = [runs.load(folder, metric=metric, mode=args.mode) for folder in folders]
    for i, (folder, info) in enumerate(zip(folders, infos), 1):
        points = curves[folder]
        final = f"{points[-1][2]:.4g}" if points else "-"
        best = "-" if info.best is None else f"{info.best[1]:.4g} (epoch {info.best[2]})"
        table.append((str(i), str(folder), info.status, str(info.epochs or "-"), str(info.steps or "-"), final, best))
    widths = [max(len(r[c]) for r in table) for c in range(len(table[0]))]
    print()
    for n, row in enumerate(table):
        text = "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
        if colour and n:
            text = f"\x1b[{COLOURS[(n - 1) % len(COLOURS)]}m{text[:len(row[0])]}\x1b[0m{text[len(row[0]):]}"
        print(text)
    for name in missing:
        print(f"(no {metric} in {name})")
    if any(info.mode is None for folder, info in zip(folders, infos) if curves[folder]):
        print(f"(no best for {metric}: no direction was configured; give Metrics(best={{...}}) in the run, "
              f"or --mode min|max here)")
    return 0


def _columns() -> int:
    try:
        return os.get_terminal_size().columns
    except OSError:
        return 80


def _spans_decades(values: list[float]) -> bool:
    """Whether positive ``values`` span more than two orders of magnitude."""
    positive = [v for v in values if v > 0]
    return len(positive) == len(values) and bool(positive) and max(positive) / min(positive) > 100
