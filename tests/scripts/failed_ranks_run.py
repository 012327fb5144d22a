"""A distributed run that fails, and its checkpoint resumed, for tests/plugins/distributed/test_rank_state.py.

``torchrun --nproc-per-node 2 failed_ranks_run.py OUT [RESUME]``: three epochs of two batches on each process,
``Distributed()`` and ``Checkpoint(on_failure=True)``. Without ``RESUME`` the step raises at its third step (the
first of epoch 2), so the main process writes a ``failed-*.pt`` checkpoint; with ``RESUME`` (a checkpoint's path)
the run resumes it and completes. Each process writes ``OUT.rank<N>.json``: its status, its number of processes,
and the warnings it saw that name a number of processes.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.distributed import Distributed


def main() -> None:
    out, resume = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None
    rank = int(os.environ.get("RANK", "0"))

    def step(loop: Any, batch: Any) -> dict[str, Any]:
        if resume is None and loop.state.step == 2:
            raise RuntimeError("the step failed")
        return {"loss": torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])}

    data = [(torch.zeros(2, 1), torch.zeros(2, 1))] * 4  # two batches on each process
    loop = hookfit.Loop(step, data, model=torch.nn.Linear(1, 1), max_epochs=3, run_dir="run", resume=resume,
                        plugins=[Distributed(), Checkpoint(on_failure=True, background=False)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loop.fit()
        except RuntimeError:
            if resume is not None:
                raise
    with open(f"{out}.rank{rank}.json", "w") as dump:
        json.dump({"status": loop.state.status, "world_size": loop.state.world_size,
                   "warned": [str(w.message) for w in caught if "process(es)" in str(w.message)]}, dump)


if __name__ == "__main__":
    main()
