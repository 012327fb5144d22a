"""checkpoint: a module the step function changes that no checkpoint holds (an EMA teacher kept in the step's
closure or globals, not in ``Loop(model=...)``) is warned of once, at the first save; one the run does not
change (frozen, batch norm in eval mode) is not; given to ``Loop(model={...})`` it resumes bit for bit."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import hookfit
from hookfit.data import Batches
from hookfit.plugins.checkpoint import Checkpoint, CheckpointWarning
from hookfit.plugins.checkpoint.unsaved import _fingerprints
from hookfit.plugins.optim import Optim

from conftest import StopAfter

TEACHER: torch.nn.Module | None = None  # the teacher of _global_step, set by the test that runs it
FROZEN: torch.nn.Module | None = None  # a module _global_step reads besides, set by the test that runs it


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 4))


def _byol(loop, student, teacher, batch, data: bool = False):
    """One BYOL step: the student regresses the teacher's output; the teacher follows the student by EMA,
    in place under no_grad or (``data``) through ``.data``, as DINO's code does."""
    with torch.no_grad():
        target = teacher(batch[0] + 0.1 * torch.randn_like(batch[0]))
    loss = torch.nn.functional.mse_loss(student(batch[0]), target)
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    with torch.no_grad():
        for t, s in zip(teacher.parameters(), student.parameters()):
            (t.data if data else t).mul_(0.9).add_(s.detach(), alpha=0.1)
    return {"loss": loss}


def _global_step(loop, batch):
    if FROZEN is not None:
        FROZEN(batch[0])
    return _byol(loop, loop.model, TEACHER, batch, data=True)


def _run(run_dir: Path, where: str, *, stop: int | None = None, resume: str | None = None,
         frozen: torch.nn.Module | None = None, monkeypatch: pytest.MonkeyPatch | None = None):
    """A run of 3 epochs of 4 batches, checkpoints every 3 steps; its teacher in the step's ``"closure"``,
    a ``"global"`` (``monkeypatch`` sets it) or the run's ``"model"`` dict. Returns the loop, the student, the
    teacher and the warnings shown."""
    torch.manual_seed(0)
    student = _net()
    teacher = copy.deepcopy(student).requires_grad_(False)
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    if where == "global":
        assert monkeypatch is not None
        monkeypatch.setattr(sys.modules[__name__], "TEACHER", teacher)
        monkeypatch.setattr(sys.modules[__name__], "FROZEN", frozen)
        step = _global_step
    elif where == "closure":
        def step(loop, batch):
            if frozen is not None:
                frozen(batch[0])
            return _byol(loop, loop.model, teacher, batch)
    else:
        def step(loop, batch):
            return _byol(loop, loop.model["student"], loop.model["teacher"], batch)
    plugins = [Optim(), Checkpoint(every_n_steps=3, background=False), *([StopAfter(stop)] if stop else [])]
    loop = hookfit.Loop(step, Batches(x, x, batch_size=8, shuffle=True, seed=3),
                        model={"student": student, "teacher": teacher} if where == "model" else student,
                        optimizers=torch.optim.Adam(student.parameters(), lr=0.01), max_epochs=3,
                        run_dir=run_dir, resume=resume, plugins=plugins)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop.fit()
    return loop, student, teacher, [w for w in caught if issubclass(w.category, CheckpointWarning)]


def _state(*modules: torch.nn.Module) -> list[torch.Tensor]:
    return [t.clone() for m in modules for t in m.state_dict().values()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.bad_input
@pytest.mark.parametrize("where", ["closure", "global"])
def test_an_ema_teacher_outside_the_model_is_warned_of_once_at_the_first_save(
        tmp_path: Path, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The teacher read from the step's closure, or as a global updated through ``.data`` (which torch's
    version counters do not see): one warning in a run of four saves, shown at the first (step 3), naming
    the step, the variable, where it is read and the fix; and what it says is so: a run stopped and resumed
    then differs from one never stopped."""
    _, student, teacher, caught = _run(tmp_path / "straight", where, monkeypatch=monkeypatch)
    straight = _state(student, teacher)
    assert len(caught) == 1, [str(w.message) for w in caught]
    step = "_global_step" if where == "global" else "_run.<locals>.step"
    read = "as a global" if where == "global" else "from its closure"
    assert str(caught[0].message).startswith(
        f"checkpoint: train_step {step!r} reads the module 'TEACHER' " if where == "global" else
        f"checkpoint: train_step {step!r} reads the module 'teacher' ")
    assert read in str(caught[0].message) and "in no checkpoint" in str(caught[0].message)
    assert "Loop(model={..., 'teacher': " in str(caught[0].message) and caught[0].filename == __file__
    told = [json.loads(line) for line in (tmp_path / "straight" / "run.jsonl").read_text().splitlines()]
    assert [line["step"] for line in told if line["event"] == "warning" and "in no checkpoint" in line["message"]] == [3]
    assert len(list((tmp_path / "straight" / "checkpoints").iterdir())) == 3  # (keep_last of the 4 saves)

    _run(tmp_path / "stopped", where, stop=5, monkeypatch=monkeypatch)
    _, student, teacher, _ = _run(tmp_path / "stopped", where, resume="latest", monkeypatch=monkeypatch)
    assert not _same(_state(student, teacher), straight)


def test_the_teacher_given_in_the_model_dict_is_not_warned_of_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    """``Loop(model={"student": ..., "teacher": ...})``: no warning, and a run stopped after 5 batches and
    resumed ends with the student and the teacher (batch-norm statistics included) of the run never stopped."""
    _, student, teacher, caught = _run(tmp_path / "straight", "model")
    assert caught == []
    straight = _state(student, teacher)
    stopped, _, _, _ = _run(tmp_path / "stopped", "model", stop=5)
    assert stopped.state.status == "interrupted"
    resumed, student, teacher, caught = _run(tmp_path / "stopped", "model", resume="latest")
    assert resumed.state.resumed_from is not None and resumed.state.step == 12 and caught == []
    assert _same(_state(student, teacher), straight)


def _frozen(kind: str) -> torch.nn.Module:
    return {"frozen": lambda: torch.nn.Linear(4, 4).requires_grad_(False), "eval": lambda: torch.nn.BatchNorm1d(4).eval(),
            "train": lambda: torch.nn.BatchNorm1d(4)}[kind]()


def _named(caught: list[warnings.WarningMessage], where: str) -> list[str]:
    """The warnings about the module besides the teacher (the teacher, outside too, has its own)."""
    name = "FROZEN" if where == "global" else "frozen"
    return [str(w.message) for w in caught if f"reads the module {name!r}" in str(w.message)]


@pytest.mark.parametrize("where", ["closure", "global"])
@pytest.mark.parametrize("kind", ["frozen", "eval"])
def test_a_module_the_run_does_not_change_is_not_warned_of(tmp_path: Path, where: str, kind: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Besides the run's model the step reads a module of its own that it never changes: a frozen linear layer
    (a perceptual network's part, an embedding read from a global) or a batch norm in eval mode."""
    _, _, _, caught = _run(tmp_path, where, frozen=_frozen(kind), monkeypatch=monkeypatch)
    assert _named(caught, where) == [] and len(caught) == 1  # (the teacher's)


@pytest.mark.bad_input
@pytest.mark.parametrize("where", ["closure", "global"])
def test_a_batch_norm_in_train_mode_outside_the_model_is_warned_of(tmp_path: Path, where: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch norm in train mode the step reads besides the run's model: the run moves its statistics."""
    _, _, _, caught = _run(tmp_path, where, frozen=_frozen("train"), monkeypatch=monkeypatch)
    named = _named(caught, where)
    assert len(named) == 1 and "(running_mean, running_var, num_batches_tracked: " in named[0], named


@pytest.mark.slow
def test_the_fingerprint_of_a_large_tensor_takes_little_memory_beside_it(tmp_path: Path) -> None:
    """The fingerprint's sum of a tensor's bits widens them to int64 a slice at a time: a 40 MB bf16 tensor of
    20M elements grows the peak memory by far less than the 160 MB a whole int64 copy of it would take."""
    script = tmp_path / "peak.py"
    script.write_text(
        "import resource, torch\n"
        "from hookfit.plugins.checkpoint.unsaved import _fingerprints\n"
        "t = torch.zeros(20_000_000, dtype=torch.bfloat16).add_(1)\n"
        "_fingerprints({'w': t[:10]})\n"  # (torch's first call's own memory, beside the question)
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "_fingerprints({'w': t})\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) < 80, f"the fingerprint grew the peak memory by {done.stdout.strip()} MiB"


def test_the_fingerprint_of_a_tensor_of_several_slices_is_its_whole_sum_and_sees_a_uniform_update() -> None:
    """Over more elements than one slice: equal tensors (one laid out transposed) fingerprint alike, the bits'
    sum is the whole tensor's, and a change of an even count of values all alike (which the hash's exclusive or
    cancels) is still seen."""
    n = (1 << 22) * 2 + 6
    t = torch.randn(n // 2, 2, generator=torch.Generator().manual_seed(0))
    a = _fingerprints({"w": t})["w"]
    assert torch.equal(a, _fingerprints({"w": t.t().contiguous().t()})["w"])
    assert int(a[1]) == int(t.view(torch.int32).to(torch.int64).sum())
    zeros, ones = _fingerprints({"w": torch.zeros(n)})["w"], _fingerprints({"w": torch.ones(n)})["w"]
    assert torch.equal(zeros[0], ones[0]) and not torch.equal(zeros, ones)
