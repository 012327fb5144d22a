"""Time to import, and to reach the first training batch, in fresh processes.

    python benchmarks/startup.py [--runs 7] [--first-step-runs 15] [--frameworks raw,hookfit,...]

Two tables, each the median over fresh interpreters, run interleaved:

1. For raw torch, hookfit, Lightning and Ignite: (a) the time to import the framework after
   ``import torch`` (what the framework adds to torch's own import), and (b) the time from
   interpreter start to the first batch reaching the step function. Target for hookfit: its
   import adds no more than 50 ms to ``import torch``, and urwid is not imported unless a
   dashboard starts.
2. What hookfit adds to the first training step. Each process imports torch and builds the
   model, the data and the optimizer before the clock starts; then a raw process times its first
   step (``zero_grad``, forward, ``backward``, ``step``), and a hookfit process times
   ``import hookfit``, ``hookfit.Loop(...)`` and ``fit()`` with the default plugins (entry-point
   discovery on, a new run folder) up to the return of the same first step from the step
   function. What hookfit adds is the hookfit process's time minus the raw one's, taken pair by
   pair (a raw process and a hookfit process run one after the other) and the median given, with
   hookfit's import counted and without it; the parts of the hookfit side (import, ``Loop()``,
   ``fit()`` up to the step, the step itself) and the modules it imports that torch had not are
   listed. Target: with the import counted, at most 100 ms over the raw first step.

Every process runs in the run folder (not in the checkout, whose build leftovers would be found
as a distribution), with bytecode caching on (``PYTHONDONTWRITEBYTECODE`` is dropped from its
environment) after one untimed round, as an installed package runs: compiling the sources is a
first import's cost, not a first ``fit()``'s.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from typing import Any

PROBE = r"""
import sys, time, os
t0 = time.perf_counter()
import torch
t_torch = time.perf_counter()
FRAMEWORK_IMPORT
t_import = time.perf_counter()
torch.manual_seed(0)
data = [(torch.randn(64, 32), torch.randn(64, 1)) for _ in range(4)]
model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
first = []
def mark():
    if not first:
        first.append(time.perf_counter())
RUN
print(__import__("json").dumps({"torch": t_torch - t0, "framework": t_import - t_torch,
                                "first_batch": first[0] - t0, "urwid": "urwid" in sys.modules}))
"""

FRAMEWORKS = {
    "raw": ("pass", """
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for x, y in data:
    mark(); opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); opt.step()
"""),
    "hookfit": ("import hookfit", """
def step(loop, batch):
    mark(); x, y = batch
    loss = torch.nn.functional.mse_loss(model(x), y)
    loop.backward(loss); loop.optimizers.step(); loop.optimizers.zero_grad()
    return loss
hookfit.Loop(step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
             run_dir=os.environ["RUN_DIR"]).fit()
"""),
    "lightning": ("import pytorch_lightning as pl", """
class M(pl.LightningModule):
    def __init__(self):
        super().__init__(); self.net = model
    def training_step(self, batch, i):
        mark(); x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
class B:
    def __iter__(self): return iter(data)
    def __len__(self): return len(data)
pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
           enable_model_summary=False, default_root_dir=os.environ["RUN_DIR"]).fit(M(), B())
"""),
    "ignite": ("from ignite.engine import Engine", """
opt = torch.optim.SGD(model.parameters(), lr=0.01)
def update(engine, batch):
    mark(); x, y = batch; opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y); loss.backward(); opt.step()
    return loss.item()
Engine(update).run(data, max_epochs=1)
"""),
}


FIRST_STEP = r"""
import json, os, sys, time
import torch
torch.manual_seed(0)
data = [(torch.randn(64, 32), torch.randn(64, 1)) for _ in range(4)]
model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)  # torch's own first-optimizer imports: not timed
before = set(sys.modules)
marks = {}
def mark(name):
    marks.setdefault(name, (time.perf_counter(), time.process_time()))
mark("start")
RUN
done = marks["done"]
print(json.dumps({"marks": {k: [v[0] - marks["start"][0], v[1] - marks["start"][1]] for k, v in marks.items()},
                  "imported": sorted(set(sys.modules) - before)}))
"""

FIRST_STEPS = {
    "raw": """
x, y = data[0]
mark("step"); opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); opt.step(); mark("done")
""",
    "hookfit": """
import hookfit
mark("import")
def step(loop, batch):
    mark("step"); x, y = batch
    loss = torch.nn.functional.mse_loss(model(x), y)
    loop.backward(loss); loop.optimizers.step(); loop.optimizers.zero_grad()
    mark("done")
    return loss
loop = hookfit.Loop(step, data, model=model, optimizers=opt, run_dir=os.environ["RUN_DIR"])
mark("loop")
loop.fit()
""",
}


def _env(run_dir: str) -> dict[str, str]:
    """The probe's environment: this one's, with the default plugins (no ``HOOKFIT_PLUGINS``),
    bytecode caching on, and the run folder."""
    drop = {"HOOKFIT_PLUGINS", "HOOKFIT_DISABLE_PLUGINS", "PYTHONDONTWRITEBYTECODE"}
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "RUN_DIR": run_dir}


def _run(name: str, code: str, run_dir: str) -> dict[str, Any]:
    os.makedirs(run_dir, exist_ok=True)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(run_dir),
                         cwd=run_dir, stdin=subprocess.DEVNULL, timeout=300)
    if out.returncode:
        raise RuntimeError(f"{name} failed:\n{out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


PEERS = {"lightning": "pytorch_lightning", "ignite": "ignite"}
"""The module each peer's probe imports: a peer without it is left out, and said so."""


def probe(name: str, run_dir: str) -> dict[str, Any]:
    imports, run = FRAMEWORKS[name]
    return _run(name, PROBE.replace("FRAMEWORK_IMPORT", imports).replace("RUN", run), run_dir)


def first_step(name: str, run_dir: str) -> dict[str, Any]:
    return _run(name, FIRST_STEP.replace("RUN", FIRST_STEPS[name]), run_dir)


def first_step_table(runs: int, scratch: str) -> None:
    """Print what hookfit adds to the first training step (table 2 of the module's docstring)."""
    pairs = []
    for i in range(runs + 1):  # the first pair is untimed: it writes the bytecode caches
        pair = first_step("raw", scratch), first_step("hookfit", os.path.join(scratch, f"first-{i}"))
        if i:
            pairs.append(pair)
    med = statistics.median

    def at(sample: dict[str, Any], mark: str, cpu: bool = False) -> float:
        return float(sample["marks"][mark][int(cpu)]) * 1e3

    print(f"what hookfit adds to the first training step, ms: median of {runs} pairs of fresh processes")
    print(f"  {'':<34} {'wall':>8} {'cpu':>8}")
    rows = [
        ("raw first step", lambda r, h, c: at(r, "done", c)),
        ("hookfit: import hookfit", lambda r, h, c: at(h, "import", c)),
        ("hookfit: Loop()", lambda r, h, c: at(h, "loop", c) - at(h, "import", c)),
        ("hookfit: fit() to the step", lambda r, h, c: at(h, "step", c) - at(h, "loop", c)),
        ("hookfit: the first step", lambda r, h, c: at(h, "done", c) - at(h, "step", c)),
        ("hookfit: to the step's return", lambda r, h, c: at(h, "done", c)),
        ("added, import counted", lambda r, h, c: at(h, "done", c) - at(r, "done", c)),
        ("added, import not counted", lambda r, h, c: at(h, "done", c) - at(h, "import", c) - at(r, "done", c)),
    ]
    for label, value in rows:
        wall, cpu = (med(value(r, h, c) for r, h in pairs) for c in (False, True))
        print(f"  {label:<34} {wall:>8.1f} {cpu:>8.1f}")
    heavy = ("urwid", "tensorboard", "mlflow", "wandb", "torchmetrics", "torch.distributed")
    imported = sorted({m for _, h in pairs for m in h["imported"]})
    roots = sorted({m.split(".")[0] for m in imported if not m.startswith("hookfit")})
    print(f"  modules hookfit's first fit() imports beyond torch's: {len(imported)}; outside hookfit: "
          f"{', '.join(roots) or 'none'}")
    print(f"  of {', '.join(heavy)}: {', '.join(m for m in heavy if m in imported) or 'none'}")
    print("target: added, import counted, <= 100 ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    parser.add_argument("--first-step-runs", type=int, default=15,
                        help="pairs of processes for what hookfit adds to the first step (0: skip)")
    args = parser.parse_args()
    from overhead import scratch  # (same folder)

    run_dir = scratch("hookfit-startup-")
    if args.first_step_runs:
        first_step_table(args.first_step_runs, run_dir)
    names = [n for n in args.frameworks.split(",") if n]
    for name in [n for n in names if n in PEERS and importlib.util.find_spec(PEERS[n]) is None]:
        print(f"{name}: not installed (pip install -e '.[bench]'), left out")
        names.remove(name)
    if not names:
        return 0
    samples: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for i in range(args.runs + 1):  # interleaved, fresh process each time; the first round untimed
        for name in names:
            sample = probe(name, run_dir)
            if i:
                samples[name].append(sample)
    print(f"startup, median of {args.runs} fresh processes each (seconds)")
    print(f"  {'framework':<10} {'import torch':>13} {'+ framework':>12} {'first batch':>12}  urwid imported")
    for name in names:
        s = samples[name]
        med = {k: statistics.median(x[k] for x in s) for k in ("torch", "framework", "first_batch")}
        print(f"  {name:<10} {med['torch']:>13.3f} {med['framework']:>12.3f} {med['first_batch']:>12.3f}  "
              f"{any(x['urwid'] for x in s)}")
    print("target: hookfit's import adds <= 0.050 s to import torch; urwid only when a dashboard starts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
