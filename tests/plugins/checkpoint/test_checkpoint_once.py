"""What the checkpoint plugin writes once and says once: a position saved once when two save
points fall at one step; a run's failed saves warned about once, whatever their errors, and torch's
zip writer's short write explained by the device's free space; the run's end saying which writes
it waits for; a checkpoint that fails its checks naming ``fallback=True`` (every process's results
under ``torchrun`` are in test_checkpoint_results.py)."""

from __future__ import annotations

import errno
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from test_writer import WAIT, Held, remove, state, until

import hookfit
from hookfit.plugins.checkpoint import Checkpoint, CheckpointError, CheckpointWarning, ending, read, sharded
from hookfit.plugins.checkpoint import plugin as checkpoint_plugin
from hookfit.plugins.checkpoint.writer import Writer, write_file

from conftest import resumable_run as train


class Saved:
    """Each ``checkpoint_saved``: the file's name, the reason, the step."""

    name = "saved"

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, int]] = []

    @hookfit.hookimpl
    def checkpoint_saved(self, path: str, reason: str, step: int) -> None:
        self.seen.append((Path(path).name, reason, step))


def counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the files the checkpoint plugins made from now write, one per write."""
    writes: list[str] = []

    def save(state: dict[str, Any], path: Path, between: Any) -> None:
        writes.append(path.name)
        write_file(state, path, between)

    monkeypatch.setattr(checkpoint_plugin, "write_file", save)
    return writes


# -- a position is saved once -----------------------------------------------------------------


@pytest.mark.parametrize("background", [True, False])
def test_a_step_save_at_an_epochs_end_is_the_epochs_checkpoint_written_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, background: bool) -> None:
    """7 batches an epoch, ``every_n_steps=7``: each epoch's last step is saved by the step's
    schedule, and the epoch's save of that same step writes nothing again."""
    writes, saved = counted(monkeypatch), Saved()
    ckpt = Checkpoint(every_n_steps=7, keep_last=10, background=background)
    loop, _, _ = train(tmp_path, checkpoint=ckpt, epochs=2, extra=[saved])
    assert loop.state.status == "completed"
    names = ["epoch0001-step000000007.pt", "epoch0002-step000000014.pt"]
    assert saved.seen == [(names[0], "step", 7), (names[1], "step", 14)]
    assert writes == names
    assert [p.name for p in ckpt.saved] == names and read(ckpt.saved[-1])["loop"]["step"] == 14


def test_a_run_that_max_steps_ends_at_a_saved_step_writes_no_second_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writes, saved = counted(monkeypatch), Saved()
    ckpt = Checkpoint(every_n_steps=3, keep_last=10)
    loop, _, _ = train(tmp_path, checkpoint=ckpt, epochs=3, max_steps=9, extra=[saved])
    assert (loop.state.status, loop.state.step) == ("completed", 9)
    assert [(reason, step) for _, reason, step in saved.seen] == [("step", 3), ("step", 6), ("epoch", 7), ("step", 9)]
    assert writes == [name for name, _, _ in saved.seen]  # each once
    assert loop.state.results["last_checkpoint"] == tmp_path / "checkpoints" / "epoch0002-step000000009.pt"


def test_a_score_published_after_a_steps_save_is_written_with_that_steps_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step's save at an epoch's last step carries no score (its validation comes after);
    the epoch's save of the same weights carries it: written, so the best checkpoint holds it."""
    writes, saved = counted(monkeypatch), Saved()
    ckpt = Checkpoint(every_n_steps=7, monitor="valid/vloss", background=False)
    loop, _, _ = train(tmp_path, checkpoint=ckpt, epochs=1, extra=[saved])
    path = tmp_path / "checkpoints" / "epoch0001-step000000007.pt"
    assert read(path)["meta"]["metric"] is not None
    assert loop.state.results["best_checkpoint"] == path
    assert writes == [path.name] * len(saved.seen) and saved.seen[-1][1:] == ("epoch", 7)


# -- failed saves: warned once a run; a short write explained --------------------------------


SHORT = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


@pytest.mark.fault
def test_a_run_warns_once_for_its_failed_saves_whatever_their_errors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk fails the first write with torch's zip writer's error and the next ones with
    ``ENOSPC``: one cause, one warning; every failure counted."""
    calls = [0]

    def full(state: dict[str, Any], path: Path, between: Any) -> None:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError(SHORT)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(checkpoint_plugin, "write_file", full)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop, _, _ = train(tmp_path, checkpoint=Checkpoint(every_n_epochs=None, every_n_steps=2), epochs=1)
    said = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    assert len(said) == 1, said
    assert "unexpected pos" in said[0] and said[0].endswith("training goes on")
    assert loop.state.status == "completed" and loop.state.results["failed_saves"] == calls[0] == 4  # 2, 4, 6; 7


@pytest.mark.fault
def test_torchs_short_write_of_a_sharded_checkpoint_says_how_much_the_device_has_free(tmp_path: Path) -> None:
    """DCP's files are written by torch's zip writer, which on a full device says only
    ``unexpected pos``: the failed save says how many bytes the device has free."""
    tmp = tmp_path / ".epoch0001-step000000006.dcp.1-1.tmp"
    tmp.mkdir()

    def written() -> Any:
        raise RuntimeError(SHORT)

    rest = {"meta": {}}
    with pytest.raises(CheckpointError, match=r"unexpected pos 704 vs 598 \(torch's writer wrote less than it asked "
                                              r"to: the device has \d+ bytes free; most often a full device\)"):
        sharded.finish(rest, tmp, tmp_path / "epoch0001-step000000006.dcp", True, write_file, written)
    assert not tmp.exists()


# -- the run's end says what it waits for -----------------------------------------------------


def test_the_runs_end_says_which_write_in_flight_it_waits_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The epoch's checkpoint is held by the test: the run's end waits for it and, past the
    notice's delay (none here), says so on stderr, once; then ends when it is written."""
    held = Held()

    def save(state: dict[str, Any], path: Path, between: Any) -> None:
        held(state, path)
        write_file(state, path, between)

    monkeypatch.setattr(checkpoint_plugin, "write_file", save)
    monkeypatch.setattr(ending, "NOTICE_AFTER", 0.0)
    ckpt = Checkpoint()
    ended: list[Any] = []
    runner = threading.Thread(target=lambda: ended.append(train(tmp_path, checkpoint=ckpt, epochs=1)[0]))
    capsys.readouterr()
    runner.start()
    err: list[str] = []
    path = tmp_path / "checkpoints" / "epoch0001-step000000007.pt"
    line = f"hookfit checkpoint: waiting for 1 write in flight to {path}"
    deadline = time.monotonic() + WAIT
    while line not in err:
        assert time.monotonic() < deadline, f"no {line!r} on stderr: {err}"
        err += capsys.readouterr().err.splitlines()
        time.sleep(0.001)
    assert not path.exists() and not ended  # still waiting: the line came while the write was held
    held.release.set()
    runner.join(WAIT)
    assert ended and ended[0].state.status == "completed" and path.exists()
    err += capsys.readouterr().err.splitlines()
    assert [text for text in err if "waiting for" in text] == [line]


def test_saves_waiting_for_the_writer_are_timed_and_most_of_a_run_spent_so_is_said() -> None:
    held = Held()
    writer = Writer(held, remove)
    assert writer.submit(state(1.0), Path("a"), "a") and writer.submit(state(2.0), Path("b"), "b")
    third = threading.Thread(target=writer.submit, args=(state(3.0), Path("c"), "c"))
    third.start()  # both snapshots taken: it waits for the write held
    until(lambda: writer.waiting == 1, "a save waiting for the writer")
    assert writer.in_flight == [Path("a"), Path("b")]
    held.release.set()
    third.join(WAIT)
    writer.close()
    assert writer.waited > 0 and writer.in_flight == []
    note = ending.bottleneck(7.5, 9.0)
    assert note is not None and note.startswith("saves waited 7.5 s of the run's 9.0 s for checkpoint writes")
    assert "when_busy='skip'" in note
    assert ending.bottleneck(4.0, 10.0) is None and ending.bottleneck(ending.NOTICE_AFTER, 3.0) is None


# -- a checkpoint that fails its checks names fallback --------------------------------------------


@pytest.mark.bad_input
def test_a_digest_mismatch_of_the_newest_checkpoint_says_fallback_takes_the_one_before(tmp_path: Path) -> None:
    train(tmp_path, epochs=2)
    newest = tmp_path / "checkpoints" / "epoch0002-step000000014.pt"
    data = torch.load(newest, weights_only=True)
    weight = data["model"]["0.weight"]
    weight.view(-1)[3] = weight.view(-1)[3] * -1.0 + 1e-3  # one element changed, the old digest kept
    torch.save(data, newest)
    with pytest.raises(CheckpointError, match=r"its contents do not match its digest .*; Checkpoint\(fallback=True\) "
                                              r"would skip it and take the newest checkpoint before it that reads "
                                              r"whole \(1 older in "):
        train(tmp_path, resume="latest", epochs=3)


def test_a_completed_runs_last_step_save_skipped_by_a_busy_writer_is_written_at_the_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``when_busy="skip"``, a save every 7 steps (an epoch) of 21, the first write held: step 14's save
    takes the second snapshot, step 21's is skipped. The run's end took step 21 for saved (it was asked)
    and wrote nothing: the completed run's newest checkpoint held step 14's weights."""
    held = Held()

    def save(state: dict[str, Any], path: Path, between: Any) -> None:
        held(state, path)
        write_file(state, path, between)

    class Release:
        name = "release"

        @hookfit.hookimpl(trylast=True)  # after the checkpoint's save of step 21
        def after_batch(self, loop: Any) -> None:
            if loop.state.step == 21:
                held.release.set()

    monkeypatch.setattr(checkpoint_plugin, "write_file", save)
    ckpt, saved = Checkpoint(every_n_epochs=None, every_n_steps=7, keep_last=10, when_busy="skip"), Saved()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop, _, _ = train(tmp_path, checkpoint=ckpt, epochs=3, extra=[Release(), saved])
    assert loop.state.status == "completed" and loop.state.step == 21 and loop.state.results["skipped_saves"] == 1
    assert [w for w in caught if "the save at step 21 was skipped" in str(w.message)]
    assert [(reason, step) for _, reason, step in saved.seen] == [("step", 7), ("step", 14), ("completed", 21)]
    assert read(ckpt.saved[-1])["loop"]["step"] == 21 == read(loop.state.results["last_checkpoint"])["loop"]["step"]
