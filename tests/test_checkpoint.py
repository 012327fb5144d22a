"""checkpoint: exact resume from any batch, atomic files, bad files, failed saves, real kills."""

from __future__ import annotations

import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import hookfit
from hookfit.data import Batches
from hookfit.plugins.checkpoint import FORMAT_VERSION, Checkpoint, CheckpointError, CheckpointWarning, read
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim

CHILD = Path(__file__).parent / "scripts" / "ckpt_child.py"
KILLS = 12  # kill -9 points tried by the random-kill test


class StopAfter:
    """Stops the run after its n-th batch, training and validation batches alike."""

    name = "stop_after"

    def __init__(self, n: int) -> None:
        self.n = n

    @hookfit.hookimpl
    def should_stop(self, loop):
        self.n -= 1
        return "test stop" if self.n == 0 else None


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


def train(run_dir, *, stop=None, resume=None, checkpoint=None, extra=(), accumulate=2, epochs=3, strict=True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(50, 4, generator=g), torch.randn(50, 1, generator=g)

    def step(loop, b):
        loss = torch.nn.functional.mse_loss(loop.model(b[0]), b[1])
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss, "noise": torch.rand(())}  # the RNG is part of the state

    metrics = Metrics(log=False)
    plugins = [Optim(accumulate=accumulate), metrics,
               checkpoint or Checkpoint(every_n_epochs=1, background=False, strict=strict), *extra]
    if stop:
        plugins.append(StopAfter(stop))
    loop = hookfit.Loop(
        step, Batches(x, y, batch_size=8, shuffle=True, seed=3),
        val_step=lambda l, b: {"vloss": torch.nn.functional.mse_loss(l.model(b[0]), b[1])},
        val_data=Batches(x[:16], y[:16], batch_size=8), model=model,
        optimizers=torch.optim.Adam(model.parameters(), lr=0.01), max_epochs=epochs,
        run_dir=run_dir, resume=resume, plugins=plugins)
    loop.fit()
    history = {k: [dict(e) for e in v] for k, v in metrics.history.items()}
    return loop, model, history


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
    with pytest.raises(CheckpointError, match="evil.pt is not a whole hookfit checkpoint"):
        train(tmp_path, resume=str(evil))
    assert not marker.exists(), "loading a checkpoint ran code from the file"


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


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


def test_a_read_only_folder_is_reported_and_training_goes_on(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() == 0:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(folder)],
                                 capture_output=True)
        if mounted.returncode:
            pytest.skip(f"root cannot mount a read-only tmpfs here: {mounted.stderr.decode().strip()}")
    else:
        folder.chmod(0o500)
    try:
        with pytest.warns(CheckpointWarning, match=r"could not write .*(Read-only|Permission denied)"):
            loop, _, _ = train(tmp_path, epochs=2, checkpoint=Checkpoint(dir=folder, background=False))
        assert loop.state.status == "completed" and loop.run.pm.get_plugin("checkpoint").failed_saves == 2
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(folder)])
        else:
            folder.chmod(0o700)


def test_saves_by_step_and_by_time(tmp_path: Path) -> None:
    by_step = Checkpoint(every_n_epochs=None, every_n_steps=3, keep_last=100, background=False)
    train(tmp_path / "steps", checkpoint=by_step, epochs=1)
    assert [read(p)["loop"]["step"] for p in by_step.saved] == [3, 6]
    by_time = Checkpoint(every_n_epochs=None, every_seconds=0.0, keep_last=100, background=False)
    train(tmp_path / "time", checkpoint=by_time, epochs=1)
    assert [read(p)["loop"]["resume_batch"] for p in by_time.saved] == list(range(1, 8))


def test_bad_options_are_named() -> None:
    with pytest.raises(ValueError, match="every_n_steps must be a positive integer"):
        Checkpoint(every_n_steps=0)
    with pytest.raises(ValueError, match="monitor must look like 'valid/loss'"):
        Checkpoint(monitor="loss")


def test_resume_latest_with_nothing_saved_starts_afresh_and_a_missing_path_is_named(tmp_path: Path) -> None:
    loop, _, _ = train(tmp_path, resume="latest", epochs=1)
    assert loop.state.status == "completed" and loop.run.pm.get_plugin("checkpoint").resumed_from is None
    with pytest.raises(FileNotFoundError, match="resume='nope.pt': no such file"):
        train(tmp_path, resume="nope.pt")


# -- real processes ---------------------------------------------------------------------------


def _child(run_dir: Path, out: Path, *args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    environment = {**os.environ, "HOOKFIT_PLUGINS": "", **(env or {})}
    return subprocess.Popen([sys.executable, str(CHILD), str(run_dir), str(out), *args],
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
def test_kill_9_at_random_moments_always_resumes_to_the_uninterrupted_result(tmp_path: Path, uninterrupted) -> None:
    """Chains of runs, each killed with SIGKILL at a random moment after training started
    (often inside a checkpoint write: there is one per step) and resumed from the newest
    checkpoint on disk, until one finishes; every chain must end with the uninterrupted
    run's parameters and metric history. ``KILLS`` kill points are tried in all."""
    rng = random.Random(1234)
    kills = chains = 0
    while kills < KILLS:
        chains += 1
        run, out = tmp_path / f"chain{chains}", tmp_path / f"chain{chains}.pt"
        while True:
            proc = _child(run, out, "--resume", "--sleep", "0.01")
            first = proc.stdout.readline().strip()
            if first.startswith("status"):  # killed after the final checkpoint: nothing left
                break
            assert first == "started", proc.stderr.read()
            time.sleep(rng.uniform(0.0, 0.3))
            if proc.poll() is not None:  # finished before the kill
                break
            proc.kill()
            proc.wait()
            kills += 1
            for p in (run / "checkpoints").iterdir():  # a torn temporary file may remain; never read
                assert not p.name.startswith(".") or p.name.endswith(".tmp")
        proc.communicate(timeout=60)
        final = _finish(run, out, "--resume")
        assert final["status"] == "completed" and final["step"] == 60
        assert _same(final, uninterrupted), f"chain {chains} differs from the uninterrupted run"
    print(f"kill -9 points tried: {kills} in {chains} chains")


@pytest.mark.slow
@pytest.mark.parametrize("fsync_call", [1, 5, 8])
def test_kill_9_inside_a_checkpoint_write_leaves_the_previous_one(tmp_path: Path, uninterrupted, fsync_call: int) -> None:
    """Killed between writing the temporary file and renaming it (odd fsync calls are the
    files', even ones the folder's), the previous checkpoint is whole and the run resumes."""
    proc = _child(tmp_path / "run", tmp_path / "out.pt", env={"KILL_AT_FSYNC": str(fsync_call)})
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    final = _finish(tmp_path / "run", tmp_path / "out.pt", "--resume")
    assert _same(final, uninterrupted)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_sigint_and_sigterm_write_an_interrupt_checkpoint_that_resumes_exactly(
        tmp_path: Path, uninterrupted, signum: int) -> None:
    proc = _child(tmp_path / "run", tmp_path / "out.pt", "--sleep", "0.01", "--every", "1000")
    assert proc.stdout.readline().strip() == "started"
    time.sleep(0.2)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "status interrupted" in stdout, stderr
    interrupted = torch.load(tmp_path / "out.pt", weights_only=True)
    saved = [read(p)["meta"]["reason"] for p in (tmp_path / "run" / "checkpoints").iterdir()]
    assert "interrupt" in saved and 0 < interrupted["step"] < 60
    final = _finish(tmp_path / "run", tmp_path / "out.pt", "--resume")
    assert _same(final, uninterrupted)
