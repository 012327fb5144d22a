"""Validation inside training, ``Loop(val_every_n_steps=N)``: a validation stage nested in the
training stage every N global steps, with every plugin, and exact resume wherever a run stops
around it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint, CheckpointError, read
from hookfit.plugins.early_stopping import EarlyStopping
from hookfit.plugins.metrics import Metrics

from conftest import Recorder, StopAfter, resumable_run


class Published:
    """Records every ``epoch_metrics`` publication as (stage, epoch, step, values)."""

    name = "published"

    def __init__(self) -> None:
        self.rows: list[tuple[str, int, int, dict[str, float]]] = []

    @hookfit.hookimpl
    def epoch_metrics(self, stage, metrics) -> None:
        self.rows.append((stage, metrics.epoch, metrics.step, {k: v.epoch for k, v in metrics.values.items()}))


def test_validation_runs_inside_training_every_n_global_steps(recorder: Recorder) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    seen = []

    def train(loop, batch):
        seen.append(("train", loop.state.step, loop.state.batch_idx, loop.training, model.training,
                     torch.is_grad_enabled()))
        return torch.tensor(float(batch))

    def valid(loop, batch):
        seen.append(("valid", loop.state.step, loop.state.batch_idx, loop.training, model.training,
                     torch.is_grad_enabled()))
        return {"v": torch.tensor(float(loop.state.step))}

    published = Published()
    loop = hookfit.Loop(train, [1, 2, 3, 4, 5], val_step=valid, val_data=[0, 0], model=model,
                        val_every_n_steps=3, max_epochs=2, plugins=[Metrics(), published, recorder])
    state = loop.fit()
    assert state.status == "completed" and state.step == 10 and not state.val_due
    assert loop.val_every_n_epochs is None  # steps instead of epochs
    # counted over the run, not per epoch: after steps 3, 6 and 9 (batch 0 of epoch 2 is step 6)
    assert [(stage, epoch, step) for stage, epoch, step, _ in published.rows] == [
        ("valid", 0, 3), ("train", 0, 5), ("valid", 1, 6), ("valid", 1, 9), ("train", 1, 10)]
    assert [values for stage, *_, values in published.rows if stage == "valid"] == [{"v": 3.0}, {"v": 6.0}, {"v": 9.0}]
    # the training stage's metrics cover every batch of its epoch, validations or not
    assert [values for stage, *_, values in published.rows if stage == "train"] == [{"loss": 3.0}, {"loss": 3.0}]
    # validation in eval mode without autograd, training back in train mode where it was
    assert seen[:6] == [("train", 0, 0, True, True, True), ("train", 1, 1, True, True, True),
                        ("train", 2, 2, True, True, True), ("valid", 3, 0, False, False, False),
                        ("valid", 3, 1, False, False, False), ("train", 3, 3, True, True, True)]
    stages = [(e, args["stage"]) for e, args in recorder.events if e in ("stage_start", "stage_end")]
    assert stages == [("stage_start", "train"), ("stage_start", "valid"), ("stage_end", "valid"),
                      ("stage_end", "train"),
                      ("stage_start", "train"), ("stage_start", "valid"), ("stage_end", "valid"),
                      ("stage_start", "valid"), ("stage_end", "valid"), ("stage_end", "train")]
    # the batch after a validation is seen by plugins as a training batch at its own position
    after = [i for i, (e, stage, _) in enumerate(recorder.seen) if e == "stage_end" and stage == "valid"][0]
    assert next(seen for seen in recorder.seen[after:] if seen[0] == "batch_start") == ("batch_start", "train", True)
    assert ("batch_start", {"batch": 4, "batch_idx": 3}) in recorder.events


@pytest.mark.bad_input
@pytest.mark.parametrize("kwargs, message", [
    (dict(val_every_n_steps=3, val_every_n_epochs=1), "give val_every_n_epochs=1 or val_every_n_steps=3, not both"),
    (dict(val_every_n_steps=0), "val_every_n_steps must be a positive integer, got 0"),
    (dict(val_every_n_steps=True), "val_every_n_steps must be a positive integer, got True"),
])
def test_bad_step_validation_options_are_named_when_the_loop_is_built(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        hookfit.Loop(lambda l, b: None, [1], val_step=lambda l, b: None, val_data=[1], **kwargs)


@pytest.mark.bad_input
def test_step_validation_without_validation_is_named() -> None:
    with pytest.raises(ValueError, match="val_every_n_steps=2 was given without a val_step and val_data"):
        hookfit.Loop(lambda l, b: None, [1], val_every_n_steps=2)


def test_max_steps_on_a_multiple_validates_before_the_run_ends() -> None:
    published = Published()
    loop = hookfit.Loop(lambda l, b: None, list(range(10)), val_step=lambda l, b: {"v": 1.0}, val_data=[0],
                        val_every_n_steps=4, max_steps=8, plugins=[Metrics(), published])
    state = loop.fit()
    assert (state.status, state.step, state.stop_reason) == ("completed", 8, "max_steps=8 reached")
    assert [step for stage, _, step, _ in published.rows if stage == "valid"] == [4, 8]


# -- exact resume around a validation inside training --------------------------------------------


class StopAfterValidation:
    """Asks for a stop once the validation at ``step`` has published its metrics: the run stops
    at that validation's stage_end, which completed."""

    name = "stop_after_validation"

    def __init__(self, step: int) -> None:
        self.step = step

    @hookfit.hookimpl
    def epoch_metrics(self, loop, stage) -> None:
        if stage == "valid" and loop.state.step == self.step:
            loop.request_stop("test stop after a validation")


class FailInValidation:
    """The validation at ``step`` fails at its second batch (a crash, no interrupt checkpoint)."""

    name = "fail_in_validation"

    def __init__(self, step: int) -> None:
        self.step = step

    @hookfit.hookimpl
    def batch_start(self, loop, batch_idx) -> None:
        self.state = loop.state
        if not loop.training and loop.state.step == self.step and batch_idx == 1:
            raise RuntimeError("injected failure during validation")


def run(run_dir: Path, *, extra=(), resume=None, checkpoint: Checkpoint | None = None):
    """conftest's resumable run over 2 epochs (7 training batches each), validating 2 batches
    after steps 3, 6, 9 and 12: 22 batches in all."""
    loop, model, history = resumable_run(run_dir, extra=extra, resume=resume, epochs=2, val_every_n_steps=3,
                                         checkpoint=checkpoint or Checkpoint(background=False))
    return loop, [p.detach().clone() for p in model.parameters()], history


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    loop, params, history = run(tmp_path_factory.mktemp("straight"))
    assert loop.state.step == 14 and [e["step"] for e in history["valid"]] == [3, 6, 9, 12]
    return params, history


def _equal(resumed, straight) -> None:
    loop, params, history = resumed
    assert (loop.state.status, loop.state.step) == ("completed", 14)
    want_params, want_history = straight
    assert all(torch.equal(p, q) for p, q in zip(params, want_params))
    assert history == want_history


@pytest.mark.parametrize("stop", range(1, 23))
def test_a_run_stopped_after_any_batch_around_validations_resumes_exactly(tmp_path: Path, straight, stop: int) -> None:
    """Stops after a training batch that makes a validation due (3, 13, ...), inside a
    validation (4, 14, ...) and after its last batch, before its stage_end (5, 15, ...): the
    validation runs again, from its start, before the next training batch."""
    stopped, _, _ = run(tmp_path, extra=[StopAfter(stop)])
    assert stopped.state.status == "interrupted"
    _equal(run(tmp_path, resume="latest"), straight)


def test_the_checkpoint_records_whether_the_validation_due_has_run(tmp_path: Path, straight) -> None:
    stopped, _, _ = run(tmp_path / "due", extra=[StopAfter(3)])  # step 3 done, its validation not
    (path,) = (tmp_path / "due" / "checkpoints").glob("*.pt")
    assert read(path)["loop"] == {"epoch": 0, "step": 3, "resume_batch": 3, "resume_stage": "train", "val_due": True}
    stopped, _, _ = run(tmp_path / "done", extra=[StopAfterValidation(3)])
    assert stopped.state.status == "interrupted" and stopped.state.step == 3
    (path,) = (tmp_path / "done" / "checkpoints").glob("*.pt")
    assert read(path)["loop"] == {"epoch": 0, "step": 3, "resume_batch": 3, "resume_stage": "train"}
    resumed = run(tmp_path / "done", resume="latest")
    assert [e["step"] for e in resumed[2]["valid"]] == [3, 6, 9, 12]  # step 3's validation not run twice
    _equal(resumed, straight)


@pytest.mark.fault
def test_a_crash_during_validation_resumes_from_the_step_checkpoint_taken_before_it(tmp_path: Path, straight) -> None:
    """Checkpoints every 3 steps are written at the batch's end, before the validation due at
    the same step: they say it is due, and a crash inside it loses nothing."""
    failing = FailInValidation(6)
    with pytest.raises(RuntimeError, match="injected failure during validation"):
        run(tmp_path, extra=[failing], checkpoint=Checkpoint(every_n_steps=3, background=False))
    assert failing.state.status == "failed" and failing.state.val_due
    latest = max((tmp_path / "checkpoints").glob("*.pt"))
    assert latest.name == "epoch0001-step000000006.pt" and read(latest)["loop"]["val_due"] is True
    _equal(run(tmp_path, resume="latest", checkpoint=Checkpoint(every_n_steps=3, background=False)), straight)


@pytest.mark.bad_input
def test_a_checkpoint_whose_val_due_is_not_a_flag_is_refused(tmp_path: Path) -> None:
    run(tmp_path, extra=[StopAfter(3)])
    (path,) = (tmp_path / "checkpoints").glob("*.pt")
    data = read(path)
    data["loop"]["val_due"] = "yes"
    del data["digest"]
    bad = tmp_path / "bad.pt"
    torch.save(data, bad)
    with pytest.raises(CheckpointError, match=r"loop\['val_due'\] is 'yes', not True or False"):
        run(tmp_path, resume=str(bad))


# -- plugins that follow validations ---------------------------------------------------------------


def test_early_stopping_counts_validations_and_stops_right_after_the_deciding_one() -> None:
    values = iter([3.0, 2.0, 2.5, 2.4, 1.0, 1.0])
    trained = []

    def train(loop, batch):
        trained.append(loop.state.step)

    loop = hookfit.Loop(train, list(range(4)), val_step=lambda l, b: {"loss": next(values)}, val_data=[0],
                        val_every_n_steps=2, max_epochs=5,
                        plugins=[Metrics(), EarlyStopping(monitor="valid/loss", patience=2)])
    state = loop.fit()
    # validations after steps 2, 4, 6 and 8: 2.5 and 2.4 do not improve on 2.0 (at step 4)
    assert (state.status, state.step) == ("completed", 8)
    assert trained == list(range(8))  # no training batch after the deciding validation
    assert state.stop_reason == ("early stopping: valid/loss did not improve for 2 validation(s) (patience 2); "
                                 "best (min) 2 at step 4 (epoch 1)")
    assert state.stopped_by == "early_stopping"


def test_the_dashboard_shows_training_progress_again_after_a_validation_inside_it() -> None:
    from hookfit.plugins.tui.dashboard import Dashboard

    board = Dashboard(2, None, on_stop=lambda: None, on_leave=lambda: None)
    board.receive("stage", "train", 0, 7)
    board.progress.batches, board.progress.rate = 3, 12.5
    board.receive("stage", "valid", 0, 2)
    assert (board.progress.stage, board.progress.batches, board.progress.total) == ("valid", 0, 2)
    board.receive("stage_end", "valid")
    p = board.progress
    assert (p.stage, p.batches, p.total, p.rate) == ("train", 3, 7, 12.5)
    board.receive("stage_end", "train")
    board.receive("stage", "valid", 0, 2)  # a validation after the training stage: nothing to come back to
    board.receive("stage_end", "valid")
    assert (board.progress.stage, board.progress.total) == ("valid", 2)


def test_a_run_resumed_where_a_validation_was_due_but_without_validation_trains_on(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    trained = []
    stopped = hookfit.Loop(lambda l, b: trained.append(b), [1, 2, 3, 4], val_step=lambda l, b: None, val_data=[0],
                           model=model, val_every_n_steps=2, run_dir=tmp_path,
                           plugins=[Checkpoint(background=False), StopAfter(2)]).fit()
    assert stopped.status == "interrupted" and stopped.val_due  # stopped before the validation due at step 2
    state = hookfit.Loop(lambda l, b: trained.append(b), [1, 2, 3, 4], model=model, run_dir=tmp_path, resume="latest",
                         plugins=[Checkpoint(background=False)]).fit()
    assert (state.status, state.step, state.val_due) == ("completed", 4, False)
    assert trained == [1, 2, 3, 4]
