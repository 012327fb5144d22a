"""hookfit.state: where a run is."""

from __future__ import annotations

import hookfit
from hookfit.state import State


def test_a_fresh_state_is_idle_and_has_taken_no_time() -> None:
    state = State()
    assert (state.status, state.epoch, state.step, state.stage, state.elapsed) == ("idle", 0, 0, None, 0.0)
    assert (state.stop_reason, state.stopped_by, state.rank, state.world_size) == (None, None, 0, 1)


def test_elapsed_grows_during_a_run_and_stops_at_its_end() -> None:
    seen = []
    state = hookfit.Loop(lambda loop, b: seen.append(loop.state.elapsed), range(3)).fit()
    assert seen == sorted(seen) and seen[0] > 0
    assert state.ended_at is not None and state.elapsed >= seen[-1]
    assert state.elapsed == state.elapsed  # frozen once the run has ended


def test_the_time_spent_in_fit_end_is_not_the_runs() -> None:
    """A dashboard held on screen after the run (persistent mode) is not training time."""
    import time

    class Hold:
        @hookfit.hookimpl
        def fit_end(self, loop):
            time.sleep(0.3)

    state = hookfit.Loop(lambda l, b: None, [1], plugins=[Hold()]).fit()
    assert state.elapsed < 0.3


def test_the_state_says_where_the_run_wrote_its_files(tmp_path, monkeypatch) -> None:
    """A sweep keeps the states, not the loops: the folder a run with no run_dir given wrote to was reachable
    only through ``loop.run.run_dir`` (which keeps the model alive). A run that wrote no file has none."""
    class Writes:
        @hookfit.hookimpl
        def fit_start(self, loop) -> None:
            (loop.run_dir / "mine.txt").write_text("written")

    monkeypatch.chdir(tmp_path)
    state = hookfit.Loop(lambda loop, b: None, [1], name="trial", plugins=[Writes()]).fit()
    assert state.run_dir is not None and state.run_dir.parent.resolve() == (tmp_path / "runs" / "trial")
    assert (state.run_dir / "mine.txt").read_text() == "written" and (state.run_dir / "run.jsonl").is_file()
    assert hookfit.Loop(lambda loop, b: None, [1], name="quiet").fit().run_dir is None
