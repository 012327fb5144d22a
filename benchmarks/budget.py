"""The per-batch budget: what the core and each built-in plugin cost a batch on their own, and
what a checkpoint costs a save; read by ``overhead.py --budget``.

Every row is a ``hookfit.Loop`` on the framework-only workload (no-op step calls, see
:func:`overhead.framework_workload`), interleaved with its baseline in one process, round by
round: ``core`` against the raw loop; a plugin against the core (or, for what reads the metrics,
against ``core + metrics``). So a row is that plugin's own per-batch cost, whatever else runs.
The checkpoint writes once a run (every epoch of one epoch): its per-batch cost is a row like
the others, and its save, which falls after the timed stage, is the difference of whole
``fit()`` calls against its baseline, reported per save on the tiny model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from overhead import HookfitRunner, Timing, Workload, _pipe, interleave, median_ci, model_workload, raw_variant

Build = Callable[[Workload], HookfitRunner]


def _plugins(*make: Callable[[], Any], keep: Sequence[str] = (), managed: bool = False) -> Build:
    return lambda workload: HookfitRunner(workload, plugins=tuple(m() for m in make), keep=keep, managed=managed)


def _console() -> Any:
    from hookfit.plugins.console import Console

    return Console(stream=_pipe())


def _interrupter() -> Any:
    from hookfit.plugins.interrupter import Interrupter

    return Interrupter()


def _early_stopping() -> Any:
    from hookfit.plugins.early_stopping import EarlyStopping

    return EarlyStopping(monitor="train/loss")


def _checkpoint() -> Any:
    from hookfit.plugins.checkpoint import Checkpoint

    return Checkpoint(every_n_epochs=1)


ROWS: dict[str, tuple[Build, str]] = {
    # name -> (builder, the baseline it is compared with)
    "core": (_plugins(), "raw"),
    "optim (managed step)": (_plugins(keep=("optim",), managed=True), "core"),  # against the optimizer's own calls
    "metrics": (_plugins(keep=("metrics",)), "core"),
    "console": (_plugins(_console, keep=("metrics",)), "core + metrics"),
    "interrupter": (_plugins(_interrupter), "core"),
    "metrics_log": (_plugins(keep=("metrics", "metrics_log")), "core + metrics"),
    "early_stopping": (_plugins(_early_stopping, keep=("metrics",)), "core + metrics"),
    "csv": (_plugins(keep=("metrics", "csv")), "core + metrics"),
    "tensorboard": (_plugins(keep=("metrics", "tensorboard")), "core + metrics"),
    "checkpoint (every epoch)": (_plugins(_checkpoint), "core"),
}
BASELINES: dict[str, Build] = {
    "core": _plugins(),
    "core + metrics": _plugins(keep=("metrics",)),
}


@dataclass
class Row:
    name: str
    baseline: str
    added_us: float  # median over rounds of (row - baseline) / batches
    added_ci: tuple[float, float]
    plugins: list[str]


def budget(workload: Workload, rounds: int, warmup: int, rows: Sequence[str] | None = None) -> list[Row]:
    """Each row of :data:`ROWS` (or those named) interleaved with its baseline."""


    names = list(rows or ROWS)
    runners: dict[str, Callable[[], Timing]] = {"raw": raw_variant(workload)}
    for base in {ROWS[n][1] for n in names} - {"raw"}:
        runners[base] = BASELINES[base](workload)
    for name in names:
        runners[name] = ROWS[name][0](workload)
    with workload.setting():
        times = interleave(runners, rounds, warmup)
    batches = len(workload.data)
    out = []
    for name in names:
        base = times[ROWS[name][1]]
        added = [(t.run - b.run) / batches * 1e6 for t, b in zip(times[name], base)]
        median, low, high = median_ci(added)
        runner = runners[name]
        out.append(Row(name, ROWS[name][1], median, (low, high), getattr(runner, "plugins_seen", None) or []))
    return out


def save_cost(rounds: int, warmup: int, batches: int = 64, seed: int = 0) -> tuple[float, float, float]:
    """The median cost of one checkpoint save on the tiny model (with its ~95% CI), in µs: whole
    ``fit()`` calls with a checkpoint every epoch against the same calls without, one save each."""
    workload = model_workload(batches, seed)
    runners = {"without": _plugins(keep=("optim",), managed=True)(workload),
               "with": _plugins(_checkpoint, keep=("optim",), managed=True)(workload)}
    times = interleave(runners, rounds, warmup)
    return median_ci([(w.fit - o.fit) * 1e6 for w, o in zip(times["with"], times["without"])])


def render(rows: list[Row], save: tuple[float, float, float] | None, rounds: int, batches: int,
           workload: str = "framework-only workload") -> str:
    lines = [f"Budget per batch, {workload} ({batches} batches a pass, {rounds} rounds interleaved): "
             f"each row against its baseline in the same rounds",
             f"  {'what':<26} {'added us/batch':>15} {'95% CI':>18}   compared with"]
    for r in rows:
        lines.append(f"  {r.name:<26} {r.added_us:>+15.3f} {r.added_ci[0]:>+8.3f}..{r.added_ci[1]:<+8.3f}   {r.baseline}")
    if save is not None:
        lines.append(f"  one checkpoint save (tiny model, after the stage): {save[0]:.0f} us "
                     f"(95% CI {save[1]:.0f}..{save[2]:.0f}), paid once per save, never per batch")
    total = sum(r.added_us for r in rows if r.name in ("core", "optim (managed step)", "metrics", "console", "interrupter"))
    lines.append(f"  the default stack's parts (core, optim, metrics, console, interrupter) add up to {total:+.3f} us/batch")
    return "\n".join(lines)


def as_json(rows: list[Row], save: tuple[float, float, float] | None) -> dict[str, Any]:
    return {"rows": [r.__dict__ for r in rows],
            "save_us": None if save is None else {"median": save[0], "ci": [save[1], save[2]]}}

