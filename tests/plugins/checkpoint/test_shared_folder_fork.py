"""A run resuming, by its path, a checkpoint that a run of another identity wrote in the folder both write in (a
shared ``Checkpoint(dir=...)``): it forks that run's checkpoint. It names its own checkpoints apart, prunes none of
that run's and writes over none of its names, so every path the other run reported keeps its bytes; each run's
``resume="latest"`` then continues its own, the line on stderr naming whose it took and the newer checkpoints of
other runs it left. Without a shared folder, a run forking another identity's checkpoint from that run's folder
gets a run folder of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.csv_log import CSVLogger
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim

SCRIPT = """
import json, sys, torch, hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.csv_log import CSVLogger
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim
folder, name, epochs, resume, keep_last = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
torch.manual_seed(0)
x = torch.randn(64, 4); y = x @ torch.randn(4, 1)
data = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)]
model = torch.nn.Linear(4, 1)
def train(loop, b):
    loss = torch.nn.functional.mse_loss(loop.model(b[0]), b[1])
    loop.backward(loss); loop.optimizers.step(); loop.optimizers.zero_grad()
    return {"loss": loss}
def valid(loop, b):
    return {"loss": torch.nn.functional.mse_loss(loop.model(b[0]), b[1])}
state = hookfit.Loop(train, data, val_step=valid, val_data=data, model=model, name=name, max_epochs=epochs,
                     optimizers=torch.optim.SGD(model.parameters(), lr=0.05), resume=None if resume == "-" else resume,
                     plugins=[Optim(), Metrics(), Checkpoint(dir=folder, monitor="valid/loss", keep_last=keep_last,
                                                             background=False)]).fit()
print(json.dumps({"step": state.step, "resumed": state.resumed_from.source if state.resumed_from else None,
                  "best": str(state.results["best_checkpoint"]), "last": str(state.results["last_checkpoint"])}))
"""


def run(where: Path, name: str, epochs: int, resume: str = "-", keep_last: int = 10) -> tuple[dict[str, object], str]:
    """The script above as a process of its own in ``where``, writing in ``where / "ck"``: what it printed (its
    step, the checkpoint it resumed from, its best and last) and its stderr."""
    done = subprocess.run([sys.executable, "run.py", str(where / "ck"), name, str(epochs), resume, str(keep_last)],
                          cwd=where, capture_output=True, text=True, timeout=300,
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")},
                               "PYTHONWARNINGS": "ignore"})  # (the discovered plugins)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.slow
def test_a_run_forking_another_names_checkpoint_by_path_keeps_every_file_of_that_run_and_names_its_own_apart(
        tmp_path: Path) -> None:
    """Run ``A`` trains 4 epochs into the shared dir; run ``B`` (``keep_last=1``) resumes from ``A``'s epoch 2 by its
    path. ``B`` took ``A``'s tag, adopted ``A``'s files and reused ``A``'s names: ``keep_last`` pruned every one of
    ``A``'s checkpoints, and ``epoch0004-step000000016.pt``, the path ``A`` reported as its best and last, held
    ``B``'s weights. Now ``A``'s files keep their bytes, ``B``'s are named apart (``-v1``), ``A``'s
    ``resume="latest"`` continues ``A``'s epoch 4 and ``B``'s continues ``B``'s."""
    (tmp_path / "run.py").write_text(textwrap.dedent(SCRIPT))
    folder = tmp_path / "ck"
    first, _ = run(tmp_path, "A", 4)
    assert first["step"] == 16 and first["last"] == str(folder / "epoch0004-step000000016.pt")
    written = {path.name: path.read_bytes() for path in folder.glob("*.pt")}
    assert len(written) == 4, sorted(written)
    fork, _ = run(tmp_path, "B", 4, str(folder / "epoch0002-step000000008.pt"), keep_last=1)
    assert fork["resumed"] == str(folder / "epoch0002-step000000008.pt") and fork["step"] == 16
    assert Path(str(fork["last"])).name == "epoch0004-step000000016-v1.pt"
    assert {name: (folder / name).read_bytes() for name in written if (folder / name).exists()} == written
    assert sorted(path.name for path in folder.glob("*.pt") if path.name not in written) == [
        "epoch0004-step000000016-v1.pt"]  # B's epoch 3 pruned by its keep_last=1 (B's best is its epoch 4)
    again, _ = run(tmp_path, "A", 5, "latest")
    assert again["resumed"] == first["last"] and again["step"] == 20
    assert again["last"] == str(folder / "epoch0005-step000000020.pt")
    for name, data in written.items():
        assert (folder / name).read_bytes() == data, name
    on, said = run(tmp_path, "B", 5, "latest", keep_last=1)
    assert on["resumed"] == fork["last"] and on["last"] == str(folder / "epoch0005-step000000020-v1.pt")
    (line,) = [line for line in said.splitlines() if "resume='latest' took" in line]
    assert line == (f"hookfit checkpoint: resume='latest' took {fork['last']} (the newest checkpoint of the name 'B' "
                    f"in {folder}) (1 newer checkpoint(s) of other runs left: epoch0005-step000000020.pt, of the "
                    f"runs named 'A')")


@pytest.mark.slow
def test_a_runs_latest_in_a_shared_dir_names_no_other_runs_where_none_is_newer(tmp_path: Path) -> None:
    """``resume="latest"`` of a run whose checkpoint is the newest in the shared dir: its line names its own
    identity and the dir, and counts no other run's checkpoints (``A``'s, older, are not "left")."""
    (tmp_path / "run.py").write_text(textwrap.dedent(SCRIPT))
    folder = tmp_path / "ck"
    run(tmp_path, "A", 1)
    first, _ = run(tmp_path, "B", 1)
    _, said = run(tmp_path, "B", 2, "latest")
    (line,) = [line for line in said.splitlines() if "resume='latest' took" in line]
    assert line == (f"hookfit checkpoint: resume='latest' took {first['last']} (the newest checkpoint of the name "
                    f"'B' in {folder})")


def test_a_run_forking_another_names_checkpoint_from_its_run_folder_writes_in_a_run_folder_of_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run ``a`` trains 2 epochs into ``runs/a/<date>-<time>``; run ``b`` resumes ``a``'s last checkpoint by its
    path there. ``b`` went on writing in ``a``'s folder: its events in ``a``'s ``run.jsonl``, its metrics in
    ``a``'s ``metrics.csv``, its checkpoints beside ``a``'s. Now ``b`` trains from ``a``'s weights (its first loss
    is the one they give) in a folder of its own under ``runs/b/``, where its checkpoints go, and every file of
    ``a``'s folder keeps its bytes. A run of ``a``'s own name resuming the same path continues in ``a``'s folder."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    x = torch.randn(32, 4)
    y = x @ torch.randn(4, 1)
    data = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)]
    losses: list[float] = []

    def train(loop, batch):
        loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
        losses.append(loss.item())
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    def fit(name: str, epochs: int, resume: Path | None = None) -> tuple[hookfit.State, torch.nn.Module]:
        model = torch.nn.Linear(4, 1)
        losses.clear()
        state = hookfit.Loop(train, data, model=model, name=name, max_epochs=epochs, resume=resume,
                             optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
                             plugins=[Optim(), Metrics(), CSVLogger(), Checkpoint(background=False)]).fit()
        return state, model

    first, trained = fit("a", 2)
    folder = first.run_dir
    resumed = first.results["last_checkpoint"]
    assert folder.parent == tmp_path / "runs" / "a" and resumed == folder / "checkpoints" / "epoch0002-step000000008.pt"
    written = {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    assert {"run.jsonl", "metrics.csv"} <= set(written), sorted(written)
    with torch.no_grad():
        given = torch.nn.functional.mse_loss(trained(data[0][0]), data[0][1]).item()
    fork, _ = fit("b", 3, resumed)
    assert fork.status == "completed" and fork.step == 12 and fork.resumed_from is not None
    assert fork.run_dir != folder and fork.run_dir.parent == tmp_path / "runs" / "b", fork.run_dir
    assert losses[0] == given  # a's weights, restored into b's model
    assert fork.results["last_checkpoint"] == fork.run_dir / "checkpoints" / "epoch0003-step000000012.pt"
    assert [p.name for p in (fork.run_dir / "checkpoints").glob("*.pt")] == ["epoch0003-step000000012.pt"]
    assert {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()} == written
    again, _ = fit("a", 3, resumed)
    assert again.run_dir == folder and again.results["last_checkpoint"] == folder / "checkpoints" / (
        "epoch0003-step000000012.pt")
