"""A training run for tests/integration/test_swapping_package.py, in a venv where hookfit-avg-swap
is installed: the ema plugin (given) and the package's plugin (discovered under the name
``SWAP_NAME``, which ``HOOKFIT_PLUGINS`` enables) both validate with their averages.

``python swap_train.py RUN_DIR [--stop-in-validation]``: three epochs of a small regression with
batch norm, resumed from the run folder's latest checkpoint if it has one, a checkpoint at each
epoch's end. With ``--stop-in-validation`` the first validation batch of epoch 1 prints
``VALIDATING`` and waits until a stop is requested (the test's SIGINT). After ``fit()`` the
model's weights and both averages go to ``RUN_DIR/final.pt``, and ``STATUS <status>`` is printed.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.ema import EMA
from hookfit.plugins.optim import Optim

run_dir = sys.argv[1]
stop_in_validation = "--stop-in-validation" in sys.argv[2:]
stopping = threading.Event()


class StopSeen:
    """Tells the validation step that the stop was requested."""

    name = "stop_seen"

    @hookfit.hookimpl
    def stop_requested(self) -> None:
        stopping.set()


def step(loop: Any, batch: Any) -> dict[str, Any]:
    loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    return {"loss": loss}


def val_step(loop: Any, batch: Any) -> dict[str, Any]:
    if stop_in_validation and (loop.state.epoch, loop.state.batch_idx) == (1, 0):
        print("VALIDATING", flush=True)
        if not stopping.wait(120):
            raise RuntimeError("no stop was requested within 120 s")
    return {"loss": torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])}


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
generator = torch.Generator().manual_seed(1)
batches = [(torch.randn(8, 3, generator=generator), torch.randn(8, 1, generator=generator)) for _ in range(8)]
ema = EMA(decay=0.5)
loop = hookfit.Loop(step, batches[:6], val_step=val_step, val_data=batches[6:], model=model, max_epochs=3,
                    optimizers=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), run_dir=run_dir,
                    resume="latest", plugins=[Optim(), ema, Checkpoint(background=False), StopSeen()])
try:
    loop.fit()
except KeyboardInterrupt:  # the interrupter's, after a graceful stop
    pass
swap = loop.run.pm.get_plugin(os.environ["SWAP_NAME"])
torch.save({"model": model.state_dict(), "ema": ema.module.state_dict(), "swap": swap.average.state_dict(),
            "swapped": swap.average.n_averaged.item()}, os.path.join(run_dir, "final.pt"))
print("STATUS", loop.run.state.status, flush=True)
