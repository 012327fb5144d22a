"""An earlier run's checkpoints in the folder a run writes in, when the run does not continue them
(run again without resume, or resumed from a checkpoint elsewhere): moved into ``earlier-run-N/``,
never written over nor pruned; one that cannot be moved stays, listed, and is never written over."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import pytest
import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint, CheckpointWarning
from hookfit.plugins.checkpoint.storage import EARLIER, checkpoint_files
from hookfit.plugins.metrics import Metrics


def name(epoch: int) -> str:
    """The checkpoint file of epoch ``epoch`` (from 1) of :func:`scored` (one step an epoch)."""
    return f"epoch{epoch:04d}-step{epoch:09d}.pt"


def scored(run_dir: Path | None, scores: list[float], keep_last: int, **options: object) -> hookfit.State:
    """A run whose validation of epoch ``e`` scores ``scores[e]`` (``valid/score``, the lower the better), a
    checkpoint every epoch, ``keep_last`` kept besides the best."""
    def val_step(loop, batch):
        return {"score": torch.tensor(scores[loop.state.epoch])}

    checkpoint = Checkpoint(keep_last=keep_last, monitor="valid/score", background=False)
    return hookfit.Loop(lambda loop, batch: None, [torch.zeros(1)], val_step=val_step, val_data=[torch.zeros(1)],
                        model=torch.nn.Linear(1, 1), max_epochs=len(scores), run_dir=run_dir,
                        plugins=[Metrics(), checkpoint], **options).fit()


def unmovable(monkeypatch: pytest.MonkeyPatch, stuck: Path) -> object:
    """``os.rename`` refusing to move ``stuck`` (PermissionError) from now on; returns the real one, to put back."""
    rename = os.rename

    def refused(source, target, *args, **kwargs):
        if Path(source) == stuck:
            raise PermissionError(13, "Permission denied", str(source))
        return rename(source, target, *args, **kwargs)

    monkeypatch.setattr(os, "rename", refused)
    return rename


def contents(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (its path inside) and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def own(folder: Path) -> dict[str, bytes]:
    """The files in ``folder`` itself, not in its subfolders, and their bytes."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_a_script_run_again_in_its_run_dir_keeps_the_earlier_runs_checkpoints_best_included(tmp_path: Path) -> None:
    """The same script run twice in one run_dir without resume, the same schedule: the second run wrote files of
    the first one's names over them, and its keep_last pruned them, the first run's best included. They are
    moved into earlier-run-1/ whole, the second run's own in the folder; a third run moves the second's into
    earlier-run-2/."""
    folder = tmp_path / "checkpoints"
    first = scored(tmp_path, [3.0, 1.0, 4.0, 2.0], keep_last=1)
    assert first.results["best_checkpoint"] == folder / name(2)
    before = contents(folder)
    assert sorted(before) == [name(2), name(4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = scored(tmp_path, [5.0, 6.0, 7.0, 8.0], keep_last=1)
    assert contents(folder / "earlier-run-1") == before  # the earlier best's bytes, and its last's
    said = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    assert len(said) == 1 and f"moved into {folder / 'earlier-run-1'}" in said[0], said
    assert second.results["best_checkpoint"] == folder / name(1)
    assert [p.name for p in checkpoint_files(folder)] == [name(4), name(1)]
    second_files = {n: (folder / n).read_bytes() for n in (name(1), name(4))}
    with pytest.warns(CheckpointWarning, match=re.escape(f"moved into {folder / 'earlier-run-2'}")):
        scored(tmp_path, [9.0, 9.5], keep_last=1)
    assert contents(folder / "earlier-run-1") == before
    assert contents(folder / "earlier-run-2") == second_files
    assert [p.name for p in checkpoint_files(folder)] == [name(2), name(1)]


def test_an_earlier_runs_failure_and_sharded_checkpoints_are_moved_too_and_nothing_else(tmp_path: Path) -> None:
    """A failure's checkpoint and a sharded checkpoint's folder of the earlier run go into earlier-run-1/ with
    its files; what is no checkpoint stays where it is."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "failed-epoch0002-step000000002.pt").write_bytes(b"a failure's")
    (folder / "epoch0001-step000000001.dcp").mkdir()
    (folder / "epoch0001-step000000001.dcp" / "state.pt").write_bytes(b"a sharded one's")
    (folder / "notes.txt").write_text("mine")
    with pytest.warns(CheckpointWarning, match=re.escape(f"held 2 checkpoint(s) of an earlier run (newest by name: "
                                                         f"epoch0001-step000000001.dcp)")):
        scored(tmp_path, [1.0], keep_last=1)
    assert contents(folder / "earlier-run-1") == {"failed-epoch0002-step000000002.pt": b"a failure's",
                                                 "epoch0001-step000000001.dcp/state.pt": b"a sharded one's"}
    assert (folder / "notes.txt").read_text() == "mine"
    assert [p.name for p in checkpoint_files(folder)] == [name(1)]


@pytest.mark.fault
def test_a_checkpoint_that_cannot_be_moved_aside_is_named_and_never_written_over_nor_pruned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The earlier run's epoch 2 cannot be moved (PermissionError): a warning names it, it stays with its bytes,
    listed, and the new run, whose schedule writes that name, fails that one save (on_save_error='warn': it
    goes on and completes); resume='latest' and keep_last then leave it alone, and a later run afresh that
    can moves it aside."""
    folder = tmp_path / "checkpoints"
    scored(tmp_path, [3.0, 1.0, 4.0, 2.0], keep_last=4)
    stuck = folder / name(2)
    earlier = stuck.read_bytes()
    rename = unmovable(monkeypatch, stuck)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = scored(tmp_path, [5.0, 6.0, 7.0, 8.0], keep_last=1)
    monkeypatch.setattr(os, "rename", rename)
    said = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    assert any(f"could not move {stuck}, an earlier run's checkpoint, into {folder / 'earlier-run-1'} "
               f"(PermissionError: [Errno 13] Permission denied: '{stuck}'): it stays where it is, listed in "
               f"{folder / EARLIER}" in text for text in said), said
    assert any("held 3 checkpoint(s) of an earlier run" in text for text in said), said
    assert any(str(stuck) in text and "is not written over" in text for text in said), said  # the failed save
    assert state.status == "completed" and state.results["failed_saves"] == 1
    assert stuck.read_bytes() == earlier
    assert sorted(contents(folder / "earlier-run-1")) == [name(1), name(3), name(4)]
    assert [p.name for p in checkpoint_files(folder)] == [name(4), name(1)]  # the new run's, the stuck one not
    resumed = scored(tmp_path, [5.0, 6.0, 7.0, 8.0, 9.0, 9.5], keep_last=1, resume="latest")
    assert resumed.resumed_from.source == str(folder / name(4))
    assert stuck.read_bytes() == earlier  # neither adopted nor pruned
    assert [p.name for p in checkpoint_files(folder)] == [name(6), name(1)]
    with pytest.warns(CheckpointWarning, match="held 3 checkpoint"):
        scored(tmp_path, [1.0], keep_last=1)
    assert (folder / "earlier-run-2" / name(2)).read_bytes() == earlier
    assert not (folder / EARLIER).exists()


@pytest.mark.fault
def test_a_run_resumed_from_earlier_run_n_keeps_its_best_that_could_not_be_moved_aside(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run A (best: epoch 2), then B afresh in its run_dir, A's epoch 2 not moved (PermissionError: it stays,
    listed), then A's epoch 3 resumed by its path in earlier-run-1/ into a run folder of its own: A's best is the
    one that stayed where it was written, found there though not in earlier-run-1/ (not none, which would make
    the resumed run's own epoch 4, worse, its best)."""
    monkeypatch.chdir(tmp_path)
    old = tmp_path / "old"
    folder = old / "checkpoints"
    scored(old, [3.0, 1.0, 4.0, 2.0], keep_last=4)
    stuck = folder / name(2)
    rename = unmovable(monkeypatch, stuck)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        scored(old, [5.0, 6.0, 7.0, 8.0], keep_last=1)
    monkeypatch.setattr(os, "rename", rename)
    assert stuck.exists() and not (folder / "earlier-run-1" / name(2)).exists()
    state = scored(None, [3.0, 1.0, 4.0, 2.0, 9.0], keep_last=1, name="again",
                   resume=str(folder / "earlier-run-1" / name(3)))
    assert state.status == "completed"
    assert state.results["best_checkpoint"] == stuck


@pytest.mark.parametrize("where", ["its run_dir", "a new run folder"])
def test_resuming_a_checkpoint_moved_aside_keeps_its_runs_best_and_prunes_nothing_of_either_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """Run A, then B afresh in the same run_dir (the same schedule: A's moved into earlier-run-1/), then A's epoch 3
    resumed by its path there. A's state names its best (epoch 2) at the path it was written at, where B's epoch 2
    lies now: the resumed run took B's file for its best. It takes A's, beside the one resumed. Given the
    run_dir, it writes there, B's moved into earlier-run-2/; without one, a run folder of its own, the old
    one left as it was. keep_last=1 prunes none of A's or B's."""
    monkeypatch.chdir(tmp_path)
    old = tmp_path / "old"
    folder = old / "checkpoints"
    scored(old, [3.0, 1.0, 4.0, 2.0], keep_last=4)
    a_files = contents(folder)
    with pytest.warns(CheckpointWarning, match="moved into"):
        scored(old, [5.0, 6.0, 7.0, 8.0], keep_last=4)
    b_files = own(folder)
    assert sorted(b_files) == sorted(a_files) and b_files != a_files
    given = old if where == "its run_dir" else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = scored(given, [3.0, 1.0, 4.0, 2.0, 9.0], keep_last=1, name="again",
                       resume=str(folder / "earlier-run-1" / name(3)))
    assert state.status == "completed"
    assert state.results["best_checkpoint"] == folder / "earlier-run-1" / name(2)
    assert contents(folder / "earlier-run-1") == a_files
    moved = [str(w.message) for w in caught if "moved into" in str(w.message)]
    if where == "its run_dir":
        assert len(moved) == 1 and str(folder / "earlier-run-2") in moved[0], moved
        assert contents(folder / "earlier-run-2") == b_files
        assert state.results["last_checkpoint"] == folder / name(5)
        assert [p.name for p in checkpoint_files(folder)] == [name(5), name(4)]  # (4: the best of its own)
    else:
        assert moved == []
        assert contents(folder) == {**b_files, **{f"earlier-run-1/{n}": b for n, b in a_files.items()}}
        last = state.results["last_checkpoint"]
        assert last.name == name(5) and last.parent.parent.parent == tmp_path / "runs" / "again", last


def test_the_best_of_a_run_resumed_from_a_checkpoint_set_aside_is_the_one_it_recorded(tmp_path: Path) -> None:
    """Run 1 (best at epoch 2) set aside by run 2 in the same run_dir, then resumed from its epoch 4 there for
    two epochs more (worse scores): ``hookfit export --best`` and ``validate(resume="best")`` took the newest
    checkpoint, scored 7, since the best it recorded, ``earlier-run-1/`` epoch 2's, was looked for by name beside
    the newest only."""
    from hookfit.plugins.checkpoint.export import best

    scored(tmp_path, [3.0, 1.0, 4.0, 2.0], keep_last=1)
    scored(tmp_path, [5.0, 6.0], keep_last=1)  # run 2: run 1's files into earlier-run-1/
    earlier = tmp_path / "checkpoints" / "earlier-run-1"
    resumed = scored(tmp_path, [3.0, 1.0, 4.0, 2.0, 5.0, 7.0], keep_last=1, resume=earlier / name(4))
    assert resumed.results["best_checkpoint"] == earlier / name(2)
    assert best(tmp_path)[0] == earlier / name(2)
    state = hookfit.Loop(None, [], val_step=lambda loop, batch: {"score": torch.tensor(0.0)}, val_data=[0],
                         model=torch.nn.Linear(1, 1), run_dir=tmp_path,
                         plugins=[Metrics(), Checkpoint()]).validate(resume="best")
    assert state.resumed_from is not None and Path(state.resumed_from.source) == earlier / name(2)


@pytest.mark.fault
def test_a_resume_that_fails_moves_no_checkpoint_aside(tmp_path: Path) -> None:
    """A run resumed from another run's checkpoint that fails to restore (another model's): it had moved the
    folder's own checkpoints into earlier-run-1/ at its start, so that the user's next ``resume="latest"`` found
    none there. They stay where they were."""
    scored(tmp_path / "other", [3.0, 1.0], keep_last=1)
    scored(tmp_path / "run", [3.0, 1.0], keep_last=1)
    before = contents(tmp_path / "run" / "checkpoints")
    loop = hookfit.Loop(lambda loop, batch: None, [torch.zeros(2)], model=torch.nn.Linear(2, 1), max_epochs=2,
                        run_dir=tmp_path / "run", resume=tmp_path / "other" / "checkpoints" / name(2),
                        plugins=[Metrics(), Checkpoint(background=False)])
    with pytest.raises(Exception, match="checkpoint"):
        loop.fit()
    assert contents(tmp_path / "run" / "checkpoints") == before


def test_a_run_moves_aside_under_one_more_than_the_highest_number_after_one_was_deleted(tmp_path: Path) -> None:
    """Three runs in one run_dir, then ``earlier-run-1/`` deleted: the fourth run sets the third run's checkpoints
    aside as ``earlier-run-3/``, one more than the highest, not the first free number, 1, which listings (the
    highest the newest) would take for the oldest."""
    import shutil

    folder = tmp_path / "checkpoints"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        for score in (3.0, 2.0, 1.0):
            scored(tmp_path, [score], keep_last=1)
        third = own(folder)
        shutil.rmtree(folder / "earlier-run-1")
        scored(tmp_path, [4.0], keep_last=1)
    assert not (folder / "earlier-run-1").exists()
    assert contents(folder / "earlier-run-3") == third


def test_one_earlier_run_has_one_number_for_its_checkpoints_and_its_tables(tmp_path: Path) -> None:
    """Run 1 without a CSV logger, runs 2 and 3 with one, in one run_dir: run 3 moved run 2's checkpoints into
    ``checkpoints/earlier-run-2/`` and its table into ``metrics.earlier-run-1.csv``, each counted apart. Both
    take 2, the highest number the run folder and its subfolders hold, then the next."""
    from hookfit.plugins.csv_log import CSVLogger

    def fit(*logger: CSVLogger) -> None:
        hookfit.Loop(lambda loop, batch: {"loss": 1.0}, [torch.zeros(1)], model=torch.nn.Linear(1, 1), max_epochs=1,
                     run_dir=tmp_path, plugins=[Metrics(), Checkpoint(background=False), *logger]).fit()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit()
        fit(CSVLogger())
        table = (tmp_path / "metrics.csv").read_text()
        fit(CSVLogger())
    assert (tmp_path / "metrics.earlier-run-2.csv").read_text() == table
    assert (tmp_path / "checkpoints" / "earlier-run-2").is_dir() and not (tmp_path / "metrics.earlier-run-1.csv").exists()


def test_one_earlier_run_has_one_number_whichever_plugin_sets_aside_first(tmp_path: Path) -> None:
    """Run 1 with a CSV logger alone, runs 2 and 3 with a checkpoint too, in one run_dir: run 3 set run 2's
    checkpoints aside first, counting run 1's ``metrics.earlier-run-1.csv`` as the highest (1), and its table after
    them, as the next (2). The run's one ``N`` is counted before anything of it moved: 2 for both."""
    from hookfit.plugins.csv_log import CSVLogger

    def fit(loss: float, *checkpoint: Checkpoint) -> None:
        hookfit.Loop(lambda loop, batch: {"loss": loss}, [torch.zeros(1)], model=torch.nn.Linear(1, 1), max_epochs=1,
                     run_dir=tmp_path, plugins=[Metrics(), CSVLogger(every_publication=False), *checkpoint]).fit()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(1.0)
        fit(2.0, Checkpoint(background=False))
        table, checkpoints = (tmp_path / "metrics.csv").read_text(), own(tmp_path / "checkpoints")
        fit(3.0, Checkpoint(background=False))
    assert (tmp_path / "metrics.earlier-run-2.csv").read_text() == table
    assert contents(tmp_path / "checkpoints" / "earlier-run-2") == checkpoints
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("earlier-run-*")) == ["earlier-run-2"]


def test_a_checkpoint_dir_inside_the_run_folder_shares_the_run_folder_s_number(tmp_path: Path) -> None:
    """``Checkpoint(dir=run_dir/"ckpt")``: the earlier run's checkpoints and table are set aside under one ``N``,
    whichever moves first."""
    from hookfit.plugins.csv_log import CSVLogger

    def fit(loss: float) -> None:
        hookfit.Loop(lambda loop, batch: {"loss": loss}, [torch.zeros(1)], model=torch.nn.Linear(1, 1), max_epochs=1,
                     run_dir=tmp_path, plugins=[Metrics(), CSVLogger(every_publication=False),
                                                Checkpoint(dir=tmp_path / "ckpt", background=False)]).fit()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(1.0)
        fit(2.0)
    assert sorted(p.name for p in tmp_path.glob("metrics.earlier-run-*")) == ["metrics.earlier-run-1.csv"]
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("earlier-run-*")) == ["earlier-run-1"]


def test_a_users_file_that_names_earlier_run_sets_no_number(tmp_path: Path) -> None:
    """A user's ``data/earlier-run-20261130.npz`` in the run folder is none of hookfit's names: an earlier run's
    checkpoints and table go to ``earlier-run-1``, not ``earlier-run-20261130``."""
    from hookfit.plugins.csv_log import CSVLogger

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "earlier-run-20261130.npz").write_bytes(b"user")
    (tmp_path / "notes.earlier-run-7").write_text("user")  # (no extension: no table a logger set aside)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            hookfit.Loop(lambda loop, batch: {"loss": 1.0}, [torch.zeros(1)], model=torch.nn.Linear(1, 1),
                         max_epochs=1, run_dir=tmp_path,
                         plugins=[Metrics(), CSVLogger(every_publication=False), Checkpoint(background=False)]).fit()
    assert (tmp_path / "metrics.earlier-run-1.csv").is_file()
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("earlier-run-*")) == ["earlier-run-1"]


def test_an_earlier_runs_best_is_found_in_earlier_run_n_whatever_its_end_line_names(tmp_path: Path) -> None:
    """Run A (best: epoch 2), then B afresh in its run_dir: A's ``run.jsonl`` end line still names its best at the
    path it was written at, which is no longer A's (the record is never rewritten). No reader takes that path:
    ``hookfit export --best`` of ``earlier-run-1/`` takes A's best by its name there, from the state of A's newest
    checkpoint, and ``validate(resume="best")`` in the run_dir takes B's."""
    import json

    from hookfit.tools import cli

    folder = tmp_path / "checkpoints"
    scored(tmp_path, [3.0, 1.0, 4.0, 2.0], keep_last=1)
    with pytest.warns(CheckpointWarning, match="moved into"):
        scored(tmp_path, [5.0, 6.0, 7.0, 8.0], keep_last=1)
    ends = [line for line in map(json.loads, (tmp_path / "run.jsonl").read_text().splitlines())
            if line.get("event") == "end"]
    assert Path(ends[0]["results"]["best_checkpoint"]) == folder / name(2)  # A's end line, as written
    earlier = folder / "earlier-run-1"
    assert cli.main(["export", str(earlier), str(tmp_path / "best.pt"), "--best"], plugins=[Checkpoint()]) == 0
    exported, saved = torch.load(tmp_path / "best.pt", weights_only=True), torch.load(earlier / name(2))["model"]
    assert all(torch.equal(exported[k], v) for k, v in saved.items()) and exported.keys() == saved.keys()
    state = hookfit.Loop(None, [], val_step=lambda loop, batch: {"score": torch.tensor(0.0)}, val_data=[0],
                         model=torch.nn.Linear(1, 1), run_dir=tmp_path,
                         plugins=[Metrics(), Checkpoint()]).validate(resume="best")
    assert Path(state.resumed_from.source) == folder / name(1)  # B's best


@pytest.mark.parametrize("source", ["earlier", "own"])
def test_every_process_says_alike_whether_a_resumed_run_continues_its_folders_records(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    """Only the main process prepares the checkpoints' folder; a process of another rank (told the main one's
    folder, as ``torch.distributed`` tells it) decides from the checkpoint and that folder too, so its
    ``state.continues`` is the main one's: ``False`` for a run resumed from an earlier run's checkpoint set aside
    in ``earlier-run-1/``, ``True`` for one resumed from the folder's own."""
    from hookfit.plugins.checkpoint import ranks

    folder = tmp_path / "checkpoints"
    scored(tmp_path, [3.0], keep_last=1)
    scored(tmp_path, [2.0], keep_last=1)  # the first run's checkpoint set aside into earlier-run-1/
    path = folder / "earlier-run-1" / name(1) if source == "earlier" else folder / name(1)
    monkeypatch.setattr(ranks, "main_directory", lambda loop, mine, checkpoint: None if loop.is_main else folder)
    seen: dict[int, bool] = {}

    class Rank:
        name = "rank"

        def __init__(self, rank: int) -> None:
            self.rank = rank

        @hookfit.hookimpl(tryfirst=True)
        def configure(self, loop):
            loop.state.rank, loop.state.world_size = self.rank, 2

        @hookfit.hookimpl
        def resumed(self, loop, info):
            seen[loop.state.rank] = loop.state.continues

    for rank in (1, 0):  # (the other rank first: the main one moves the folder's checkpoints aside)
        hookfit.Loop(lambda loop, batch: None, [torch.zeros(1)], model=torch.nn.Linear(1, 1), max_epochs=2,
                     run_dir=tmp_path, resume=path, plugins=[Metrics(), Checkpoint(background=False), Rank(rank)]).fit()
    assert seen == {0: source == "own", 1: source == "own"}
