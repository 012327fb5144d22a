"""How much hookfit's core adds per training step: a measurement, never an assertion.

Two workloads, each timed as rounds of full passes over in-memory data, with every variant
interleaved in one process (the order rotates each round) and compared round by round with a
hand-written loop:

* ``model``: a tiny MLP (Linear 32->32, ReLU, Linear 32->1; batch 64; MSE; SGD lr 0.01; one
  torch thread). ``raw`` is ``for x, y in data: zero_grad, forward, backward, step``; ``core``
  runs the same work as a step function under ``hookfit.Loop`` with no plugin at all.
* ``framework``: the same loops with every call of the step a no-op (:func:`framework_workload`),
  so the difference is the framework's own cost per batch, optim's path included.

For a ``hookfit.Loop`` variant, two times are taken per round: ``run`` covers the batches of
the training stage with every per-batch event (:class:`StageClock`), which is what the per-step
targets are about; ``fit`` is the whole ``Loop(...).fit()`` call, whose difference from ``run``
(discovery, registration, per-run and per-stage events such as the metrics summary, the
dashboard's start) is a fixed cost paid once per run or epoch, reported separately.

Variants are a registry, :data:`VARIANTS` (name -> builder); a builder takes a
:class:`Workload` and returns a runner, a callable that makes one full pass and returns its
:class:`Timing`. ``raw`` is the baseline every other variant is compared with.

    python benchmarks/overhead.py                 # both tables (~15 s on 2 cores)
    python benchmarks/overhead.py --framework-only
    python benchmarks/overhead.py --rounds 1201 --json runs/overhead.json   # ~1 min, tighter CI
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import atexit
import platform
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Sequence

import tempfile
import threading

import torch

import hookfit
from hookfit import discovery, hookimpl

TARGET_RATIO = 1.03
TARGETS = {  # (workload, variant, compared with) -> the most that variant may add
    ("model", "core", "raw"): 1.03,
    ("model", "default", "raw"): 1.10,
    ("big", "default", "raw"): 1.01,
    ("model", "dashboard", "default"): 1.05,
}
ADDED_TARGETS = {  # (workload, variant) -> the most it may add over raw, in us a step
    ("model", "core"): 1.0,
    ("model", "default"): 5.0,
}
TARGET_TEXT = ("targets: core <= 3% over raw; default stack <= 10% over raw (tiny) and <= 1% "
               "(compute-bound); dashboard <= 5% over the console stack; added per step on the tiny model: "
               "core <= 1 us, default stack <= 5 us")


# -- workloads -------------------------------------------------------------------------------
def _batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(64, 32, generator=gen), torch.randn(64, 1, generator=gen)


@dataclass
class Workload:
    """What every variant runs: the same data and work, as a step function and as a
    hand-written loop."""

    name: str
    data: list[Any]
    make: Callable[[], Parts]
    """Fresh parts for one variant: its own model copy and optimizer."""
    setting: Callable[[], Any] = contextlib.nullcontext
    """A context every pass of this workload runs in (see :func:`framework_workload`)."""
    device: str = "cpu"
    """Where the model and batches are: every timed span ends with a synchronisation there."""


@dataclass
class Parts:
    """``step(loop, batch)`` steps the optimizer itself (core variants); ``managed_step`` does
    the same work through the optim plugin (``loop.backward``, ``loop.optimizers``), for the
    stack variants; ``raw_pass()`` is the hand-written loop over the data."""

    step: Callable[[Any, Any], Any]
    managed_step: Callable[[Any, Any], Any]
    raw_pass: Callable[[], None]
    model: Any
    optimizer: Any
    inline_pass: Callable[[], None] | None = None
    """The raw loop with the default stack's per-batch work written into it (the model
    workload only): see :func:`inline_variant`."""
    floor_pass: Callable[[], None] | None = None
    """The raw loop with the least of that work (model workload only): see :func:`floor_variant`."""


def model_workload(batches: int, seed: int = 0, big: bool = False, device: str = "cpu") -> Workload:
    """The tiny model (or, with ``big``, the compute-bound 4 x Linear 1024 on batches of 256):
    each variant gets its own copy of one seeded model and its own SGD. With ``device`` (e.g.
    ``"cuda"``) the model and the batches are made there beforehand."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    nn = torch.nn
    if big:
        data = [(torch.randn(256, 1024, generator=gen), torch.randn(256, 1, generator=gen)) for _ in range(batches)]
        template = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(1024, 1024), nn.ReLU())], nn.Linear(1024, 1))
    else:
        data = [_batch(gen) for _ in range(batches)]
        template = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    if device != "cpu":
        data = [(x.to(device), y.to(device)) for x, y in data]
        template = template.to(device)

    def make() -> Parts:
        model = copy.deepcopy(template)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        mse = torch.nn.functional.mse_loss

        def step(loop: Any, batch: Any) -> torch.Tensor:
            x, y = batch
            opt.zero_grad()
            loss = mse(model(x), y)
            loss.backward()
            opt.step()
            return loss

        def managed_step(loop: Any, batch: Any) -> dict[str, torch.Tensor]:
            x, y = batch
            loop.optimizers.zero_grad()
            loss = mse(model(x), y)
            loop.backward(loss)
            loop.optimizers.step()
            return {"loss": loss}

        def raw_pass() -> None:
            for x, y in data:
                opt.zero_grad()
                loss = mse(model(x), y)
                loss.backward()
                opt.step()

        def inline_pass() -> None:
            clock, isfinite, interval = time.perf_counter, math.isfinite, 0.5
            kept: list[tuple[float, int]] = []
            steps = batches = samples = 0
            waited = stepping = 0.0
            due = clock() + interval
            t0 = clock()
            for x, y in data:
                t1 = clock()  # the core: where the time goes (waiting for data, the step)
                waited += t1 - t0
                opt.zero_grad()
                loss = mse(model(x), y)
                if isfinite(loss.item()):  # optim: a non-finite loss skips the step
                    loss.backward()
                    opt.step()
                    steps += 1
                stepping += clock() - t1
                n = x.shape[0]  # metrics: the batch's loss, weighted by its size
                batches += 1
                samples += n
                kept.append((loss.item(), n))
                t0 = clock()
                if t0 >= due:  # a publication, then a fresh list
                    due = t0 + interval
                    kept = []

        def floor_pass() -> None:
            clock, isfinite, interval = time.perf_counter, math.isfinite, 0.5
            kept: list[tuple[float, int]] = []
            due = clock() + interval
            for x, y in data:
                opt.zero_grad()
                loss = mse(model(x), y)
                value = loss.item()  # one read, for the check and the metric
                if isfinite(value):
                    loss.backward()
                    opt.step()
                kept.append((value, x.shape[0]))
                if clock() >= due:
                    due = clock() + interval
                    kept = []

        return Parts(step, managed_step, raw_pass, model, opt, inline_pass, floor_pass)

    return Workload("big" if big else "model", data, make, device=device)


@contextlib.contextmanager
def _no_backward() -> Iterator[None]:
    """``Tensor.backward`` does nothing inside (for the framework-only workload)."""
    original = torch.Tensor.backward
    torch.Tensor.backward = lambda self, *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.backward = original  # type: ignore[method-assign]


def framework_workload(batches: int, seed: int = 0) -> Workload:
    """No model: a step's four calls (``zero_grad``, forward, ``backward``, ``step``) do
    nothing. The loss is a pre-made 0-d tensor, the optimizer's ``step`` and ``zero_grad`` are
    no-ops, and ``Tensor.backward`` is one during the passes; so ``raw`` costs next to nothing
    and a variant's difference is the framework's own cost per batch, the optim plugin's path
    (``loop.backward``, ``loop.optimizers.step()``) included."""
    gen = torch.Generator().manual_seed(seed)
    pool = [_batch(gen) for _ in range(64)]
    data = [pool[i % len(pool)] for i in range(batches)]
    loss = torch.zeros(())

    def make() -> Parts:
        opt = torch.optim.SGD([torch.zeros((), requires_grad=True)], lr=0.0)
        opt.step = lambda closure=None: None  # type: ignore[method-assign]
        opt.zero_grad = lambda set_to_none=True: None  # type: ignore[method-assign]

        def step(loop: Any, batch: Any) -> torch.Tensor:
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss

        def managed_step(loop: Any, batch: Any) -> dict[str, torch.Tensor]:
            loop.optimizers.zero_grad()
            loop.backward(loss)
            loop.optimizers.step()
            return {"loss": loss}

        def raw_pass() -> None:
            for batch in data:
                opt.zero_grad()
                loss.backward()
                opt.step()

        return Parts(step, managed_step, raw_pass, None, opt)

    return Workload("framework", data, make, _no_backward)


# -- variants --------------------------------------------------------------------------------
@dataclass
class Timing:
    """One full pass. ``run``: the per-step part (for hookfit, ``fit_start`` to ``fit_end``);
    ``fit``: the whole call, fixed per-run costs included (equal to ``run`` for ``raw``)."""

    run: float
    fit: float


Runner = Callable[[], Timing]


def _sync(device: str) -> Callable[[], None]:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device == "cpu":
        return lambda: None
    return getattr(torch, torch.device(device).type).synchronize


def _timed(workload: Workload, one_pass: Callable[[], None]) -> Runner:
    """A runner for a hand-written pass: its time, up to the device's last queued work."""
    clock, sync = time.perf_counter, _sync(workload.device)

    def run() -> Timing:
        sync()
        start = clock()
        one_pass()
        sync()
        elapsed = clock() - start
        return Timing(elapsed, elapsed)

    return run


def raw_variant(workload: Workload) -> Runner:
    return _timed(workload, workload.make().raw_pass)


def inline_variant(workload: Workload) -> Runner:
    """What the default stack does a batch on the CPU, written by hand into the raw loop, in one
    frame, with no framework: three clock reads (the core's time split, metrics' publication
    check), optim's non-finite check (one host read of the loss) and step count, metrics'
    weighted value (a second read, the batch size, an append). ``default`` minus ``inline`` is
    what the framework's structure costs (model workload only; on an accelerator the default
    stack reads nothing a batch, so there this is no floor of it)."""
    return _timed(workload, _hand_written(workload, "inline"))


def floor_variant(workload: Workload) -> Runner:
    """The least any implementation of the default stack's behaviours does a batch, written
    into the raw loop: one host read of the loss, shared by the non-finite check and the
    metric, one append of the weighted value, one clock read for the publication; no time
    split. What ``floor`` adds over ``raw`` is what Python between two steps costs on this
    machine; a per-step target under it cannot be met here (model workload only)."""
    return _timed(workload, _hand_written(workload, "floor"))


def _hand_written(workload: Workload, name: str) -> Callable[[], None]:
    one_pass = getattr(workload.make(), f"{name}_pass")
    if one_pass is None:
        raise SystemExit(f"the {name} variant has no {workload.name} workload")
    return one_pass


def call_variant(workload: Workload) -> Runner:
    """The floor under any framework built on step functions: a bare loop that calls the step
    function (the ``core`` variant's, which steps its optimizer itself) for every batch and
    does nothing else."""
    step, data = workload.make().step, workload.data
    clock, sync = time.perf_counter, _sync(workload.device)

    def run() -> Timing:
        sync()
        start = clock()
        for batch in data:
            # kept until the next step has returned, as the raw loop keeps its loss (and the
            # core its output): a loss dropped at once frees its graph, and with it the
            # parameters' AccumulateGrad nodes, which the next forward then builds anew
            last = step(None, batch)  # noqa: F841
        sync()
        elapsed = clock() - start
        return Timing(elapsed, elapsed)

    return run


class StageClock:
    """Times the batches of the training stage, every per-batch event included, without a
    per-batch hook: it starts after every other plugin's ``stage_start`` and stops before any
    ``stage_end``, so per-stage work (a metrics summary) counts as a fixed cost, not per step."""

    name = "stage_clock"

    def __init__(self, device: str = "cpu") -> None:
        self.start = self.end = 0.0
        self.sync = _sync(device)

    @hookimpl(trylast=True)
    def stage_start(self, stage: str) -> None:
        if stage == "train":
            self.sync()
            self.start = time.perf_counter()

    @hookimpl(tryfirst=True)
    def stage_end(self, stage: str) -> None:
        if stage == "train":
            self.sync()
            self.end = time.perf_counter()


class HookfitRunner:
    """One ``hookfit.Loop(...).fit()`` per pass, with only the discovered plugins named in
    ``keep`` loaded (``HOOKFIT_PLUGINS`` set to them for the call; empty loads none) and
    ``plugins`` given to ``Loop``. With ``managed`` the step goes through the optim plugin.
    ``run`` is the training stage; ``fit`` the whole call. ``plugins_seen`` lists what the
    last run registered (the clock excepted); ``last_loop`` is that run's ``Loop``.
    ``max_epochs`` is the ``Loop``'s (1: a pass is one epoch; ``opcodes.py`` counts a second)."""

    def __init__(
        self, workload: Workload, *, plugins: Sequence[Any] = (), keep: Sequence[str] = (),
        managed: bool = False,
    ) -> None:
        parts = workload.make()
        self.step = parts.managed_step if managed else parts.step
        self.model = parts.model
        self.optimizer = parts.optimizer if managed else None
        self.data = workload.data
        self.clock = StageClock(workload.device)
        self.plugins = (*plugins, self.clock)
        self.only = ",".join(keep)
        self.plugins_seen: list[str] | None = None
        self.last_loop: hookfit.Loop | None = None
        self.run_dir = scratch("hookfit-bench-")
        self.max_epochs = 1

    def __call__(self) -> Timing:
        saved = os.environ.get(discovery.ENV_ONLY)
        os.environ[discovery.ENV_ONLY] = self.only
        clock = time.perf_counter
        try:
            start = clock()
            loop = hookfit.Loop(
                self.step, self.data, model=self.model, optimizers=self.optimizer, max_epochs=self.max_epochs,
                plugins=self.plugins, run_dir=self.run_dir,
            )
            loop.fit()
            elapsed = clock() - start
        finally:
            if saved is None:
                del os.environ[discovery.ENV_ONLY]
            else:
                os.environ[discovery.ENV_ONLY] = saved
        pm: Any = loop.run.pm  # type: ignore[union-attr]
        self.plugins_seen = sorted(name for name, _ in pm.list_name_plugin() if name != StageClock.name)
        self.last_loop = loop
        return Timing(self.clock.end - self.clock.start, elapsed)


def scratch(prefix: str) -> str:
    """A new temporary folder for a run's files, removed when the process exits (a benchmark,
    or the test that runs it, leaves nothing behind)."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _pipe() -> Any:
    """The write end of a real pipe whose reader drains it on a daemon thread."""
    read, write = os.pipe()

    def drain() -> None:
        while os.read(read, 65536):
            pass

    threading.Thread(target=drain, daemon=True).start()
    return os.fdopen(write, "w", buffering=1)


def core_variant(workload: Workload) -> Runner:
    """The core with no plugin: no discovered plugin loaded, nothing given."""
    return HookfitRunner(workload, plugins=(), keep=())


def default_variant(workload: Workload) -> Runner:
    """The default stack of the README's first script: optim (the managed step), metrics, the
    interrupter and the console writing to a pipe."""
    from hookfit.plugins.console import Console

    return HookfitRunner(workload, plugins=(Console(stream=_pipe()),), keep=("optim", "metrics", "interrupter"),
                         managed=True)


def device_path_variant(workload: Workload) -> Runner:
    """The default stack through the path a loss on an accelerator takes (optim and metrics
    with ``defer=True``), wherever the workload is: on the CPU, what that path's Python costs a
    batch, which a GPU step pays on the host."""
    from hookfit.plugins.console import Console
    from hookfit.plugins.metrics import Metrics
    from hookfit.plugins.optim import Optim

    return HookfitRunner(workload, plugins=(Optim(defer=True), Metrics(defer=True), Console(stream=_pipe())),
                         keep=("interrupter",), managed=True)


def dashboard_variant(workload: Workload) -> Runner:
    """optim, metrics and the urwid dashboard; needs a terminal (``--pty`` provides one)."""
    from hookfit.plugins.tui import interactive_terminal

    reason = interactive_terminal()
    if reason is not None:
        raise SystemExit(f"the dashboard variant needs a terminal ({reason}): run with --pty")
    return HookfitRunner(workload, keep=("optim", "metrics", "tui", "console"), managed=True)


VARIANTS: dict[str, Callable[[Workload], Runner]] = {
    "raw": raw_variant,
    "call": call_variant,
    "inline": inline_variant,
    "floor": floor_variant,
    "core": core_variant,
    "default": default_variant,
    "device-path": device_path_variant,
    "dashboard": dashboard_variant,
}
"""name -> builder. ``raw`` is the baseline; every other variant is compared with it."""
MODEL_ONLY = {"inline", "floor"}
"""Variants with no framework-only form (left out of that table)."""


# -- measuring -------------------------------------------------------------------------------
def median_ci(values: Sequence[float]) -> tuple[float, float, float]:
    """The median and a distribution-free ~95% confidence interval for it (order statistics
    ``n/2 -+ 0.98 sqrt(n)``); with fewer than 6 values the interval is min..max."""
    ordered = sorted(values)
    n = len(ordered)
    k = max(0, math.floor((n - 1.96 * math.sqrt(n)) / 2)) if n >= 6 else 0
    return statistics.median(ordered), ordered[k], ordered[n - 1 - k]


@dataclass
class Result:
    """One variant on one workload. Times in microseconds; medians over rounds; ``*_ci``: the
    ~95% confidence interval of that median. Ratios and added time compare each round with the
    raw pass of the same round."""

    variant: str
    us_per_step: float  # median of run / batches
    us_per_step_fit: float  # median of fit / batches
    ratio: float | None = None  # median of (run / raw run)
    ratio_ci: tuple[float, float] | None = None
    ratio_fit: float | None = None  # median of (whole fit() / raw run)
    added_us: float | None = None  # median of (run - raw run) / batches
    added_ci: tuple[float, float] | None = None
    fixed_us_per_fit: float | None = None  # median of (fit - run): Loop(), discovery, ...
    plugins: list[str] | None = None
    rounds_run_us: list[float] = field(default_factory=list)
    rounds_fit_us: list[float] = field(default_factory=list)


def interleave(runners: dict[str, Callable[[], Any]], rounds: int, warmup: int) -> dict[str, list[Any]]:
    """Each runner's results over ``rounds`` rounds, every round running each runner once in an
    order that rotates, after ``warmup`` untimed rounds; ``gc`` is frozen first and collected
    before every pass, so no runner pays for another's garbage."""
    names = list(runners)
    gc.collect()
    gc.freeze()  # what exists now is never scanned again: gc.collect() per pass costs ~0
    for _ in range(warmup):
        for name in names:
            runners[name]()
    times: dict[str, list[Any]] = {name: [] for name in names}
    for i in range(rounds):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            gc.collect()
            times[name].append(runners[name]())
    gc.unfreeze()
    return times


def measure(workload: Workload, names: Sequence[str], rounds: int, warmup: int) -> list[Result]:
    batches = len(workload.data)
    runners = {name: VARIANTS[name](workload) for name in names}
    with workload.setting():
        times: dict[str, list[Timing]] = interleave(runners, rounds, warmup)

    raw = [t.run for t in times["raw"]]
    results = []
    for name in names:
        run = [t.run for t in times[name]]
        fit = [t.fit for t in times[name]]
        res = Result(
            variant=name,
            us_per_step=statistics.median(run) / batches * 1e6,
            us_per_step_fit=statistics.median(fit) / batches * 1e6,
            plugins=getattr(runners[name], "plugins_seen", None),
            rounds_run_us=[r * 1e6 for r in run],
            rounds_fit_us=[f * 1e6 for f in fit],
        )
        if name != "raw":
            ratios = [r / b for r, b in zip(run, raw)]
            added = [(r - b) / batches * 1e6 for r, b in zip(run, raw)]
            res.ratio, *ci = median_ci(ratios)
            res.ratio_ci = (ci[0], ci[1])
            res.ratio_fit = statistics.median(f / b for f, b in zip(fit, raw))
            res.added_us, *ci = median_ci(added)
            res.added_ci = (ci[0], ci[1])
            res.fixed_us_per_fit = statistics.median(f - r for f, r in zip(fit, run)) * 1e6
        results.append(res)
    return results


# -- output ----------------------------------------------------------------------------------
def environment() -> dict[str, Any]:
    import pluggy

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pluggy": pluggy.__version__,
        "hookfit": hookfit.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "platform": platform.platform(),
    }


def table(title: str, unit: str, results: list[Result], rounds: int, digits: int) -> str:
    """The readable table of one workload."""
    lines = [f"{title}, {rounds} rounds interleaved, medians over rounds"]
    head = ("variant", unit, "ratio", "ratio 95% CI", f"added {unit}", "added 95% CI")
    row = "  {:<8} {:>10} {:>7} {:>14} {:>16} {:>18}"
    lines.append(row.format(*head))
    for r in results:
        if r.ratio is None or r.ratio_ci is None or r.added_ci is None:
            raw_row = row.format(r.variant, f"{r.us_per_step:.{digits}f}", "1", "", "", "")
            lines.append(raw_row.rstrip())
            continue
        lines.append(row.format(
            r.variant,
            f"{r.us_per_step:.{digits}f}",
            f"{r.ratio:.3f}",
            f"{r.ratio_ci[0]:.3f}-{r.ratio_ci[1]:.3f}",
            f"{r.added_us:+.{digits}f}",
            f"{r.added_ci[0]:+.{digits}f}..{r.added_ci[1]:+.{digits}f}",
        ))
    for r in results:
        if r.ratio is None or r.plugins is None:  # (raw, and the peers: no hookfit plugins)
            continue
        lines.append(
            f"  {r.variant}: plugins registered: {', '.join(r.plugins or []) or 'none'}; "
            f"fixed cost per run outside fit_start..fit_end (Loop(), discovery, registration): "
            f"{r.fixed_us_per_fit:.0f} us; whole fit() / raw pass: {r.ratio_fit:.3f}"
        )
    return "\n".join(lines)


def verdicts(workload: str, results: list[Result]) -> list[str]:
    """One line per target that applies to this workload: the per-round ratio of the variant
    to its baseline, its ~95% CI, and whether the target is met."""
    by_name = {r.variant: r for r in results}
    lines = []
    for (key, variant, base), limit in TARGETS.items():
        if key != workload or variant not in by_name or base not in by_name:
            continue
        ratios = [a / b for a, b in zip(by_name[variant].rounds_run_us, by_name[base].rounds_run_us)]
        ratio, low, high = median_ci(ratios)
        if high <= limit:
            word = "within the target"
        elif low > limit:
            word = "OVER the target"
        else:
            word = "undecided: the 95% CI straddles the target (more rounds, or a quieter machine)"
        lines.append(f"measured: {variant}/{base} per step = {ratio:.3f} ({(ratio - 1) * 100:+.1f}%, "
                     f"95% CI {low:.3f}-{high:.3f}; target <= {(limit - 1) * 100:.0f}%): {word}")
    for (key, variant), limit in ADDED_TARGETS.items():
        row = by_name.get(variant)
        if key != workload or row is None or row.added_us is None or row.added_ci is None:
            continue
        low, high = row.added_ci
        word = ("within the target" if high <= limit else "OVER the target" if low > limit
                else "undecided: the 95% CI straddles the target (more rounds, or a quieter machine)")
        lines.append(f"measured: {variant} adds {row.added_us:+.1f} us a step (95% CI {low:+.1f}..{high:+.1f}; "
                     f"target <= {limit:g} us): {word}")
    floor, limit = by_name.get("floor"), ADDED_TARGETS.get((workload, "default"))
    if floor is not None and floor.added_us is not None and floor.added_ci is not None and limit is not None:
        low, high = floor.added_ci
        word = (f"over the default stack's target ({limit:g} us): no implementation of this work can meet it on this machine"
                if low > limit else f"the default stack's target ({limit:g} us) is above it" if high <= limit
                else f"the default stack's target ({limit:g} us) is within its CI")
        lines.append(f"floor: the least of the default stack's work a batch, hand-written into the raw loop, adds "
                     f"{floor.added_us:+.1f} us a step (95% CI {low:+.1f}..{high:+.1f}): {word}")
    base = by_name.get("default")
    if base is not None and base.added_us is not None and base.added_us > 0:
        for peer in ("ignite", "ignite-default", "lightning", "lightning-default"):
            if (row := by_name.get(peer)) is not None and row.added_us is not None:
                lines.append(f"{peer} adds {row.added_us:+.1f} us a step: {row.added_us / base.added_us:.1f}x "
                             f"what hookfit's default stack adds")
    return lines


def in_pty(argv: Sequence[str], script: str | None = None, renderer: Callable[[dict[str, Any]], str] | None = None) -> int:
    """Run this benchmark again in a pseudo-terminal (for the dashboard variant): the frames
    it draws are read and dropped, the tables come back as JSON and are printed here."""
    import pty
    import select

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        args = [a for a in argv if a != "--pty"] + ["--json", out, "--quiet"]
        env = {k: v for k, v in os.environ.items() if k not in ("CI", discovery.ENV_DISABLE)}
        env.setdefault("TERM", "xterm-256color")
        env.pop("HOOKFIT_NO_TUI", None)
        pid, fd = pty.fork()
        if pid == 0:  # the child: this script, on the pseudo-terminal
            os.execve(sys.executable, [sys.executable, script or os.path.abspath(__file__), *args], env)
        tail = b""
        while True:
            ready, _, _ = select.select([fd], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                tail = (tail + chunk)[-4000:]
        _, status = os.waitpid(pid, 0)
        if not os.path.exists(out):
            print(tail.decode(errors="replace"), file=sys.stderr)
            return 1
        with open(out) as handle:
            print((renderer or render)(json.load(handle)))
        return os.waitstatus_to_exitcode(status)


def render(out: dict[str, Any]) -> str:
    """The readable report of a JSON result."""
    lines = [out["header"], TARGET_TEXT]
    for workload in out["workloads"].values():
        results = [Result(**{**r, "ratio_ci": tuple(r["ratio_ci"]) if r["ratio_ci"] else None,
                              "added_ci": tuple(r["added_ci"]) if r["added_ci"] else None})
                   for r in workload["results"]]
        lines += ["", table(workload["title"], workload["unit"], results, workload["rounds"], workload["digits"])]
        lines += ["  " + v for v in workload["verdicts"]]
    for key in ("budget", "budget_model"):
        if key in out:
            lines += ["", out[key]["text"]]
    lines.append(f"\n({out['seconds']:.1f} s; 1-minute load average {out['load_average'][0]:.2f} before, "
                 f"{out['load_average'][1]:.2f} after: anything else running on the machine distorts these numbers)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--rounds", type=int, default=101,
        help="timed rounds per workload, at least 15 (default 101: this machine is noisy)")
    add("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    add("--batches", type=int, default=1000,
        help="batches a pass, tiny model (default 1000: an epoch's fixed costs spread as in a real one)")
    add("--fw-batches", type=int, default=5000,
        help="batches a pass, framework-only workload (default 5000)")
    add("--big", action="store_true", help="also the compute-bound model (4 x Linear 1024, batch 256)")
    add("--big-rounds", type=int, default=21, help="rounds for the compute-bound model (default 21)")
    add("--big-batches", type=int, default=8, help="batches a pass, compute-bound model (default 8)")
    add("--framework-only", action="store_true", help="only the no-op-step workload")
    add("--variants", default="core,default",
        help=f"comma-separated; raw is always run (registered: {', '.join(VARIANTS)}; "
             f"dashboard needs --pty)")
    add("--pty", action="store_true", help="run in a pseudo-terminal, for the dashboard variant")
    add("--device", default="cpu", help="where the tiny model and its batches are (e.g. cuda; default cpu)")
    add("--peers", action="store_true",
        help="also Lightning's and Ignite's stacks on the tiny model, where installed (the [bench] extra)")
    add("--budget", action="store_true",
        help="also the per-batch budget: the core and each built-in plugin on its own, and a checkpoint's save")
    add("--budget-model", action="store_true",
        help="also the same budget on the tiny model (core, optim, metrics, console, interrupter): "
             "what each costs a step between real steps, several times its framework-only cost")
    add("--seed", type=int, default=0, help="seed of the data and the model (default 0)")
    add("--json", metavar="PATH", help="also write every number, round by round, as JSON")
    add("--quiet", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 15 or args.big_rounds < 15:
        parser.error("--rounds and --big-rounds must be at least 15: fewer says nothing on a noisy machine")
    if args.batches < 1 or args.fw_batches < 1 or args.big_batches < 1 or args.warmup < 0:
        parser.error("batch counts must be positive, --warmup not negative")
    names = ["raw"] + [n for n in args.variants.split(",") if n and n != "raw"]
    peer_names: list[str] = []
    if args.peers:
        import peers

        found = peers.available()
        VARIANTS.update(found)
        peer_names = list(found)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; registered: {', '.join(VARIANTS)}")
    if args.pty:
        return in_pty(argv)

    torch.set_num_threads(1)
    env = environment()
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    header = (f"hookfit overhead: Python {env['python']}, torch {env['torch']}, pluggy {env['pluggy']}, "
              f"{env['cpus']} CPUs, torch threads {env['torch_threads']}")
    out: dict[str, Any] = {"header": header, "environment": env, "targets": [
        {"workload": k[0], "variant": k[1], "baseline": k[2], "max_ratio": v} for k, v in TARGETS.items()
    ], "config": vars(args), "workloads": {}}
    plan = []
    if not args.framework_only:
        title = f"Tiny model (Linear 32-32, ReLU, Linear 32-1; batch 64; SGD), {args.batches} batches a pass"
        if args.device != "cpu":
            title += f", on {args.device}"
        plan.append(("model", model_workload(args.batches, args.seed, device=args.device), title, "us/step", 1,
                     args.rounds))
        if args.big:
            title = f"Compute-bound model (4 x Linear 1024; batch 256; SGD), {args.big_batches} batches a pass"
            plan.append(("big", model_workload(args.big_batches, args.seed, big=True), title, "us/step", 0, args.big_rounds))
    title = f"Framework only (no-op step calls), {args.fw_batches} batches a pass"
    plan.append(("framework", framework_workload(args.fw_batches, args.seed), title, "us/batch", 3, args.rounds))
    for key, workload, title, unit, digits, rounds in plan:
        here = [n for n in names if n not in MODEL_ONLY or key != "framework"]
        results = measure(workload, here + (peer_names if key == "model" and args.device == "cpu" else []),
                          rounds, args.warmup)
        lines = verdicts(key, results)
        out["workloads"][key] = {"title": title, "unit": unit, "digits": digits, "rounds": rounds,
                                 "batches": len(workload.data), "verdicts": lines,
                                 "results": [asdict(r) for r in results]}
    if args.budget:
        import budget

        rows = budget.budget(framework_workload(args.fw_batches, args.seed), args.rounds, args.warmup)
        save = budget.save_cost(max(15, args.rounds // 5), args.warmup)
        out["budget"] = {**budget.as_json(rows, save),
                         "text": budget.render(rows, save, args.rounds, args.fw_batches)}
    if args.budget_model:
        import budget

        parts = ["core", "optim (managed step)", "metrics", "console", "interrupter"]
        rows = budget.budget(model_workload(args.batches, args.seed, device=args.device), args.rounds,
                             args.warmup, parts)
        out["budget_model"] = {**budget.as_json(rows, None),
                               "text": budget.render(rows, None, args.rounds, args.batches, "the tiny model")}
    out["seconds"] = time.perf_counter() - started
    out["load_average"] = [load_before, os.getloadavg()[0]]
    if not args.quiet:
        print(render(out))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump(out, handle, indent=2)
        if not args.quiet:
            print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
