"""hookfit.position: Position.key orders the positions of one run as the run reaches them, so a
checkpoint store can tell which of its files is newest."""

from __future__ import annotations

import pytest
import torch

import hookfit


@pytest.mark.parametrize("validation", [{"val_every_n_steps": 3}, {"val_every_n_epochs": 1}])
def test_position_keys_grow_through_a_run_with_validations_inside_or_at_epoch_ends(tmp_path, validation) -> None:
    """Every moment a checkpoint may be taken (each batch, a validation due inside the
    training stage and running, the stage's end, the epoch's end): never a smaller key than
    the moment before, and larger at each moment a resume would continue differently."""
    seen = []

    class Look:
        name = "look"

        @hookfit.hookimpl
        def after_batch(self, loop):
            seen.append(("after_batch", loop.position))

        @hookfit.hookimpl
        def batch_end(self, loop):
            if not loop.training:  # inside a validation: the position as it began (val_due)
                seen.append(("valid batch", loop.position))

        @hookfit.hookimpl(trylast=True)
        def stage_end(self, loop, stage):
            seen.append((f"{stage} end", loop.position))

        @hookfit.hookimpl
        def after_epoch(self, loop):
            seen.append(("after_epoch", loop.position))

    hookfit.Loop(lambda loop, b: None, list(range(4)), val_step=lambda loop, b: None, val_data=[0],
                 max_epochs=2, **validation, run_dir=tmp_path, plugins=[Look()]).fit()
    keys = [position.key() for _, position in seen]
    assert keys == sorted(keys), seen
    distinct = {}
    for what, position in seen:
        distinct.setdefault(position, what)
    assert len({p.key() for p in distinct}) == len(distinct), distinct  # other positions, other keys
    last_batch = next(p for w, p in seen if w == "after_batch" and p.step == 4)
    epoch_end = next(p for w, p in seen if w == "after_epoch" and p.step == 4)
    assert (last_batch.epoch, epoch_end.epoch) == (0, 1) and last_batch.key() < epoch_end.key()
    if "val_every_n_steps" in validation:  # a validation due inside the training stage
        assert any(p.val_due for _, p in seen)
    else:  # the epoch's validation, its training stage complete
        assert any(p.stage == "valid" for _, p in seen)


class StopAtValidationEnd:
    """Asks for a stop as the first epoch's validation publishes its metrics (its ``stage_end``): the run
    stops at that boundary, the validation complete but not its epoch."""

    name = "stop_at_validation_end"

    @hookfit.hookimpl
    def epoch_metrics(self, loop, stage) -> None:
        if stage == "valid" and loop.state.epoch == 0:
            loop.request_stop("test stop as the validation ends")


def test_a_stop_at_the_end_of_an_epochs_validation_resumes_with_the_random_state_as_it_began(tmp_path) -> None:
    """The checkpoint of a stop at the validation's stage_end says the validation is left to run
    (``resume_stage: 'valid'``): its random state is the one it began with, so the resumed run draws
    what the uninterrupted one drew, its validation data's iterator included."""
    from conftest import resumable_run
    from hookfit.plugins.checkpoint import read

    _, straight, want = resumable_run(tmp_path / "straight", epochs=2)
    stopped, _, _ = resumable_run(tmp_path / "run", epochs=2, extra=[StopAtValidationEnd()])
    assert stopped.state.status == "interrupted" and stopped.state.epoch == 0
    (path,) = (tmp_path / "run" / "checkpoints").glob("*.pt")
    assert read(path)["loop"]["resume_stage"] == "valid"
    _, model, history = resumable_run(tmp_path / "run", epochs=2, resume="latest")
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), straight.parameters()))
    assert history["train"] == want["train"]
