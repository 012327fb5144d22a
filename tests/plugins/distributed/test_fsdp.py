"""``Distributed(strategy="fsdp")``: FSDP2 sharding and sharded checkpoints written with
``torch.distributed.checkpoint``, checked in this process (a one-process group) and with real
``torchrun`` processes (CPU, gloo): training equal to one process, exact resume on the same
number of processes, resume on another number (2 -> 1, 1 -> 2, and 2 -> a plain process),
``hookfit export``, and a failing rank named."""

from __future__ import annotations

import gc
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import hookfit
from hookfit import hookimpl
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.checkpoint.storage import CheckpointError
from hookfit.plugins.distributed import Distributed
from hookfit.plugins.optim import Optim
from test_distributed import (  # noqa: F401 - _not_launched: autouse, this process is not torchrun's
    EXAMPLE,
    PLUGINS,
    ROOT,
    _env,
    _not_launched,
    _torchrun,
    _step,
    assert_same_training,
    dumps,
    one_process,
    torchrun,
)


@pytest.fixture
def group(tmp_path: Path) -> Any:
    """A one-process gloo group, initialised by the 'script' (this test)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Sequential(torch.nn.Linear(8, 2)))


def _data(batches: int = 6) -> list[Any]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 4, generator=generator), torch.randn(4, 2, generator=generator)) for _ in range(batches)]


def _whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}


# -- in this process -------------------------------------------------------------------------


def test_fsdp_shards_the_model_in_place_and_the_optimizer_follows(group: Any) -> None:
    """Every direct child holding parameters, then the root, is an FSDP module; the optimizer
    given to the Loop steps the sharded parameters, so the run trains exactly as without
    sharding (one process)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    plain = _net()
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.01)
    for x, y in _data():  # the same training by hand
        torch.nn.functional.mse_loss(plain(x), y).backward()
        plain_opt.step()
        plain_opt.zero_grad()

    model = _net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    loop = hookfit.Loop(_step, _data(), model=model, optimizers=optimizer,
                        plugins=[Distributed(strategy="fsdp"), Optim()])
    assert loop.fit().status == "completed"
    assert loop.model is model and isinstance(model, FSDPModule)
    sharded = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    assert sharded == ["", "0", "2"]  # the children with parameters, then the root; not Tanh
    params = [p for group in optimizer.param_groups for p in group["params"]]
    assert all(isinstance(p, DTensor) for p in params)
    assert [id(p) for p in params] == [id(p) for p in model.parameters()]
    for name, value in _whole(model).items():
        torch.testing.assert_close(value, dict(plain.named_parameters())[name].detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.bad_input
def test_ema_with_sharded_parameters_is_refused_before_any_batch(group: Any) -> None:
    from hookfit.plugins.ema import EMA

    model = _net()
    seen: list[int] = []

    def step(loop: Any, batch: Any) -> Any:
        seen.append(loop.state.step)
        return _step(loop, batch)

    with pytest.raises(ValueError, match=r"ema: the model's parameters are sharded \(Distributed\(strategy='fsdp'\)"):
        hookfit.Loop(step, _data(), model=model, optimizers=torch.optim.Adam(model.parameters(), lr=0.01),
                     plugins=[Distributed(strategy="fsdp"), Optim(), EMA(decay=0.9)]).fit()
    assert seen == []


def test_fsdp_options_and_the_shard_policy_are_passed_through(group: Any) -> None:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    seen: list[torch.dtype] = []

    def step(loop: Any, batch: Any) -> dict[str, Any]:
        out = loop.model(batch[0])
        seen.append(out.dtype)  # computed in bfloat16 by the mixed-precision policy
        loop.backward(torch.nn.functional.mse_loss(out.float(), batch[1]))
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {}

    model = _net()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    loop = hookfit.Loop(step, _data(2), model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                        plugins=[Distributed(strategy="fsdp", fsdp_options={"mp_policy": policy},
                                             shard_policy=lambda m: isinstance(m, torch.nn.Linear)), Optim()])
    assert loop.fit().status == "completed"
    assert seen == [torch.bfloat16] * 2
    # the policy picked the Linear layers, the nested one included; the root always
    assert [n for n, m in model.named_modules() if isinstance(m, FSDPModule)] == ["", "0", "2.0"]
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the sharded master weights


@pytest.mark.bad_input
def test_fsdp_options_are_checked() -> None:
    with pytest.raises(ValueError, match="strategy must be 'ddp' or 'fsdp', got 'zero'"):
        Distributed(strategy="zero")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shard_policy and fsdp_options are options of strategy='fsdp'"):
        Distributed(fsdp_options={"reshard_after_forward": False})
    with pytest.raises(TypeError, match="shard_policy must be a function"):
        Distributed(strategy="fsdp", shard_policy="Linear")  # type: ignore[arg-type]


@pytest.mark.bad_input
def test_an_optimizer_that_has_stepped_cannot_follow_into_the_shards(group: Any) -> None:
    model = _net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    loop = hookfit.Loop(_step, _data(), model=model, optimizers=optimizer,
                        plugins=[Distributed(strategy="fsdp"), Optim()])
    with pytest.raises(ValueError, match=r"optimizer 0 \(Adam\) has stepped already.*Create the optimizer fresh"):
        loop.fit()


@pytest.mark.fault
def test_a_sharded_checkpoint_is_a_folder_kept_pruned_exported_and_resumed_without_sharding(
        group: Any, tmp_path: Path) -> None:
    """One process in a group: the checkpoints of an FSDP run are DCP folders; keep_last
    prunes folders; the temporary folder of a killed writer is removed at the next start; a
    plain process (no group) resumes one with the same parameters; ``hookfit export`` writes
    them as one plain state dict; a plain checkpoint is refused by a sharded run."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = folder / f".epoch0001-step000000006.dcp.{int(dead.stdout)}-1.tmp"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"torn")
    model = _net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    loop = hookfit.Loop(_step, _data(), model=model, optimizers=optimizer,
                        max_epochs=3, plugins=[Distributed(strategy="fsdp"), Optim(),
                                               Checkpoint(dir=folder, keep_last=2)])
    assert loop.fit().status == "completed"
    assert not stale.exists()
    names = sorted(p.name for p in folder.iterdir() if p.name != "run.lock")  # (one process a folder)
    assert names == ["epoch0002-step000000012.dcp", "epoch0003-step000000018.dcp"], names
    last = folder / names[-1]
    assert {p.name for p in last.iterdir()} == {"state.pt", ".metadata", "__0_0.distcp"}
    saved = _whole(model)
    optimizer_state = {k: v.full_tensor().clone() for k, v in
                       optimizer.state[next(iter(model.parameters()))].items() if hasattr(v, "full_tensor")}
    assert optimizer_state.keys() == {"exp_avg", "exp_avg_sq"}

    from hookfit.tools import cli

    assert cli.main(["export", str(folder), str(tmp_path / "model.pt")], plugins=[Checkpoint()]) == 0
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert exported.keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(exported[name], value) and type(exported[name]) is torch.Tensor

    # a plain checkpoint into a sharded run: refused, naming the file and what to do
    plain_dir = tmp_path / "plain"
    plain = _net()
    hookfit.Loop(_step, _data(), model=plain, optimizers=torch.optim.Adam(plain.parameters(), lr=0.01),
                 plugins=[Optim(), Checkpoint(dir=plain_dir)]).fit()
    again = _net()
    refused = hookfit.Loop(_step, _data(), model=again, optimizers=torch.optim.Adam(again.parameters(), lr=0.01),
                           max_epochs=2, resume=str(plain_dir),
                           plugins=[Distributed(strategy="fsdp"), Optim(), Checkpoint(dir=plain_dir)])
    with pytest.raises(CheckpointError, match=r"epoch0001-step000000006.pt was written by a run without sharded"):
        refused.fit()

    dist.destroy_process_group()
    fresh = _net()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    resumed: dict[str, Any] = {}

    class Look:
        @hookimpl
        def resumed(self, loop: Any) -> None:
            resumed["params"] = _whole(loop.model)
            resumed["state"] = {k: v.clone() for k, v in fresh_opt.state[next(iter(fresh.parameters()))].items()}

    loop = hookfit.Loop(_step, _data(), model=fresh, optimizers=fresh_opt,
                        max_epochs=4, resume=str(last), plugins=[Optim(), Checkpoint(dir=folder), Look()])
    assert loop.fit().status == "completed"
    assert resumed["params"].keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(resumed["params"][name], value), name
    for key, value in optimizer_state.items():  # Adam's moments, whole in a plain process
        assert torch.equal(resumed["state"][key], value), key
    assert sorted(p.suffix for p in folder.iterdir() if p.name != "run.lock") == [".dcp", ".dcp", ".pt"]  # the plain run writes a file


def test_a_sharded_checkpoint_resumes_with_another_validation_batch(group: Any, tmp_path: Path) -> None:
    """A resumed run validates from the start of a validation, over all its samples, so the
    validation batch (and the number of processes sharing the validation) may differ from the
    run that wrote the checkpoint: an FSDP run's checkpoint, validation batches of 4, resumes in
    a plain process with batches of 2. It failed with "the saved state is for other batches:
    batch_size 4 saved, 2 here". Validation data of other samples is still refused."""
    from hookfit.data import Batches

    generator = torch.Generator().manual_seed(2)
    x, y = torch.randn(10, 4, generator=generator), torch.randn(10, 2, generator=generator)
    seen: list[int] = []

    def valid(loop: Any, batch: Any) -> dict[str, Any]:
        seen.append(len(batch[0]))
        return {"loss": torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])}

    def run(val_batch: int, samples: int = 10, **options: Any) -> hookfit.Loop:
        model = _net()
        return hookfit.Loop(_step, _data(), val_step=valid, val_data=Batches(x[:samples], y[:samples],
                                                                             batch_size=val_batch),
                            model=model, optimizers=torch.optim.Adam(model.parameters(), lr=0.01), **options)

    folder = tmp_path / "ckpt"
    sharded = run(4, plugins=[Distributed(strategy="fsdp"), Optim(), Checkpoint(dir=folder)])
    assert sharded.fit().status == "completed" and seen == [4, 4, 2]
    saved = _whole(sharded.model)
    [checkpoint] = folder.glob("*.dcp")
    dist.destroy_process_group()

    params: dict[str, Any] = {}

    class Look:
        @hookimpl
        def resumed(self, loop: Any) -> None:
            params.update(_whole(loop.model))

    seen.clear()
    state = run(2, max_epochs=2, resume=str(checkpoint),
                plugins=[Optim(), Checkpoint(dir=tmp_path / "plain"), Look()]).fit()
    assert (state.status, state.step, seen) == ("completed", 12, [2] * 5)
    assert params.keys() == saved.keys() and all(torch.equal(params[k], v) for k, v in saved.items())

    other = run(2, samples=8, max_epochs=2, resume=str(checkpoint), plugins=[Optim(), Checkpoint(dir=tmp_path / "o")])
    with pytest.raises(ValueError, match="num_samples 10 saved, 8 here"):
        other.fit()


# -- real processes ----------------------------------------------------------------------------

SHARDED = ("--strategy", "fsdp", "--samples", "1024")


def _run_plain(folder: Path, *args: str, **env: str) -> tuple[int, str]:
    """The example as a plain one-process script (no torchrun)."""
    done = subprocess.run([sys.executable, str(EXAMPLE), *args], cwd=folder, env=_env(**env),
                          capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr


def _dump(folder: Path, name: str, rank: int = 0) -> dict[str, Any]:
    return json.loads((folder / f"{name}.rank{rank}.json").read_text())


@pytest.mark.slow
def test_two_sharded_processes_train_like_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP2 on two processes with gradient accumulation (the window's gradients are reduced
    once, at its end): parameters and metrics equal to one process with the global batch."""
    args = (*SHARDED, "--accumulate", "2", "--epochs", "2")
    code, out, err, _ = torchrun(tmp_path, *args, "--batch-size", "32", "--dump", "dump")
    assert code == 0, out + err
    ranks = dumps(tmp_path)
    assert {r["model_type"] for r in ranks} == {"FSDPSequential"}
    assert_same_training(ranks, one_process(tmp_path, monkeypatch, *args, "--batch-size", "64"))


@pytest.mark.slow
def test_sharded_checkpoints_resume_exactly_and_on_other_numbers_of_processes(tmp_path: Path) -> None:
    """One run of 2 processes stopped in its first epoch writes a sharded checkpoint (every
    rank its shard). Resumed on 2 processes it ends bitwise where an uninterrupted run does;
    on 1 process under torchrun, and in a plain process, it starts from the same parameters
    and ends where the uninterrupted run does (within float tolerance: one process sums the
    global batch in another order); the one-process FSDP run's checkpoint resumes on 2.
    ``hookfit export`` gives the parameters as one plain state dict."""
    plugins = PLUGINS + ",checkpoint"
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    code, out, err, _ = torchrun(whole, *SHARDED, "--batch-size", "32", "--epochs", "2", "--dump", "d",
                                 HOOKFIT_PLUGINS=plugins)
    assert code == 0, out + err
    code, out, err, _ = torchrun(stopped, *SHARDED, "--batch-size", "32", "--epochs", "2", "--dump", "d",
                                 "--stop-on-rank", "1", "--stop-at-batch", "5", HOOKFIT_PLUGINS=plugins)
    assert code == 0, out + err
    at_stop = _dump(stopped, "d")
    assert (at_stop["status"], at_stop["step"]) == ("interrupted", 6)
    [checkpoint] = stopped.glob("runs/ddp/*/checkpoints/*")
    assert checkpoint.name == "epoch0001-step000000006.dcp" and checkpoint.is_dir()
    assert {p.name for p in checkpoint.iterdir()} == {"state.pt", ".metadata", "__0_0.distcp", "__1_0.distcp"}
    copies = {name: tmp_path / name for name in ("one", "plain")}
    for copy in copies.values():
        shutil.copytree(stopped, copy)

    # the same number of processes: bitwise the uninterrupted run
    code, out, err, _ = torchrun(stopped, *SHARDED, "--batch-size", "32", "--epochs", "2", "--dump", "r",
                                 HOOKFIT_PLUGINS=plugins, HOOKFIT_RESUME="latest")
    assert code == 0, out + err
    want = _dump(whole, "d")
    for rank in (0, 1):
        got = _dump(stopped, "r", rank)
        assert got["resumed_params"] == at_stop["params"]
        assert (got["status"], got["step"]) == ("completed", 32) and got["params"] == want["params"]

    # 2 -> 1: under torchrun (FSDP on one process) and as a plain script, global batch 64
    code, out, err, _ = torchrun(copies["one"], *SHARDED, "--batch-size", "64", "--epochs", "2", "--dump", "r",
                                 nproc=1, HOOKFIT_PLUGINS=plugins, HOOKFIT_RESUME="latest")
    assert code == 0, out + err
    code, text = _run_plain(copies["plain"], *SHARDED, "--batch-size", "64", "--epochs", "2", "--dump", "r",
                            HOOKFIT_PLUGINS="console,interrupter,metrics,optim,checkpoint", HOOKFIT_RESUME="latest")
    assert code == 0, text
    for folder in copies.values():
        got = _dump(folder, "r")
        assert got["resumed_params"] == at_stop["params"], folder.name
        assert (got["status"], got["step"], got["world_size"]) == ("completed", 32, 1)
        torch.testing.assert_close(torch.tensor(got["params"]), torch.tensor(want["params"]), rtol=1e-5, atol=1e-6)

    # 1 -> 2: the one-process FSDP run's last checkpoint, on two processes
    code, out, err, _ = torchrun(copies["one"], *SHARDED, "--batch-size", "32", "--epochs", "3", "--dump", "t",
                                 HOOKFIT_PLUGINS=plugins, HOOKFIT_RESUME="latest")
    assert code == 0, out + err
    one = _dump(copies["one"], "r")
    for rank in (0, 1):
        got = _dump(copies["one"], "t", rank)
        assert got["resumed_params"] == one["params"] and (got["status"], got["step"]) == ("completed", 48)

    # export: the sharded run's last checkpoint as one plain state dict
    run = next(stopped.glob("runs/ddp/*"))
    done = subprocess.run([sys.executable, "-m", "hookfit", "export", str(run), "model.pt"], cwd=tmp_path,
                          env=_env(HOOKFIT_PLUGINS="checkpoint"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "epoch0002-step000000032.dcp" in done.stdout
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert list(exported) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert torch.cat([t.flatten() for t in exported.values()]).tolist() == want["params"]


VAL_BATCH = ROOT / "tests" / "scripts" / "val_batch_run.py"


@pytest.mark.slow
def test_two_sharded_processes_resume_as_a_plain_process_that_keeps_its_validation_batch(tmp_path: Path) -> None:
    """A 2-process FSDP run (batches of 8 per process, validation batches of 4)
    resumed from its sharded checkpoint as a plain script, with the global training batch (16)
    and the same validation batch (4). It failed at resume ("the saved state is for other
    batches: world_size 2 saved, 1 here": the validation data's state was held to the training
    data's rule); now it continues from the saved parameters and ends, parameters and
    validation losses, where a plain run that was never interrupted does."""
    two = subprocess.run([*_torchrun(), "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                          "localhost:0", str(VAL_BATCH), "two", "--batch-size", "8", "--val-batch-size", "4",
                          "--epochs", "1"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=180)
    assert two.returncode == 0, two.stdout + two.stderr
    [checkpoint] = tmp_path.glob("ckpt/*.dcp")
    whole = tmp_path / "whole"
    whole.mkdir()
    for folder, name, resume in ((tmp_path, "plain", ["--resume", str(checkpoint)]), (whole, "whole", [])):
        done = subprocess.run([sys.executable, str(VAL_BATCH), name, "--batch-size", "16", "--val-batch-size", "4",
                               "--epochs", "2", *resume], cwd=folder, env=_env(), capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
    sharded, plain, want = _dump(tmp_path, "two"), _dump(tmp_path, "plain"), _dump(whole, "whole")
    assert plain["resumed_params"] == sharded["params"]
    assert (plain["status"], plain["step"], plain["world_size"]) == ("completed", 8, 1)
    torch.testing.assert_close(torch.tensor(plain["params"]), torch.tensor(want["params"]), rtol=1e-5, atol=1e-6)
    assert sharded["valid"] + plain["valid"] == pytest.approx(want["valid"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.fault
def test_a_failing_sharded_rank_is_named(tmp_path: Path) -> None:
    code, out, err, seconds = torchrun(tmp_path, *SHARDED, "--batch-size", "32", "--fail-on-rank", "1")
    assert code != 0
    failure = "RuntimeError: injected failure on rank 1"
    assert f"hookfit distributed: rank 1 of 2 failed: {failure}" in err, err
    assert f"hookfit distributed: rank 0 of 2 stopped: a collective operation failed: rank 1 of 2 failed first: {failure}" in err, err
    assert seconds < 60, f"took {seconds:.0f} s"
