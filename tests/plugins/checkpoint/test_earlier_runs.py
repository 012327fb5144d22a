"""An earlier run's checkpoints in the folder a run writes in, when the run does not continue them
(run again without resume, or resumed from a checkpoint elsewhere): they stay where they were written, never
written over nor pruned, the new run's names apart under a tag (``-vT``); a folder whose earlier runs'
checkpoints are in ``earlier-run-N/`` subfolders or listed in ``.earlier-runs`` is read as it is laid out."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint, CheckpointWarning
from hookfit.plugins.checkpoint.storage import EARLIER, checkpoint_files
from hookfit.plugins.metrics import Metrics


def name(epoch: int, tag: int = 0) -> str:
    """The checkpoint file of epoch ``epoch`` (from 1) of :func:`scored` (one step an epoch), of a run of ``tag``."""
    return f"epoch{epoch:04d}-step{epoch:09d}{f'-v{tag}' if tag else ''}.pt"


def scored(run_dir: Path | None, scores: list[float], keep_last: int, **options: object) -> hookfit.State:
    """A run whose validation of epoch ``e`` scores ``scores[e]`` (``valid/score``, the lower the better), a
    checkpoint every epoch, ``keep_last`` kept besides the best."""
    def val_step(loop, batch):
        return {"score": torch.tensor(scores[loop.state.epoch])}

    checkpoint = Checkpoint(keep_last=keep_last, monitor="valid/score", background=False)
    return hookfit.Loop(lambda loop, batch: None, [torch.zeros(1)], val_step=val_step, val_data=[torch.zeros(1)],
                        model=torch.nn.Linear(1, 1), max_epochs=len(scores), run_dir=run_dir,
                        plugins=[Metrics(), checkpoint], **options).fit()


def set_aside(folder: Path, stuck: tuple[str, ...] = ()) -> Path:
    """The layout of a folder whose run's checkpoints were set aside: every one in ``folder`` moved into
    ``earlier-run-N/`` (``N`` one more than the highest there), but those named in ``stuck``, which stay, listed in
    ``.earlier-runs``; returns the subfolder."""
    numbers = [int(p.name.rsplit("-", 1)[1]) for p in folder.glob("earlier-run-*")]
    into = folder / f"earlier-run-{max(numbers, default=0) + 1}"
    into.mkdir()
    for path in [*folder.glob("epoch*"), *folder.glob("failed-epoch*")]:
        if path.name not in stuck:
            path.rename(into / path.name)
    if stuck:
        (folder / EARLIER).write_text("".join(f"{n}\n" for n in stuck))
    return into


def contents(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (its path inside) and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def own(folder: Path) -> dict[str, bytes]:
    """The files in ``folder`` itself, not in its subfolders, and their bytes."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_a_script_run_again_in_its_run_dir_keeps_the_earlier_runs_checkpoints_where_they_are(tmp_path: Path) -> None:
    """The same script run twice in one run_dir without resume, the same schedule: the first run's files stay,
    byte for byte, unwarned of, so that every path the first run reported (its best, its last, in its results
    and its run.jsonl) names its own file; the second's are named apart (-v1), a third's -v2, and the listing
    takes the run written last first."""
    folder = tmp_path / "checkpoints"
    first = scored(tmp_path, [3.0, 1.0, 4.0, 2.0], keep_last=1)
    assert first.results["best_checkpoint"] == folder / name(2)
    before = contents(folder)
    assert sorted(before) == [name(2), name(4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = scored(tmp_path, [5.0, 6.0, 7.0, 8.0], keep_last=1)
    assert [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)] == []
    assert {n: b for n, b in contents(folder).items() if n in before} == before  # the first run's, in place
    assert second.results["best_checkpoint"] == folder / name(1, 1)
    assert [p.name for p in checkpoint_files(folder)] == [name(4, 1), name(1, 1), name(4), name(2)]
    second_files = {n: (folder / n).read_bytes() for n in (name(1, 1), name(4, 1))}
    third = scored(tmp_path, [9.0, 9.5], keep_last=1)
    assert third.results["best_checkpoint"] == folder / name(1, 2)
    assert {n: b for n, b in contents(folder).items() if n in before or n in second_files} == {**before, **second_files}
    assert [p.name for p in checkpoint_files(folder)][:2] == [name(2, 2), name(1, 2)]
    assert not list(folder.glob("earlier-run-*"))


def test_an_earlier_runs_failure_and_sharded_checkpoints_stay_and_the_new_run_is_named_apart(tmp_path: Path) -> None:
    """A failure's checkpoint and a sharded checkpoint's folder of an earlier run stay where they are, as does what
    is no checkpoint; the new run's names take the next tag, so none is theirs."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "failed-epoch0001-step000000001.pt").write_bytes(b"a failure's")
    (folder / "epoch0001-step000000001.dcp").mkdir()
    (folder / "epoch0001-step000000001.dcp" / "state.pt").write_bytes(b"a sharded one's")
    (folder / "notes.txt").write_text("mine")
    before = contents(folder)
    state = scored(tmp_path, [1.0], keep_last=1)
    assert {n: b for n, b in contents(folder).items() if n in before} == before
    assert state.results["last_checkpoint"] == folder / name(1, 1)


def test_a_checkpoint_listed_in_earlier_runs_is_never_taken_written_over_nor_pruned(tmp_path: Path) -> None:
    """A folder whose run's checkpoints were set aside, its epoch 2 left where it was and listed in
    ``.earlier-runs``: a new run afresh there writes beside it (named apart), a resume='latest' takes the new
    run's, and keep_last prunes none of the listed one."""
    folder = tmp_path / "checkpoints"
    scored(tmp_path, [3.0, 1.0, 4.0, 2.0], keep_last=4)
    stuck = folder / name(2)
    earlier = stuck.read_bytes()
    set_aside(folder, stuck=(name(2),))
    state = scored(tmp_path, [5.0, 6.0, 7.0, 8.0], keep_last=1)
    assert state.status == "completed" and state.results["failed_saves"] == 0
    assert stuck.read_bytes() == earlier
    assert sorted(contents(folder / "earlier-run-1")) == [name(1), name(3), name(4)]
    assert [p.name for p in checkpoint_files(folder)] == [name(4, 1), name(1, 1)]  # the new run's, the listed one not
    resumed = scored(tmp_path, [5.0, 6.0, 7.0, 8.0, 9.0, 9.5], keep_last=1, resume="latest")
    assert resumed.resumed_from.source == str(folder / name(4, 1))
    assert stuck.read_bytes() == earlier  # neither adopted nor pruned
    assert [p.name for p in checkpoint_files(folder)] == [name(6, 1), name(1, 1)]


def test_a_run_resumed_from_earlier_run_n_keeps_its_best_that_stayed_listed_where_it_was(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run A (best: epoch 2) set aside into earlier-run-1/ but its epoch 2 (listed), then B afresh in its run_dir,
    then A's epoch 3 resumed by its path in earlier-run-1/ into a run folder of its own: A's best is the one that
    stayed where it was written, found there though not in earlier-run-1/ (not none, which would make the resumed
    run's own epoch 4, worse, its best)."""
    monkeypatch.chdir(tmp_path)
    old = tmp_path / "old"
    folder = old / "checkpoints"
    scored(old, [3.0, 1.0, 4.0, 2.0], keep_last=4)
    stuck = folder / name(2)
    set_aside(folder, stuck=(name(2),))
    scored(old, [5.0, 6.0, 7.0, 8.0], keep_last=1)
    assert stuck.exists() and not (folder / "earlier-run-1" / name(2)).exists()
    state = scored(None, [3.0, 1.0, 4.0, 2.0, 9.0], keep_last=1, name="again",
                   resume=str(folder / "earlier-run-1" / name(3)))
    assert state.status == "completed"
    assert state.results["best_checkpoint"] == stuck


@pytest.mark.parametrize("where", ["its run_dir", "a new run folder"])
def test_resuming_a_checkpoint_set_aside_keeps_its_runs_best_and_prunes_nothing_of_either_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """Run A set aside into earlier-run-1/, then B afresh in the same run_dir (the same schedule: B's files have A's
    names), then A's epoch 3 resumed by its path there. A's state names its best (epoch 2) at the path it was
    written at, where B's epoch 2 lies: the resumed run takes A's for its best, beside the one resumed, never B's
    file. Given the run_dir, it writes there, named apart from B's (-v1), which stay; without one, in a run
    folder of its own, the old one left as it was. keep_last=1 prunes none of A's or B's."""
    monkeypatch.chdir(tmp_path)
    old = tmp_path / "old"
    folder = old / "checkpoints"
    scored(old, [3.0, 1.0, 4.0, 2.0], keep_last=4)
    a_files = contents(folder)
    set_aside(folder)
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
    assert [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)] == []
    if where == "its run_dir":
        assert {n: b for n, b in own(folder).items() if n in b_files} == b_files
        assert state.results["last_checkpoint"] == folder / name(5, 1)
        assert [p.name for p in checkpoint_files(folder)][:2] == [name(5, 1), name(4, 1)]  # (4: the best of its own)
    else:
        assert contents(folder) == {**b_files, **{f"earlier-run-1/{n}": b for n, b in a_files.items()}}
        last = state.results["last_checkpoint"]
        assert last.name == name(5) and last.parent.parent.parent == tmp_path / "runs" / "again", last


def test_the_best_of_a_run_resumed_from_a_checkpoint_set_aside_is_the_one_it_recorded(tmp_path: Path) -> None:
    """Run 1 (best at epoch 2) set aside, run 2 afresh in the same run_dir, then run 1 resumed from its epoch 4
    there for two epochs more (worse scores): its best is the one it recorded, ``earlier-run-1/`` epoch 2's, found
    where it is and not by name beside the newest: its results, ``hookfit export --best`` and
    ``validate(resume="best")`` take it, not the newest checkpoint (scored 7)."""
    from hookfit.plugins.checkpoint.export import best

    scored(tmp_path, [3.0, 1.0, 4.0, 2.0], keep_last=1)
    earlier = set_aside(tmp_path / "checkpoints")
    scored(tmp_path, [5.0, 6.0], keep_last=1)  # run 2, under run 1's names
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


def test_a_runs_tag_is_one_more_than_the_highest_in_the_folder_after_one_runs_files_were_deleted(
        tmp_path: Path) -> None:
    """Three runs in one run_dir (tags 0, 1, 2), then the second's files deleted: the fourth run takes tag 3, one
    more than the highest there, so that no name of it is one of the third run's."""
    folder = tmp_path / "checkpoints"
    for score in (3.0, 2.0, 1.0):
        scored(tmp_path, [score, score], keep_last=1)
    third = {n: b for n, b in own(folder).items() if n.endswith("-v2.pt")}
    assert sorted(third) == [name(1, 2), name(2, 2)]
    for path in folder.glob("*-v1.pt"):
        path.unlink()
    scored(tmp_path, [4.0], keep_last=1)
    assert {n: b for n, b in own(folder).items() if n in third} == third
    assert (folder / name(1, 3)).is_file()


def test_a_run_afresh_sets_the_earlier_tables_aside_and_leaves_the_checkpoints_where_they_are(tmp_path: Path) -> None:
    """Run 1 without a CSV logger, runs 2 and 3 with one, in one run_dir: run 3 sets run 2's table aside as
    ``metrics.earlier-run-1.csv``; no checkpoint moves (no ``checkpoints/earlier-run-N/``), each run's named by its
    tag."""
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
    assert (tmp_path / "metrics.earlier-run-1.csv").read_text() == table
    assert not list((tmp_path / "checkpoints").glob("earlier-run-*"))
    assert set(own(tmp_path / "checkpoints")) == {name(1), name(1, 1), name(1, 2)}


def test_one_earlier_run_has_one_number_for_its_tables_whichever_plugin_runs_first(tmp_path: Path) -> None:
    """Run 1 with a CSV logger alone, runs 2 and 3 with a checkpoint too, in one run_dir: run 2 sets run 1's table
    aside as ``metrics.earlier-run-1.csv``, run 3 run 2's as the next (2); run 2's checkpoints stay where they
    are, byte for byte."""
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
    assert {n: b for n, b in own(tmp_path / "checkpoints").items() if n in checkpoints} == checkpoints
    assert not list((tmp_path / "checkpoints").glob("earlier-run-*"))


def test_a_checkpoint_dir_inside_the_run_folder_keeps_its_checkpoints_and_the_tables_take_one_number(
        tmp_path: Path) -> None:
    """``Checkpoint(dir=run_dir/"ckpt")``: the earlier run's table is set aside as ``metrics.earlier-run-1.csv``, its
    checkpoints stay, the new run's named apart."""
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
    assert {n for n in own(tmp_path / "ckpt") if n.endswith(".pt")} == {name(1), name(1, 1)}


def test_a_users_file_that_names_earlier_run_sets_no_number(tmp_path: Path) -> None:
    """A user's ``data/earlier-run-20261130.npz`` in the run folder is none of hookfit's names: an earlier run's
    table goes to ``metrics.earlier-run-1.csv``, not ``earlier-run-20261130``."""
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
    assert not list((tmp_path / "checkpoints").glob("earlier-run-*"))


def test_an_earlier_runs_end_line_names_its_own_best_after_a_later_run_in_its_run_dir(tmp_path: Path) -> None:
    """Run A (best: epoch 2), then B afresh in its run_dir: A's ``run.jsonl`` end line names its best at the path
    it was written at, which holds A's best, byte for byte, after B ran (B's named apart), and ``hookfit export``
    of it writes A's weights; ``validate(resume="best")`` in the run_dir takes B's
    (the run written last)."""
    import json

    from hookfit.tools import cli

    folder = tmp_path / "checkpoints"
    scored(tmp_path, [3.0, 1.0, 4.0, 2.0], keep_last=1)
    a_best = (folder / name(2)).read_bytes()
    scored(tmp_path, [5.0, 6.0, 7.0, 8.0], keep_last=1)
    ends = [line for line in map(json.loads, (tmp_path / "run.jsonl").read_text().splitlines())
            if line.get("event") == "end"]
    reported = Path(ends[0]["results"]["best_checkpoint"])
    assert reported == folder / name(2) and reported.read_bytes() == a_best  # A's end line, A's file
    assert cli.main(["export", str(reported), str(tmp_path / "best.pt")], plugins=[Checkpoint()]) == 0
    exported, saved = torch.load(tmp_path / "best.pt", weights_only=True), torch.load(reported)["model"]
    assert all(torch.equal(exported[k], v) for k, v in saved.items()) and exported.keys() == saved.keys()
    state = hookfit.Loop(None, [], val_step=lambda loop, batch: {"score": torch.tensor(0.0)}, val_data=[0],
                         model=torch.nn.Linear(1, 1), run_dir=tmp_path,
                         plugins=[Metrics(), Checkpoint()]).validate(resume="best")
    assert Path(state.resumed_from.source) == folder / name(1, 1)  # B's best


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
    set_aside(folder)  # the first run's checkpoint set aside into earlier-run-1/
    scored(tmp_path, [2.0], keep_last=1)
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
