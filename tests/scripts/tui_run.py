"""A training run shaped by its arguments, for the dashboard's end-to-end tests (tmux).

``python tui_run.py OUT [--batches N] [--epochs E] [--max-steps S] [--delay SECONDS]
[--nan-after STEP] [--inf-metric-after STEP] [--metrics M] [--valid] [--long-name]
[--checkpoint-every STEPS] [--accumulate N]``

* ``--nan-after STEP``: from that step on the loss is NaN (the optim plugin skips those steps).
* ``--inf-metric-after STEP``: a metric ``blowup`` that is infinite from that step on.
* ``--metrics M``: M extra training metrics ``metric_01`` ... (a table longer than the screen).
* ``--valid``: a validation stage, with a metric only validation reports (``val_only_score``).
* ``--long-name``: a training metric with a 63-character name.
* ``--checkpoint-every STEPS``: the checkpoint plugin saves every STEPS steps.
* ``--accumulate N``: the optim plugin steps once every N batches (``Optim(accumulate=N)``).

Writes ``OUT.pid`` at the start and ``OUT`` (JSON: status, reason, step, epoch) after ``fit()``
returned; the run folder is ``OUT``'s folder's ``run``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

import hookfit

LONG_NAME = "a_metric_with_a_very_long_name_that_no_table_column_can_hold_63"

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--batches", type=int, default=20)
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--max-steps", type=int, default=None)
parser.add_argument("--delay", type=float, default=0.0)
parser.add_argument("--nan-after", type=int, default=None)
parser.add_argument("--inf-metric-after", type=int, default=None)
parser.add_argument("--metrics", type=int, default=0)
parser.add_argument("--valid", action="store_true")
parser.add_argument("--long-name", action="store_true")
parser.add_argument("--checkpoint-every", type=int, default=None)
parser.add_argument("--accumulate", type=int, default=1)
args = parser.parse_args()
out = Path(args.out)
out.with_name(out.name + ".pid").write_text(str(os.getpid()))

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(args.batches)]


def train_step(loop: Any, batch: Any) -> dict[str, Any]:
    x, y = batch
    if args.delay:
        time.sleep(args.delay)
    loss = torch.nn.functional.mse_loss(loop.model(x), y)
    step = loop.state.step + 1  # the step this batch makes
    if args.nan_after is not None and step > args.nan_after:
        loss = loss * float("nan")
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    output: dict[str, Any] = {"loss": loss}
    if args.inf_metric_after is not None:
        output["blowup"] = math.inf if step > args.inf_metric_after else 1.0 / step
    for i in range(1, args.metrics + 1):
        output[f"metric_{i:02d}"] = i + 1.0 / step
    if args.long_name:
        output[LONG_NAME] = 0.25
    return output


def val_step(loop: Any, batch: Any) -> dict[str, Any]:
    x, y = batch
    return {"loss": torch.nn.functional.mse_loss(loop.model(x), y), "val_only_score": 0.75}


plugins: list[Any] = []
if args.checkpoint_every is not None:
    from hookfit.plugins.checkpoint import Checkpoint

    plugins.append(Checkpoint(every_n_steps=args.checkpoint_every, every_n_epochs=None))
if args.accumulate > 1:
    from hookfit.plugins.optim import Optim

    plugins.append(Optim(accumulate=args.accumulate))
loop = hookfit.Loop(train_step, data, val_step=val_step if args.valid else None,
                    val_data=data[: max(1, args.batches // 4)] if args.valid else None, model=model,
                    optimizers=torch.optim.SGD(model.parameters(), lr=0.01), max_epochs=args.epochs,
                    max_steps=args.max_steps, run_dir=out.parent / "run", plugins=plugins)
state = loop.fit()
out.write_text(json.dumps({"status": state.status, "reason": state.stop_reason, "step": state.step,
                           "epoch": state.epoch}))
