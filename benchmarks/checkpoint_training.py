"""Training with checkpoint saves against the same training without: time per step and peak memory.

A measurement, never an assertion. The model is ``--layers`` x ``Linear(width, width)`` (by
default 24 x 2048: 100.7 M parameters, 403 MB of float32), trained with plain SGD on one
random batch (``--batch`` rows) with torch's default intra-op threads (``--threads``: fewer). Three variants run in
alternating rounds in one process, each round the same number of steps:

* ``raw``: the plain PyTorch loop (forward, backward, ``step``, ``zero_grad``): the reference;
* ``without``: ``hookfit.Loop(...).fit()`` with no plugin (``HOOKFIT_PLUGINS=""``);
* ``with``: the same plus ``Checkpoint(every_n_steps=N, every_n_epochs=None, keep_last=2)``
  with ``background=True`` (the default): a one-file save every ``N`` steps. The save copies
  the state into reused staging buffers on the training thread; the writer thread digests,
  writes, fsyncs, renames and prunes while training goes on.

The gradients are zeroed in place (``zero_grad(set_to_none=False)``): with torch's default,
every step frees and allocates the 403 MB of gradients, and whether glibc gives that memory
back to the system after each step (then the next step pays about 100 000 page faults, some
0.1 s here) depends on the heap's history, which any other allocation (the staging buffers
among them) shifts; that chance would be measured in place of the saves.

``N`` (``--every``; by default chosen here) is such that ``N`` steps take longer than one
write: one write of the state (:func:`hookfit.plugins.checkpoint.writer.write_file`, digest,
file, fsyncs, rename) is timed on its own first, and ``N`` is the least number of steps that
outlasts ``--margin`` times it. A round runs ``saves * N + N - 1`` steps (so every save's write
has ``N - 1`` steps to end in before the run's end), its time per step is the time from the
first step's start to the last step's end over the steps; the run's end (which, with saves,
waits for the last write) is timed on its own (``end``). Reported per variant: the median over
rounds, the ratio of ``with`` over ``without`` (and of each over ``raw``) in each round with its
median, the CPU seconds the process spent per step (the writer thread's work shows there) and its
minor page faults per step (memory the kernel handed it anew),
after how many steps each save's write was announced (``checkpoint_saved``: a write that ended
within ``N`` steps never made a save wait), and each round's peak resident memory.

Why one process: the model, its gradients, the allocator and the page cache are the same for
every variant, and alternating rounds spread the shared machine's load over all three; a fresh
process per round would add torch's import and the first steps' page faults to each. The peak
resident memory of each round is still its own: Linux's high-water mark (``VmHWM``) is reset
before each round (``/proc/self/clear_refs``), after glibc gives back freed memory
(``malloc_trim``), so a round's peak is what that round held (where the reset is refused, the
process's peak, ``getrusage``, is shown and said so).

    python benchmarks/checkpoint_training.py                       # about 5 minutes on 2 cores
    python benchmarks/checkpoint_training.py --rounds 7 --json runs/checkpoint_training.json
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import math
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

os.environ["HOOKFIT_PLUGINS"] = ""  # only the plugins given here

import torch  # noqa: E402

import hookfit  # noqa: E402
from hookfit.plugins.checkpoint import Checkpoint  # noqa: E402
from hookfit.plugins.checkpoint.staging import Staging  # noqa: E402
from hookfit.plugins.checkpoint.writer import write_file  # noqa: E402

TARGET = 1.05  # with saves / without, the time per step
VARIANTS = ("raw", "without", "with")


# -- memory ---------------------------------------------------------------------------------


def _libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


LIBC = _libc()


def reset_peak() -> bool:
    """Give freed memory back (glibc's ``malloc_trim``) and reset the process's resident
    high-water mark; ``False`` when the reset is refused (then :func:`peak_mb` is the process's)."""
    if LIBC is not None and hasattr(LIBC, "malloc_trim"):
        LIBC.malloc_trim(0)
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_mb(reset: bool) -> float:
    """The resident high-water mark since :func:`reset_peak` (or the process's peak), MiB."""
    if reset:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # (KiB on Linux)


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def faults() -> int:
    """Minor page faults of the process so far (memory the kernel handed it, page by page)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# -- the work -------------------------------------------------------------------------------


class Work:
    """The model, its optimizer and the batch every variant trains on."""

    def __init__(self, layers: int, width: int, batch: int) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-6)
        self.x = torch.randn(batch, width)

    def step(self) -> None:
        loss = self.model(self.x).square().mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)  # (see the module: the gradients' memory stays)

    @property
    def state_mb(self) -> float:
        return sum(t.numel() * t.element_size() for t in self.model.state_dict().values()) / 2**20


class Announced:
    """The step at which each save every ``N`` steps was announced written (``checkpoint_saved``; the
    checkpoint a completed run writes of its final state, ``"completed"``, is the run's end's)."""

    name = "announced"

    def __init__(self, clock: Callable[[], int]) -> None:
        self.clock = clock
        self.lags: list[int] = []

    @hookfit.hookimpl
    def checkpoint_saved(self, reason: str, step: int) -> None:
        if reason == "step":
            self.lags.append(self.clock() - step)  # steps trained since the save was asked


def round_of(variant: str, work: Work, steps: int, every: int, folder: Path) -> dict[str, Any]:
    """One round of ``variant``: seconds per step (first step's start to last step's end),
    seconds of the run's end, CPU seconds and minor page faults per step, steps each write took to be announced."""
    starts: list[float] = []
    lags: list[int] = []
    reset = reset_peak()
    cpu, faulted = cpu_s(), faults()
    if variant == "raw":
        for _ in range(steps):
            starts.append(time.perf_counter())
            work.step()
        last = ended = time.perf_counter()
    else:
        def step(loop: Any, batch: Any) -> None:
            starts.append(time.perf_counter())
            work.step()

        ends: list[float] = []
        plugins: list[Any] = [_LastStep(ends)]
        if variant == "with":
            announced = Announced(lambda: len(starts))
            lags = announced.lags
            plugins = [Checkpoint(dir=folder, every_n_epochs=None, every_n_steps=every, keep_last=2), announced, *plugins]
        loop = hookfit.Loop(step, range(steps), model=work.model, optimizers=work.optimizer,
                            run_dir=folder / "run", plugins=plugins)
        loop.fit()
        ended = time.perf_counter()
        last = ends[-1]
        if variant == "with":
            ckpt = plugins[0]
            assert ckpt.failed_saves == 0 and ckpt.skipped_saves == 0 and len(ckpt.saved) == min(2, steps // every)
    return {"per_step_s": (last - starts[0]) / steps, "end_s": ended - last, "cpu_per_step_s": (cpu_s() - cpu) / steps,
            "faults_per_step": (faults() - faulted) / steps,
            "lags": lags, "peak_mb": peak_mb(reset), "peak_own": reset}


class _LastStep:
    """The time each training batch ended (its ``batch_end``; a save, in ``after_batch``, comes
    after it, so a save's cost falls in the next step's time)."""

    name = "last-step"

    def __init__(self, ends: list[float]) -> None:
        self.ends = ends

    @hookfit.hookimpl
    def batch_end(self) -> None:
        self.ends.append(time.perf_counter())


def one_write(work: Work, folder: Path, times: int) -> list[float]:
    """Seconds of the writer's work for one save of the model's state, alone on the machine:
    digest, file, fsyncs, rename (from a staged copy, as the writer thread writes)."""
    staged = Staging().stage({"model": work.model.state_dict(), "optimizers": [work.optimizer.state_dict()]})
    took = []
    for _ in range(times):
        start = time.perf_counter()
        write_file(dict(staged), folder / "alone.pt")
        took.append(time.perf_counter() - start)
    (folder / "alone.pt").unlink()
    return took


def measure(args: argparse.Namespace) -> dict[str, Any]:
    work = Work(args.layers, args.width, args.batch)
    out: dict[str, Any] = {"params_m": sum(p.numel() for p in work.model.parameters()) / 1e6,
                           "state_mb": work.state_mb, "threads": torch.get_num_threads(),
                           "load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        warm = []
        for _ in range(5):  # the model's first steps pay page faults; the least is the machine's own pace
            start = time.perf_counter()
            work.step()
            warm.append(time.perf_counter() - start)
        out["step_alone_s"] = min(warm[1:])
        out["write_alone_s"] = one_write(work, folder, 2)
        write = max(out["write_alone_s"])
        every = args.every or max(2, math.ceil(args.margin * write / out["step_alone_s"]))
        steps = args.saves * every + every - 1
        out.update(every=every, steps=steps)
        if not args.quiet:
            print(f"one step alone {out['step_alone_s']:.3f} s, one write alone "
                  f"{', '.join(f'{t:.3f}' for t in out['write_alone_s'])} s: a save every {every} steps "
                  f"({every * out['step_alone_s']:.2f} s of steps), {steps} steps a round", flush=True)
        rounds: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
        for r in range(args.rounds):
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]  # alternating: no variant always first
            for variant in order:
                rounds[variant].append(round_of(variant, work, steps, every, folder / f"{variant}{r}"))
            if not args.quiet:
                print(f"round {r + 1}: " + ", ".join(
                    f"{v} {rounds[v][-1]['per_step_s']:.4f} s/step ({rounds[v][-1]['faults_per_step']:.0f} faults)" for v in VARIANTS)
                    + f"; load {os.getloadavg()[0]:.2f}", flush=True)
    out["rounds"] = rounds
    out["load_after"] = os.getloadavg()
    out["process_peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def summary(out: dict[str, Any]) -> str:
    med = statistics.median
    rounds = out["rounds"]
    per = {v: [r["per_step_s"] for r in rounds[v]] for v in VARIANTS}
    ratio = [w / o for w, o in zip(per["with"], per["without"])]
    lines = [
        f"{out['params_m']:.1f} M parameters ({out['state_mb']:.0f} MB), {out['threads']} intra-op threads; "
        f"a save every {out['every']} steps, {out['steps']} steps a round, {len(ratio)} rounds; "
        f"one write alone {max(out['write_alone_s']):.3f} s, {out['every']} steps alone "
        f"{out['every'] * out['step_alone_s']:.3f} s; load {out['load_before'][0]:.2f} before, "
        f"{out['load_after'][0]:.2f} after (1-minute averages)",
        f"  {'variant':<8} {'s/step':>8} {'/raw':>6} {'end s':>6} {'cpu s/step':>10} {'faults/step':>11} {'peak RSS MB':>11}",
    ]
    for v in VARIANTS:
        vs_raw = med([a / b for a, b in zip(per[v], per["raw"])])
        lines.append(f"  {v:<8} {med(per[v]):>8.4f} {vs_raw:>6.3f} {med(r['end_s'] for r in rounds[v]):>6.3f} "
                     f"{med(r['cpu_per_step_s'] for r in rounds[v]):>10.3f} "
                     f"{med(r['faults_per_step'] for r in rounds[v]):>11.0f} "
                     f"{med(r['peak_mb'] for r in rounds[v]):>11.0f}")
    lags = [lag for r in rounds["with"] for lag in r["lags"]]
    own = all(r["peak_own"] for rs in rounds.values() for r in rs)
    lines += [
        f"  with / without, per round: {' '.join(f'{x:.3f}' for x in ratio)}; median {med(ratio):.3f} "
        f"(target <= {TARGET}: {'met' if med(ratio) <= TARGET else 'NOT met'})",
        f"  each write announced after (steps): {' '.join(map(str, lags))} (a save every {out['every']})",
        f"  peak RSS: {'each round its own (VmHWM reset)' if own else 'the process peak (VmHWM reset refused)'}; "
        f"with - without {med(r['peak_mb'] for r in rounds['with']) - med(r['peak_mb'] for r in rounds['without']):.0f} MB "
        f"(the state is {out['state_mb']:.0f} MB); the process's peak {out['process_peak_mb']:.0f} MB",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24, help="Linear layers (default 24: 100 M parameters)")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64, help="rows of the batch (a step of about 0.4 s on 2 cores)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each variant, alternating")
    parser.add_argument("--saves", type=int, default=3, help="saves in a round")
    parser.add_argument("--every", type=int, default=None, help="steps between saves (default: chosen here)")
    parser.add_argument("--margin", type=float, default=2.0, help="N steps outlast this many writes alone")
    parser.add_argument("--dir", default=None, help="folder to write in (default: a temporary one)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--quiet", action="store_true", help="only the summary")
    parser.add_argument("--threads", type=int, default=None,
                        help="training's intra-op threads (default torch's: every core); fewer leaves a core "
                             "to the writer, as a run whose steps are an accelerator's does")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = measure(args)
    text = summary(out)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"machine": platform.platform(), "torch": torch.__version__,
                                               "python": sys.version.split()[0], **out, "text": text}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
