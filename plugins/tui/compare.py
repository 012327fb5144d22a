"""``hookfit compare RUN RUN...``: one metric of several runs in one plot (each run's curve
ends in its number; in colour on a terminal) and a table of their final and best values, the
runs read with :mod:`hookfit.tools.runs`. A RUN that is a folder of runs (a sweep's
``runs/sweep``, a run name with several runs) stands for every training run under it."""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from hookfit.errors import HookfitWarning
from hookfit.tools import runs

COLOURS = ("36", "33", "35", "32", "34", "31", "96", "93")  # ANSI foregrounds, one per run


def add_compare(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``compare`` subcommand."""
    p = commands.add_parser("compare", help="one metric of several runs in one plot, with their final and best values")
    p.add_argument("runs", nargs="+", help="run folders, or folders of runs and run names under runs/ (such as a "
                                           "sweep's runs/sweep): every training run under each, as hookfit runs "
                                           "lists them")
    p.add_argument("--metric", help="stage/name, such as valid/loss (default: the metric the first run configured a "
                                    "direction for, Metrics(best=...), else valid/loss, else train/loss)")
    p.add_argument("--mode", choices=("min", "max"), help="which value of the metric is best, where the runs' "
                                                          "logs do not say (default: the logs', min for loss)")
    p.add_argument("--width", type=int, default=None, help="plot columns (default: the terminal's)")
    p.add_argument("--height", type=int, default=14, help="plot rows")
    p.add_argument("--log", choices=("auto", "on", "off"), default="auto",
                   help="log-scale y axis (auto: when the values span more than two orders of magnitude)")
    p.set_defaults(run=_compare)


def _compare(args: argparse.Namespace) -> int:
    from hookfit.plugins.support.plot import text_plot

    folders: list[Path] = []
    for source in args.runs:
        try:
            found = _every_run(source)
        except FileNotFoundError as error:
            print(f"hookfit compare: {error}", file=sys.stderr)
            return 2
        folders += [folder for folder in found if folder not in folders]
    rows = {folder: runs.epoch_rows(folder) for folder in folders}
    ranked = (runs.default_metric(r, runs.directions(runs.read_metrics(f / "metrics.jsonl"))) for f, r in rows.items())
    metric = args.metric or next((m for m in ranked if m), None)
    if metric is None:
        print("hookfit compare: these runs have no metrics (no metrics.jsonl epochs)", file=sys.stderr)
        return 2
    metric = metric if "/" in metric else f"train/{metric}"
    curves = {folder: runs.series(r, metric) for folder, r in rows.items()}
    missing = [str(f) for f, points in curves.items() if not points]
    if len(missing) == len(folders):
        print(f"hookfit compare: {_missing(metric, args.metric, list(rows.values()))}", file=sys.stderr)
        return 2
    loaded = {folder: runs.load(folder, metric=metric, mode=args.mode) for folder in folders}
    infos = dict(sorted(loaded.items(), key=lambda item: _rank(item[1])))  # ranked: the table's rows, curves' numbers
    curves = {folder: curves[folder] for folder in infos}
    colour = sys.stdout.isatty() and os.environ.get("NO_COLOR") is None
    width = args.width or max(20, min(120, _columns() - 14))
    series = {f"{i}": [(float(s), v, v) for s, _, v in points if math.isfinite(v)]
              for i, points in enumerate(curves.values(), 1)}
    values = [v for points in series.values() for _, v, _ in points]
    steps = [float(s) for points in curves.values() for s, _, _ in points]
    log = (args.log == "on" or (args.log == "auto" and _spans_decades(values))) and min(values, default=0) > 0
    print(f"{metric} over steps{' (log scale)' if log else ''}")
    for line in text_plot(series, width=width, height=max(3, args.height), log=log, marks=True,
                          colours=COLOURS if colour else None, x_range=(min(steps), max(steps)),
                          nonfinite=[r for points in curves.values() for r in _nonfinite(points)],
                          undrawn={name: float(points[-1][0]) for name, points in zip(series, curves.values())
                                   if points and not series[name]}):
        print(line)
    table = [("#", "RUN", "STATUS", "EPOCHS", "STEPS", "FINAL", "BEST")]
    for i, (folder, info) in enumerate(infos.items(), 1):
        final = "-" if info.final is None else f"{info.final[0]:.4g}" + (  # (NaN or inf: the run diverged)
            " (partial)" if info.partial else "")
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
    if any(info.partial for info in infos.values()):
        print(runs.PARTIAL)
    if any(_nonfinite(points) for points in curves.values()):
        print(f"(×: where {metric} was NaN or infinite, not drawn; a run that ended so diverged, and is ranked last)")
    for i, info in enumerate(infos.values(), 1):
        if info.diverged is not None and info.final is not None:
            print(f"({i} {info.folder}: {metric} {info.final[0]:.4g} from epoch {info.diverged})")
    if any(info.mode is None for folder, info in infos.items() if curves[folder]):
        print(f"(no best for {metric}: no direction was configured; give Metrics(best={{...}}) in the run, "
              f"or --mode min|max here)")
    return 0


def _missing(metric: str, given: str | None, rows: list[list[dict[str, Any]]]) -> str:
    """What to say when no run has ``metric`` (``given`` as the user gave it): the metrics the runs
    have, every other name ``--metric`` accepts, and those ending in ``/<given>``, if any."""
    metrics = sorted({n for r in rows for n in runs.metric_names(r)})
    others = sorted({n for r in rows for n in runs.series_names(r)} - set(metrics))
    text = f"no run has {metric}; they have: {', '.join(metrics) or 'nothing'}"
    text += f" (and {', '.join(others)})" if others else ""
    near = [n for n in metrics + others if given and n.endswith(f"/{given}")]
    return text + (f"; did you mean {' or '.join(near)}?" if near else "")


def _every_run(source: str) -> list[Path]:
    """The runs ``source`` names: a run folder; every training run under a folder of runs or a run
    name under ``runs/`` (as ``hookfit runs`` lists them, newest first; a folder of evaluations alone
    among them is no training run: :func:`hookfit.tools.runs.find`), ``FileNotFoundError`` without one."""
    first = runs.find(source)  # (says why where there is none)
    path = Path(source) if Path(source).exists() else Path("runs") / source
    if first == path:
        return [first]
    with warnings.catch_warnings():  # (what is damaged is said where the runs are read)
        warnings.simplefilter("ignore", HookfitWarning)
        return [folder for folder in runs.run_folders(path) if not runs.load(folder).evaluation]


def _rank(info: runs.RunInfo) -> tuple[bool, bool, float]:
    """Where a run stands in ``hookfit compare``: by its best, best first in the metric's direction; a run
    without one after those, and a run whose metric ended NaN or infinite (it diverged, whatever its
    best before) after every other (in the order given: the sort is stable)."""
    if info.best is None:
        return info.diverged is not None, True, 0.0
    return info.diverged is not None, False, info.best[1] if info.mode == "min" else -info.best[1]


def _nonfinite(points: list[tuple[int, int, float]]) -> list[tuple[float, float]]:
    """The runs of steps ``(first, last)`` where a curve's values are NaN or infinite."""
    out: list[list[float]] = []
    for i, (step, _, value) in enumerate(points):
        if math.isfinite(value):
            continue
        if out and i and not math.isfinite(points[i - 1][2]):  # the run of the point before goes on
            out[-1][1] = float(step)
        else:
            out.append([float(step), float(step)])
    return [(first, last) for first, last in out]


def _columns() -> int:
    try:
        return os.get_terminal_size().columns
    except OSError:
        return 80


def _spans_decades(values: list[float]) -> bool:
    """Whether positive ``values`` span more than two orders of magnitude."""
    positive = [v for v in values if v > 0]
    return len(positive) == len(values) and bool(positive) and max(positive) / min(positive) > 100
