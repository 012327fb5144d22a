"""The distributed plugin: DDP under torchrun, checked with real processes (CPU, gloo).

Fast tests run in this process: without torchrun the plugin leaves the run alone; with a
one-process group (initialised here, as a script may do) it wraps, checks and agrees on stops;
the sharding rules are checked directly. The ``slow`` tests start ``torchrun`` with two
processes on ``examples/ddp.py`` and compare what every rank saw with a one-process run.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import hookfit
from hookfit import hookimpl
from hookfit.plugins.distributed import Distributed
from hookfit.plugins.interrupter import Interrupter
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim
from conftest import REPO

ROOT = REPO
EXAMPLE = ROOT / "examples" / "ddp.py"
PLUGINS = "console,distributed,interrupter,metrics,metrics_log,optim"
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "GROUP_RANK", "TORCHELASTIC_RUN_ID")


@pytest.fixture(autouse=True)
def _not_launched(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process is not started by torchrun, whatever started pytest."""
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def process_group(tmp_path: Path) -> Any:
    """A one-process gloo group initialised by the 'script' (this test), as a user may do."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    gc.collect()  # free DDP wrappers first, while the group is still referenced here
    if dist.is_initialized():
        dist.destroy_process_group()


def _regression(batches: int = 6, size: int = 8) -> tuple[torch.nn.Module, list[Any]]:
    generator = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(3, 1)
    data = [(torch.randn(size, 3, generator=generator), torch.randn(size, 1, generator=generator))
            for _ in range(batches)]
    return model, data


def _step(loop: Any, batch: Any) -> Any:
    x, y = batch
    loss = torch.nn.functional.mse_loss(loop.model(x), y)
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    return {"loss": loss}


class Probe:
    """Records what the run looks like once it has started."""

    name = "probe"

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    @hookimpl
    def fit_start(self, loop: Any) -> None:
        self.seen.update(
            registered=loop.pm.get_plugin("distributed") is not None,
            model=type(loop.model).__name__,
            rank=loop.state.rank,
            world_size=loop.state.world_size,
            batch_start=loop.hooks.batch_start,
            should_stop=loop.hooks.should_stop,
            all_reduce=loop.hooks.all_reduce,
            epoch_start=loop.hooks.epoch_start,
        )
        if loop.hooks.all_reduce is not None:
            self.seen["sum"] = loop.hooks.all_reduce(loop, torch.tensor([1.5, 2.0])).tolist()


# -- in this process -------------------------------------------------------------------------


def test_hookfit_plugins_says_it_is_off_in_one_process_and_what_turns_it_on(monkeypatch, capsys, tmp_path) -> None:
    """Outside torchrun the plugin takes no part in a run: the listing says so ("inert") and what
    turns it on, not "active"; the env:// variables of a launcher turn it on."""
    from hookfit.tools import cli

    monkeypatch.chdir(tmp_path)  # (no hookfit.toml)
    for name in ("RANK", "WORLD_SIZE", "HOOKFIT_PLUGINS", "HOOKFIT_DISABLE_PLUGINS"):
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()
    assert cli.main(["plugins"]) == 0
    listed = capsys.readouterr().out
    # (under its name, the first sentence of its docstring, then why it is inert)
    assert re.search(r"^distributed  \[inert\].*\n    Data-parallel training.*\n"
                     r"    inert until: started by torchrun \(RANK and WORLD_SIZE set\)", listed, re.M), listed
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main(["plugins"]) == 0
    assert re.search(r"^distributed  \[active\]", capsys.readouterr().out, re.M)


def test_without_torchrun_the_plugin_unregisters_itself_and_costs_nothing() -> None:
    model, data = _regression()
    probe = Probe()
    loop = hookfit.Loop(_step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                        plugins=[Distributed(), Optim(), probe])
    state = loop.fit()
    assert state.status == "completed"
    assert not dist.is_initialized()
    seen = probe.seen
    assert seen["registered"] is False
    assert (seen["model"], seen["rank"], seen["world_size"]) == ("Linear", 0, 1)
    # no per-batch or per-epoch hook of the plugin is left to call
    for event in ("batch_start", "should_stop", "all_reduce", "epoch_start"):
        assert seen[event] is None, event
    assert loop.model is model and loop.train_data is data


def test_with_a_process_group_the_model_is_wrapped_then_given_back(process_group: Any) -> None:
    model, data = _regression()
    probe = Probe()
    loop = hookfit.Loop(_step, data, val_step=lambda loop, b: {"loss": loop.model(b[0]).mean()},
                        val_data=data[:2], model=model,
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.1), max_epochs=2,
                        plugins=[Distributed(), Optim(), Metrics(), Interrupter(), probe])
    state = loop.fit()
    assert state.status == "completed", state.stop_reason
    seen = probe.seen
    assert seen["registered"] and seen["model"] == "DistributedDataParallel"
    assert (seen["rank"], seen["world_size"]) == (0, 1)
    assert seen["sum"] == [1.5, 2.0]  # one process: the sum is its own value
    assert loop.model is model and loop.train_data is data  # the user's objects again
    assert dist.is_initialized(), "a group the script created is the script's to destroy"


@pytest.mark.parametrize("complete, status", [(True, "completed"), (False, "interrupted")])
def test_the_agreed_stop_keeps_whether_it_completes_the_run(process_group: Any, complete: bool, status: str) -> None:
    """A stop by the run's own rule (early stopping: every rank decides the same) still
    completes the run once the ranks agree on it; an interruption stays one."""
    model, data = _regression()

    class Rule:
        name = "rule"

        @hookimpl
        def epoch_end(self, loop, epoch):
            loop.request_stop("target reached", complete=complete)

    state = hookfit.Loop(_step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                         max_epochs=3, plugins=[Distributed(), Optim(), Rule()]).fit()
    assert (state.status, state.epoch) == (status, 0)
    assert state.stop_reason == "stop requested on rank 0: target reached"


def test_several_validation_sets_are_each_sharded(process_group: Any) -> None:
    model, data = _regression()
    seen = []

    def valid(loop, batch):
        seen.append(loop.state.val_set)
        return {"loss": loop.model(batch[0]).mean()}

    state = hookfit.Loop(_step, data, val_step=valid, val_data={"a": data[:2], "b": data[2:5]}, model=model,
                         optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                         plugins=[Distributed(), Optim(), Metrics()]).fit()
    assert state.status == "completed" and seen == ["a", "a", "b", "b", "b"]


def test_a_shuffled_validation_loaders_sampler_is_never_told_the_epoch(process_group: Any) -> None:
    """The validation loader, rebuilt with an exact sampler that keeps its shuffle, reads the same order at every
    validation, as ``Loop.validate()`` does; the training sampler is told each epoch and reshuffles."""
    from torch.utils.data import DataLoader, TensorDataset

    model = torch.nn.Linear(1, 1)
    seen: dict[tuple[bool, int], list[float]] = {}

    def record(loop: Any, batch: Any) -> Any:
        seen.setdefault((loop.training, loop.state.epoch), []).extend(batch[0].flatten().tolist())
        return {"loss": loop.model(batch[0]).mean()}

    def train(loop: Any, batch: Any) -> Any:
        out = record(loop, batch)
        out["loss"].backward()
        return out

    data = TensorDataset(torch.arange(8.0).unsqueeze(1))
    state = hookfit.Loop(train, DataLoader(data, batch_size=2, shuffle=True), val_step=record,
                         val_data=DataLoader(data, batch_size=2, shuffle=True), model=model, max_epochs=3,
                         plugins=[Distributed()]).fit()
    assert state.status == "completed"
    assert seen[False, 0] == seen[False, 1] == seen[False, 2], seen
    assert len({tuple(seen[True, epoch]) for epoch in range(3)}) > 1, seen


@pytest.mark.bad_input
def test_a_step_that_bypasses_loop_model_fails_with_a_clear_error(process_group: Any) -> None:
    model, data = _regression()

    def bypassing(loop: Any, batch: Any) -> Any:
        x, y = batch
        loss = torch.nn.functional.mse_loss(model(x), y)  # the script's variable, not loop.model
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    loop = hookfit.Loop(bypassing, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                        plugins=[Distributed(), Optim(), Interrupter()])
    with pytest.raises(RuntimeError, match=r"call loop\.model\(x\)"):
        loop.fit()
    # found in the first backward pass, before any optimizer step
    assert (loop.state.step, loop.state.batch_idx) == (0, 0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.bad_input
def test_several_models_need_wrap_model_false(process_group: Any) -> None:
    _, data = _regression()
    models = {"a": torch.nn.Linear(3, 1), "b": torch.nn.Linear(3, 1)}
    loop = hookfit.Loop(lambda loop, b: None, data, model=models, plugins=[Distributed()])
    with pytest.raises(TypeError, match=r"wrap_model=False"):
        loop.fit()


def test_a_stop_waits_for_the_next_agreement(process_group: Any) -> None:
    model, data = _regression(batches=8)

    def step(loop: Any, batch: Any) -> Any:
        if loop.state.batch_idx == 0:
            loop.request_stop("enough")
        return _step(loop, batch)

    loop = hookfit.Loop(step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                        plugins=[Distributed(stop_check_every=3), Optim(), Interrupter()])
    state = loop.fit()
    assert state.status == "interrupted"
    assert state.step == 3  # asked in batch 0, agreed after batch 2
    assert state.stop_reason == "stop requested on rank 0: enough"


def test_sharding_rules() -> None:
    from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

    from hookfit.data import Batches
    from hookfit.plugins.distributed.sharding import shard

    samplers: list[Any] = []

    def _shard(data: Any, what: str) -> Any:  # rank 1 of 3, as the plugin calls it
        data, sampler = shard(data, what, 1, 3, 0)
        if sampler is not None:
            samplers.append(sampler)
        return data

    assert _shard(list(range(10)), "train_data") == [1, 4, 7]  # cut to 10 // 3 batches
    assert _shard(tuple(range(9)), "train_data") == [1, 4, 7]
    with pytest.raises(ValueError, match="fewer than the 3 processes"):
        _shard([0, 1], "val_data")

    x = torch.arange(20.0).unsqueeze(1)
    collate = torch.utils.data.default_collate
    for shuffle in (False, True):
        loader = DataLoader(TensorDataset(x), batch_size=2, shuffle=shuffle, drop_last=True, collate_fn=collate)
        sharded = _shard(loader, "train_data")
        sampler = sharded.sampler
        assert isinstance(sampler, DistributedSampler)
        assert (sampler.rank, sampler.num_replicas, sampler.shuffle) == (1, 3, shuffle)
        assert (sharded.batch_size, sharded.drop_last, sharded.collate_fn) == (2, True, collate)
        if not shuffle:
            assert [b[0].flatten().tolist() for b in sharded] == [[1.0, 4.0], [7.0, 10.0], [13.0, 16.0]]
    assert len(samplers) == 2  # told the epoch at every epoch_start

    batches = _shard(Batches(x, batch_size=2), "train_data")
    assert (batches.rank, batches.world_size) == (1, 3)
    assert _shard(batches, "train_data") is batches  # already a shard: left alone

    class Stream(IterableDataset):
        def __iter__(self) -> Any:
            return iter(range(3))

    with pytest.raises(TypeError, match="IterableDataset"):
        _shard(DataLoader(Stream()), "train_data")
    with pytest.raises(TypeError, match="shard_data=False"):
        _shard((b for b in range(3)), "train_data")


def test_validation_is_sharded_exactly_every_sample_once() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    from hookfit.data import Batches
    from hookfit.plugins.distributed.sharding import ExactSampler, shard

    def parts(data: Any) -> list[Any]:  # ranks 0, 1 and 2 of 3, as the plugin shards validation
        return [shard(data, "val_data", rank, 3, 0, even=False)[0] for rank in range(3)]

    assert parts(list(range(10))) == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]  # nothing cut
    x = torch.arange(10.0).unsqueeze(1)
    for shuffle in (False, True):
        loaders = parts(DataLoader(TensorDataset(x), batch_size=2, shuffle=shuffle))
        assert all(isinstance(loader.sampler, ExactSampler) for loader in loaders)
        rows = [[v for b in loader for v in b[0].flatten().tolist()] for loader in loaders]
        assert sorted(v for r in rows for v in r) == x.flatten().tolist()  # none twice, none left out
        assert [len(loader) for loader in loaders] == [2, 2, 2] and [len(r) for r in rows] == [4, 3, 3]
    batches = parts(Batches(x, batch_size=2, shuffle=True))
    rows = [[v for b in part for v in b[0].flatten().tolist()] for part in batches]
    assert sorted(v for r in rows for v in r) == x.flatten().tolist()
    assert [len(part) for part in batches] == [2, 2, 2] and [len(r) for r in rows] == [4, 3, 3]
    with pytest.raises(ValueError, match=r"val_data has 2 samples, fewer than the 3 processes"):
        parts(DataLoader(TensorDataset(x[:2]), batch_size=2))
    with pytest.raises(ValueError, match=r"val_data has 2 batches, fewer than the 3 processes"):
        parts([0, 1])
    # training shards stay even: the same batches everywhere, by repeating the first samples
    even = [shard(Batches(x, batch_size=2), "train_data", rank, 3, 0)[0] for rank in range(3)]
    assert [sum(len(b[0]) for b in part) for part in even] == [4, 4, 4]


@pytest.mark.bad_input
def test_a_validation_loaders_own_distributed_sampler_that_pads_or_drops_is_replaced_or_named() -> None:
    """Validation given torch's ``DistributedSampler`` (for this rank and size, over the loader's dataset)
    that repeats samples to pad the parts, or leaves some out (``drop_last=True``), is replaced by the exact
    split, in its order (its shuffle and seed); one that splits evenly is kept. A sampler the plugin cannot
    judge (a subclass of it) is kept, with one warning on the main process naming the set, the samples
    counted twice and the fix; training keeps its own sampler as it is (its parts must be even)."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from hookfit.plugins.distributed.sharding import ExactSampler, shard

    x = torch.arange(10.0).unsqueeze(1)
    dataset = TensorDataset(x)

    def parts(make: Any, what: str = "val_data", even: bool = False) -> list[Any]:
        return [shard(DataLoader(dataset, batch_size=2, sampler=make(rank)), what, rank, 3, 0, even=even)
                for rank in range(3)]

    for drop_last in (False, True):  # 10 samples on 3 processes: 2 repeated, or 1 left out
        own = parts(lambda rank: DistributedSampler(dataset, 3, rank, shuffle=True, seed=7, drop_last=drop_last))
        assert all(isinstance(sampler, ExactSampler) and loader.sampler is sampler for loader, sampler in own)
        rows = [[v for b in loader for v in b[0].flatten().tolist()] for loader, _ in own]
        assert sorted(v for r in rows for v in r) == x.flatten().tolist()  # none twice, none left out
        padded = [list(DistributedSampler(dataset, 3, rank, shuffle=True, seed=7)) for rank in range(3)]
        assert rows == [[float(i) for i in p[:len(r)]] for p, r in zip(padded, rows)]  # its order, less the pad
    kept = parts(lambda rank: DistributedSampler(dataset, 3, rank), "train_data", even=True)
    assert all(type(sampler) is DistributedSampler and loader.sampler is sampler for loader, sampler in kept)
    even = TensorDataset(x[:9])
    loader = DataLoader(even, batch_size=2, sampler=DistributedSampler(even, 3, 1))
    assert shard(loader, "val_data", 1, 3, 0, even=False) == (loader, loader.sampler)

    class Mine(DistributedSampler):  # type: ignore[type-arg]
        pass

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mine = parts(lambda rank: Mine(dataset, 3, rank), "val_data['test']")
    assert all(type(sampler) is Mine and loader.sampler is sampler for loader, sampler in mine)
    assert [(w.category, str(w.message)) for w in caught] == [(hookfit.HookfitWarning, (
        "distributed: val_data['test']'s sampler, a Mine of its own, repeats 2 of its 10 samples to pad the 3 "
        "parts to 4 samples each, counting them twice in every validation's metrics, and a "
        "Checkpoint(monitor=...) ranks checkpoints on them: give val_data['test'] without a sampler "
        "(DataLoader(dataset, batch_size=...)), and the plugin splits validation exactly, every sample once"))]


@pytest.mark.bad_input
def test_a_validation_sampler_replaced_by_the_exact_split_is_checked_as_a_set_without_one() -> None:
    """torch's ``DistributedSampler`` over fewer samples than processes pads every part to one sample;
    replaced by the exact split, a rank would have no batch (its metric sums then differ from the others'
    and the collective fails): the same clear error as for the set given without a sampler, on every rank."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from hookfit.plugins.distributed.sharding import shard

    tiny = TensorDataset(torch.arange(2.0).unsqueeze(1))
    for rank in range(3):
        loader = DataLoader(tiny, batch_size=4, sampler=DistributedSampler(tiny, 3, rank, shuffle=False))
        with pytest.raises(ValueError, match=r"^distributed: val_data\['b'\] has 2 samples, fewer than the 3 "
                                             r"processes; every process needs at least one batch$"):
            shard(loader, "val_data['b']", rank, 3, 0, even=False)


@pytest.mark.bad_input
@pytest.mark.parametrize("size", [9, 10])
def test_a_validation_sampler_made_for_another_rank_or_size_warns_on_each_process_that_finds_it(size: int) -> None:
    """A ``DistributedSampler`` made with ``rank=0`` on every process (or for another number of processes)
    validates the same samples on several ranks: each process whose own sampler names another rank or size
    warns once, naming the set, the sampler's rank and ``num_replicas`` and its own, whether or not the
    size divides evenly, and keeps it; the process it was made for says nothing."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from hookfit.plugins.distributed.sharding import shard

    dataset = TensorDataset(torch.arange(float(size)).unsqueeze(1))
    for replicas, made_for, warned in ((3, 0, [1, 2]), (2, 1, [0, 1, 2])):
        for rank in range(3):
            loader = DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, replicas, made_for))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                kept = shard(loader, "val_data['b']", rank, 3, 0, even=False) == (loader, loader.sampler)
            assert kept or rank not in warned  # (the process it was made for may take the exact split)
            expected = [(hookfit.HookfitWarning, (
                f"distributed: val_data['b']'s sampler was made for rank {made_for} of num_replicas={replicas}, but "
                f"this process is rank {rank} of 3: processes validate the wrong samples (some twice, some never); "
                f"give val_data['b'] without a sampler (DataLoader(dataset, batch_size=...)), and the plugin splits "
                f"validation exactly, every sample once"))] if rank in warned else []
            assert [(w.category, str(w.message)) for w in caught] == expected, (replicas, rank)


@pytest.mark.bad_input
def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="stop_check_every"):
        Distributed(stop_check_every=0)
    with pytest.raises(ValueError, match="timeout"):
        Distributed(timeout=0)


BAD_OPTIONS = [
    ("timeout", float("inf")), ("timeout", "10"), ("timeout", math.nan), ("timeout", -1), ("backend", 5),
    ("backend", ""), ("seed", "a"), ("seed", 1.5), ("stop_check_every", True), ("find_unused_parameters", "yes"),
    ("wrap_model", 0), ("shard_data", None), ("ddp_options", ["static_graph"]),
]


@pytest.mark.bad_input
@pytest.mark.parametrize("option, value", BAD_OPTIONS, ids=[f"{o}={v!r}" for o, v in BAD_OPTIONS])
def test_options_are_checked_when_it_is_built_naming_option_and_value(option: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"^distributed: {option} must be .*, got {re.escape(repr(value))}$"):
        Distributed(**{option: value})


@pytest.mark.fault
def test_the_first_failing_rank_is_recorded_and_the_others_name_it(capsys: pytest.CaptureFixture[str]) -> None:
    """The exception handling of three ranks sharing one store (as torchrun's ranks share the
    agent's): rank 2 fails, then ranks 0 and 1 see their collective operation fail; both name
    rank 2 and its error. A rank that finds no record (its peer hangs) says so."""
    store = dist.PrefixStore("test/", dist.HashStore())

    def rank(number: int) -> Distributed:
        plugin = Distributed(timeout=7)
        plugin.rank, plugin.world_size, plugin._store = number, 3, store
        return plugin

    def failure(text: str, note: str | None = None) -> BaseException:
        error = RuntimeError(text)
        if note:
            error.add_note(note)
        return error

    rank(2).exception(None, failure("CUDA out of memory", "hookfit: raised in step function 'step' (epoch 1, stage train, batch 5)"))
    survivors = [failure("[gloo/pair.cc:534] Connection closed by peer [127.0.0.1]:1234") for _ in range(2)]
    rank(0).exception(None, survivors[0])
    rank(1).exception(None, survivors[1])
    lines = capsys.readouterr().err.splitlines()
    first = "RuntimeError: CUDA out of memory (raised in step function 'step' (epoch 1, stage train, batch 5))"
    assert lines[0] == f"hookfit distributed: rank 2 of 3 failed: {first}"
    for number, line, error in zip((0, 1), lines[1:], survivors):
        assert line == (f"hookfit distributed: rank {number} of 3 stopped: a collective operation failed: "
                        f"rank 2 of 3 failed first: {first}; here: RuntimeError: [gloo/pair.cc:534] Connection "
                        f"closed by peer [127.0.0.1]:1234")
        assert error.__notes__ == [f"hookfit distributed: a collective operation failed on rank {number} of 3 "
                                   f"because rank 2 of 3 failed first: {first}; collectives time out after 7 s "
                                   f"(HOOKFIT_DIST_TIMEOUT or Distributed(timeout=...))"]

    # a peer that hangs records nothing: the first rank to time out says so, and records itself
    store = dist.PrefixStore("other/", dist.HashStore())
    timed_out = failure("[gloo] Timed out waiting 7000ms for recv operation to complete")
    rank(0).exception(None, timed_out)
    late = failure("[gloo] Connection closed by peer")
    rank(1).exception(None, late)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("hookfit distributed: rank 0 of 3 stopped: a collective operation failed and no "
                               "other rank recorded a failure (a rank that hangs or is killed cannot): ")
    assert "another rank probably failed, stopped or hung first" in timed_out.__notes__[0]
    assert lines[1].startswith("hookfit distributed: rank 1 of 3 stopped: a collective operation failed: rank 0 "
                               "of 3 stopped first, a collective operation having failed there: RuntimeError: "
                               "[gloo] Timed out waiting 7000ms")

    # no store (a group without one): the message of old, never an error of its own
    plugin = rank(0)
    plugin._store = None
    plugin.exception(None, failure("[gloo] Connection closed by peer"))
    assert "no other rank recorded a failure" in capsys.readouterr().err


# -- real processes ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV and k != "HOOKFIT_DISABLE_PLUGINS"}
    env.update({"OMP_NUM_THREADS": "1", "HOOKFIT_PLUGINS": PLUGINS, "PYTHONFAULTHANDLER": "1", **extra})
    return env


def _torchrun() -> list[str]:
    script = Path(sys.executable).with_name("torchrun")
    return [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]


class Run:
    """``torchrun --nproc-per-node NPROC examples/ddp.py ARGS``, started in ``folder``; stdout has
    each rank's lines prefixed ``[default<rank>]:`` (stderr too with ``tee="3"``)."""

    def __init__(self, folder: Path, *args: str, tee: str = "1", nproc: int = 2, **env: str) -> None:
        launch = ["--nproc-per-node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
        folder.mkdir(parents=True, exist_ok=True)
        self.start = time.monotonic()
        self.process = subprocess.Popen(  # a session of its own: a timeout kills its ranks too
            [*_torchrun(), *launch, "--tee", tee, str(EXAMPLE), *args],
            cwd=folder, env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )

    def finish(self, timeout: float = 120) -> tuple[int, str, str, float]:
        """Exit code, stdout, stderr and the seconds the run took."""
        try:
            out, err = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # torchrun alone killed, a hung rank would keep the pipes open and this wait forever
            os.killpg(self.process.pid, signal.SIGKILL)
            out, err = self.process.communicate(timeout=60)
            pytest.fail(f"torchrun did not end in {timeout} s:\n{out}\n{err}")
        return self.process.returncode, out, err, time.monotonic() - self.start


def torchrun(folder: Path, *args: str, nproc: int = 2, **env: str) -> tuple[int, str, str, float]:
    return Run(folder, *args, nproc=nproc, **env).finish()


def one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> dict[str, Any]:
    """The example in this process (no torchrun): its dump."""
    spec = importlib.util.spec_from_file_location("hookfit_ddp_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    folder = tmp_path / "single"
    folder.mkdir()
    monkeypatch.chdir(folder)
    # the distributed plugin would unregister itself here (one process); leaving it out of the
    # list keeps this independent of what is installed
    monkeypatch.setenv("HOOKFIT_PLUGINS", "interrupter,metrics,optim")
    state = module.main([*args, "--dump", str(folder / "dump")])
    assert state.status == "completed"
    return json.loads((folder / "dump.rank0.json").read_text())


def dumps(tmp_path: Path, name: str = "dump") -> list[dict[str, Any]]:
    return [json.loads((tmp_path / f"{name}.rank{r}.json").read_text()) for r in (0, 1)]


def assert_same_training(ranks: list[dict[str, Any]], single: dict[str, Any]) -> None:
    """Identical parameters on both ranks after every epoch, equal (within float tolerance)
    to the one-process run's; the same global metrics as the one-process run."""
    assert len(ranks[0]["epochs"]) == len(single["epochs"]) > 0
    for r0, r1, one in zip(ranks[0]["epochs"], ranks[1]["epochs"], single["epochs"]):
        assert r0["params"] == r1["params"], f"ranks differ after epoch {r0['epoch']}"
        torch.testing.assert_close(torch.tensor(r0["params"]), torch.tensor(one["params"]), rtol=1e-5, atol=1e-6)
    for rank in ranks:
        assert len(rank["metrics"]) == len(single["metrics"])
        for got, want in zip(rank["metrics"], single["metrics"]):
            assert got.keys() == want.keys() and got["samples"] == want["samples"]
            for key in want.keys() - {"epoch", "stage", "samples"}:
                assert got[key] == pytest.approx(want[key], rel=1e-5), (got, want)


@pytest.mark.slow
def test_two_processes_train_like_one_and_only_rank_0_prints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """hookfit.data.Batches, gradient accumulation over 2 batches; 1984 samples are 31 batches
    of 32 per rank, so every epoch ends with a partial window."""
    args = ("--samples", "1984", "--accumulate", "2", "--epochs", "2")
    code, out, err, _ = torchrun(tmp_path, *args, "--batch-size", "32", "--count-allreduce", "--dump", "dump")
    assert code == 0, out + err
    ranks = dumps(tmp_path)
    assert [r["rank"] for r in ranks] == [0, 1] and {r["world_size"] for r in ranks} == {2}
    assert {r["model_type"] for r in ranks} == {"DistributedDataParallel"}
    assert {r["model_after_fit"] for r in ranks} == {"Sequential"}
    assert {r["status"] for r in ranks} == {"completed"}
    # gradients all-reduced once per window: 15 whole windows and the partial one per epoch
    # (one bucket for this small model)
    assert [r["allreduces"] for r in ranks] == [2 * 16, 2 * 16]
    # two processes with batch 32 are one process with batch 64, over the same samples
    assert_same_training(ranks, one_process(tmp_path, monkeypatch, *args, "--batch-size", "64"))
    lines = out.splitlines()
    assert any(line.startswith("[default0]:hookfit start") for line in lines), out
    assert any(line.startswith("[default0]:ddp example: completed") for line in lines), out
    assert not [line for line in lines if line.startswith("[default1]:")], out
    assert len(list(tmp_path.glob("runs/ddp/*/metrics.jsonl"))) == 1  # written by rank 0 only


@pytest.mark.fault
@pytest.mark.slow
def test_a_checkpoint_inside_an_accumulation_window_under_ddp_says_it_is_not_exact(tmp_path: Path) -> None:
    """Stopped inside a window of 2 (step 5), DDP: the checkpoint holds rank 0's window gradients only, and
    the run resumed from it ended 0.0088 away from the uninterrupted one without a word (FSDP2 warned)."""
    code, out, err, _ = torchrun(tmp_path, "--accumulate", "2", "--stop-on-rank", "1", "--stop-at-batch", "4",
                                 "--dump", "dump", HOOKFIT_PLUGINS=PLUGINS + ",checkpoint")
    assert code == 0, out + err
    assert {r["step"] for r in dumps(tmp_path)} == {5}
    assert list(tmp_path.glob("runs/ddp/*/checkpoints/epoch0001-step000000005.pt")), out + err
    assert "a checkpoint taken inside a gradient-accumulation window does not hold every rank's" in out + err
    assert "each rank's are its own until the window's last batch" in out + err
    said = [line for line in (out + err).splitlines() if "does not hold every rank's" in line]
    assert len(said) == 1 and "core/dispatch.py" not in said[0] and "hookfit/" not in said[0], said  # once, the script's line


@pytest.mark.fault
@pytest.mark.slow
def test_a_stop_on_rank_1_stops_both_ranks_on_two_nodes(tmp_path: Path) -> None:
    """Two torchrun agents, as on two machines (the README's commands), with a DataLoader."""
    port = str(_free_port())
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port]
    args = [str(EXAMPLE), "--data", "loader", "--shuffle", "--stop-on-rank", "1", "--stop-at-batch", "3",
            "--dump", "dump"]
    start = time.monotonic()
    agents = [
        subprocess.Popen([*_torchrun(), *common, "--node-rank", str(node), *args], cwd=tmp_path, env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)
    ]
    outputs = [agent.communicate(timeout=120)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    assert time.monotonic() - start < 60
    ranks = dumps(tmp_path)
    for rank in ranks:
        assert rank["status"] == "interrupted"
        assert rank["reason"] == "stop requested on rank 1: injected stop at batch 3"
        assert (rank["step"], rank["epoch"]) == (4, 0)
    assert ranks[0]["params"] == ranks[1]["params"]
    assert "hookfit end status=interrupted" in outputs[0], outputs[0]
    assert not [line for line in outputs[1].splitlines() if line.startswith("hookfit ")], outputs[1]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["validate", "fit"])
def test_validation_on_two_processes_counts_every_sample_once_as_one_process_does(tmp_path: Path, mode: str) -> None:
    """41 validation samples in each of three sets (Batches, a shuffled DataLoader, a list of
    11 batches): the two ranks' parts differ by a sample or a batch, repeat none and leave none
    out, and the published validation metrics equal one process's, alone (validate) and
    inside training (fit, val_every_n_steps=3)."""
    script = ROOT / "tests" / "scripts" / "exact_validation.py"
    single = subprocess.run([sys.executable, str(script), "one", mode], cwd=tmp_path, env=_env(),
                            capture_output=True, text=True, timeout=120)
    assert single.returncode == 0, single.stdout + single.stderr
    launch = ["--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    two = subprocess.run([*_torchrun(), *launch, str(script), "two", mode], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=180)
    assert two.returncode == 0, two.stdout + two.stderr
    one = json.loads((tmp_path / "one.rank0.json").read_text())
    ranks = [json.loads((tmp_path / f"two.rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    # the process group is kept for a later run of the job (test_job.py): its gloo threads are
    # there when fit() returns, and the group is destroyed at exit, where the process ends well
    assert all(any("gloo" in name for name in r["threads"]) for r in ranks), ranks[0]["threads"]
    # every sample once, at every validation: 21 + 20 samples a set, one more batch on rank 0 in each
    validations = 1 if mode == "validate" else 5
    assert sum(one["batches"]) == sum(ranks[0]["batches"]) + sum(ranks[1]["batches"]) == validations * 3 * 41
    assert [len(r["batches"]) // validations for r in (one, *ranks)] == [33, 18, 15]
    want = one["rows"]
    assert [row["step"] for row in want] == ([0] if mode == "validate" else [3, 6, 9, 12, 15])
    for rank in ranks:
        assert len(rank["rows"]) == len(want)
        for got, row in zip(rank["rows"], want):
            assert got.keys() == row.keys() and got["samples"] == row["samples"] == 3 * 41
            for key in row.keys() - {"step", "samples"}:
                assert got[key] == pytest.approx(row[key], rel=1e-6), (mode, key, got, row)


@pytest.mark.slow
@pytest.mark.bad_input
def test_a_validation_loaders_own_distributed_sampler_counts_every_sample_once(tmp_path: Path) -> None:
    """A validation ``DataLoader`` given torch's ``DistributedSampler`` (shuffled), which pads 41 samples
    to 42 on 2 processes, one of them counted twice: the plugin splits it exactly instead, in the sampler's
    order, so the published metrics are one process's over the 41 samples, and nothing is warned."""
    script = ROOT / "tests" / "scripts" / "exact_validation.py"
    single = subprocess.run([sys.executable, str(script), "one", "sampler"], cwd=tmp_path, env=_env(),
                            capture_output=True, text=True, timeout=120)
    assert single.returncode == 0, single.stdout + single.stderr
    launch = ["--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    two = subprocess.run([*_torchrun(), *launch, str(script), "two", "sampler"], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=180)
    assert two.returncode == 0, two.stdout + two.stderr
    one = json.loads((tmp_path / "one.rank0.json").read_text())
    ranks = [json.loads((tmp_path / f"two.rank{r}.json").read_text()) for r in (0, 1)]
    assert [sum(r["batches"]) for r in (one, *ranks)] == [41, 21, 20]  # 21 + 21 with the sampler's padding
    for rank in ranks:
        assert not [w for w in rank["warned"] if "sampler" in w], rank["warned"]
        (got,), (want,) = rank["rows"], one["rows"]
        assert got["samples"] == want["samples"] == 41
        assert got.keys() == want.keys() == {"step", "samples", "own/mse", "own/mae"}
        assert all(got[key] == pytest.approx(want[key], rel=1e-6) for key in ("own/mse", "own/mae")), (got, want)


@pytest.mark.slow
@pytest.mark.parametrize("data", ["list", "batches"])
def test_a_run_resumed_on_two_processes_continues_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: str) -> None:
    """The checkpoint plugin saves on rank 0 only and every rank loads; the resumed run ends
    where an uninterrupted one does. hookfit.data.Batches has a state of its own, saved from
    rank 0's shard and loaded into each rank's."""
    plugins = PLUGINS + ",checkpoint"
    code, out, err, _ = torchrun(tmp_path, "--data", data, "--batch-size", "32", "--epochs", "1",
                                 HOOKFIT_PLUGINS=plugins)
    assert code == 0, out + err
    saved = list(tmp_path.glob("runs/ddp/*/checkpoints/*.pt"))
    assert len(saved) == 1 and len(list(tmp_path.glob("runs/ddp/*"))) == 1, saved  # rank 0 only
    code, out, err, _ = torchrun(tmp_path, "--data", data, "--batch-size", "32", "--epochs", "2", "--dump", "dump",
                                 HOOKFIT_PLUGINS=plugins, HOOKFIT_RESUME="latest")
    assert code == 0, out + err
    ranks = dumps(tmp_path)
    assert [(r["status"], r["step"]) for r in ranks] == [("completed", 64)] * 2
    single = one_process(tmp_path, monkeypatch, "--data", data, "--batch-size", "64", "--epochs", "2")
    assert ranks[0]["params"] == ranks[1]["params"]
    torch.testing.assert_close(torch.tensor(ranks[0]["params"]), torch.tensor(single["params"]), rtol=1e-5, atol=1e-6)
    single["epochs"], single["metrics"] = single["epochs"][1:], single["metrics"][2:]  # the resumed epoch
    assert_same_training(ranks, single)


@pytest.mark.fault
@pytest.mark.slow
def test_a_failing_or_hanging_rank_ends_the_run_in_bounded_time_with_a_clear_error(tmp_path: Path) -> None:
    """A rank that raises: the others fail at once. A rank that hangs: the others fail after the
    timeout (3 s here: far longer than any collective of this run takes, and than the ranks'
    start-up skew). Both runs at the same time: the second mostly waits."""
    hanging = Run(tmp_path / "hang", "--batch-size", "32", "--hang-on-rank", "1", "--hang-seconds", "5",
                  HOOKFIT_DIST_TIMEOUT="3")
    failing = Run(tmp_path / "fail", "--batch-size", "32", "--fail-on-rank", "1", "--fail-at-batch", "3")

    code, _, err, seconds = failing.finish()
    assert code != 0
    assert seconds < 60, f"took {seconds:.0f} s"
    failure = ("RuntimeError: injected failure on rank 1 (raised in step function 'main.<locals>.train_step' "
               "(epoch 1, stage train, batch 4))")
    assert f"hookfit distributed: rank 1 of 2 failed: {failure}" in err, err
    assert "hookfit distributed: rank 0 of 2 stopped: a collective operation failed" in err, err
    # the survivor names the rank that failed and its error (recorded in torchrun's store), in
    # its line and in its error's note, not a guess ("another rank probably failed")
    assert (f"hookfit distributed: rank 0 of 2 stopped: a collective operation failed: rank 1 of 2 failed "
            f"first: {failure}; here: ") in err, err
    assert (f"hookfit distributed: a collective operation failed on rank 0 of 2 because rank 1 of 2 failed "
            f"first: {failure}") in err, err

    code, _, err, seconds = hanging.finish()
    assert code != 0
    assert seconds < 60, f"took {seconds:.0f} s"
    assert "hookfit distributed: rank 0 of 2 stopped: a collective operation failed" in err, err
    assert "Timed out waiting 3000ms" in err, err
    assert "collectives time out after 3 s" in err, err
    # a rank that hangs records nothing: the message says so, and guesses
    assert ("hookfit distributed: rank 0 of 2 stopped: a collective operation failed and no other rank "
            "recorded a failure (a rank that hangs or is killed cannot)") in err, err
    assert "another rank probably failed" in err, err


@pytest.mark.slow
@pytest.mark.fault
def test_ctrl_c_under_torchrun_stops_every_rank_and_only_rank_0_says_so(tmp_path: Path) -> None:
    """Ctrl-C reaches torchrun, which passes SIGINT on to every rank: every rank requests the
    stop, they agree on the same batch, and only rank 0 prints that the signal was received.
    (31 batches an epoch per rank, so the run goes on until the signal.)"""
    run = Run(tmp_path, "--samples", "1984", "--batch-size", "32", "--epochs", "1000", "--dump", "dump", tee="3")
    assert run.process.stdout is not None
    for line in run.process.stdout:  # both ranks train once rank 0 reports an epoch
        if line.startswith("[default0]:hookfit train epoch="):
            break
    else:
        pytest.fail("torchrun ended before the first epoch: " + run.process.stderr.read())  # type: ignore[union-attr]
    run.process.send_signal(signal.SIGINT)
    _, out, err, _ = run.finish()
    ranks = dumps(tmp_path)
    assert [rank["status"] for rank in ranks] == ["interrupted"] * 2, [rank["reason"] for rank in ranks]
    # torchrun signals one rank after the other: the agreed stop names the ranks whose request
    # had arrived by then (the interrupter, named once, is who asked: StopRequest.by)
    assert ranks[0]["reason"] == ranks[1]["reason"]
    assert re.fullmatch(r"stop requested on (rank [01]|ranks 0, 1): SIGINT", ranks[0]["reason"])
    assert ranks[0]["step"] == ranks[1]["step"] and ranks[0]["params"] == ranks[1]["params"]
    said = [line for line in (out + err).splitlines() if "SIGINT received" in line]
    assert said == ["[default0]:hookfit: SIGINT received, stopping after this batch; press Ctrl-C again to abort"], err
