"""Time to import, and to reach the first training batch, in fresh processes.

    python benchmarks/startup.py [--runs 7]

For raw torch, hookfit, Lightning and Ignite: the median over fresh interpreters of (a) the time
to import the framework after ``import torch`` (what the framework adds to torch's own import),
and (b) the time from interpreter start to the first batch reaching the step function. The
target for hookfit: its import adds no more than 50 ms to ``import torch``, and urwid is not
imported unless a dashboard starts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

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


def probe(name: str, run_dir: str) -> dict:
    imports, run = FRAMEWORKS[name]
    code = PROBE.replace("FRAMEWORK_IMPORT", imports).replace("RUN", run)
    env = {**{k: v for k, v in os.environ.items() if k != "HOOKFIT_PLUGINS"}, "RUN_DIR": run_dir}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         stdin=subprocess.DEVNULL, timeout=300)
    if out.returncode:
        raise RuntimeError(f"{name} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    args = parser.parse_args()
    from overhead import scratch  # (same folder)

    run_dir = scratch("hookfit-startup-")
    names = args.frameworks.split(",")
    samples: dict[str, list[dict]] = {n: [] for n in names}
    for _ in range(args.runs):  # interleaved, fresh process each time
        for name in names:
            samples[name].append(probe(name, run_dir))
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
