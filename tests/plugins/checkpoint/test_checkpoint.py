"""checkpoint: exact resume from any batch, atomic files, bad files, failed saves, real kills."""

from __future__ import annotations

import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import hookfit
from hookfit.data import Batches
from hookfit.plugins.checkpoint import FORMAT_VERSION, Checkpoint, CheckpointError, CheckpointWarning, digest, read
from hookfit.plugins.checkpoint.storage import checkpoint_files
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim

from conftest import StopAfter
from conftest import resumable_run as train
from conftest import TESTS
import warm

CHILD = TESTS / "scripts" / "ckpt_child.py"
WRITING = TESTS / "scripts" / "ckpt_writing.py"  # the same run, its background writes told and paced
KILLS = 8  # kill -9 points tried by the random-kill test (a chain of runs through the whole run)


class Stateful:
    """A third-party plugin with state."""

    name = "thirdparty"

    def __init__(self) -> None:
        self.count = 0

    @hookfit.hookimpl
    def batch_end(self):
        self.count += 1

    @hookfit.hookimpl
    def save_state(self):
        return {"count": self.count}

    @hookfit.hookimpl
    def load_state(self, state):
        self.count = state["count"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    loop, model, history = train(tmp_path_factory.mktemp("ref"))
    return [p.detach().clone() for p in model.parameters()], history


# 7 training and 2 validation batches per epoch, 3 epochs: every place a run can stop
@pytest.mark.parametrize("stop", range(1, 27))
def test_a_run_stopped_after_any_batch_resumes_to_bitwise_equal_parameters_and_history(
        tmp_path: Path, reference, stop: int) -> None:
    stopped, _, _ = train(tmp_path, stop=stop)
    assert stopped.state.status == "interrupted"
    resumed, model, history = train(tmp_path, resume="latest")
    assert resumed.state.status == "completed" and resumed.state.step == 21
    want_params, want_history = reference
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), want_params))
    assert history == want_history


def test_files_are_whole_pruned_to_keep_last_and_best_and_read_weights_only(tmp_path: Path) -> None:
    ckpt = Checkpoint(every_n_epochs=1, keep_last=2, monitor="valid/vloss", mode="max", background=True)
    train(tmp_path, checkpoint=ckpt, epochs=4)
    files = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert not [f for f in files if f.startswith(".")], "temporary files left behind"
    best = ckpt.best[1]
    assert ckpt.saved[-2:] == [tmp_path / "checkpoints" / f for f in files if f != best.name][-2:]
    assert best.name in files and len(files) in (2, 3)
    data = torch.load(best, weights_only=True)  # plain data and tensors only
    assert data["version"] == FORMAT_VERSION and data["meta"]["metric"] == ckpt.best[0]
    assert data["meta"]["metric"] == max(read(tmp_path / "checkpoints" / f)["meta"]["metric"] for f in files)


class Scored:
    """The monitored metric of every checkpoint written, read from the file as it is announced."""

    name = "scored"

    def __init__(self) -> None:
        self.metrics: dict[str, float | None] = {}

    @hookfit.hookimpl
    def checkpoint_saved(self, path: str) -> None:
        self.metrics[Path(path).name] = read(Path(path))["meta"]["metric"]


def test_keep_best_keeps_the_k_best_scored_checkpoints_besides_the_last_across_a_resume(tmp_path: Path) -> None:
    """Lightning's save_top_k: with keep_best=3 the three best by the monitor stay, however old, with the
    keep_last newest; a run stopped and resumed keeps the same files as one that ran through."""
    def ckpt() -> Checkpoint:
        return Checkpoint(every_n_epochs=1, keep_last=1, keep_best=3, monitor="valid/vloss", background=False)

    whole, stopped = Scored(), Scored()
    train(tmp_path / "whole", checkpoint=ckpt(), epochs=7, extra=[whole])
    train(tmp_path / "split", checkpoint=ckpt(), epochs=7, stop=4 * 9 + 3, extra=[stopped])
    train(tmp_path / "split", checkpoint=(kept := ckpt()), epochs=7, resume="latest", extra=[stopped])
    scored = {name: m for name, m in whole.metrics.items() if name.startswith("epoch")}
    assert len(scored) == 7 and None not in scored.values() and stopped.metrics.items() >= scored.items()
    newest = max(scored)
    expected = {newest, *sorted(scored, key=scored.__getitem__)[:3]}
    assert len(expected) in (3, 4) and sorted(scored, key=scored.__getitem__)[:3] != sorted(scored)[:3]
    for folder in ("whole", "split"):
        assert {p.name for p in (tmp_path / folder / "checkpoints").iterdir() if p.name.startswith("epoch")} == expected
    assert {p.name for p in kept.saved} >= expected and kept.best is not None
    assert kept.best[1].name == min(scored, key=scored.__getitem__)


def _scored(run_dir, scores, checkpoint: Checkpoint, monitor: str = "score", **options):
    """A run whose validation of epoch ``e`` scores ``scores[e]`` (as ``valid/<monitor>``)."""
    model = torch.nn.Linear(1, 1)

    def val_step(loop, batch):
        return {monitor: torch.tensor(scores[loop.state.epoch])}

    return hookfit.Loop(lambda loop, batch: None, [torch.zeros(1)], val_step=val_step, val_data=[torch.zeros(1)],
                        model=model, max_epochs=len(scores), run_dir=run_dir, plugins=[Metrics(), checkpoint],
                        **options).fit()


def _kept(folder: Path) -> list[int]:
    """The epochs (from 1) of the checkpoint files in ``folder``'s checkpoints."""
    return sorted(int(p.name[5:9]) for p in (folder / "checkpoints").iterdir() if p.name.startswith("epoch"))


def test_keep_best_saves_a_score_among_the_k_best_even_when_no_save_is_due(tmp_path: Path) -> None:
    """Lightning's save_top_k with checkpoints every 10 epochs: a validation whose score ranks among the
    keep_best is saved for it, not only a new best."""
    ckpt = Checkpoint(every_n_epochs=10, keep_last=1, keep_best=2, monitor="valid/score", background=False)
    _scored(tmp_path, [3.0, 1.0, 5.0, 4.0, 2.0, 6.0], ckpt)
    assert _kept(tmp_path) == [2, 5, 6]  # scores 1 and 2, and the run's end


def test_keep_best_holds_when_a_resumed_run_names_its_folder_another_way(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """run_dir absolute, then relative (or a checkpoint named by a relative path): one file, not two, so
    the best ones are never pruned as someone else's."""
    def ckpt() -> Checkpoint:
        return Checkpoint(keep_last=1, keep_best=2, monitor="valid/score", background=False)

    monkeypatch.chdir(tmp_path)
    _scored(tmp_path / "run", [3.0, 1.0, 4.0, 2.0], ckpt())
    assert _kept(tmp_path / "run") == [2, 4]
    resumed = ckpt()
    _scored("run", [3.0, 1.0, 4.0, 2.0, 5.0, 6.0], resumed, resume="latest")
    assert _kept(tmp_path / "run") == [2, 4, 6]
    assert resumed.best is not None
    assert resumed.best[1] == tmp_path / "run" / "checkpoints" / "epoch0002-step000000002.pt"
    _scored("run", [3.0, 1.0, 4.0, 2.0, 5.0, 6.0, 7.0], ckpt(), resume="run/checkpoints/epoch0006-step000000006.pt")
    assert _kept(tmp_path / "run") == [2, 4, 7]


def test_keep_best_ranks_checkpoints_whose_state_kept_no_scores_by_their_own(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A run resumed from a checkpoint whose state lists no scores (written before keep_best): the files'
    own scores (meta["metric"]) rank them."""
    from hookfit.plugins.checkpoint.catalog import Catalog

    state = Catalog.state
    with monkeypatch.context() as patched:
        patched.setattr(Catalog, "state", lambda self: {k: v for k, v in state(self).items() if k != "scores"})
        _scored(tmp_path, [5.0, 1.0, 4.0, 2.0, 3.0], Checkpoint(keep_last=5, monitor="valid/score", background=False))
    assert _kept(tmp_path) == [1, 2, 3, 4, 5]
    _scored(tmp_path, [5.0, 1.0, 4.0, 2.0, 3.0, 9.0],
            Checkpoint(keep_last=1, keep_best=3, monitor="valid/score", background=False), resume="latest")
    assert _kept(tmp_path) == [2, 4, 5, 6]


def test_a_best_by_another_metric_is_not_kept_when_the_monitor_changes(tmp_path: Path) -> None:
    """Resumed with another monitor, the earlier best (by the metric no longer watched) is neither the best
    nor kept for it."""
    _scored(tmp_path, [1.0, 2.0, 3.0], Checkpoint(keep_last=1, monitor="valid/score", background=False))
    assert _kept(tmp_path) == [1, 3]
    other = Checkpoint(keep_last=1, monitor="valid/other", background=False)
    _scored(tmp_path, [1.0, 2.0, 3.0, 4.0, 5.0], other, monitor="other", resume="latest")
    assert other.best is not None and other.best[0] == 4.0 and _kept(tmp_path) == [4, 5]


@pytest.mark.bad_input
def test_a_checkpoint_of_another_model_is_said_so_not_as_a_position_the_data_cannot_hold(tmp_path: Path) -> None:
    """Resuming the checkpoint of another script (its model and its longer data): the model is the mistake,
    not 'impossible position: 7 training batches done ... and this run's training data has 4'."""
    def fit(model, batches, **options):
        return hookfit.Loop(lambda loop, batch: None, [torch.zeros(1)] * batches, model=model, run_dir=tmp_path,
                            plugins=[Checkpoint(every_n_epochs=None, every_n_steps=7, background=False)],
                            **options).fit()

    fit(torch.nn.Sequential(torch.nn.Linear(1, 1)), 10)
    path = tmp_path / "checkpoints" / "epoch0001-step000000007.pt"
    with pytest.raises(CheckpointError, match=re.escape(
            f"checkpoint: the model in {path} does not fit this run's model (this run's model has 'bias', "
            f"'weight'; the checkpoint has '0.bias', '0.weight'): a checkpoint of another model")) as raised:
        fit(torch.nn.Linear(1, 1), 4, resume=str(path))
    assert "impossible position: 7 training batches done in epoch 1" in str(raised.value.__cause__)
    with pytest.raises(CheckpointError, match="impossible position: 7 training batches done in epoch 1, and this "
                                              "run's training data has 4"):  # the same model: the data it is
        fit(torch.nn.Sequential(torch.nn.Linear(1, 1)), 4, resume=str(path))
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint: {path} holds the entries '0.bias', '0.weight', "
                                                        f"this run 2 models")):  # (a TypeError from torch before)
        fit([torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)], 10, resume=str(path))


def test_the_model_mismatch_compares_each_modules_keys_whatever_its_values() -> None:
    """A sharded checkpoint's placeholders, a module's extra state, an old compiled module's keys and
    models given as dicts: the same model is no mismatch; another one is, named by its keys."""
    import collections

    from hookfit.plugins.checkpoint.sharded import MARK
    from hookfit.plugins.checkpoint.state import model_mismatch, model_state

    class Extra(torch.nn.Linear):
        def get_extra_state(self):
            return {"v": 1}

        def set_extra_state(self, state):
            pass

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    placeholders = {k: {MARK: f"model/{k}", "shape": list(v.shape)} for k, v in model_state(model).items()}
    assert model_mismatch(model, placeholders) is None
    extra, linear = Extra(2, 2), torch.nn.Linear(2, 2)
    assert model_mismatch(extra, model_state(Extra(2, 2))) is None
    assert model_mismatch(extra, model_state(torch.nn.Sequential(Extra(2, 2)))) == (
        "this run's model has '_extra_state', 'bias', 'weight'; the checkpoint has '0._extra_state', '0.bias', "
        "'0.weight'")
    compiled = collections.OrderedDict(("_orig_mod." + k, v) for k, v in linear.state_dict().items())
    assert model_mismatch({"g": linear}, {"g": compiled}) is None
    assert model_mismatch({"g": linear}, linear.state_dict()) == (
        "the checkpoint holds the entries 'bias', 'weight', this run the models 'g'")
    assert model_mismatch([linear, linear], [linear.state_dict()] * 3) == (
        "the checkpoint holds 3 models, this run 2 models")
    assert model_mismatch(linear, [linear.state_dict()]) == "the checkpoint holds 1 model, this run one model"
    assert model_mismatch(linear, None) == "the checkpoint holds no model, this run a model"
    assert model_mismatch([linear, model], [linear.state_dict(), model_state(model)]) is None


@pytest.mark.bad_input
def test_keep_best_without_a_monitor_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match=r"checkpoint: keep_best=2 keeps the checkpoints best by monitor, and none "
                                         r"is given: give monitor='valid/loss'"):
        Checkpoint(keep_best=2)


@pytest.mark.bad_input
def test_a_mode_without_a_monitor_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match=r"^checkpoint: mode='min' is the direction of the monitored metric, and "
                                         r"no monitor is given: give monitor='valid/loss'"):
        Checkpoint(mode="min")


@pytest.mark.bad_input
@pytest.mark.fault
def test_torn_foreign_newer_and_malicious_files_are_refused_by_name(tmp_path: Path) -> None:
    train(tmp_path, epochs=2)
    folder = tmp_path / "checkpoints"
    newest = sorted(folder.iterdir())[-1]
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # torn
    with pytest.raises(CheckpointError, match=rf"{newest.name} is not a whole hookfit checkpoint"):
        train(tmp_path, resume="latest")
    with pytest.warns(CheckpointWarning, match="trying an older one"):
        loop, _, _ = train(tmp_path, resume="latest", checkpoint=Checkpoint(fallback=True, background=False))
    assert loop.run.pm.get_plugin("checkpoint").resumed_from.name == "epoch0001-step000000007.pt"

    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.ones(2)}, foreign)
    with pytest.raises(CheckpointError, match="foreign.pt is not a hookfit checkpoint"):
        train(tmp_path, resume=str(foreign))

    newer = tmp_path / "newer.pt"
    data = read(folder / "epoch0001-step000000007.pt")
    torch.save({**data, "version": FORMAT_VERSION + 1}, newer)
    with pytest.raises(CheckpointError, match=r"newer.pt has format version 2, newer than this hookfit reads"):
        train(tmp_path, resume=str(newer))

    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"format": "hookfit-checkpoint", "x": _Evil(str(marker))}, evil)
    with pytest.raises(CheckpointError, match=r"evil.pt holds an object that a safe load refuses, \S*open: ") as caught:
        train(tmp_path, resume=str(evil))
    assert not marker.exists(), "loading a checkpoint ran code from the file"
    assert "truncated" not in str(caught.value), caught.value  # a whole file, not a corrupt one
    assert "weights_only" not in str(caught.value), caught.value  # and not torch's advice to load unsafely


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.bad_input
def test_plugin_state_mismatch_is_strict_or_lenient(tmp_path: Path) -> None:
    train(tmp_path, epochs=1, extra=[Stateful()])
    with pytest.raises(ValueError, match=r"saved state of plugin\(s\) 'thirdparty' that no enabled plugin"):
        train(tmp_path, resume="latest", epochs=2)
    with pytest.warns(hookfit.HookfitWarning, match="thirdparty"):
        loop, _, _ = train(tmp_path, resume="latest", epochs=2, strict=False)
    assert loop.state.status == "completed"
    third = Stateful()
    train(tmp_path / "b", epochs=1)
    with pytest.raises(ValueError, match=r"no saved state for plugin 'thirdparty'"):
        train(tmp_path / "b", resume="latest", epochs=2, extra=[third])


def test_background_saves_write_the_state_of_the_moment_they_were_asked(tmp_path: Path) -> None:
    model = torch.nn.Linear(200, 200)
    loop = hookfit.Loop(lambda l, b: None, [1], model=model, run_dir=tmp_path, plugins=[
        Checkpoint(background=True, every_n_epochs=None)])
    ckpt = loop._given[0]
    seen = {}

    class Mutate:
        name = "mutate"

        @hookfit.hookimpl
        def batch_end(self, loop):
            seen["before"] = model.weight.detach().clone()
            seen["path"] = ckpt.save(loop, "test")
            with torch.no_grad():
                model.weight.add_(1.0)  # training goes on while the file is written

    loop._given = (*loop._given, Mutate())
    loop.fit()
    assert torch.equal(read(seen["path"])["model"]["weight"], seen["before"])


def _limited_file_size(limit: int):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    return lambda: (resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard)), signal.signal(signal.SIGXFSZ, previous))


@pytest.mark.fault
@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_a_save_that_hits_a_full_disk_keeps_the_previous_checkpoint(tmp_path: Path, policy: str) -> None:
    """The kernel refuses writes past RLIMIT_FSIZE with EFBIG, as a full disk refuses with
    ENOSPC: the same failure inside ``torch.save``."""
    train(tmp_path, epochs=1)
    folder = tmp_path / "checkpoints"
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    class Squeeze:
        name = "squeeze"

        @hookfit.hookimpl
        def epoch_start(self, loop, epoch):
            if epoch == 1:
                self.restore = _limited_file_size(1000)

        @hookfit.hookimpl
        def fit_end(self):
            self.restore()

    squeeze = Squeeze()
    ckpt = Checkpoint(background=True, on_save_error=policy)
    if policy == "warn":
        with pytest.warns(CheckpointWarning, match=r"could not write .*epoch0002.*File too large.*previous checkpoints are kept") as caught:
            loop, _, _ = train(tmp_path, resume="latest", checkpoint=ckpt, extra=[squeeze])
        assert loop.state.status == "completed" and ckpt.failed_saves == 2
        assert len([w for w in caught if w.category is CheckpointWarning]) == 1  # once per kind
    else:
        with pytest.raises(OSError, match="File too large"):
            train(tmp_path, resume="latest", checkpoint=ckpt, extra=[squeeze])
    after = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert after == before, "the previous checkpoint changed, or a partial file was left"


@pytest.mark.fault
def test_a_read_only_folder_is_reported_and_training_goes_on(tmp_path: Path, read_only_folder: Path) -> None:
    with pytest.warns(CheckpointWarning, match=r"could not write .*(Read-only|Permission denied)"):
        loop, _, _ = train(tmp_path, epochs=2, checkpoint=Checkpoint(dir=read_only_folder, background=False))
    assert loop.state.status == "completed" and loop.run.pm.get_plugin("checkpoint").failed_saves == 2


class FailsAt:
    """Fails the run at the end of the batch that makes ``step``."""

    name = "fails_at"

    def __init__(self, step: int) -> None:
        self.step = step

    @hookfit.hookimpl
    def batch_end(self, loop) -> None:
        if loop.state.step == self.step:
            raise RuntimeError(f"failed at step {self.step}")


@pytest.mark.fault
@pytest.mark.parametrize("background", [True, False])
def test_a_failing_runs_save_that_could_not_be_written_says_the_run_ends_not_that_training_goes_on(
        tmp_path: Path, read_only_folder: Path, background: bool) -> None:
    """The failure's checkpoint (``on_failure=True``) of a run failing at step 3, into a folder
    nothing can be written in: its warning says the run ends failed; training does not go on."""
    ckpt = Checkpoint(dir=read_only_folder, every_n_epochs=None, on_failure=True, background=background)
    with pytest.warns(CheckpointWarning, match="could not write") as caught:
        with pytest.raises(RuntimeError, match="failed at step 3"):
            train(tmp_path, epochs=2, checkpoint=ckpt, extra=[FailsAt(3)])
    (said,) = [str(w.message) for w in caught if w.category is CheckpointWarning]
    assert "failed-epoch0001-step000000003.pt, the save at step 3 (" in said, said
    assert said.endswith("; the previous checkpoints are kept and the run ends (failed)"), said


@pytest.mark.fault
def test_saves_that_failed_after_the_warning_are_counted_in_the_run_s_results(tmp_path: Path,
                                                                              read_only_folder: Path) -> None:
    """A disk that stayed full warned at its first failed save (once per kind), then every later save
    failed in silence, and the completed run said nothing of it: results (and run.jsonl's end line) count them."""
    with pytest.warns(CheckpointWarning, match=r"could not write .*training goes on"):
        loop, _, _ = train(tmp_path, epochs=3, checkpoint=Checkpoint(dir=read_only_folder, background=False))
    assert (loop.state.results["failed_saves"], loop.state.results["skipped_saves"]) == (3, 0)
    loop, _, _ = train(tmp_path / "fine", epochs=1)
    assert loop.state.results["failed_saves"] == 0  # the run's own count


class Announced:
    """Records ``checkpoint_saved``: what, on which thread, and whether the file was whole then."""

    name = "announced"

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, int, str, bool]] = []

    @hookfit.hookimpl
    def checkpoint_saved(self, path: str, reason: str, step: int) -> None:
        whole = Path(path).exists() and read(path)["loop"]["step"] == step
        self.seen.append((Path(path).name, reason, step, threading.current_thread().name, whole))


@pytest.mark.parametrize("background", [True, False])
def test_each_written_checkpoint_is_announced_on_the_training_thread_once_whole(tmp_path: Path, background: bool) -> None:
    announced = Announced()
    ckpt = Checkpoint(every_n_steps=2, keep_last=100, background=background)
    train(tmp_path, epochs=2, checkpoint=ckpt, extra=[announced], stop=12)
    main = threading.main_thread().name
    assert [(name, reason, step) for name, reason, step, _, _ in announced.seen] == [
        ("epoch0001-step000000002.pt", "step", 2), ("epoch0001-step000000004.pt", "step", 4),
        ("epoch0001-step000000006.pt", "step", 6), ("epoch0001-step000000007.pt", "epoch", 7),
        ("epoch0002-step000000008.pt", "step", 8), ("epoch0002-step000000010.pt", "step", 10)]
    # (the stop at step 10: its checkpoint is the step's, written once)
    assert {(thread, whole) for *_, thread, whole in announced.seen} == {(main, True)}


@pytest.mark.fault
def test_a_checkpoint_that_could_not_be_written_is_not_announced(tmp_path: Path, read_only_folder: Path) -> None:
    announced = Announced()
    with pytest.warns(CheckpointWarning, match="could not write"):
        train(tmp_path, epochs=2, checkpoint=Checkpoint(dir=read_only_folder), extra=[announced])
    assert announced.seen == []


def test_saves_by_step_and_by_time(tmp_path: Path) -> None:
    by_step = Checkpoint(every_n_epochs=None, every_n_steps=3, keep_last=100, background=False)
    train(tmp_path / "steps", checkpoint=by_step, epochs=1)
    assert [read(p)["loop"]["step"] for p in by_step.saved] == [3, 6, 7]  # 7: the completed run's end
    by_time = Checkpoint(every_n_epochs=None, every_seconds=1e-9, keep_last=100, background=False)
    train(tmp_path / "time", checkpoint=by_time, epochs=1)
    assert [read(p)["loop"]["resume_batch"] for p in by_time.saved] == list(range(1, 8))


def test_a_completed_run_saving_on_a_schedule_ends_with_a_checkpoint_of_its_final_state(tmp_path: Path) -> None:
    """Saves every 5 steps over 14: the last would be step 10's, and ``"latest"`` (``hookfit
    export``) would take weights 4 steps old; the run's end is saved, once, and a run resumed
    there has nothing left to do and saves nothing again."""
    ckpt = Checkpoint(every_n_epochs=None, every_n_steps=5, keep_last=2, background=False)
    loop, model, _ = train(tmp_path, checkpoint=ckpt, epochs=2)
    assert [(read(p)["loop"]["step"], read(p)["meta"]["reason"]) for p in ckpt.saved] == [(10, "step"),
                                                                                         (14, "completed")]
    last = loop.state.results["last_checkpoint"]
    assert last == ckpt.saved[-1] == tmp_path / "checkpoints" / "epoch0002-step000000014.pt"
    assert all(torch.equal(a, b) for a, b in zip(read(last)["model"].values(), model.state_dict().values()))
    written = last.stat().st_mtime_ns
    again = Checkpoint(every_n_epochs=None, every_n_steps=5, keep_last=2, background=False)
    loop, _, _ = train(tmp_path, checkpoint=again, epochs=2, resume="latest")
    assert (loop.state.status, loop.state.step) == ("completed", 14)
    assert last.stat().st_mtime_ns == written and loop.state.results["last_checkpoint"] == last


@pytest.mark.bad_input
def test_bad_options_are_named() -> None:
    with pytest.raises(ValueError, match="every_n_steps must be a positive integer"):
        Checkpoint(every_n_steps=0)
    with pytest.raises(ValueError, match="monitor must look like 'valid/loss'"):
        Checkpoint(monitor="loss")


@pytest.mark.bad_input
def test_resume_latest_with_nothing_saved_starts_afresh_and_a_missing_path_is_named(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``"latest"`` with nothing saved starts afresh and says where it looked (a script started
    from another folder finds no ``runs/`` of its own: a requeued job must not lose its progress
    without a word); an evaluation finding none says, as ``resume='best'`` does, how to point it at the run it
    meant; a missing path is named, and a near miss of "latest" suggested."""
    loop, _, _ = train(tmp_path, resume="latest", epochs=1)
    assert loop.state.status == "completed" and loop.run.pm.get_plugin("checkpoint").resumed_from is None
    said = [line for line in capsys.readouterr().err.splitlines() if "resume='latest'" in line]
    assert said == [f"hookfit checkpoint: resume='latest' found no checkpoint in {tmp_path / 'checkpoints'}: the run "
                    f"starts from the beginning"], said
    data = [torch.zeros(1, 1)]
    hookfit.Loop(lambda loop, b: None, data, val_step=lambda loop, b: None, val_data=data, model=torch.nn.Linear(1, 1),
                 run_dir=tmp_path / "v", plugins=[Checkpoint()]).validate(resume="latest")  # validates the weights it has
    assert [line for line in capsys.readouterr().err.splitlines() if "resume='latest'" in line] == [
        f"hookfit checkpoint: resume='latest' found no checkpoint in {tmp_path / 'v' / 'checkpoints'}: the model's "
        f"weights as they are; to evaluate another run, give Loop(run_dir=<that run's folder>) (a run given a run_dir "
        f"is found there only), or resume=<a checkpoint's path> (a training run's state.results['best_checkpoint'])"]
    with pytest.raises(FileNotFoundError, match=r"resume='nope.pt': no such file\n"):
        train(tmp_path, resume="nope.pt")
    with pytest.raises(FileNotFoundError, match=r"resume='latets': no such file; did you mean resume='latest'\?\n"):
        train(tmp_path, resume="latets")


# -- real processes ---------------------------------------------------------------------------


def _child(run_dir: Path, out: Path, *args: str, env: dict | None = None, script: Path = CHILD,
           **kw) -> subprocess.Popen:
    environment = {**os.environ, "HOOKFIT_PLUGINS": "", **(env or {})}
    return warm.Popen([sys.executable, str(script), str(run_dir), str(out), *args],
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment, **kw)


def _finish(run_dir: Path, out: Path, *args: str, **kw) -> dict:
    proc = _child(run_dir, out, *args, **kw)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("uninterrupted")
    return _finish(folder / "run", folder / "out.pt")


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"]) and a["history"] == b["history"]


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.parametrize("moment", ["batch", "write"])
def test_kill_9_at_random_moments_always_resumes_to_the_uninterrupted_result(
        tmp_path: Path, uninterrupted, moment: str) -> None:
    """Chains of runs, each killed with SIGKILL at a random moment after training started
    and resumed from the newest checkpoint on disk, until one finishes; every chain must end
    with the uninterrupted run's parameters and metric history. ``KILLS`` kill points are
    tried in all.

    ``moment="batch"``: a kill comes a random number of batches into a run (1 to 14: the run
    gets on, however loaded the machine) and then a random fraction of a batch later (inside
    the next step, or inside the checkpoint write after the batch: there is one per step).
    ``moment="write"``: the run's background writes are told and paced (``ckpt_writing.py``)
    and a kill comes a random moment into its 1st to 3rd write, while training goes on; most
    such kills leave the write's temporary file. The last chain is resumed to its end once
    ``KILLS`` kills are done."""
    rng = random.Random(1234)
    script, marker, most, late = (CHILD, "batch", 14, 0.02) if moment == "batch" else (WRITING, "writing", 3, 0.06)
    kills = chains = inside = 0
    while kills < KILLS:
        chains += 1
        run, out = tmp_path / f"chain{chains}", tmp_path / f"chain{chains}.pt"
        ended = False  # the chain's last run went to the end by itself
        while kills < KILLS and not ended:
            proc = _child(run, out, "--resume", "--sleep", "0.01", "--tell", script=script)
            told = proc.stdout.readline().strip()
            assert told in ("started", "status completed 60"), proc.stderr.read()  # status: killed after the final checkpoint
            for _ in range(rng.randint(1, most)):
                while not told.startswith("status"):
                    told = proc.stdout.readline().strip()
                    if told == marker or not told:
                        break
                if told.startswith("status") or not told:
                    break
            if not told.startswith("status"):
                time.sleep(rng.uniform(0.0, late))
                proc.kill()
            stdout, stderr = proc.communicate(timeout=60)
            if proc.returncode == 0:  # it ended before the kill came
                ended = True
                continue
            assert proc.returncode == -signal.SIGKILL, stderr
            kills += 1
            written = list((run / "checkpoints").iterdir()) if (run / "checkpoints").exists() else []  # killed before the first save
            for p in written:  # a torn temporary file may remain; never read
                assert not p.name.startswith(".") or p.name.endswith(".tmp")
            inside += any(p.name.endswith(".tmp") for p in written)
        final = torch.load(out, weights_only=True) if ended else _finish(run, out, "--resume")
        assert final["status"] == "completed" and final["step"] == 60
        assert _same(final, uninterrupted), f"chain {chains} differs from the uninterrupted run"
        left = sorted(p.name for p in (run / "checkpoints").iterdir())
        assert len([f for f in left if f.startswith("epoch")]) <= 2, left  # keep_last=2 across the resumes
        assert not [f for f in left if f.endswith(".tmp")], left  # the killed writers' files are gone
    if moment == "write":
        assert inside >= KILLS // 2, f"only {inside} of {KILLS} kills fell inside a write"
    print(f"kill -9 points tried: {kills} in {chains} chains, {inside} inside a write")


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.parametrize("fsync_call", [1, 5, 8])
def test_kill_9_inside_a_checkpoint_write_leaves_the_previous_one(tmp_path: Path, uninterrupted, fsync_call: int) -> None:
    """Killed between writing the temporary file and renaming it (odd fsync calls are the
    files', even ones the folder's), the previous checkpoint is whole and the run resumes."""
    proc = _child(tmp_path / "run", tmp_path / "out.pt", env={"KILL_AT_FSYNC": str(fsync_call)})
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    left = [p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.endswith(".tmp")]
    assert (len(left) == 1) == (fsync_call % 2 == 1), left  # killed after writing the temporary file
    final = _finish(tmp_path / "run", tmp_path / "out.pt", "--resume")
    assert _same(final, uninterrupted)
    assert not [p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.endswith(".tmp")]


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_sigint_and_sigterm_write_an_interrupt_checkpoint_that_resumes_exactly(
        tmp_path: Path, uninterrupted, signum: int) -> None:
    proc = _child(tmp_path / "run", tmp_path / "out.pt", "--sleep", "0.01", "--every", "1000")
    assert proc.stdout.readline().strip() == "started"  # said inside the first step: the
    proc.send_signal(signum)  # handler is installed, and the stop comes after some batch
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "status interrupted" in stdout, stderr
    interrupted = torch.load(tmp_path / "out.pt", weights_only=True)
    saved = [read(p)["meta"]["reason"] for p in (tmp_path / "run" / "checkpoints").iterdir()]
    assert "interrupt" in saved and 0 < interrupted["step"] < 60
    final = _finish(tmp_path / "run", tmp_path / "out.pt", "--resume")
    assert _same(final, uninterrupted)


# -- which checkpoint "latest" is, and where a resumed run goes on ------------------------------

NAMED = TESTS / "scripts" / "ckpt_named.py"


def _named(folder: Path, script: str, *args: str, resume: bool = False) -> dict:
    """Runs a copy of ckpt_named.py called ``script`` in ``folder``: a run named ``script``."""
    path = folder / f"{script}.py"
    if not path.exists():
        path.write_text(NAMED.read_text())
    env = {**os.environ, "HOOKFIT_PLUGINS": "metrics_log"}  # the metric log, which goes on in the resumed folder
    env.pop("HOOKFIT_RESUME", None)
    if resume:
        env["HOOKFIT_RESUME"] = "latest"
    done = warm.run([sys.executable, str(path), str(folder / f"{script}.json"), *args], cwd=folder, env=env,
                    capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    import json

    return json.loads((folder / f"{script}.json").read_text())


@pytest.mark.slow
def test_latest_never_crosses_to_another_runs_checkpoints_and_a_resumed_run_goes_on_in_its_folder(
        tmp_path: Path) -> None:
    """Two scripts (two names) in one folder: each one's "latest" is its own newest checkpoint
    (none: a fresh start), even when the other wrote later; a resumed run writes its checkpoints
    and its metrics log in the folder of the run it continues."""
    a1 = _named(tmp_path, "a", "--epochs", "2")
    assert (a1["name"], a1["step"], a1["resumed_from"]) == ("a", 8, None)
    folder = Path(a1["run_dir"])
    assert folder.parent == tmp_path / "runs" / "a"
    b1 = _named(tmp_path, "b", "--epochs", "1", resume=True)  # a's checkpoints are there, and newer
    assert (b1["name"], b1["resumed_from"], b1["step"]) == ("b", None, 4)
    assert Path(b1["run_dir"]).parent == tmp_path / "runs" / "b"
    a2 = _named(tmp_path, "a", "--epochs", "3", resume=True)
    assert a2["resumed_from"] == str(folder / "checkpoints" / "epoch0002-step000000008.pt")
    assert (a2["run_dir"], a2["step"]) == (str(folder), 12)  # went on in a's folder
    assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == [
        "epoch0001-step000000004.pt", "epoch0002-step000000008.pt", "epoch0003-step000000012.pt"]
    log = [line for line in (folder / "metrics.jsonl").read_text().splitlines() if '"event": "end"' in line]
    assert len(log) == 2  # both runs' ends, in one log
    assert len(list((tmp_path / "runs" / "a").iterdir())) == 1
    b2 = _named(tmp_path, "b", "--epochs", "2", resume=True)  # a wrote last: still b's own
    assert b2["resumed_from"] == str(Path(b1["run_dir"]) / "checkpoints" / "epoch0001-step000000004.pt")
    assert b2["step"] == 8 and b2["run_dir"] == b1["run_dir"]


def test_latest_with_a_run_dir_or_a_dir_looks_only_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    train(tmp_path / "runs" / "given" / "later", epochs=2)  # a run of the same name, elsewhere
    loop, _, _ = train(tmp_path / "given", resume="latest", epochs=1)
    assert loop.run.pm.get_plugin("checkpoint").resumed_from is None
    train(tmp_path / "given", epochs=1)
    loop, _, _ = train(tmp_path / "given", resume="latest", epochs=2)
    # (the run written last there: the second, its names apart from the first's)
    assert loop.state.resumed_from.source == str(tmp_path / "given" / "checkpoints" / "epoch0001-step000000007-v1.pt")
    mine = tmp_path / "mine"
    train(tmp_path / "x", epochs=1, checkpoint=Checkpoint(dir=mine, background=False))  # another run's (x), left
    loop, _, _ = train(tmp_path / "given", resume="latest", epochs=1, checkpoint=Checkpoint(dir=mine, background=False))
    assert loop.state.resumed_from is None
    loop, _, _ = train(tmp_path / "given", resume="latest", epochs=2, checkpoint=Checkpoint(dir=mine, background=False))
    assert loop.state.resumed_from.source == str(mine / "epoch0001-step000000007-v1.pt")


# -- runs without a model -----------------------------------------------------------------------


@pytest.mark.bad_input
def test_a_run_without_a_model_saves_nothing_and_cannot_be_resumed(tmp_path: Path) -> None:
    def run(**kw):
        return hookfit.Loop(lambda l, b: None, [1, 2, 3], max_epochs=2, run_dir=tmp_path, plugins=[
            StopAfter(4), Checkpoint(every_n_steps=1, background=False)], **kw).fit()

    with pytest.warns(CheckpointWarning, match=r"checkpoints are off for this run: it has no model \(Loop\(model=") as caught:
        state = run()
    assert state.status == "interrupted" and len([w for w in caught if w.category is CheckpointWarning]) == 1
    assert not (tmp_path / "checkpoints").exists()
    with pytest.raises(ValueError, match=r"resume='latest' needs the run's model: .*pass Loop\(model=\.\.\.\)"):
        run(resume="latest")


# -- plugin states that do not match the run ----------------------------------------------------


@pytest.mark.bad_input
def test_by_default_new_or_removed_plugins_start_fresh_with_a_warning_and_strict_names_the_file(
        tmp_path: Path) -> None:
    train(tmp_path, epochs=1)
    third = Stateful()
    with pytest.warns(hookfit.HookfitWarning, match=r"no saved state for plugin 'thirdparty'.*starts fresh") as caught:
        loop, _, _ = train(tmp_path, resume="latest", epochs=2, extra=[third],
                           checkpoint=Checkpoint(background=False))
    assert loop.state.status == "completed" and third.count == 9  # counted from 0: this run's batches
    assert len([w for w in caught if "thirdparty" in str(w.message)]) == 1
    with pytest.warns(hookfit.HookfitWarning, match=r"saved state of plugin\(s\) 'thirdparty' that no enabled plugin"):
        loop, _, _ = train(tmp_path, resume="latest", epochs=3, checkpoint=Checkpoint(background=False))
    assert loop.state.status == "completed"
    newest = tmp_path / "checkpoints" / "epoch0003-step000000021.pt"
    with pytest.raises(ValueError, match=rf"{newest.name}: .*no saved state for plugin 'thirdparty'.*"
                                         rf"Pass Checkpoint\(strict=False\) in Loop\(plugins=\[\.\.\.\]\) to start those "
                                         rf"plugins fresh"):
        train(tmp_path, resume="latest", epochs=4, extra=[Stateful()], checkpoint=Checkpoint(strict=True))


# -- exact positions: max_steps, failures ---------------------------------------------------------


def exact(run_dir: Path, *, max_steps: int | None = None, resume=None, fail_at: int | None = None,
          checkpoint: Checkpoint | None = None):
    """20 shuffled training batches and 4 validation batches per epoch, 3 epochs, Adam with
    accumulation windows of 3 and dropout: where a run stops, windows, optimizer state, RNG and
    data order all matter. ``fail_at``: the step raises at that global step, before it
    touches the model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.1), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(200, 16, generator=g), torch.randn(200, 1, generator=g)

    def step(loop, b):
        if loop.state.step == fail_at:
            raise RuntimeError("injected failure")
        loss = torch.nn.functional.mse_loss(loop.model(b[0]), b[1])
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    metrics = Metrics()
    loop = hookfit.Loop(
        step, Batches(x, y, batch_size=10, shuffle=True, seed=7),
        val_step=lambda l, b: {"vloss": torch.nn.functional.mse_loss(l.model(b[0]), b[1])},
        val_data=Batches(x[:40], y[:40], batch_size=10), model=model,
        optimizers=torch.optim.Adam(model.parameters(), lr=1e-3), max_epochs=3, max_steps=max_steps,
        run_dir=run_dir, resume=resume,
        plugins=[Optim(accumulate=3), metrics, checkpoint or Checkpoint(background=False)])
    loop.fit()
    history = {k: [dict(e) for e in v] for k, v in metrics.history.items()}
    return loop, [p.detach().clone() for p in model.parameters()], history


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    loop, params, history = exact(tmp_path_factory.mktemp("straight"), max_steps=60)
    assert loop.state.step == 60
    return params, history


@pytest.mark.parametrize("first", [25, 26])
def test_max_steps_inside_an_epoch_then_a_longer_run_equals_one_run(tmp_path: Path, straight, first: int) -> None:
    """25: ends inside an accumulation window, 26: just after one closed (windows of 3 from
    batch 0 of epoch 2, which starts at step 20)."""
    loop, _, _ = exact(tmp_path, max_steps=first)
    assert (loop.state.status, loop.state.step) == ("completed", first)
    ckpt = loop.run.pm.get_plugin("checkpoint")
    saved = read(ckpt.saved[-1])
    assert ckpt.saved[-1].name == f"epoch0002-step{first:09d}.pt"
    assert saved["loop"] == {"epoch": 1, "step": first, "resume_batch": first - 20, "resume_stage": "train"}
    assert saved["meta"]["reason"] == "max_steps"
    loop, params, history = exact(tmp_path, max_steps=60, resume="latest")
    assert (loop.state.status, loop.state.step) == ("completed", 60)
    want_params, want_history = straight
    assert all(torch.equal(p, q) for p, q in zip(params, want_params))
    assert history == want_history


@pytest.mark.fault
def test_a_failed_checkpoint_resumes_at_the_batch_that_failed(tmp_path: Path, straight) -> None:
    """The step raises at batch 4 of the second epoch (global step 24, inside a window)
    before touching the model: the failed-*.pt file's position is before that batch, and
    resuming from it ends with the uninterrupted run's parameters and history."""
    with pytest.raises(RuntimeError, match="injected failure"):
        exact(tmp_path, fail_at=24, checkpoint=Checkpoint(on_failure=True, background=False))
    (failed,) = (tmp_path / "checkpoints").glob("failed-*.pt")
    loop, params, history = exact(tmp_path, max_steps=60, resume=str(failed))
    assert (loop.state.status, loop.state.step) == ("completed", 60)
    want_params, want_history = straight
    assert all(torch.equal(p, q) for p, q in zip(params, want_params))
    assert history == want_history
    assert failed.name == "failed-epoch0002-step000000024.pt"
    assert read(failed)["loop"] == {"epoch": 1, "step": 24, "resume_batch": 4, "resume_stage": "train"}


# -- contents checked before use -------------------------------------------------------------------


def _flip(data: dict) -> str:
    weight = data["model"]["0.weight"]
    weight.view(-1)[3] = weight.view(-1)[3] * -1.0 + 1e-3  # one element of a parameter changed
    return "its contents do not match its digest"


def _without(key: str):
    def edit(data: dict) -> str:
        del data[key]
        return f"lacks '{key}'"

    return edit


def _set(where: str, key: str, value, message: str):
    def edit(data: dict) -> str:
        data[where][key] = value
        return message

    return edit


BAD = {
    "bit flip": _flip,
    "no loop": _without("loop"),
    "no model": _without("model"),
    "no rng": _without("rng"),
    "no plugins": _without("plugins"),
    "rng type": _set("rng", "torch", [1, 2, 3], r"bad RNG state: rng\['torch'\] is a list"),
    "rng size": _set("rng", "torch", torch.zeros(100, dtype=torch.uint8), r"bad RNG state: rng\['torch'\] .*shape \(100,\)"),
    "python rng": _set("rng", "python", [3, [1, 2], None], r"bad RNG state: rng\['python'\]"),
    "negative batch": _set("loop", "resume_batch", -1, r"impossible position: loop\['resume_batch'\] is -1"),
    "negative epoch": _set("loop", "epoch", -2, r"impossible position: loop\['epoch'\] is -2"),
    "stage": _set("loop", "resume_stage", "test", r"impossible position: loop\['resume_stage'\] is 'test'"),
    "beyond the data": _set("loop", "resume_batch", 8, r"impossible position: 8 training batches done in epoch 3, "
                                                      r"and this run's training data has 7"),
}


@pytest.mark.bad_input
@pytest.mark.fault
@pytest.mark.parametrize("bad", list(BAD))
def test_contents_are_checked_before_use_and_fallback_takes_the_next_newest(tmp_path: Path, bad: str) -> None:
    train(tmp_path, epochs=2)
    newest = tmp_path / "checkpoints" / "epoch0002-step000000014.pt"
    data = torch.load(newest, weights_only=True)
    message = BAD[bad](data)
    if bad != "bit flip":  # each check on its own: a file written so, with a digest that matches
        data["digest"] = digest(data)
    torch.save(data, newest)  # a bit flip keeps the old digest
    named = rf"checkpoint: {re.escape(str(newest))}.*{message}"
    if bad != "beyond the data":  # that one needs the run: its training data's length
        with pytest.raises(CheckpointError, match=named):
            read(newest)
    with pytest.raises(CheckpointError, match=named):
        train(tmp_path, resume="latest", epochs=3)
    with pytest.warns(CheckpointWarning, match=rf"{newest.name}.*{message}.*trying an older one"):
        loop, _, _ = train(tmp_path, resume="latest", epochs=3, checkpoint=Checkpoint(fallback=True, background=False))
    assert loop.state.resumed_from.source == str(tmp_path / "checkpoints" / "epoch0001-step000000007.pt")


def test_fallback_names_the_newer_checkpoints_it_skipped_and_warns_at_the_fit_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    train(tmp_path, epochs=2)
    folder = tmp_path / "checkpoints"
    newest = folder / "epoch0002-step000000014.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # torn
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(tmp_path, resume="latest", epochs=3, checkpoint=Checkpoint(fallback=True, background=False))
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "resume='latest' took" in line]
    taken = folder / "epoch0001-step000000007.pt"
    assert line.startswith(f"hookfit checkpoint: resume='latest' took {taken} (the newest checkpoint of ")
    assert line.endswith(f" that reads whole; skipped: {newest} (fallback=True))")
    said = [w for w in caught if issubclass(w.category, CheckpointWarning)]
    assert [w.filename for w in said] == [str(TESTS / "conftest.py")]  # the fit() line of resumable_run
    assert "trying an older one" in str(said[0].message)


@pytest.mark.fault
def test_a_checkpoint_that_cannot_be_written_is_warned_about_at_the_fit_line(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").write_text("")  # a file where the folder goes
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop, _, _ = train(tmp_path, epochs=1)
    assert loop.state.status == "completed"
    said = [w for w in caught if issubclass(w.category, CheckpointWarning)]
    assert len(said) == 1 and str(said[0].message).startswith("checkpoint: could not write ")
    assert said[0].filename == str(TESTS / "conftest.py")  # the fit() line of resumable_run


def test_background_saves_carry_a_digest_of_what_they_hold(tmp_path: Path) -> None:
    ckpt = Checkpoint(every_n_steps=2, background=True)
    train(tmp_path, checkpoint=ckpt, epochs=1)
    for path in ckpt.saved:
        data = torch.load(path, weights_only=True)
        assert re.fullmatch(r"crc32:[0-9a-f]{8}", data["digest"]) and data["digest"] == digest(data)


# -- keep_last across resumes; temporary files of killed writers ---------------------------------


class Abort:
    """Ends the run like a kill after its n-th batch: a KeyboardInterrupt, no final checkpoint."""

    name = "abort"

    def __init__(self, n: int) -> None:
        self.n = n

    @hookfit.hookimpl
    def batch_end(self):
        self.n -= 1
        if self.n == 0:
            raise KeyboardInterrupt


def test_keep_last_holds_after_resumes(tmp_path: Path, reference) -> None:
    """Four runs ended abruptly after 4 batches (every step saved), each resumed from the
    newest: keep_last=3 files remain, the files of earlier runs and the one resumed from
    included; the last run to the end is exact."""
    def ckpt():
        return Checkpoint(every_n_steps=1, keep_last=3, background=False)

    for _ in range(4):
        with pytest.raises(KeyboardInterrupt):
            train(tmp_path, resume="latest", checkpoint=ckpt(), extra=[Abort(4)])
        files = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
        assert len(files) == 3, files
    _, model, history = train(tmp_path, resume="latest", checkpoint=ckpt())
    assert len(list((tmp_path / "checkpoints").iterdir())) == 3
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference[0])) and history == reference[1]


@pytest.mark.fault
def test_temporary_files_of_killed_writers_are_removed_when_the_run_starts_again(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = folder / f".epoch0001-step000000007.pt.{int(gone.stdout)}.tmp"
    alive = folder / f".epoch0001-step000000007.pt.{os.getppid()}.tmp"  # another process writing now
    other = folder / "notes.tmp"
    for path in (dead, alive, other):
        path.write_bytes(b"partial")
    train(tmp_path, epochs=1, resume="latest")
    assert not dead.exists() and alive.exists() and other.exists()


# -- warnings, options, names --------------------------------------------------------------------


def test_checkpoint_warnings_are_file_warnings(tmp_path: Path) -> None:
    from hookfit.files import FileWarning

    assert issubclass(CheckpointWarning, FileWarning) and issubclass(CheckpointWarning, hookfit.HookfitWarning)


@pytest.mark.bad_input
def test_a_monitored_metric_the_run_does_not_produce_is_warned_about_once(tmp_path: Path) -> None:
    ckpt = Checkpoint(monitor="valid/loss", background=False)
    with pytest.warns(CheckpointWarning, match=r"monitor='valid/loss' names a metric this run does not produce: "
                                               r"the valid metrics of epoch 1 are vloss") as caught:
        train(tmp_path, checkpoint=ckpt)
    assert len([w for w in caught if "monitor" in str(w.message)]) == 1
    assert ckpt.best is None and len(ckpt.saved) == 3


BAD_OPTIONS = [
    ("every_seconds", 0), ("every_seconds", -5), ("every_seconds", float("nan")), ("every_seconds", float("inf")),
    ("every_seconds", "10"), ("every_seconds", True), ("every_n_epochs", 0), ("every_n_steps", 2.5),
    ("keep_last", 0), ("keep_last", True), ("keep_best", 0), ("monitor", 3), ("monitor", "valid/"), ("monitor", "test/loss"),
    ("mode", "best"), ("on_save_error", "ignore"), ("on_interrupt", "yes"), ("on_failure", 1), ("strict", None),
    ("fallback", "no"), ("background", 0), ("dir", 5),
]


@pytest.mark.bad_input
@pytest.mark.parametrize(("option", "value"), BAD_OPTIONS, ids=[f"{o}={v!r}" for o, v in BAD_OPTIONS])
def test_options_are_checked_at_construction_and_the_message_names_them(option: str, value) -> None:
    with pytest.raises(ValueError, match=rf"^checkpoint: {option} must .*, got {re.escape(repr(value))}$"):
        Checkpoint(**{option: value})


def test_names_count_epochs_from_1_and_sort_in_run_order(tmp_path: Path) -> None:
    ckpt = Checkpoint(every_n_steps=3, keep_last=100, background=False)
    train(tmp_path, checkpoint=ckpt, epochs=2)
    names = [p.name for p in ckpt.saved]
    assert names == ["epoch0001-step000000003.pt", "epoch0001-step000000006.pt", "epoch0001-step000000007.pt",
                     "epoch0002-step000000009.pt", "epoch0002-step000000012.pt", "epoch0002-step000000014.pt"]
    assert sorted(names) == names


def test_a_nan_or_infinite_metric_is_never_the_best_checkpoint(tmp_path: Path) -> None:
    """A diverged epoch (NaN) used to become the best checkpoint when it came first, and then
    stayed the best for good: nothing compares below NaN."""
    values = [float("nan"), 2.0, 1.0, float("-inf"), float("nan")]
    ckpt = Checkpoint(monitor="valid/m", keep_last=1, background=False)
    hookfit.Loop(lambda loop, batch: None, [1], val_step=lambda loop, batch: {"m": values[loop.state.epoch]},
                 val_data=[1], model=torch.nn.Linear(1, 1), max_epochs=len(values), run_dir=tmp_path,
                 plugins=[Metrics(), ckpt]).fit()
    assert ckpt.best is not None and ckpt.best[0] == 1.0 and ckpt.best[1].name.startswith("epoch0003")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [ckpt.best[1].name, ckpt.saved[-1].name]


def _compilable_run(run_dir: Path, *, compiled: bool, epochs: int, resume: str | None = None) -> torch.nn.Module:
    """Two epochs of four batches of a tiny model, given to the run plain or ``torch.compile``d
    (with dynamo's ``eager`` backend: the same operations, no compiler to wait for)."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 2, generator=g), torch.randn(4, 1, generator=g)) for _ in range(4)]

    def step(loop, batch):
        loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    model = torch.compile(plain, backend="eager") if compiled else plain
    hookfit.Loop(step, data, model=model, optimizers=torch.optim.SGD(plain.parameters(), lr=0.1),
                 max_epochs=epochs, run_dir=run_dir, resume=resume,
                 plugins=[Optim(), Metrics(), Checkpoint(background=False)]).fit()
    return plain


@pytest.mark.parametrize("written, resumed", [("compiled", "plain"), ("plain", "compiled")])
def test_a_compiled_models_checkpoint_holds_the_plain_modules_keys_and_resumes_into_either(
        tmp_path: Path, written: str, resumed: str) -> None:
    from hookfit.plugins.checkpoint.export import export

    whole = _compilable_run(tmp_path / "whole", compiled=False, epochs=2)
    _compilable_run(tmp_path / "run", compiled=written == "compiled", epochs=1)
    keys = {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert set(read(sorted((tmp_path / "run" / "checkpoints").glob("*.pt"))[-1])["model"]) == keys  # no _orig_mod.
    export(tmp_path / "run", tmp_path / "model.pt")
    assert set(torch.load(tmp_path / "model.pt", weights_only=True)) == keys
    model = _compilable_run(tmp_path / "run", compiled=resumed == "compiled", epochs=2, resume="latest")
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), whole.parameters(), strict=True))


def test_a_checkpoint_written_from_a_compiled_module_with_its_prefixed_keys_still_resumes(tmp_path: Path) -> None:
    """Checkpoints written before the model was unwrapped held a compiled model's keys as
    ``torch.compile`` gives them (``_orig_mod.0.weight``): they load into the plain module."""
    whole = _compilable_run(tmp_path / "whole", compiled=False, epochs=2)
    _compilable_run(tmp_path / "run", compiled=True, epochs=1)
    path = sorted((tmp_path / "run" / "checkpoints").glob("*.pt"))[-1]
    data = read(path)
    data["model"] = {f"_orig_mod.{key}": value for key, value in data["model"].items()}
    data["digest"] = digest(data)
    torch.save(data, path)
    model = _compilable_run(tmp_path / "run", compiled=True, epochs=2, resume="latest")
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), whole.parameters(), strict=True))


@pytest.mark.fault
@pytest.mark.parametrize("where", ["inside an epoch", "at an epoch's end"])
def test_a_resume_inside_an_epoch_on_another_number_of_processes_says_the_rest_is_another_share(
        tmp_path: Path, where: str) -> None:
    """A checkpoint written inside a training epoch by one process, resumed by a run of two (as
    the distributed plugin sets it at configure), over a list of batches (no position of its
    own): each process's batches of that epoch are another share of the data, so one warning
    says the rest of the epoch is not the rest of the run it continues. At an epoch's end one
    warning says what changes from there on (each step's global batch, an epoch's steps); over
    :class:`hookfit.data.Batches` with the same global batch the run goes on with the same batches: the
    one warning says the second process takes the main process's random states. Each warning says that too."""
    from conftest import StopAfter

    class TwoProcesses:
        name = "two"

        @hookfit.hookimpl(tryfirst=True)
        def configure(self, loop):
            loop.state.world_size = 2

    data = [(torch.zeros(2, 1), torch.zeros(2, 1))] * 4
    model = torch.nn.Linear(1, 1)
    inside = where == "inside an epoch"  # stopped after its second batch, or the first epoch run whole
    hookfit.Loop(lambda loop, b: None, data, model=model, max_epochs=2 if inside else 1, run_dir=tmp_path,
                 plugins=[Checkpoint(background=False), *([StopAfter(2)] if inside else [])]).fit()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hookfit.Loop(lambda loop, b: None, data, model=model, max_epochs=2, run_dir=tmp_path, resume="latest",
                     plugins=[Checkpoint(background=False), TwoProcesses()]).fit()
    said = [str(w.message) for w in caught if "another share of the data" in str(w.message)]
    changed = [w for w in caught if "is resumed in" in str(w.message)]
    if where == "inside an epoch":
        assert len(said) == 1 and "was written by 1 process(es) inside epoch 1 (2 batches of it done by each) and " \
                                  "this run has 2" in said[0], said
        assert changed == []  # (one warning: the one above says it)
        assert "samples of the run it continues, and the processes beyond 1 take the main process's random states; " \
               "resume with 1 process(es)" in said[0], said
    else:
        assert said == [] and len(changed) == 1 and changed[0].category is hookfit.HookfitWarning
        assert str(changed[0].message).startswith(
            f"checkpoint: {tmp_path / 'checkpoints' / 'epoch0001-step000000004.pt'} was written by 1 process(es) "
            f"and is resumed in 2: from here on the data is shared among 2 processes instead of 1, so each "
            f"optimizer step's global batch"), changed[0].message
        assert "other batches, and the processes beyond 1 take the main process's random states: the run goes on" \
               in str(changed[0].message), changed[0].message
        assert Path(changed[0].filename).name == "test_checkpoint.py"  # (the fit() line)
    with warnings.catch_warnings(record=True) as caught:  # Batches of the same global batch: the same batches
        warnings.simplefilter("always")
        batches = Batches(torch.zeros(8, 1), batch_size=2)
        hookfit.Loop(lambda loop, b: None, batches, model=model, max_epochs=2, run_dir=tmp_path / "b",
                     plugins=[Checkpoint(background=False)]).fit()
        batches = Batches(torch.zeros(8, 1), batch_size=1).shard(0, 2)  # (as the distributed plugin shards it)
        hookfit.Loop(lambda loop, b: None, batches, model=model, max_epochs=3, run_dir=tmp_path / "b", resume="latest",
                     plugins=[Checkpoint(background=False), TwoProcesses()]).fit()
    # (the one process's random states alone: the second process takes them, which one warning says)
    assert [str(w.message).split(": ", 2)[2] for w in caught if "process(es)" in str(w.message)] == [
        "each process resumes its own where it has one, the others the main process's (random draws of those "
        "processes differ from the run it continues)"]


@pytest.mark.parametrize("says", ["meta", "ranks"])
def test_a_checkpoint_of_two_processes_resumed_in_one_at_an_epochs_end_is_warned_once_at_the_resume(
        tmp_path: Path, says: str) -> None:
    """A checkpoint as ``torchrun --nproc-per-node 2`` writes it, resumed by one process over a list of batches:
    one warning, at the resume (before any batch), that it was written by 2 processes and goes on in 1, and what
    changes from there on. The number of processes is the one its ``meta`` records (``meta``: a failed run's file
    has no ``ranks`` entry, the process group being gone as it is written), or, in a file without it (an older
    hookfit's), the length of its ``ranks`` entry (each process's random states). Resumed with no training
    left (its ``max_epochs`` done), the run is not warned."""
    data = [(torch.zeros(2, 1), torch.zeros(2, 1))] * 4
    model = torch.nn.Linear(1, 1)
    hookfit.Loop(lambda loop, b: None, data, model=model, max_epochs=1, run_dir=tmp_path,
                 plugins=[Checkpoint(background=False)]).fit()
    path = checkpoint_files(tmp_path / "checkpoints")[0]
    written = read(path)
    assert written["meta"]["world_size"] == 1 and "ranks" not in written
    if says == "meta":
        written["meta"]["world_size"] = 2
    else:
        del written["meta"]["world_size"]
        written["ranks"] = [{key: written[key] for key in ("rng",)}] * 2
    written["digest"] = digest(written)
    torch.save(written, path)
    trained: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hookfit.Loop(lambda loop, b: trained.append(sum("process(es)" in str(w.message) for w in caught)), data, model=model, max_epochs=2, run_dir=tmp_path,
                     resume="latest", plugins=[Checkpoint(background=False)]).fit()
    said = [str(w.message) for w in caught if "process(es)" in str(w.message)]
    assert len(said) == 1 and said[0].startswith(f"checkpoint: {path} was written by 2 process(es) and is resumed "
                                                 f"in 1: from here on the data is read by one process instead of 2, "
                                                 f"so each optimizer step's global batch"), said
    assert trained[0] == 1  # (warned before the first batch)
    with warnings.catch_warnings(record=True) as caught:  # nothing left to train (max_epochs=1 done): no word
        warnings.simplefilter("always")
        hookfit.Loop(lambda loop, b: None, data, model=model, max_epochs=1, run_dir=tmp_path / "done",
                     resume=path, plugins=[Checkpoint(background=False)]).fit()
    assert [w.message for w in caught if "process(es)" in str(w.message)] == []


def test_a_run_that_does_not_resume_into_a_folder_of_an_earlier_runs_checkpoints_names_its_own_apart(
        tmp_path: Path) -> None:
    """A script run again with the same run_dir and no resume (a new experiment) writes beside the earlier run's
    checkpoints, its names with a tag of their own (-v1): the earlier run's files stay where they are, byte for
    byte, a later resume='latest' continues the new run, and neither that nor a resume is warned of: nothing is
    moved or changed."""
    def said(**options: object) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(tmp_path, **options)
        return [f"{Path(w.filename).name}: {w.message}" for w in caught if issubclass(w.category, CheckpointWarning)]

    folder = tmp_path / "checkpoints"
    assert said(epochs=2) == []  # the first run
    first = {p.name: p.read_bytes() for p in folder.glob("*.pt")}
    assert sorted(first) == ["epoch0001-step000000007.pt", "epoch0002-step000000014.pt"]
    assert said(epochs=1) == []
    assert {p.name: p.read_bytes() for p in folder.glob("*.pt") if p.name in first} == first
    assert [p.name for p in checkpoint_files(folder)][0] == "epoch0001-step000000007-v1.pt"
    assert said(epochs=3, resume="latest") == []
    assert [p.name for p in checkpoint_files(folder)][0] == "epoch0003-step000000021-v1.pt"


@pytest.mark.bad_input
def test_resume_latest_that_finds_only_set_aside_checkpoints_says_they_are_there(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Run A saved two epochs, set aside into earlier-run-1/ since: resume='latest', finding no checkpoint in the
    folder itself, says where A's are and how to resume one, as does a resume from the folder's path."""
    folder = tmp_path / "checkpoints"
    train(tmp_path, epochs=2)
    (folder / "earlier-run-1").mkdir()
    for path in folder.glob("epoch*"):
        path.rename(folder / "earlier-run-1" / path.name)
    newest = folder / "earlier-run-1" / "epoch0002-step000000014.pt"
    note = (f" (it holds 2 checkpoint(s) of earlier runs, set aside in earlier-run-N/ subfolders; resume "
            f"one by its path: resume={str(newest)!r})")
    with pytest.raises(FileNotFoundError) as raised:
        train(tmp_path / "other", resume=str(folder))
    assert str(raised.value) == f"checkpoint: no checkpoint in {folder}{note}"
    capsys.readouterr()
    train(tmp_path, epochs=1, resume="latest")
    said = [line for line in capsys.readouterr().err.splitlines() if "resume='latest'" in line]
    assert said == [f"hookfit checkpoint: resume='latest' found no checkpoint in {folder}{note}: the run starts from "
                    f"the beginning"], said


@pytest.mark.fault
def test_resuming_an_earlier_runs_checkpoint_by_its_path_continues_that_run_and_prunes_none_of_the_later_runs(
        tmp_path: Path) -> None:
    """Run A (3 epochs), run B afresh in the same run_dir (1 epoch), then A's epoch 2 resumed by its path: the
    resumed run continues A (its names, its tag), never taking B's checkpoint as its own; keep_last=1 prunes A's
    alone, and B's stays."""
    folder = tmp_path / "checkpoints"
    train(tmp_path, epochs=3)
    train(tmp_path, epochs=1, seed=5)
    b_first = folder / "epoch0001-step000000007-v1.pt"
    b_bytes = b_first.read_bytes()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop, _, _ = train(tmp_path, epochs=3, resume=str(folder / "epoch0002-step000000014.pt"),
                           checkpoint=Checkpoint(every_n_epochs=1, background=False, keep_last=1))
    assert [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)] == []
    assert loop.state.status == "completed" and loop.state.epoch == 2
    assert b_first.read_bytes() == b_bytes  # B's, kept
    assert [p.name for p in checkpoint_files(folder)] == ["epoch0003-step000000021.pt", b_first.name]


def test_resume_latest_after_a_fresh_run_in_the_same_folder_continues_that_run_and_keeps_the_earlier_files(
        tmp_path: Path) -> None:
    """Run A (3 epochs), then run B afresh in the same run_dir (1 epoch, another seed): resume='latest'
    takes B's (the run written last), not A's epoch 3 (the newest by epoch and step), and keep_last prunes
    B's own alone; A's files stay, untouched."""
    folder = tmp_path / "checkpoints"
    train(tmp_path, epochs=3)
    a_files = {p.name: p.read_bytes() for p in folder.glob("*.pt")}
    train(tmp_path, epochs=1, seed=5)
    b_first = folder / "epoch0001-step000000007-v1.pt"  # B's, beside A's file of that name
    assert [p.name for p in checkpoint_files(folder)][0] == b_first.name
    loop, _, _ = train(tmp_path, epochs=2, seed=5, resume="latest",
                       checkpoint=Checkpoint(every_n_epochs=1, background=False, keep_last=1))
    assert loop.state.resumed_from.source == str(b_first)
    listed = [p.name for p in checkpoint_files(folder)]
    assert listed == ["epoch0002-step000000014-v1.pt", *sorted(a_files, reverse=True)]  # B's own pruned, then A's
    assert {p.name: p.read_bytes() for p in folder.glob("*.pt") if p.name in a_files} == a_files  # A's, untouched
    copy = tmp_path / "copied"  # a copy (cp -r: every file's time the copy's) lists the same
    shutil.copytree(folder, copy, copy_function=shutil.copy)
    assert [p.name for p in checkpoint_files(copy)] == listed
