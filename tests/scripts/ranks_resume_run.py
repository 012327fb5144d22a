"""A run of one process resumed on two, for tests/plugins/distributed/test_rank_state.py.

``python ranks_resume_run.py OUT DATA`` trains one epoch in one process and writes its checkpoint;
``torchrun --nproc-per-node 2 ranks_resume_run.py OUT DATA latest`` resumes it (``resume="latest"``) for a
second epoch; ``... latest validate`` evaluates it instead (``Loop.validate``, ``resume="latest"``). DATA ``batches``: ``hookfit.data.Batches`` of the same global batch (4 samples on one process,
2 on each of two: the run goes on with the same batches); ``list``: a list of 4 batches (one epoch is then
2 batches on each process). ``Distributed()`` and ``Checkpoint()`` are given explicitly. Each process writes
``OUT.rank<N>.json``: its status, its number of processes and the warnings it saw that name a number of
processes.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

import torch

import hookfit
from hookfit.data import Batches
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.distributed import Distributed


def main() -> None:
    out, kind, resume = sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None
    evaluate = sys.argv[4:] == ["validate"]
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    x = torch.arange(16.0).unsqueeze(1)
    data: Any = (Batches(x, x, batch_size=4 // world, shuffle=True, seed=1) if kind == "batches"
                 else [(x[i:i + 4], x[i:i + 4]) for i in range(0, 16, 4)])

    def step(loop: Any, batch: Any) -> Any:
        return torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])

    loop = hookfit.Loop(step, data, model=torch.nn.Linear(1, 1), max_epochs=1 if resume is None else 2,
                        run_dir="run", resume=resume, plugins=[Distributed(), Checkpoint(background=False)],
                        val_step=step if evaluate else None, val_data=data if evaluate else None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = loop.validate() if evaluate else loop.fit()
    with open(f"{out}.rank{rank}.json", "w") as dump:
        json.dump({"status": state.status, "world_size": state.world_size, "epoch": state.epoch,
                   "warned": [str(w.message) for w in caught if "process(es)" in str(w.message)]}, dump)


if __name__ == "__main__":
    main()
