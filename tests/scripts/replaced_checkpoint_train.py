"""A training run for tests/integration/test_replaced_checkpoint.py, in a venv where
hookfit-json-checkpoint is installed (it replaces the built-in checkpoint; options from the
hookfit.toml that HOOKFIT_CONFIG names).

``python replaced_checkpoint_train.py OUT --run-dir DIR --data list|global|own [--resume SOURCE]
[--pause-at STEP]``: a small regression with dropout and noise from the global generator, the
built-in Optim with accumulate=2, 3 epochs of 8 batches from a list of batches, a shuffled
DataLoader on the global generator, or one with a seeded generator of its own. With
``--pause-at STEP`` it prints ``paused`` after that training batch's step and waits for a
signal. Writes OUT (torch.save): the final parameters, status, step and where it resumed.
"""

import argparse
import signal

import torch
from torch.utils.data import DataLoader, TensorDataset

import hookfit
from hookfit.plugins.optim import Optim

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--run-dir", required=True)
parser.add_argument("--data", choices=("list", "global", "own"), required=True)
parser.add_argument("--resume")
parser.add_argument("--pause-at", type=int)
args = parser.parse_args()

torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(40, 6, generator=g), torch.randn(40, 1, generator=g)
if args.data == "list":
    data = [(x[i:i + 5], y[i:i + 5]) for i in range(0, 40, 5)]
elif args.data == "global":
    data = DataLoader(TensorDataset(x, y), batch_size=5, shuffle=True)
else:
    data = DataLoader(TensorDataset(x, y), batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(7))
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))


def step(loop, batch):
    inputs, targets = batch
    loss = torch.nn.functional.mse_loss(loop.model(inputs + 0.01 * torch.randn(inputs.shape)), targets)
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    if loop.state.step + 1 == args.pause_at:
        print("paused", flush=True)
        signal.pause()
    return {"loss": loss}


state = hookfit.Loop(step, data, model=model, optimizers=torch.optim.Adam(model.parameters(), lr=0.01),
                     max_epochs=3, run_dir=args.run_dir, resume=args.resume,
                     plugins=[Optim(accumulate=2)]).fit()
torch.save({"params": model.state_dict(), "status": state.status, "step": state.step,
            "resumed": state.resumed_from.step if state.resumed_from else None}, args.out)
