"""A run with the learning-rate range test under whatever renderer the terminal gets: the sweep's
plot goes to stderr at fit_start, while the dashboard (if any) is up.

    python lr_find_dashboard.py RESULT_JSON RUN_DIR
"""

import json
import sys

import torch

import hookfit
from hookfit.plugins.lr_find import LRFinder

out, run_dir = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(8)]


def train_step(loop, batch):
    loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    return {"loss": loss}


finder = LRFinder(num_steps=30, end_lr=10.0)
loop = hookfit.Loop(train_step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
                    max_epochs=2, run_dir=run_dir, plugins=[finder])
state = loop.fit()
with open(out, "w") as f:
    json.dump({"status": state.status, "step": state.step, "suggestion": finder.suggestion}, f)
