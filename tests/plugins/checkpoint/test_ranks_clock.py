"""checkpoint ranks: when a save by time is due, read on the main process's clock at steps every process knows."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from hookfit.plugins.checkpoint import ranks


class Steps:
    """A fake clock and run: each ``step()`` is a training step of ``seconds``; every broadcast is counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, seconds: float, world_size: int = 2) -> None:
        self.now, self.seconds, self.broadcasts = 1000.0, seconds, 0
        self.loop: Any = SimpleNamespace(state=SimpleNamespace(step=0, world_size=world_size), is_main=True)
        monkeypatch.setattr(ranks, "time", SimpleNamespace(monotonic=lambda: self.now))

        def from_main(loop: Any, value: Any) -> Any:
            self.broadcasts += 1
            return value

        monkeypatch.setattr(ranks, "from_main", from_main)

    def step(self) -> None:
        self.now += self.seconds
        self.loop.state.step += 1


def due_steps(clock: ranks.Clock, run: Steps, steps: int) -> list[int]:
    clock.start()
    due = []
    for _ in range(steps):
        run.step()
        if clock.due(run.loop):
            due.append(run.loop.state.step)
            clock.saved()
    return due


def test_slow_steps_under_several_processes_are_saved_on_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of 5 s and ``every_seconds=60``: a save after 12 steps (60 s), 24, 36, as one process saves; read
    only every 50th step, the first save came at step 50, more than three minutes late."""
    run = Steps(monkeypatch, seconds=5.0)
    assert due_steps(ranks.Clock(60.0), run, 40) == [12, 24, 36]
    assert run.broadcasts == 40  # a step longer than a second: the main process's clock read after each
    alone = Steps(monkeypatch, seconds=5.0, world_size=1)
    assert due_steps(ranks.Clock(60.0), alone, 40) == [12, 24, 36] and alone.broadcasts == 0


def test_fast_steps_read_the_main_processs_clock_about_once_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of 2 ms over 60 s, ``every_seconds=20``: saved within a second of each 20 s, with some sixty
    broadcasts rather than one at every step (a broadcast waits for the device under NCCL)."""
    run = Steps(monkeypatch, seconds=0.002)
    due = due_steps(ranks.Clock(20.0), run, 30_000)
    assert len(due) == 2 and all(10_000 <= step - before <= 10_500 for step, before in zip(due, [0] + due)), due
    assert 50 <= run.broadcasts <= 70, run.broadcasts


def test_a_short_every_seconds_is_read_at_a_tenth_of_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``every_seconds=2`` over steps of 10 ms: read every 0.2 s (20 steps), each save at most 0.2 s late."""
    run = Steps(monkeypatch, seconds=0.01)
    due = due_steps(ranks.Clock(2.0), run, 1000)
    assert all(200 <= step - before <= 220 for step, before in zip(due, [0] + due)) and len(due) >= 4, due


def test_a_resumed_run_reads_the_clock_at_its_own_pace(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run starts at step 0 and its resume sets step 20,000 before the first batch: steps of 5 s with
    ``every_seconds=60`` are saved every 12 steps, as in a fresh run; the pace from the start to the first
    batch (5 s over 20,001 steps) put the next reading some 2,800 steps (four hours) away."""
    run = Steps(monkeypatch, seconds=5.0)
    clock = ranks.Clock(60.0)
    clock.start()
    run.loop.state.step = 20_000
    due = []
    for _ in range(40):
        run.step()
        if clock.due(run.loop):
            due.append(run.loop.state.step - 20_000)
            clock.saved()
    assert due == [12, 24, 36], due


def test_no_every_seconds_is_never_due(monkeypatch: pytest.MonkeyPatch) -> None:
    run = Steps(monkeypatch, seconds=100.0)
    assert due_steps(ranks.Clock(None), run, 10) == [] and run.broadcasts == 0
