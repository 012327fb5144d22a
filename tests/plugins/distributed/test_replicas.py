"""The processes train one model: after the first optimizer step the distributed plugin compares every rank's
trainable parameters once, and a run whose ranks train apart fails naming what differs (real torchrun
processes on tests/scripts/two_models.py: two models stepped by hand, as a GAN's are)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hookfit.plugins.distributed.replicas import checksums, differing
from test_distributed import ROOT, _env, _not_launched, _torchrun  # noqa: F401 - _not_launched: autouse

SCRIPT = ROOT / "tests" / "scripts" / "two_models.py"


def _two_models(folder: Path, mode: str) -> tuple[subprocess.CompletedProcess[str], dict[str, object] | None]:
    launch = ["--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    done = subprocess.run([*_torchrun(), *launch, str(SCRIPT), mode], cwd=folder, env=_env(HOOKFIT_PLUGINS=""),
                          capture_output=True, text=True, timeout=180)
    written = folder / "trained.json"
    return done, json.loads(written.read_text()) if written.exists() else None


@pytest.mark.slow
@pytest.mark.bad_input
def test_modules_left_unwrapped_under_wrap_model_false_fail_the_run_naming_them(tmp_path: Path) -> None:
    """``Distributed(wrap_model=False)`` with two plain modules: each rank would train its own copy and the run
    end "completed". It fails after the first optimizer step, on every rank, naming each module's parameters
    that differ and the two ways to synchronise them."""
    done, trained = _two_models(tmp_path, "unwrapped")
    assert done.returncode != 0 and trained is None, done.stdout + done.stderr
    message = ("RuntimeError: distributed: after the first optimizer step the processes hold different values of "
               "4 of their 4 trainable parameter tensors ('gen': weight, bias; 'disc': weight, bias): each process "
               "trained its own copy, because their gradients were not synchronised. Under torchrun every module "
               "the optimizers step must be wrapped in torch.nn.parallel.DistributedDataParallel "
               "(Distributed(wrap_model=False) leaves loop.model as given: wrap each module yourself")
    assert done.stderr.count(message) >= 2, done.stderr  # (one report a rank; the traceback says it again)
    assert "all-reduce (average) the gradients itself" in done.stderr
    assert "Distributed(check_replicas=False) turns this check off" in done.stderr


@pytest.mark.slow
def test_check_replicas_false_turns_the_check_off(tmp_path: Path) -> None:
    """The same unwrapped modules with ``Distributed(check_replicas=False)``: the run completes, each rank
    having trained its own copy (the check, which would have failed it, did not run)."""
    done, trained = _two_models(tmp_path, "unchecked")
    assert done.returncode == 0, done.stdout + done.stderr
    assert trained == {"status": "completed", "steps": 8, "same": False}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "allreduce"])
def test_modules_whose_gradients_are_synchronised_train_as_one(tmp_path: Path, mode: str) -> None:
    """Each module wrapped in DistributedDataParallel by the script, or the step averaging the gradients
    itself: the check passes and every rank ends with the same parameters."""
    done, trained = _two_models(tmp_path, mode)
    assert done.returncode == 0, done.stdout + done.stderr
    assert trained == {"status": "completed", "steps": 8, "same": True}


def test_only_parameters_every_rank_holds_and_trains_are_compared() -> None:
    """A frozen parameter, one some ranks lack (a pipeline's stages) and a shared one are left out or counted
    once; equal values give equal checksums whatever their order of summation, a changed value another."""
    torch.manual_seed(0)
    first = {"a": torch.nn.Linear(3, 2), "b": torch.nn.Linear(2, 1)}
    first["b"].bias.requires_grad_(False)
    same = checksums(first)
    assert list(same) == [("a", "weight"), ("a", "bias"), ("b", "weight")]
    assert differing([same, checksums(first)]) is None
    with torch.no_grad():
        first["a"].weight[0, 0] += 1e-7
    changed = checksums(first)
    assert changed[("a", "weight")] != same[("a", "weight")]
    fewer = {key: value for key, value in same.items() if key[0] == "a"}
    assert differing([same, fewer]) is None  # 'b' on rank 0 only: not compared
    message = differing([same, changed, same])
    assert message is not None and "1 of their 3 trainable parameter tensors ('a': weight)" in message
    assert list(checksums(torch.nn.Sequential(first["a"], first["a"]))) == [("", "0.weight"), ("", "0.bias")]


def test_a_parameter_viewing_a_buffer_at_an_odd_offset_has_the_checksum_of_its_values() -> None:
    """A bf16 parameter that views a flat buffer from its second element (its bytes not aligned to words):
    its checksum is that of the same values held on their own, at whatever offset the view starts."""
    values = torch.randn(4, 4).to(torch.bfloat16)
    on_its_own = checksums(torch.nn.ParameterList([torch.nn.Parameter(values.clone())]))
    for offset in (1, 2, 3):
        flat = torch.zeros(4 * 4 + 4, dtype=torch.bfloat16)
        flat[offset:offset + 16] = values.reshape(-1)
        view = torch.nn.ParameterList([torch.nn.Parameter(flat[offset:offset + 16].view(4, 4))])
        assert view[0].storage_offset() == offset
        assert checksums(view) == on_its_own


def test_parameters_fsdp1_shards_are_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP1's ``FlatParameter`` and the parameters of an FSDP1 module (``use_orig_params=True``: views of each
    rank's shard) differ between the ranks by design: they have no checksum. (FSDP1 needs an accelerator: the
    classes are stood in for here.)"""
    import torch.distributed.fsdp._flat_param as flat_param
    import torch.distributed.fsdp.fully_sharded_data_parallel as fsdp1

    class Flat(torch.nn.Parameter):
        pass

    class Sharded(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(2, 2)

    monkeypatch.setattr(flat_param, "FlatParameter", Flat)
    monkeypatch.setattr(fsdp1, "FullyShardedDataParallel", Sharded)
    model = torch.nn.Module()
    model.plain = torch.nn.Linear(2, 1)
    model.sharded = Sharded()
    model.flat = Flat(torch.zeros(3))
    assert list(checksums(model)) == [("", "plain.weight"), ("", "plain.bias")]
