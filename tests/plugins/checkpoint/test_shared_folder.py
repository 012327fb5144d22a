"""One checkpoint folder shared by several runs (a sweep's trials in one process, the folds of a k-fold CV in
processes of their own, ``Checkpoint(dir=...)`` or ``[plugins.checkpoint] dir`` in ``hookfit.toml``): a path a run
reported names that run's file for good, and ``resume="latest"`` takes only a checkpoint of the run's own name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.checkpoint.storage import checkpoint_files
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim


def trial(lr: float, folder: Path, **options: object) -> tuple[hookfit.State, torch.nn.Module]:
    """A trial of a sweep: a small regression trained 3 epochs at learning rate ``lr`` from one seed, its
    checkpoints in ``folder`` (shared), the best by ``valid/loss``; the state and the trained model."""
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = x @ torch.randn(4, 1)
    data = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)]
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)

    def train(loop, batch):
        loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    def valid(loop, batch):
        return {"loss": torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])}

    state = hookfit.Loop(train, data, val_step=valid, val_data=data, model=model, optimizers=optimizer,
                         max_epochs=3, plugins=[Optim(), Metrics(), Checkpoint(dir=folder, monitor="valid/loss",
                                                                               background=False)], **options).fit()
    return state, model


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["model"]


def test_each_trial_of_a_sweep_sharing_a_dir_keeps_its_best_checkpoint_path_naming_its_own_weights(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three trials in one process, one ``Checkpoint(dir=...)``: each trial's ``results["best_checkpoint"]`` (its
    last epoch: the loss falls every epoch) is a path of its own (the later trials' named apart, ``-v1``, ``-v2``),
    which holds its own trial's weights after the later trials ran, its bytes unchanged, so that picking the best
    trial and evaluating its path (``validate(resume=path)``) evaluates that trial's weights."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "ckpts"
    trials = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for lr in (0.01, 0.05, 0.02):
            state, model = trial(lr, folder)
            best = state.results["best_checkpoint"]
            assert best is not None and best == state.results["last_checkpoint"]
            trials.append((best, best.read_bytes(), {k: v.clone() for k, v in model.state_dict().items()}))
    for path, written, trained in trials:
        assert path.read_bytes() == written
        assert all(torch.equal(weights(path)[k], v) for k, v in trained.items())
    assert not [w for w in caught if "checkpoint" in str(w.message)], [str(w.message) for w in caught]  # none moved
    assert [path.name for path, _, _ in trials] == ["epoch0003-step000000012.pt", "epoch0003-step000000012-v1.pt",
                                                    "epoch0003-step000000012-v2.pt"]
    first_path, _, first_model = trials[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hookfit.HookfitWarning)  # (the trial's optim state, unused here)
        evaluation = hookfit.Loop(val_step=lambda loop, b: {"loss": loop.model(b).sum()}, val_data=[torch.ones(2, 4)],
                                  model=torch.nn.Linear(4, 1),
                                  plugins=[Metrics(), Checkpoint()]).validate(resume=first_path)
    expected = (torch.ones(2, 4) @ first_model["weight"].T + first_model["bias"]).sum().item()
    assert evaluation.results["metrics"]["valid/loss"] == pytest.approx(expected)


def test_a_trial_named_apart_in_a_shared_dir_resumes_its_own_and_starts_afresh_beside_anothers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """In one process: trial ``a`` finishes, then ``b`` with ``resume="latest"`` in the same dir finds none of its
    name (never taking ``a``'s finished checkpoint, which would train nothing) and starts afresh, its line naming
    ``a``'s; then ``a`` again resumes its own, not ``b``'s (the newer)."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "ckpts"
    first, _ = trial(0.01, folder, name="a")
    capsys.readouterr()
    second, _ = trial(0.05, folder, name="b", resume="latest")
    said = capsys.readouterr().err
    assert second.resumed_from is None and second.step == 12
    assert f"found no checkpoint in {folder} (it holds 3 checkpoint(s) of other runs, named 'a':" in said, said
    assert second.results["last_checkpoint"].name == "epoch0003-step000000012-v1.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (nothing left to train: a's run had ended)
        again, _ = trial(0.01, folder, name="a", resume="latest")
    assert again.resumed_from is not None and Path(again.resumed_from.source) == first.results["last_checkpoint"]


SCRIPT = """
import json, sys, torch, hookfit
name, epochs, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None
torch.manual_seed(int(name[-1]) if name[-1].isdigit() else 0)
x = torch.randn(48, 4); y = x @ torch.randn(4, 1)
data = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 48, 16)]
model = torch.nn.Linear(4, 1)
def train(loop, b):
    loss = torch.nn.functional.mse_loss(loop.model(b[0]), b[1])
    loop.backward(loss); loop.optimizers.step(); loop.optimizers.zero_grad()
    return {"loss": loss}
def valid(loop, b):
    return {"loss": torch.nn.functional.mse_loss(loop.model(b[0]), b[1])}
state = hookfit.Loop(train, data, val_step=valid, val_data=data, model=model, name=name, max_epochs=epochs,
                     optimizers=torch.optim.SGD(model.parameters(), lr=0.01), resume=resume).fit()
print(json.dumps({"step": state.step, "resumed": state.resumed_from.source if state.resumed_from else None,
                  "best": str(state.results["best_checkpoint"]), "last": str(state.results["last_checkpoint"]),
                  "valid": state.results["metrics"]["valid/loss"]}))
"""


def run(folder: Path, *args: str) -> tuple[dict[str, object], str]:
    """The script above run in ``folder`` as a process of its own: what it printed, and its stderr."""
    done = subprocess.run([sys.executable, "fold.py", *args], cwd=folder, capture_output=True, text=True, timeout=300,
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")},
                               "PYTHONWARNINGS": "ignore"})  # (the discovered plugins, the toml's options)
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout.strip().splitlines()[-1])
    return {key: str((folder / value).resolve()) if key in ("resumed", "best", "last") and value else value
            for key, value in said.items()}, done.stderr


@pytest.mark.slow
def test_folds_in_processes_of_their_own_sharing_the_toml_dir_resume_their_own_and_keep_their_paths(
        tmp_path: Path) -> None:
    """``[plugins.checkpoint] dir = "ckpts"`` in ``hookfit.toml``, each fold a process named ``fold<k>`` with
    ``resume="latest"``: fold 1 never takes fold 0's finished checkpoint (which would train no step and report fold
    0's ``valid/loss``): it trains its own, the line on stderr naming fold 0's; fold 0 run again for more epochs
    resumes its own; the paths every process reported hold what they held, after the others ran; and a run of fold
    0 afresh (no resume) writes beside its earlier files, and a later ``resume="latest"`` takes the fresh run's
    (the run of fold 0 written last)."""
    (tmp_path / "fold.py").write_text(textwrap.dedent(SCRIPT))
    (tmp_path / "hookfit.toml").write_text('[plugins.checkpoint]\ndir = "ckpts"\nmonitor = "valid/loss"\n')
    folder = tmp_path / "ckpts"
    zero, _ = run(tmp_path, "fold0", "2", "latest")
    assert zero["step"] == 6 and zero["resumed"] is None
    reported = {Path(zero[key]): Path(zero[key]).read_bytes() for key in ("best", "last")}
    one, said = run(tmp_path, "fold1", "2", "latest")
    assert one["step"] == 6 and one["resumed"] is None and one["valid"] != zero["valid"]
    assert "(it holds" in said and "named 'fold0'" in said, said
    assert Path(one["last"]).name == "epoch0002-step000000006-v1.pt"
    again, _ = run(tmp_path, "fold0", "3", "latest")
    assert again["resumed"] == zero["last"] and again["step"] == 9
    assert again["last"] == str(folder / "epoch0003-step000000009.pt")
    fresh, _ = run(tmp_path, "fold0", "1")  # afresh: fold 0's earlier files stay, its own named apart
    assert Path(fresh["last"]).name == "epoch0001-step000000003-v2.pt"
    latest, _ = run(tmp_path, "fold0", "2", "latest")  # the run of fold 0 written last: the fresh one
    assert latest["resumed"] == fresh["last"] and latest["step"] == 6
    for path, written in reported.items():
        assert path.read_bytes() == written, path
    assert Path(one["last"]).exists()
    assert [p.name for p in checkpoint_files(folder)][0] == "epoch0002-step000000006-v2.pt"
