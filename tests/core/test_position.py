"""hookfit.position: Position.key orders the positions of one run as the run reaches them, so a
checkpoint store can tell which of its files is newest."""

from __future__ import annotations

import pytest

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
