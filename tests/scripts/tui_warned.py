"""A run that warns while the dashboard is up, for the dashboard's end-to-end tests (tmux).

``python tui_warned.py OUT [raise]``: 20 batches; from step 10 on the loss is NaN (the optim
plugin skips those steps and warns, once at the first and once at the end of the run); the
step warns itself at step 5 (a ``UserWarning`` pointing at this file); with ``raise`` the step
raises at step 15. Writes ``OUT`` (JSON: status, and whether ``warnings.showwarning`` is the one
of before the run) after ``fit()`` returned or raised.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from typing import Any

import torch

import hookfit

out = sys.argv[1]
fail = sys.argv[2:] == ["raise"]
before = warnings.showwarning
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(20)]


def step(loop: hookfit.Run, batch: Any) -> torch.Tensor:
    time.sleep(0.05)
    if loop.state.step == 5:
        warnings.warn("THE SCRIPT WARNS AT STEP 5", UserWarning)
    if fail and loop.state.step == 15:
        raise RuntimeError("the step broke at step 15")
    loss = torch.nn.functional.mse_loss(model(batch[0]), batch[1])
    if loop.state.step >= 10:
        loss = loss * float("nan")
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    return loss


loop = hookfit.Loop(step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1), max_epochs=1,
                    run_dir=os.path.join(os.path.dirname(out), "run"))
try:
    loop.fit()
finally:
    with open(out, "w") as f:
        json.dump({"status": loop.state.status, "showwarning": warnings.showwarning is before}, f)
