"""tensorboard: a run stopped and resumed reads back, with TensorBoard's own reader, as the run that
never stopped: every scalar tag, point for point, also where no publication of the metrics plugin
fell on the stop's step (the stage the stop cut short is written with no learning rate, which the
run that goes on writes at the epoch's end)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import StopAfter, mse_step

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

import hookfit  # noqa: E402
from hookfit.plugins.checkpoint import Checkpoint  # noqa: E402
from hookfit.plugins.metrics import Metrics  # noqa: E402
from hookfit.plugins.optim import Optim  # noqa: E402
from hookfit.plugins.tensorboard import TensorBoard  # noqa: E402

NEVER = 3600.0  # Metrics(interval=NEVER): no publication inside a stage of these runs, whatever the clock says


def _run(run_dir: Path, *plugins: object, interval: float, resume: str | None = None) -> hookfit.Loop:
    """Three epochs of four training and two validation batches, a learning rate that changes every epoch."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(4)]

    def step(loop: hookfit.Loop, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        for group in loop.optimizers.param_groups:
            group["lr"] = 0.1 / (1 + loop.state.epoch)
        return mse_step(loop, batch)

    def val_step(loop: hookfit.Loop, batch: int) -> dict[str, float]:
        return {"loss": 1.0 / (1 + loop.state.epoch + batch)}

    loop = hookfit.Loop(step, data, val_step=val_step, val_data=[0, 1], model=model, optimizers=optimizer,
                        max_epochs=3, run_dir=run_dir, resume=resume,
                        plugins=[Optim(), Metrics(interval=interval), *plugins])
    loop.fit()
    return loop


def _curves(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the run folder, as TensorBoard reads the folder (its purges applied)."""
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


# where a stop lands, counting batches of four training and two validation batches an epoch
STOPS = {7: "after epoch 2's first training batch", 8: "after epoch 2's second training batch",
         10: "right after epoch 2's last training batch", 11: "inside epoch 2's validation",
         12: "right after epoch 2's validation"}


@pytest.mark.parametrize(("interval", "every_publication"), [(NEVER, True), (NEVER, False), (0.0, True)])
@pytest.mark.parametrize("stop", sorted(STOPS))
def test_every_scalar_curve_of_a_resumed_run_is_the_uninterrupted_runs(tmp_path: Path, stop: int, interval: float,
                                                                        every_publication: bool) -> None:
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    _run(whole, TensorBoard(every_publication=every_publication), interval=interval)
    first = _run(resumed, TensorBoard(every_publication=every_publication), Checkpoint(background=False),
                 StopAfter(stop), interval=interval)
    assert first.state.status == "interrupted", STOPS[stop]
    loop = _run(resumed, TensorBoard(every_publication=every_publication), Checkpoint(background=False),
                interval=interval, resume="latest")
    assert loop.state.resumed_from is not None and loop.state.status == "completed"
    expected, got = _curves(whole), _curves(resumed)
    assert {"epoch", "lr/default", "train/loss", "valid/loss"} <= set(expected)
    assert ("train_step/loss" in expected) == (every_publication and interval == 0)
    assert got == expected, STOPS[stop]
