"""How much of hookfit's own Python runs per training batch: opcodes and calls, counted.

A count, not a time: the same tree gives the same numbers on a loaded machine or a quiet one,
so a change of a few opcodes a batch, far under the clock's spread between runs, is visible.
It counts Python bytecode only; what a call into torch or C costs is not in it (``counts.py``
counts instructions under valgrind, that included).

How a batch is counted: ``sys.settrace`` with ``frame.f_trace_opcodes = True``, counting the
opcode events and the calls of the frames whose code lives in hookfit's own folders, the
package's ``core/`` and ``plugins/`` (found from ``hookfit.__file__`` and
``hookfit.plugins.__file__``: the checkout's folders for an editable install, the package's for
one installed apart). pluggy, torch and this script are not counted. A variant of
``overhead.py`` (a :class:`overhead.HookfitRunner`) runs one ``Loop`` of two epochs over its
workload; only the training stage of the second epoch is counted (from after every plugin's
``stage_start`` to before any ``stage_end``, as ``overhead.StageClock`` times it), so the first
epoch's one-off work (lazy imports, first-use checks) is not. Two such runs, of a short and a
long pass (``--batches 200,400``), and their difference divided by the difference in batches is
the per-batch count, free of what a stage costs once. Work driven by the clock is off, as in
``counts.py`` (:data:`counts.UNTIMED`: no publication of the metrics by time, so no console line;
the core's live time split put off), and the garbage collector is off during the runs: a count
does not depend on the machine's speed. Calls are ``call`` trace events, so a generator's resume
counts as one.

The count runs against whichever hookfit is importable, so another tree installed into a folder
of its own is counted by putting that folder first on ``PYTHONPATH`` (the header says which
hookfit was counted):

    python benchmarks/opcodes.py                       # the default stack, framework-only workload, ~10 s
    python benchmarks/opcodes.py --variant core
    python benchmarks/opcodes.py --json runs/new.json --against runs/old.json   # per-function difference
    PYTHONPATH=/tmp/old-site python benchmarks/opcodes.py --json runs/old.json  # another tree, installed apart
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import math
import os
import sys
import tempfile
import warnings
from collections import Counter
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any, Callable, Sequence

import hookfit
import hookfit.plugins
import hookfit.run
from hookfit import hookimpl

import counts
import overhead

WORKLOADS: dict[str, Callable[[int], overhead.Workload]] = {
    "framework": overhead.framework_workload,
    "model": overhead.model_workload,
}
COUNTED_EPOCH = 1
"""The epoch (from 0) whose training stage is counted: the second."""
UNTIMED_INTERVAL = 1e9
"""The metrics' publication interval in :data:`counts.UNTIMED`, for a metrics plugin given to
``Loop``, which reads no config file."""


def folders() -> list[tuple[str, str]]:
    """hookfit's own folders, as (path, the name the report gives it), the plugins' first: in an
    installed package ``plugins/`` lies inside the package's folder, in a checkout beside it."""
    core = os.path.dirname(os.path.realpath(hookfit.__file__))
    plugins = os.path.dirname(os.path.realpath(hookfit.plugins.__file__))
    return [(plugins, "plugins"), (core, "core")]


def where(filename: str, roots: Sequence[tuple[str, str]]) -> str | None:
    """``core/...`` or ``plugins/...`` for a file of hookfit's own, None for any other."""
    path = os.path.realpath(filename)
    for root, name in roots:
        if path.startswith(root + os.sep):
            return f"{name}/{os.path.relpath(path, root)}"
    return None


@dataclass(frozen=True)
class Function:
    """One code object of hookfit's, by its file under ``core/`` or ``plugins/``, its qualified
    name and its first line."""

    file: str
    name: str
    line: int


class Tracer:
    """The trace functions: every new frame is looked at once (``call``); a frame of hookfit's
    gets opcode events, counted while :attr:`on` is true, and its calls are counted then too."""

    def __init__(self) -> None:
        self.roots = folders()
        self.on = False
        self.opcodes: Counter[CodeType] = Counter()
        self.calls: Counter[CodeType] = Counter()
        self.ours: dict[CodeType, bool] = {}

    def call(self, frame: FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        ours = self.ours.get(code)
        if ours is None:
            ours = self.ours[code] = where(code.co_filename, self.roots) is not None
        if not ours:
            return None
        frame.f_trace_lines = False
        frame.f_trace_opcodes = True
        if self.on:
            self.calls[code] += 1
        return self.local

    def local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode" and self.on:
            self.opcodes[frame.f_code] += 1
        return self.local

    def totals(self) -> dict[Function, tuple[int, int]]:
        """(opcodes, calls) of each function that ran while counting."""
        out: dict[Function, tuple[int, int]] = {}
        for code in set(self.opcodes) | set(self.calls):
            file = where(code.co_filename, self.roots) or code.co_filename
            name = getattr(code, "co_qualname", code.co_name)
            out[Function(file, name, code.co_firstlineno)] = (self.opcodes[code], self.calls[code])
        return out


class Window:
    """Turns the count on for the training stage of :data:`COUNTED_EPOCH`: after every other
    plugin's ``stage_start``, until before any ``stage_end``."""

    name = "opcode_window"

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.opened = 0

    @hookimpl(trylast=True)
    def stage_start(self, loop: Any, stage: str) -> None:
        if stage == "train" and loop.state.epoch == COUNTED_EPOCH:
            self.tracer.on = True
            self.opened += 1

    @hookimpl(tryfirst=True)
    def stage_end(self, stage: str) -> None:
        if stage == "train":
            self.tracer.on = False


def untimed() -> None:
    """No clock-driven work in this process (see :data:`counts.UNTIMED`)."""
    config = tempfile.NamedTemporaryFile("w", prefix="hookfit-opcodes-", suffix=".toml", delete=False)
    with config:
        config.write(counts.UNTIMED)
    atexit.register(os.unlink, config.name)
    os.environ["HOOKFIT_CONFIG"] = config.name
    hookfit.run.Run.TIME_SPLIT_INTERVAL = math.inf  # the stage's split once, at its end


def count(variant: str, workload_name: str, batches: int) -> dict[Function, tuple[int, int]]:
    """The opcodes and calls of each hookfit function in the counted stage of one run."""
    workload = WORKLOADS[workload_name](batches)
    runner = overhead.VARIANTS[variant](workload)
    if not isinstance(runner, overhead.HookfitRunner):
        raise SystemExit(f"opcodes.py: the {variant} variant runs no hookfit Loop; nothing of hookfit's to count")
    for plugin in runner.plugins:  # one given to Loop reads no config file (the device-path variant's)
        if getattr(plugin, "name", None) == "metrics":
            plugin.interval = UNTIMED_INTERVAL
    tracer = Tracer()
    window = Window(tracer)
    runner.plugins = (*runner.plugins, window)
    runner.max_epochs = COUNTED_EPOCH + 1
    gc.collect()
    gc.disable()  # no finalizer runs inside a counted frame
    try:
        with workload.setting(), warnings.catch_warnings():
            # (the config file's [plugins.metrics] is not for a metrics plugin given to Loop: set above)
            warnings.filterwarnings("ignore", message=r".*\[plugins\.metrics\] is not used")
            sys.settrace(tracer.call)
            try:
                runner()
            finally:
                sys.settrace(None)
    finally:
        gc.enable()
    if window.opened != 1:
        raise RuntimeError(f"the training stage of epoch {COUNTED_EPOCH + 1} started {window.opened} times, not once")
    loop: Any = runner.last_loop
    metrics = loop.run.pm.get_plugin("metrics")
    if metrics is not None and metrics.interval < UNTIMED_INTERVAL:
        raise RuntimeError(f"the metrics plugin publishes every {metrics.interval:g} s: the untimed config was not read")
    return tracer.totals()


def per_batch(short: dict[Function, tuple[int, int]], long: dict[Function, tuple[int, int]],
              batches: Sequence[int]) -> dict[str, Any]:
    """The long run minus the short one, per batch of difference, in total and per function
    (functions whose difference is zero left out; most opcodes a batch first)."""
    span = batches[1] - batches[0]
    rows: list[dict[str, Any]] = []
    for function in {**short, **long}:
        (o1, c1), (o2, c2) = short.get(function, (0, 0)), long.get(function, (0, 0))
        if o2 != o1 or c2 != c1:
            rows.append({"function": function.name, "file": function.file, "line": function.line,
                         "opcodes": (o2 - o1) / span, "calls": (c2 - c1) / span})
    rows.sort(key=lambda r: (-r["opcodes"], r["file"], r["function"]))
    return {"opcodes": sum(r["opcodes"] for r in rows), "calls": sum(r["calls"] for r in rows), "functions": rows}


def keyed(rows: list[dict[str, Any]], other: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``rows`` by function name where that name is one function's on both sides (so a function
    that moved to another file is compared with itself), by file and name otherwise."""
    def once(group: list[dict[str, Any]]) -> set[str]:
        names = Counter(r["function"] for r in group)
        return {name for name, n in names.items() if n == 1}

    unique = once(rows) & once(other)
    return {r["function"] if r["function"] in unique else f"{r['file']}:{r['function']}": r for r in rows}


def render(out: dict[str, Any], top: int) -> str:
    lines = [f"hookfit {out['hookfit_version']} at {out['hookfit']}",
             f"variant {out['variant']}, {out['workload']} workload, training stage of epoch {COUNTED_EPOCH + 1}, "
             f"({out['batches'][1]} - {out['batches'][0]} batches) / {out['batches'][1] - out['batches'][0]}:",
             f"  opcodes a batch: {out['opcodes']:g}",
             f"  Python calls a batch: {out['calls']:g}",
             f"  per function (the {top} with most opcodes a batch):",
             f"  {'opcodes':>9} {'calls':>6}  function"]
    for row in out["functions"][:top]:
        lines.append(f"  {row['opcodes']:9g} {row['calls']:6g}  {row['function']}  ({row['file']}:{row['line']})")
    if len(out["functions"]) > top:
        rest = out["functions"][top:]
        lines.append(f"  {sum(r['opcodes'] for r in rest):9g} {sum(r['calls'] for r in rest):6g}  "
                     f"{len(rest)} more functions")
    return "\n".join(lines)


def difference(old: dict[str, Any], new: dict[str, Any]) -> str:
    """Per function, what ``new`` runs a batch more (or less) than ``old``."""
    before = keyed(old["functions"], new["functions"])
    after = keyed(new["functions"], old["functions"])
    lines = [f"against {old['hookfit']} (variant {old['variant']}, {old['workload']} workload): "
             f"opcodes a batch {old['opcodes']:g} -> {new['opcodes']:g} ({new['opcodes'] - old['opcodes']:+g}), "
             f"calls {old['calls']:g} -> {new['calls']:g} ({new['calls'] - old['calls']:+g})",
             f"  {'before':>9} {'after':>9} {'change':>9}  function (opcodes a batch)"]
    rows = []
    for name in sorted(set(before) | set(after)):
        b, a = before.get(name), after.get(name)
        ob, oa = (b["opcodes"] if b else 0.0), (a["opcodes"] if a else 0.0)
        cb, ca = (b["calls"] if b else 0.0), (a["calls"] if a else 0.0)
        if ob != oa or cb != ca:
            rows.append((oa - ob, name, ob, oa, cb, ca))
    rows.sort(key=lambda r: (-abs(r[0]), r[1]))
    for change, name, ob, oa, cb, ca in rows:
        files = dict.fromkeys(r["file"] for r in (before.get(name), after.get(name)) if r is not None)
        lines.append(f"  {ob:9g} {oa:9g} {change:+9g}  {name.split(':')[-1]} ({' -> '.join(files)}; "
                     f"calls {cb:g} -> {ca:g})")
    if not rows:
        lines.append("  no function differs")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    counted = [name for name in overhead.VARIANTS if name not in ("raw", "call", "dashboard", *overhead.MODEL_ONLY)]
    add("--variant", default="default", choices=counted,
        help="the overhead.py variant (default: default, the default stack)")
    add("--workload", default="framework", choices=list(WORKLOADS),
        help="framework (no-op step calls, the default) or model (the tiny model)")
    add("--batches", default="200,400", help="the short and the long pass, in batches (default 200,400)")
    add("--top", type=int, default=10, help="functions shown (default 10; --json holds all)")
    add("--json", metavar="PATH", help="also write the counts as JSON")
    add("--against", metavar="PATH", help="an earlier --json output: also print the per-function difference")
    args = parser.parse_args(argv)
    try:
        batches = [int(s) for s in args.batches.split(",")]
    except ValueError:
        parser.error(f"--batches takes two whole numbers, e.g. 200,400, not {args.batches!r}")
    if len(batches) != 2 or not 0 < batches[0] < batches[1]:
        parser.error("--batches takes two sizes, the short pass first: e.g. 200,400")
    import torch

    torch.set_num_threads(1)
    untimed()
    short, long = (count(args.variant, args.workload, n) for n in batches)
    out = {"hookfit": os.path.dirname(os.path.realpath(hookfit.__file__)), "hookfit_version": hookfit.__version__,
           "variant": args.variant, "workload": args.workload, "batches": batches,
           "counted": f"training stage of epoch {COUNTED_EPOCH + 1}",
           **per_batch(short, long, batches)}
    print(render(out, args.top))
    if args.against:
        with open(args.against, encoding="utf-8") as handle:
            print(difference(json.load(handle), out))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(out, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
