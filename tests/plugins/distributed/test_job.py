"""The distributed plugin across a job: gradient synchronisation decided per forward pass (an
optimizer with several passes per batch), the stop the ranks agree on (``by`` the plugin's
name, the ranks apart), a ``Loop`` after a ``Loop`` in one ``torchrun`` job (the process group
kept, destroyed at exit or by ``shutdown()``), and observers on ranks other than 0.

The fast tests run in this process with a one-process group (DDP and FSDP2 still decide per
pass there); the ``slow`` ones run ``tests/scripts/dist_runs.py`` under ``torchrun`` with two
processes, once for the module.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import hookfit
from hookfit import StopRequest, hookimpl
from hookfit.plugins.distributed import Distributed
from hookfit.plugins.distributed.agreement import agreed
from test_distributed import (  # noqa: F401 - _not_launched: autouse, this process is not torchrun's
    ROOT,
    _env,
    _free_port,
    _not_launched,
    _torchrun,
)

SCRIPT = ROOT / "tests" / "scripts" / "dist_runs.py"


@pytest.fixture
def group(tmp_path: Path) -> Any:
    """A one-process gloo group, initialised by the 'script' (this test)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


class TwoPasses:
    """An optimizer plugin (replacing ``optim`` by name) whose step function runs two passes
    per batch and answers ``should_sync_gradients`` ``False`` for the first, ``True`` for the
    second; records what it was asked and what each pass left."""

    name = "optim"

    def __init__(self) -> None:
        self.passes = 0  # in the running batch
        self.asked: list[tuple[int, int]] = []  # (step, pass)
        self.seen: list[Any] = []

    @hookimpl
    def batch_start(self) -> None:
        self.passes = 0

    @hookimpl
    def backward(self, loss: torch.Tensor) -> bool:
        loss.backward()
        self.passes += 1
        return True

    @hookimpl
    def should_sync_gradients(self, loop: Any) -> bool:
        self.asked.append((loop.state.step, self.passes))
        return self.passes == 1


def _data(batches: int = 3) -> list[Any]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)) for _ in range(batches)]


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


# -- in this process -------------------------------------------------------------------------


def test_ddp_asks_before_every_training_pass_and_reduces_only_the_passes_answered_true(group: Any) -> None:
    """A comm hook counts DDP's all-reduces: none in the first pass of each batch, one (one
    bucket) in the second. Asked once per batch, as before, both passes went unsynchronised."""
    plugin = TwoPasses()
    counted = {"allreduces": 0}
    per_pass: list[int] = []

    class Count:
        @hookimpl
        def fit_start(self, loop: Any) -> None:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def counting(state, bucket):  # no annotations: DDP checks them against its own
                counted["allreduces"] += 1
                return allreduce_hook(state, bucket)

            loop.model.register_comm_hook(None, counting)

    def step(loop: Any, batch: Any) -> None:
        x, y = batch
        for _ in range(2):
            before = counted["allreduces"]
            loop.backward(torch.nn.functional.mse_loss(loop.model(x), y))
            per_pass.append(counted["allreduces"] - before)
        with torch.no_grad():
            loop.model(x)  # a forward without autograd: not a pass, nothing asked

    model = _net()
    loop = hookfit.Loop(step, _data(), val_step=lambda loop, b: loop.model(b[0]).sum(), val_data=_data(1),
                        model=model, plugins=[Distributed(), plugin, Count()])
    assert loop.fit().status == "completed"
    assert plugin.asked == [(step, n) for step in range(3) for n in (0, 1)]  # validation asks nothing
    assert per_pass == [0, 1] * 3


def test_fsdp_asks_before_every_training_pass_and_keeps_the_unsynchronised_gradients_inside(group: Any) -> None:
    """FSDP2 reads its flag in the backward pass: the first pass, answered False, leaves no
    gradient on the sharded parameters; the second reduce-scatters both passes' sum."""
    plugin = TwoPasses()
    grads: list[list[bool]] = []
    plain = _net()

    def step(loop: Any, batch: Any) -> None:
        x, y = batch
        for _ in range(2):
            loop.backward(torch.nn.functional.mse_loss(loop.model(x), y))
            grads.append([p.grad is not None for p in loop.model.parameters()])
            torch.nn.functional.mse_loss(plain(x), y).backward()  # the same two passes, unsharded
        for mine, theirs in zip(loop.model.parameters(), plain.parameters()):
            torch.testing.assert_close(mine.grad.full_tensor(), theirs.grad, rtol=1e-6, atol=1e-7)
            mine.grad, theirs.grad = None, None

    loop = hookfit.Loop(step, _data(), model=_net(), plugins=[Distributed(strategy="fsdp"), plugin])
    assert loop.fit().status == "completed"
    assert plugin.asked == [(step, n) for step in range(3) for n in (0, 1)]
    assert grads == [[False] * 4, [True] * 4] * 3


def test_a_run_without_a_data_parallel_module_asks_nothing(group: Any) -> None:
    plugin = TwoPasses()
    model = _net()

    def step(loop: Any, batch: Any) -> None:
        loop.backward(torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1]))

    state = hookfit.Loop(step, _data(), model=model, plugins=[Distributed(wrap_model=False), plugin]).fit()
    assert state.status == "completed" and plugin.asked == []
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_the_agreed_stop_names_each_asker_once_and_the_ranks_apart() -> None:
    budget = StopRequest("time budget spent", "time_budget", True)
    request = agreed([budget, budget])
    assert (request.reason, request.by, request.ranks, request.complete) == (
        "stop requested on ranks 0, 1: time budget spent", "time_budget", (0, 1), True)
    request = agreed([None, StopRequest("SIGTERM", "interrupter", False, ends_process=True), None, budget, budget, budget, None, budget])
    assert request.reason == "stop requested on rank 1: SIGTERM; stop requested on ranks 3-5, 7: time budget spent"
    assert (request.by, request.ranks, request.complete) == ("interrupter, time_budget", (1, 3, 4, 5, 7), False)
    assert request.ends_process and not agreed([budget, budget]).ends_process  # one rank's process ends: no hold
    assert agreed([None, StopRequest("enough", None, False)]).by is None


def test_the_agreed_request_is_the_run_s_stop_request(group: Any) -> None:
    def step(loop: Any, batch: Any) -> None:
        if loop.state.batch_idx == 1:
            loop.request_stop("enough", by="the test")

    loop = hookfit.Loop(step, _data(), model=_net(), plugins=[Distributed()])
    state = loop.fit()
    request = loop.run.stop_requested
    assert (state.stop_reason, state.stopped_by) == ("stop requested on rank 0: enough", "the test")
    assert (request.reason, request.by, request.ranks) == (state.stop_reason, "the test", (0,))


@pytest.mark.bad_input
def test_a_validation_set_smaller_than_the_processes_is_refused_naming_it() -> None:
    """Several validation sets, one of hookfit.data.Batches with fewer samples than processes:
    refused at configure on every rank (the numbers are the same everywhere), naming the set.
    Rank 1 had no batch of it, and the ranks' collectives at the validation's end no longer
    matched: gloo aborted both processes ("Received data size doesn't match expected size")."""
    from hookfit.data import Batches

    plugin = Distributed()
    plugin.world_size = 2
    sets = {"a": Batches(torch.zeros(10, 2), batch_size=4), "b": Batches(torch.zeros(1, 2), batch_size=4)}
    for rank in (0, 1):
        plugin.rank = rank
        with pytest.raises(ValueError, match=r"^distributed: val_data\['b'\] has 1 samples, fewer than the 2 "
                                             r"processes; every process needs at least one batch$"):
            plugin._sharded(sets, "val_data", even=False)
    parts = plugin._sharded({"a": sets["a"], "b": Batches(torch.zeros(2, 2), batch_size=4)}, "val_data", even=False)
    assert [len(part) for part in parts.values()] == [2, 1]  # rank 1's: 5 samples of a, 1 of b
    # training data stays even: a sample too few is repeated, as before
    assert len(plugin._sharded(sets["b"], "train_data", even=True)) == 1


# -- real processes --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``dist_runs.py`` under torchrun, two processes, once: what each rank wrote and said."""
    folder = tmp_path_factory.mktemp("job")
    launch = ["--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--tee", "3"]
    env = _env()  # console, metrics and its log, the interrupter
    done = subprocess.run([*_torchrun(), *launch, str(SCRIPT), "out"], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = [json.loads((folder / f"out.rank{r}.json").read_text()) for r in (0, 1)]
    return {"ranks": ranks, "out": done.stdout, "err": done.stderr, "folder": folder}


@pytest.mark.slow
def test_a_two_pass_optimizer_keeps_its_first_pass_free_of_all_reduces(job: dict[str, Any]) -> None:
    """Sharpness-Aware Minimization replacing optim: the step's pass answered False, the
    closure's True. The first pass all-reduces nothing (its gradients differ between the
    ranks), the second once (one bucket), after which they agree, and so do the weights."""
    first = [rank["first"] for rank in job["ranks"]]
    for record in first:
        assert record["status"] == "completed"
        assert [(b["first"]["allreduces"], b["second"]["allreduces"]) for b in record["batches"]] == [(0, 1)] * 6
    for zero, one in zip(first[0]["batches"], first[1]["batches"]):
        assert zero["first"]["grads"] != one["first"]["grads"]  # each rank's own
        assert zero["second"]["grads"] == one["second"]["grads"]  # averaged over the ranks
    assert first[0]["params"] == first[1]["params"]
    for record in first:  # asked before each pass, not once per batch
        assert record["asked"] == [[step, closure] for step in range(6) for closure in (False, True)]


@pytest.mark.slow
def test_a_stop_every_rank_asks_for_is_by_the_plugin_with_the_ranks_apart(job: dict[str, Any]) -> None:
    reason = "stop requested on ranks 0, 1: time budget spent"
    for rank in job["ranks"]:
        assert rank["second"] == {"status": "interrupted", "step": 3, "reason": reason, "by": "time_budget",
                                  "ranks": [0, 1], "request_by": "time_budget"}
    ends = [line for line in job["out"].splitlines() if " end status=interrupted" in line]
    assert len(ends) == 1 and ends[0].startswith("[default0]:hookfit end ")  # rank 0 alone prints
    assert f'reason="{reason}" by="time_budget" ' in ends[0]
    logs = list((job["folder"] / "out.run2").glob("**/metrics.jsonl"))
    assert len(logs) == 1, logs  # rank 0 alone writes it
    end = json.loads(logs[0].read_text().splitlines()[-1])
    assert (end["event"], end["reason"], end["by"]) == ("end", reason, "time_budget")


@pytest.mark.slow
def test_a_loop_after_a_loop_in_one_job_reuses_the_process_group(job: dict[str, Any]) -> None:
    """fit, fit again, then validate a test set on a new Loop: the group made by the first run
    is kept (re-creating it failed with gloo's "Connection refused") and destroyed by
    shutdown(), its threads with it."""
    for rank, record in enumerate(job["ranks"]):
        assert record["first"]["group_kept"] is True
        assert record["third"]["status"] == "completed"
        assert record["third"]["events"][0] == ["fit_start", rank]
        assert record["shutdown"] is True
        assert record["after_shutdown"] == {"initialized": False, "gloo_threads": []}
    assert "Connection refused" not in job["err"]


@pytest.mark.slow
def test_an_evaluation_runs_whatever_training_data_each_process_holds(job: dict[str, Any]) -> None:
    """Data each process shards itself, 2 training batches on rank 0 and 3 on rank 1:
    Loop.validate() reads no training data, so it runs (it was refused as a fit is)."""
    assert [record["uneven_validate"] for record in job["ranks"]] == ["completed", "completed"]


@pytest.mark.bad_input
@pytest.mark.parametrize("mode", ["fit", "validate"])
def test_training_data_of_other_lengths_per_process_is_refused_in_a_fit(
        mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lengths every process has, as the all_gather at configure brings them (rank 1 has a
    training batch more): a fit is refused on every rank, naming each one's length (the ranks'
    collectives would not match); an evaluation reads no training data and is not."""
    import hookfit.plugins.distributed.plugin as module

    class Gathered:  # the lengths of rank 0 and rank 1, whatever this process holds
        @staticmethod
        def all_gather(everyone: list[torch.Tensor], mine: torch.Tensor, group: Any = None) -> None:
            for rank, tensor in enumerate(everyone):
                tensor.copy_(torch.tensor([2 + rank, 1]))

    monkeypatch.setattr(module, "_dist", lambda: Gathered)
    plugin = Distributed()
    plugin.world_size, plugin._control = 2, None
    loop = type("Run", (), {"mode": mode, "train_data": [0, 1], "val_data": [0]})()
    if mode == "validate":
        plugin._check_lengths(loop)  # type: ignore[arg-type]
        return
    with pytest.raises(ValueError, match=r"^distributed: the processes have different numbers of train_data "
                                         r"batches per epoch \(rank 0: 2, rank 1: 3\); every rank must run the same"):
        plugin._check_lengths(loop)  # type: ignore[arg-type]


@pytest.mark.bad_input
def test_plugins_taking_part_on_some_processes_only_are_refused_naming_them() -> None:
    """Each rank's plugins as the all_gather at configure brings them: rank 0 runs a checkpoint and an EMA the
    other does not, rank 1 a plugin of its own (their collectives would not match: a hang). Observers are left
    out: they run on rank 0 alone by design."""
    from hookfit.plugins.distributed.agreement import check_plugins

    class Gathered:  # the torch.distributed module, as check_plugins calls it
        @staticmethod
        def all_gather_object(everyone: list[Any], mine: Any, group: Any = None) -> None:
            everyone[:] = [["checkpoint", "ema", "optim"], ["mine", "optim"]]

    class Observer:
        observer = True

    pm = type("PM", (), {"list_name_plugin": staticmethod(lambda: [("optim", object()), ("tui", Observer())])})
    loop = type("Run", (), {"pm": pm})()
    with pytest.raises(ValueError, match=r"^distributed: the processes run different plugins \('checkpoint' on rank "
                                         r"0 only; 'ema' on rank 0 only; 'mine' on rank 1 only\); give every process "
                                         r"the same plugins \(observers aside: a plugin that only watches, a logger of yours, says "
                                         r"observer = True in its class\)"):
        check_plugins(loop, Gathered, 2, None)  # type: ignore[arg-type]
    seen: list[Any] = []

    def alike(everyone: list[Any], mine: Any, group: Any = None) -> None:
        seen.append(mine)
        everyone[:] = [mine, ["optim"]]

    Gathered.all_gather_object = staticmethod(alike)  # type: ignore[method-assign]
    check_plugins(loop, Gathered, 2, None)  # type: ignore[arg-type]
    assert seen == [["optim"]]  # its own plugins, the observer left out: the same as rank 1's, accepted
    Gathered.all_gather_object = staticmethod(  # type: ignore[method-assign]
        lambda everyone, mine, group=None: everyone.__setitem__(slice(None), [["ema", "optim"], ["optim", "ema"]]))
    with pytest.raises(ValueError, match=r"^distributed: the processes run different plugins \(the same plugins in "
                                         r"other orders: rank 0: ema, optim; rank 1: optim, ema\)"):
        check_plugins(loop, Gathered, 2, None)  # type: ignore[arg-type]  # (their hooks, so their collectives, in other orders)


@pytest.mark.slow
@pytest.mark.fault
def test_a_stream_one_process_runs_out_of_first_fails_there_naming_its_batches(tmp_path: Path) -> None:
    """Streams each process reads itself (shard_data=False, no length). As many training batches on every rank:
    two epochs complete, with validation streams of 2 and 5 batches (no collective per validation batch; the
    metrics summed at its end; DDP broadcasts the model's buffers at the first forward). Rank 1's two training
    batches short: rank 1, whose stream ran out, fails naming its count and the rank that went on; rank 0, left
    in its next batch's collectives, fails naming rank 1's error, and neither process is aborted."""
    launch = ["--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    done = subprocess.run([*_torchrun(), *launch, str(SCRIPT), "out", "uneven"], cwd=tmp_path, capture_output=True,
                          env=_env(HOOKFIT_PLUGINS="distributed,optim,metrics"), text=True, timeout=240)
    seen = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("out.uneven*.json"))]
    assert len(seen) == 2, done.stderr[-3000:]  # neither process aborted
    assert [s["even"] for s in seen] == [{"error": None, "status": "completed", "step": 6}] * 2
    said = ("ValueError: distributed: train_data, a stream each process reads itself (shard_data=False, no length), "
            "ran out on rank 1 after 4 batches in epoch 1, but rank(s) 0 had not run out 5 s later (the collective "
            "timeout, 10 s (HOOKFIT_DIST_TIMEOUT or Distributed(timeout=...)), less the time this process has to say "
            "so): they probably went on to another batch")
    zero, one = (s["uneven"] for s in seen)
    assert one["error"].startswith(said), one
    assert "every process must give as many batches an epoch" in one["error"]
    assert any("because rank 1 of 2 failed first: " + said in note for note in zero["notes"]), zero["notes"]


@pytest.mark.slow
@pytest.mark.fault
def test_a_stream_that_raises_as_it_runs_out_fails_its_peer_naming_that_error(tmp_path: Path) -> None:
    """Rank 1's stream (shard_data=False, no length) raises as it runs out, after the epoch's last collective,
    while rank 0, whose stream ran out at the same batch, waits in the store for rank 1's to end: rank 0 stops
    waiting when rank 1 records its failure, naming rank 1 and its OSError, instead of waiting out the collective
    timeout (60 s) and blaming rank 1 for going on to another batch."""
    launch = ["--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    done = subprocess.run([*_torchrun(), *launch, str(SCRIPT), "out", "raising"], cwd=tmp_path, capture_output=True,
                          env=_env(HOOKFIT_PLUGINS="distributed,optim"), text=True, timeout=240)
    seen = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("out.raising*.json"))]
    assert len(seen) == 2, done.stderr[-3000:]
    zero, one = seen
    assert one["error"] == "OSError: shard file truncated", one
    assert zero["error"].startswith("PeerFailed: distributed: rank 0 stopped waiting for the other ranks' training "
                                    "streams to run out in epoch 1 (its own ran out after 3 batches)"), zero
    assert any("failed on rank 0 of 2 because rank 1 of 2 failed first: OSError: shard file truncated" in note
               for note in zero["notes"]), zero["notes"]
    assert "hookfit distributed: rank 0 of 2 stopped: a wait for the other ranks failed: rank 1 of 2 failed first: " \
           "OSError: shard file truncated" in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
def test_observers_run_on_rank_0_unless_they_ask_for_every_rank(job: dict[str, Any]) -> None:
    zero, one = (rank["first"] for rank in job["ranks"])
    assert [event[0] for event in zero["plain"]] == [event[0] for event in zero["every_rank"]] == [
        "fit_start", *["epoch_metrics"] * 4, "fit_end"]
    assert one["plain"] == []  # unregistered on rank 1: not even fit_start
    assert [event[0] for event in one["every_rank"]] == [event[0] for event in zero["every_rank"]]
    assert one["every_rank"][0] == ["fit_start", 1]
    # the metrics are global: rank 1's observer gets the numbers rank 0's does
    assert one["every_rank"][1:] == zero["every_rank"][1:]


@pytest.mark.slow
def test_the_group_hookfit_made_is_destroyed_at_exit(tmp_path: Path) -> None:
    """A one-process job started as torchrun starts it (its environment), one run, no
    shutdown(): an atexit handler registered before hookfit's sees the group gone."""
    env = _env(HOOKFIT_PLUGINS="distributed,optim", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    done = subprocess.run([sys.executable, str(SCRIPT), "out", "exit"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = json.loads((tmp_path / "out.exit.json").read_text())
    assert seen == {"status": "completed", "world_size": 1, "initialized_after_fit": True,
                    "initialized_at_exit": False}
