"""checkpoint scores: a checkpoint's metric is the score of its own weights (a validation of
them published it), and a validation of the monitored stage is followed by a save of the weights
it scored when that save is due or the score is a new best, so the best checkpoint holds the
best-scored weights: at epoch ends, and with ``Loop(val_every_n_steps=N)`` inside epochs, where
the state is copied before the validation and written once it has scored."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint, CheckpointWarning, read
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim

from conftest import mse_step, resumable_run, run_script_here


class Scored:
    """Records, at each validation's publication, its global step, its ``vloss`` and the
    model's weights it scored; and every checkpoint announced, as (reason, step, file name)."""

    name = "scored"

    def __init__(self, key: str = "vloss") -> None:
        self.key = key
        self.scores: dict[int, float] = {}
        self.weights: dict[int, list[torch.Tensor]] = {}
        self.saved: list[tuple[str, int, str]] = []

    @hookfit.hookimpl
    def epoch_metrics(self, loop: Any, stage: str, metrics: Any) -> None:
        if stage == "valid":
            self.scores[loop.state.step] = metrics.values[self.key].epoch
            self.weights[loop.state.step] = [t.detach().clone() for t in loop.model.state_dict().values()]

    @hookfit.hookimpl
    def checkpoint_saved(self, path: str, reason: str, step: int) -> None:
        self.saved.append((reason, step, Path(path).name))


def weights(path: Path) -> list[torch.Tensor]:
    return list(read(path)["model"].values())


def test_each_checkpoint_carries_the_score_of_its_own_weights_and_the_best_is_the_best_scored(
        tmp_path: Path) -> None:
    """Validations after steps 3, 6, 9 and 12 (2 epochs of 7 batches), a save every 3 steps and
    at each epoch's end: the step saves carry their validation's score (they were stamped with
    nothing), the epoch ends at steps 7 and 14 carry none (they were stamped with the score of
    the validation before, of other weights), and the best is the best-scored step."""
    scored = Scored()
    checkpoint = Checkpoint(every_n_steps=3, keep_last=10, monitor="valid/vloss", background=False)
    loop, _, _ = resumable_run(tmp_path, epochs=2, val_every_n_steps=3, checkpoint=checkpoint, extra=[scored])
    assert sorted(scored.scores) == [3, 6, 9, 12]
    files = {read(p)["loop"]["step"]: p for p in (tmp_path / "checkpoints").glob("*.pt")}
    assert sorted(files) == [3, 6, 7, 9, 12, 14]
    for step, path in files.items():
        meta = read(path)["meta"]
        if step in scored.scores:
            assert meta["metric"] == scored.scores[step], path.name
            assert all(torch.equal(a, b) for a, b in zip(weights(path), scored.weights[step], strict=True))
        else:
            assert meta["metric"] is None, path.name
    best_step = min(scored.scores, key=scored.scores.__getitem__)
    assert loop.state.results["best_checkpoint"] == files[best_step]
    assert checkpoint.best == (scored.scores[best_step], files[best_step])


def scripted(scores: dict[int, float]) -> Any:
    """A validation step whose loss is ``scores[global step]``."""
    def valid(loop: Any, batch: Any) -> Any:
        return {"loss": torch.tensor(scores[loop.state.step])}
    return valid


def small_run(tmp_path: Path, checkpoint: Checkpoint, scores: dict[int, float], **options: Any) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    batches = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(6)]
    scored = Scored("loss")
    state = hookfit.Loop(mse_step, batches, val_step=scripted(scores), val_data=[0], model=model,
                         optimizers=torch.optim.SGD(model.parameters(), lr=0.1), run_dir=tmp_path,
                         plugins=[Optim(), Metrics(), checkpoint, scored], **options).fit()
    return state, scored


@pytest.mark.parametrize("background", [False, True])
def test_a_validation_inside_training_saves_a_new_best_where_no_save_is_due(tmp_path: Path, background: bool) -> None:
    """No save by steps or epochs: the validations after steps 3, 6, 9 and 12 are followed by a
    save of the weights they scored when they improve (3, 6, 12), not when they do not (9)."""
    checkpoint = Checkpoint(every_n_epochs=None, keep_last=1, monitor="valid/loss", background=background)
    state, scored = small_run(tmp_path, checkpoint, {3: 5.0, 6: 2.0, 9: 3.0, 12: 1.5}, max_epochs=2,
                              val_every_n_steps=3)
    assert [(reason, step) for reason, step, _ in scored.saved if reason == "best"] == [("best", 3), ("best", 6),
                                                                                      ("best", 12)]
    best = state.results["best_checkpoint"]
    assert best is not None and read(best)["meta"]["metric"] == 1.5 and read(best)["loop"]["step"] == 12
    assert all(torch.equal(a, b) for a, b in zip(weights(best), scored.weights[12], strict=True))


def test_epoch_end_validations_keep_the_best_when_epoch_saves_are_off(tmp_path: Path) -> None:
    """``every_n_epochs=None`` with saves by steps: the epoch-end validation that improves is
    followed by a save at that epoch's end (there was no best checkpoint at all)."""
    checkpoint = Checkpoint(every_n_epochs=None, every_n_steps=4, keep_last=1, monitor="valid/loss",
                            background=False)
    state, scored = small_run(tmp_path, checkpoint, {6: 3.0, 12: 1.0, 18: 2.0}, max_epochs=3)
    assert [(reason, step) for reason, step, _ in scored.saved if reason == "best"] == [("best", 6), ("best", 12)]
    best = state.results["best_checkpoint"]
    assert best is not None and best.name == "epoch0002-step000000012.pt" and read(best)["meta"]["metric"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(weights(best), scored.weights[12], strict=True))


def test_a_run_resumed_from_a_best_checkpoint_taken_before_its_validation_continues_exactly(tmp_path: Path) -> None:
    """The best checkpoint of a validation inside training holds the run as it was before that
    validation (its position says the validation is due): a run resumed from it validates
    again, once, and ends as the run that never stopped, metric history included."""
    checkpoint = Checkpoint(every_n_epochs=None, keep_last=10, monitor="valid/vloss", background=False)
    straight, model, history = resumable_run(tmp_path / "straight", epochs=2, val_every_n_steps=3,
                                             checkpoint=checkpoint)
    best = straight.state.results["best_checkpoint"]
    assert best is not None and read(best)["loop"]["val_due"] is True and read(best)["meta"]["reason"] == "best"
    resumed, again, rerun = resumable_run(tmp_path / "resumed", epochs=2, val_every_n_steps=3, resume=str(best))
    assert resumed.state.step == straight.state.step == 14
    assert all(torch.equal(p, q) for p, q in zip(again.parameters(), model.parameters(), strict=True))
    assert rerun == history


class FailInValidation:
    """The validation at ``step`` fails at its first batch."""

    name = "fail_in_validation"

    def __init__(self, step: int) -> None:
        self.step = step

    @hookfit.hookimpl
    def batch_start(self, loop: Any) -> None:
        if not loop.training and loop.state.step == self.step:
            raise RuntimeError("injected failure during validation")


@pytest.mark.fault
def test_a_step_save_due_before_a_validation_that_fails_is_written_without_a_score(tmp_path: Path) -> None:
    checkpoint = Checkpoint(every_n_steps=3, monitor="valid/vloss", background=False)
    with pytest.raises(RuntimeError, match="injected failure during validation"):
        resumable_run(tmp_path, epochs=2, val_every_n_steps=3, checkpoint=checkpoint, extra=[FailInValidation(6)])
    latest = max((tmp_path / "checkpoints").glob("*.pt"))
    assert latest.name == "epoch0001-step000000006.pt"
    data = read(latest)
    assert data["loop"]["val_due"] is True and data["meta"]["metric"] is None and data["meta"]["reason"] == "step"


def test_a_run_whose_last_validation_ends_it_is_saved_once_with_that_validations_score(tmp_path: Path) -> None:
    """Saves and validations every 6 steps, epochs of 6: the run's last step is saved once,
    after its validation, with its score (the run's end adds no second save of it)."""
    checkpoint = Checkpoint(every_n_epochs=None, every_n_steps=6, keep_last=5, monitor="valid/loss", background=False)
    state, scored = small_run(tmp_path, checkpoint, {6: 2.0, 12: 1.0}, max_epochs=2, val_every_n_steps=6)
    assert [(reason, step) for reason, step, _ in scored.saved] == [("step", 6), ("step", 12)]
    assert [read(p)["meta"]["metric"] for p in checkpoint.saved] == [2.0, 1.0]
    assert state.results["last_checkpoint"] == state.results["best_checkpoint"] == checkpoint.saved[-1]


@pytest.mark.fault
@pytest.mark.parametrize("background", [False, True])
def test_validations_inside_training_that_publish_no_score_never_hold_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, background: bool) -> None:
    """A monitored checkpoint copies the state before each validation inside training, for its
    score; without the metrics plugin no validation publishes one. Each copy is settled at the
    next save point (written without a metric where the step's save was due, else let go): the
    copies held two snapshots from the second validation on, and the third waited for a free one
    forever."""
    import threading

    monkeypatch.setenv("HOOKFIT_PLUGINS", "optim,checkpoint")
    model = torch.nn.Linear(2, 1)
    checkpoint = Checkpoint(every_n_epochs=None, every_n_steps=4, keep_last=10, monitor="valid/loss",
                            background=background)
    ended: list[Any] = []

    def fit() -> None:
        ended.append(hookfit.Loop(mse_step, [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(12)],
                                  val_step=lambda loop, batch: {"loss": torch.tensor(1.0)}, val_data=[0],
                                  model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                                  max_epochs=1, val_every_n_steps=2, run_dir=tmp_path,
                                  plugins=[Optim(), checkpoint]).fit())

    worker = threading.Thread(target=fit, daemon=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        worker.start()
        worker.join(timeout=120)
    assert not worker.is_alive(), "six validations inside training without a score held the run"
    said = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    assert said == ["checkpoint: monitor='valid/loss': the validation after step 2 published no valid metrics (no "
                    "plugin publishes epoch_metrics; the metrics plugin does), so checkpoints carry no metric and "
                    "no best checkpoint is kept"]
    assert ended[0].status == "completed" and checkpoint.writer.pending == 0
    saved = [read(p) for p in checkpoint.saved]
    assert [(d["loop"]["step"], d["meta"]["reason"], d["meta"]["metric"]) for d in saved] == [
        (4, "step", None), (8, "step", None), (12, "step", None)]
    assert checkpoint.best is None and ended[0].results["best_checkpoint"] is None


OWED = '''
import json, os, sys
import torch, hookfit
from hookfit.data import Batches
from hookfit.plugins.checkpoint import Checkpoint, read
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim

run_dir, kind, target = sys.argv[1], sys.argv[2], float(sys.argv[3])
marker = run_dir + ".fail"  # the global step whose validation fails (or, "N stop", asks to stop), once


class FailOnce:
    name = "fail_once"

    @hookfit.hookimpl
    def batch_start(self, loop, batch_idx):
        if not loop.training and batch_idx == 1 and os.path.exists(marker):
            with open(marker) as f:
                at, *how = f.read().split()
            if loop.state.step == int(at):
                os.remove(marker)
                if how == ["stop"]:
                    loop.request_stop("stopped in a validation")
                else:
                    raise RuntimeError(f"injected failure in the validation after step {at}")


def step(loop, b):
    loss = torch.nn.functional.mse_loss(loop.model(b[0]), b[0] + 0.05 * torch.randn_like(b[0]))  # draws
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    return {"loss": loss}


def val_step(loop, b):  # the weight goes from 0 towards 1: the best is the one nearest the target
    return {"loss": torch.nn.functional.mse_loss(loop.model(b[0]), target * b[0])}


torch.manual_seed(0)
x = 1 + 0.1 * torch.randn(24, 1, generator=torch.Generator().manual_seed(1))
model = torch.nn.Linear(1, 1, bias=False)
with torch.no_grad():
    model.weight.zero_()
model.register_buffer("pad", torch.zeros(int(sys.argv[4]) if len(sys.argv) > 4 else 0))  # (a longer write)
bounds, saves = {"steps": ({"max_epochs": 2, "val_every_n_steps": 4}, {"every_n_steps": 4}),
                 "max_steps": ({"max_steps": 8, "val_every_n_steps": 4}, {"every_n_steps": 4}),
                 "best_only": ({"max_epochs": 2, "val_every_n_steps": 4}, {"every_n_epochs": None}),
                 "epochs": ({"max_epochs": 3}, {"every_n_epochs": 1}),
                 "epochs_steps": ({"max_epochs": 3}, {"every_n_steps": 6, "every_n_epochs": 1})}[kind]
checkpoint, metrics = Checkpoint(monitor="valid/loss", **saves), Metrics()
state = hookfit.Loop(step, Batches(x, batch_size=4, shuffle=True, seed=3), model=model, val_step=val_step,
                     val_data=Batches(x[:8], batch_size=4), run_dir=run_dir, resume="latest",
                     optimizers=torch.optim.SGD(model.parameters(), lr=0.05), **bounds,
                     plugins=[Optim(), metrics, checkpoint, FailOnce()]).fit()
best = checkpoint.best
with open(run_dir + ".json", "w") as f:
    json.dump({"status": state.status, "step": state.step, "weight": model.weight.item(),
               "best": None if best is None else [best[0], os.path.basename(best[1])],
               "last": os.path.basename(checkpoint.last),
               "valid": [[e["step"], e["loss"]] for e in metrics.history["valid"]],
               "files": {p.name: read(p)["meta"]["metric"] for p in sorted(checkpoint.saved)}}, f)
'''


def _owed(tmp_path: Path, name: str, kind: str, target: float, here: pytest.MonkeyPatch | None = None,
          pad: int = 0) -> tuple[dict[str, Any], str]:
    """The script above in a process of its own (``here``: in this one, for the run compared with): what it
    recorded, and its stderr."""
    import json
    import os
    import subprocess
    import sys

    if here is not None:
        run_script_here(tmp_path / "owed.py", str(tmp_path / name), kind, str(target), str(pad), monkeypatch=here)
        return json.loads((tmp_path / f"{name}.json").read_text()), ""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")}, "HOOKFIT_PLUGINS": ""}
    done = subprocess.run([sys.executable, "owed.py", str(tmp_path / name), kind, str(target), str(pad)],
                          cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    out = tmp_path / f"{name}.json"
    return (json.loads(out.read_text()) if done.returncode == 0 else {"failed": done.returncode}), done.stderr


@pytest.mark.fault
@pytest.mark.parametrize("kind, fails, target", [
    ("steps", 8, 0.6),  # val_every_n_steps=4, every_n_steps=4: step 8, inside epoch 2 of 2
    ("max_steps", 8, 0.6),  # the same, max_steps=8 ending the run at that step
    ("epochs", 12, 0.72),  # epoch-end validations, every_n_epochs=1: the failure is before the epoch's save
    ("epochs_steps", 12, 0.72),  # every_n_steps=6 saves epoch 2's last batch, then its validation fails
])
@pytest.mark.slow
def test_a_run_resumed_after_a_validation_failed_scores_the_checkpoint_taken_before_it(
        tmp_path: Path, kind: str, fails: int, target: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The validation after step ``fails`` (the best weights of the run) fails once, the run dies; resumed
    (``resume="latest"``), it validates there first, and scores the checkpoint of that step as the run that did
    not fail wrote it: the same best checkpoint, with the same metric, the same files and their metrics, the
    same weights and validations: the checkpoint of a ``val_every_n_steps`` step written before its validation
    failed is scored by the resumed run, and no other checkpoint becomes the best."""
    (tmp_path / "owed.py").write_text(OWED)
    straight, _ = _owed(tmp_path, "straight", kind, target, here=monkeypatch)
    assert straight["best"] is not None and straight["best"][1].endswith(f"-step{fails:09d}.pt"), straight
    (tmp_path / "resumed.fail").write_text(str(fails))
    failed, said = _owed(tmp_path, "resumed", kind, target)
    assert failed == {"failed": 1} and f"injected failure in the validation after step {fails}" in said, said
    assert not (tmp_path / "resumed.fail").exists()
    resumed, said = _owed(tmp_path, "resumed", kind, target)
    assert "resume='latest' took" in said and "Warning" not in said, said
    assert resumed == straight


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.parametrize("kind", ["steps", "max_steps"])
def test_a_resumed_run_keeps_the_best_checkpoint_whose_write_was_in_flight_when_its_state_was_copied(
        tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The best weights are step 4's; the validation after step 8 fails. The checkpoint of step 8 was copied
    while the writer (``background=True``) was still writing step 4's (a model of 32 MB, batches of
    microseconds): the state it holds does not name step 4's as the best. Resumed, the run reads the scores of
    its checkpoints up to step 8 that the state lacks: step 4's stays the best, as in the run that did not
    fail, and inside epoch 2 of 2 ``keep_last=3`` keeps it at step 12: the best weights are never pruned."""
    pad = 8_000_000
    (tmp_path / "owed.py").write_text(OWED)
    straight, _ = _owed(tmp_path, "straight", kind, 0.35, here=monkeypatch, pad=pad)
    assert straight["best"] is not None and straight["best"][1].endswith("-step000000004.pt"), straight
    (tmp_path / "resumed.fail").write_text("8")
    failed, said = _owed(tmp_path, "resumed", kind, 0.35, pad=pad)
    assert failed == {"failed": 1} and "injected failure in the validation after step 8" in said, said
    resumed, said = _owed(tmp_path, "resumed", kind, 0.35, pad=pad)
    assert "Warning" not in said, said
    assert resumed == straight


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["steps", "best_only"])
def test_a_run_resumed_after_a_stop_inside_a_validation_scores_the_checkpoint_of_that_step(
        tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop asked inside the validation after step 8 (the best weights): the run ends interrupted, its
    checkpoint of step 8 unscored (its save due, ``every_n_steps=4``; or its interrupt's, where no save is due
    and that validation's copy was let go). Resumed, the run validates there first and writes the checkpoint of
    step 8 again with its score (as its step's save, or as the best), as the run that did not stop wrote it."""
    (tmp_path / "owed.py").write_text(OWED)
    straight, _ = _owed(tmp_path, "straight", kind, 0.6, here=monkeypatch)
    assert straight["best"] is not None and straight["best"][1].endswith("-step000000008.pt"), straight
    (tmp_path / "resumed.fail").write_text("8 stop")
    stopped, said = _owed(tmp_path, "resumed", kind, 0.6)
    assert stopped["status"] == "interrupted" and stopped["files"][straight["best"][1]] is None, (stopped, said)
    resumed, said = _owed(tmp_path, "resumed", kind, 0.6)
    assert "Warning" not in said, said
    assert resumed == straight
