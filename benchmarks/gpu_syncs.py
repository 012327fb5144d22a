"""A whole default-stack run on a CUDA device under ``torch.cuda.set_sync_debug_mode("warn")``:
every synchronising call warns, and each warning is counted against the innermost hookfit
function on its stack, so the run shows which synchronisations exist (publications, epoch ends,
checkpoint saves) and that none is per step. Needs a GPU: ``python benchmarks/gpu_syncs.py``."""
import collections, io, sys, traceback, warnings
import torch, hookfit
from hookfit.plugins.console import Console
from hookfit.plugins.interrupter import Interrupter
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim

if not torch.cuda.is_available():
    sys.exit("gpu_syncs.py needs a CUDA device")
dev = torch.device("cuda")
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(dev)
g = torch.Generator().manual_seed(0)
data = [(torch.randn(64, 32, generator=g).to(dev), torch.randn(64, 1, generator=g).to(dev)) for _ in range(2000)]
val = data[:200]
opt = torch.optim.SGD(m.parameters(), lr=0.01)
mse = torch.nn.functional.mse_loss

def train(loop, batch):
    x, y = batch
    loop.optimizers.zero_grad()
    loss = mse(m(x), y)
    loop.backward(loss)
    loop.optimizers.step()
    return {"loss": loss}

def valid(loop, batch):
    x, y = batch
    return {"loss": mse(m(x), y)}

where = collections.Counter()
publications = collections.Counter()

class Count:
    @hookfit.hookimpl
    def metrics_update(self, loop, stage):
        publications["metrics_update"] += 1
    @hookfit.hookimpl
    def epoch_metrics(self, loop, stage):
        publications["epoch_metrics"] += 1

def showwarning(message, category, filename, lineno, file=None, line=None):
    frames = [f for f in traceback.extract_stack() if ("hookfit" in f.filename or "/core/" in f.filename or "/plugins/" in f.filename)
              and "gpu_syncs" not in f.filename]
    where[f"{frames[-1].filename.split('hookfit/')[-1]}:{frames[-1].name}" if frames else "outside hookfit"] += 1

torch.cuda.synchronize()
warnings.showwarning = showwarning
warnings.simplefilter("always")
torch.cuda.set_sync_debug_mode("warn")
try:
    state = hookfit.Loop(train, data, val_step=valid, val_data=val, model=m, optimizers=opt, max_epochs=2,
                         plugins=[Optim(), Metrics(), Console(stream=io.StringIO()), Interrupter(signals=False), Count()]).fit()
finally:
    torch.cuda.set_sync_debug_mode("default")
steps = state.step
total = sum(where.values())
print(f"whole run: {steps} training steps, {2 * 200} validation batches, status {state.status}")
print(f"publications: {dict(publications)}")
print(f"synchronising calls: {total} ({total / steps:.4f} a training step)")
for k, v in where.most_common():
    print(f"  {v:6d}  {k}")
