"""Two processes under a real torchrun (gloo, CPU): a stop inside the training stage publishes
the partial epoch on both ranks with global numbers (the reduction runs at fit_end, on every
rank, before the process group is let go), and only rank 0 writes metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

EXAMPLE = REPO / "examples" / "ddp.py"


def torchrun() -> list[str]:
    script = Path(sys.executable).with_name("torchrun")
    return [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]


@pytest.mark.slow
@pytest.mark.fault
def test_a_stop_on_rank_1_publishes_the_partial_epoch_on_both_ranks_with_global_numbers(tmp_path: Path) -> None:
    launch = ["--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOOKFIT_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                         "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", HOOKFIT_PLUGINS="distributed,optim,metrics,metrics_log")
    done = subprocess.run([*torchrun(), *launch, str(EXAMPLE), "--stop-on-rank", "1", "--stop-at-batch", "3",
                           "--dump", "dump"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = [json.loads((tmp_path / f"dump.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [(r["status"], r["step"], r["epoch"]) for r in ranks] == [("interrupted", 4, 0)] * 2
    published = [r["metrics"] for r in ranks]
    # 4 batches of 64 samples on each of the 2 ranks, summed over both, the same on both
    assert published[0] == published[1] and len(published[0]) == 1
    assert (published[0][0]["stage"], published[0][0]["samples"]) == ("train", 4 * 64 * 2)
    [log] = tmp_path.glob("runs/ddp/*/metrics.jsonl")  # rank 0's only
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["event"], r.get("stage"), r.get("batches"), r.get("samples")) for r in rows] == [
        ("best", None, None, None), ("epoch", "train", 4, 512), ("end", None, None, None)]
    assert rows[1]["loss"] == pytest.approx(published[0][0]["loss"])
    assert rows[-1]["status"] == "interrupted"


SYNCED = """
import sys, torch, hookfit
g = torch.Generator().manual_seed(0)
x = torch.randn(1200, 4, generator=g); y = x.sum(1, keepdim=True)
train = [(x[i:i + 10], y[i:i + 10]) for i in range(0, 1200, 10)]  # 120 batches: 60 a process
model = torch.nn.Linear(4, 1)
def step(loop, batch):
    inputs, targets = batch
    loss = torch.nn.functional.mse_loss(loop.model(inputs), targets)
    loop.backward(loss); loop.optimizers.step(); loop.optimizers.zero_grad()
    return {"loss": loss}
loop = hookfit.Loop(step, train, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.01), max_epochs=1)
state = loop.fit()
sys.stdout.write(f"RESULT {state.rank} {state.status} {state.step}\\n")  # one write: the ranks share the pipe
sys.stdout.flush()
"""


@pytest.mark.slow
def test_every_process_joins_the_training_reduction_whether_or_not_a_plugin_listens_to_its_updates(
        tmp_path: Path) -> None:
    # past sync_every (50) batches a process, training publishes every 50 batches, all-reducing the sums: rank 0
    # has listeners (the console), the others none, and every process must still take part in each reduction
    script = tmp_path / "synced.py"
    script.write_text(SYNCED)
    launch = ["--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOOKFIT_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                         "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    done = subprocess.run([*torchrun(), *launch, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(line for line in done.stdout.splitlines() if line.startswith("RESULT")) == [
        "RESULT 0 completed 60", "RESULT 1 completed 60"]
