"""checkpoint writer: staging buffers reused across saves and made again when a tensor
changes, the policy for a save asked while one write is in flight and another waits, the
training thread never waiting for an earlier write, failures of the last write reported at
the run's end."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint, CheckpointWarning, read
from hookfit.plugins.checkpoint import plugin as checkpoint_plugin
from hookfit.plugins.checkpoint.staging import Staging
from hookfit.plugins.checkpoint.writer import Done, Writer, write_file

from conftest import resumable_run as train

WAIT = 60.0  # seconds a test waits for a condition before it fails


def until(condition: Any, what: str) -> None:
    """Wait for ``condition()`` to hold (a state another thread reaches), failing after WAIT."""
    deadline = time.monotonic() + WAIT
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


class Held:
    """A save function for a Writer that records what it was given and holds its first write
    until :attr:`release` is set."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.seen: list[tuple[Path, dict[str, Any], dict[str, torch.Tensor]]] = []

    def __call__(self, state: dict[str, Any], path: Path, between: Any = None) -> None:
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(WAIT), "the test never released the writer"
        values = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
        self.seen.append((path, state, values))  # the staged tensors themselves are kept alive


def state(value: float, n: int = 1000) -> dict[str, Any]:
    return {"w": torch.full((n,), value), "b": torch.full((3,), value, dtype=torch.float64), "step": int(value)}


def remove(path: Path) -> None:
    path.unlink()


# -- staging buffers ------------------------------------------------------------------------


def test_staging_buffers_are_reused_across_saves_and_made_again_when_a_shape_or_dtype_changes() -> None:
    held = Held()
    held.release.set()
    writer = Writer(held, remove)
    sources = [state(1.0), state(2.0), {**state(3.0), "b": torch.zeros(5, dtype=torch.float64)},
               {**state(4.0), "w": torch.zeros(1000, dtype=torch.float16)}]
    for i, source in enumerate(sources):
        assert writer.submit(source, Path(f"f{i}"), i)
        writer.wait()  # the next save finds the first buffers free
    writer.close()
    first, second, reshaped, retyped = (staged for _, staged, _ in held.seen)
    assert first["w"].data_ptr() == second["w"].data_ptr() and first["b"].data_ptr() == second["b"].data_ptr()
    assert first["w"].data_ptr() != sources[0]["w"].data_ptr()  # a copy, not the training's tensor
    assert reshaped["w"].data_ptr() == first["w"].data_ptr() and reshaped["b"].data_ptr() != first["b"].data_ptr()
    assert retyped["w"].data_ptr() != first["w"].data_ptr() and retyped["w"].dtype == torch.float16
    assert [values["w"][0].item() for _, _, values in held.seen] == [1.0, 2.0, 3.0, 0.0]
    assert [staged["step"] for _, staged, _ in held.seen] == [1, 2, 3, 4]


def test_a_staging_copies_plain_tensors_into_its_buffers_and_clones_the_others() -> None:
    staging = Staging()
    sparse = torch.eye(3).to_sparse()
    source = {"a": [torch.arange(4.0), (torch.ones(2, 2).t(),)], "s": sparse, "n": None}
    staged = staging.stage(source)
    assert torch.equal(staged["a"][0], source["a"][0]) and torch.equal(staged["a"][1][0], source["a"][1][0])
    assert isinstance(staged["a"][1], tuple) and staged["n"] is None
    assert [t.data_ptr() for t in staging.tensors] == [staged["a"][0].data_ptr(), staged["a"][1][0].data_ptr()]
    assert staged["s"].is_sparse and torch.equal(staged["s"].to_dense(), torch.eye(3))
    assert staging.nbytes == 4 * 4 + 4 * 4
    source["a"][0].add_(1)  # training goes on: the staged copy stays
    assert torch.equal(staged["a"][0], torch.arange(4.0))


def test_a_run_holds_at_most_two_copies_of_its_state_whatever_the_number_of_saves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every staged tensor a write was given is kept alive here: the buffers are reused, so
    all of them share at most two storages per tensor of the state."""
    given: list[dict[str, Any]] = []

    def recording(state: dict[str, Any], path: Path, between: Any) -> None:
        given.append(state)
        write_file(state, path, between)

    monkeypatch.setattr(checkpoint_plugin, "write_file", recording)
    ckpt = Checkpoint(every_n_steps=1, keep_last=2)
    train(tmp_path, checkpoint=ckpt, epochs=2)
    assert len(given) == 14  # every step (an epoch's end is a step saved already: written once)
    for key in given[0]["model"]:
        assert len({state["model"][key].data_ptr() for state in given}) <= 2, key
    assert read(ckpt.last)["loop"]["step"] == 14



class Settle:
    """Waits, before each batch, for the checkpoint writer to finish every write asked (so each
    save finds the first snapshot's buffers free)."""

    name = "settle"

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt

    @hookfit.hookimpl
    def batch_start(self) -> None:
        self.ckpt.writer.wait()


def test_in_a_run_a_tensor_that_changes_shape_gets_a_new_buffer_and_the_others_keep_their_storage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model's buffer grows from 2 to 5 values after the 3rd step: the saves after it copy it
    into a buffer of the new shape, made once and reused; the weight and bias are copied into
    the same storages at every save; each file holds the values of its step."""
    given: list[dict[str, Any]] = []

    def recording(state: dict[str, Any], path: Path, between: Any) -> None:
        given.append(state)  # kept alive: a storage let go could be reused by another buffer
        write_file(state, path, between)

    monkeypatch.setattr(checkpoint_plugin, "write_file", recording)
    ckpt = Checkpoint(every_n_epochs=None, every_n_steps=1, keep_last=100)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    model.register_buffer("seen", torch.zeros(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(loop: Any, batch: torch.Tensor) -> None:
        if loop.state.step == 3:
            model.seen = torch.zeros(5)  # (a registered buffer replaced: it stays in the state dict)
        model.seen.add_(1)
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    hookfit.Loop(step, [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(6)],
                 model=model, optimizers=optimizer, run_dir=tmp_path, plugins=[ckpt, Settle(ckpt)]).fit()
    assert len(given) == 6

    def storages(key: str) -> list[int]:
        return [state["model"][key].untyped_storage().data_ptr() for state in given]

    assert len(set(storages("weight"))) == 1 and len(set(storages("bias"))) == 1
    seen = storages("seen")
    assert len(set(seen[:3])) == 1 and len(set(seen[3:])) == 1 and seen[0] != seen[3]
    assert [read(p)["model"]["seen"].tolist() for p in ckpt.saved] == [[1.0] * 2, [2.0] * 2, [3.0] * 2,
                                                                       [1.0] * 5, [2.0] * 5, [3.0] * 5]
    assert torch.equal(read(ckpt.saved[-1])["model"]["weight"], model.weight.detach())


# -- a save asked while one write is in flight and another waits -----------------------------


def test_with_when_busy_skip_a_save_asked_while_both_snapshots_are_taken_is_skipped_and_counted() -> None:
    held = Held()
    writer = Writer(held, remove, when_busy="skip")
    assert writer.submit(state(1.0), Path("a"), "a")
    held.entered.wait(WAIT)  # the first is being written
    assert writer.submit(state(2.0), Path("b"), "b")  # waits its turn, staged
    assert writer.pending == 2
    assert not writer.submit(state(3.0), Path("c"), "c")  # both taken: skipped
    assert writer.skipped == 1
    held.release.set()
    writer.close()
    assert [(o.path, o.tag, o.error) for o in writer.outcomes() if isinstance(o, Done)] == [
        (Path("a"), "a", None), (Path("b"), "b", None)]
    assert [values["w"][0].item() for _, _, values in held.seen] == [1.0, 2.0]


@pytest.mark.parametrize("policy,must", [("wait", False), ("skip", True)])
def test_a_save_that_waits_for_a_snapshot_is_written_once_the_write_in_flight_ends(policy: str, must: bool) -> None:
    """``when_busy="wait"``, or a save that must not be lost: it returns only once the write
    in flight has ended, and what it asked is written, as it was when it was asked."""
    held = Held()
    writer = Writer(held, remove, when_busy=policy)
    writer.submit(state(1.0), Path("a"), "a")
    held.entered.wait(WAIT)
    writer.submit(state(2.0), Path("b"), "b")
    third = state(3.0)
    returned: list[int] = []
    asked = threading.Thread(target=lambda: returned.append(writer.submit(third, Path("c"), "c", must=must)))
    asked.start()
    until(lambda: writer.waiting == 1, "the third save to wait for a snapshot")
    assert not returned and len(held.seen) == 0  # still waiting: the first write is held
    third["w"].fill_(9.0)  # changed after it was asked, before it was copied: the copy is of now
    held.release.set()
    asked.join(WAIT)
    assert returned == [True] and writer.skipped == 0
    writer.close()
    assert [path.name for path, _, _ in held.seen] == ["a", "b", "c"]
    assert [values["w"][0].item() for _, _, values in held.seen] == [1.0, 2.0, 9.0]


def test_a_writer_without_background_writes_on_the_callers_thread() -> None:
    threads: list[str] = []
    writer = Writer(lambda s, p, b: threads.append(threading.current_thread().name), remove, background=False)
    writer.submit(state(1.0), Path("a"), "a")
    assert threads == [threading.current_thread().name] and [o.tag for o in writer.outcomes()] == ["a"]


@pytest.mark.fault
def test_an_error_outside_the_save_function_is_told_back_and_the_writer_thread_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer's thread finishing a snapshot's copy (a device's copy: Staging.ready) or
    removing a file met an error that is not an OSError: it ended the thread, and every later
    save and the run's end waited for it forever."""
    held = Held()
    held.release.set()

    def refuse(path: Path) -> None:
        raise ValueError(f"cannot remove {path.name}")

    def fail(self: Staging) -> None:
        raise RuntimeError("copy failed")

    writer = Writer(held, refuse)
    real_ready = Staging.ready
    monkeypatch.setattr(Staging, "ready", fail)
    writer.submit(state(1.0), Path("a"), "a")
    writer.remove([Path("old")])
    waiter = threading.Thread(target=writer.wait, daemon=True)
    waiter.start()
    waiter.join(WAIT)
    assert not waiter.is_alive(), "the writer's thread died: wait() never returned"
    told = writer.outcomes()
    assert [(o.path.name, type(o.error).__name__, str(o.error)) for o in told] == [
        ("a", "RuntimeError", "copy failed"), ("old", "ValueError", "cannot remove old")]
    monkeypatch.setattr(Staging, "ready", real_ready)
    writer.submit(state(2.0), Path("b"), "b")  # the same thread writes the next save
    writer.wait()
    assert [path.name for path, _, _ in held.seen] == ["b"] and [o.tag for o in writer.outcomes()] == ["b"]
    writer.close()


@pytest.mark.parametrize("background", [True, False])
def test_a_held_snapshot_is_a_copy_written_when_released_and_a_dropped_one_frees_its_buffers(
        background: bool) -> None:
    """A save whose metric is known only later (a validation that follows it): the state is
    copied at once, the run may change its tensors meanwhile, and the copy is written, with
    its plain values changed, or let go."""
    held = Held()
    held.release.set()
    writer = Writer(held, remove, background=background)
    source = state(1.0)
    snapshot = writer.hold(source)
    assert snapshot is not None and writer.pending == 1 and not held.seen
    source["w"].fill_(5.0)  # training goes on: the copy keeps what was held
    snapshot.state["step"] = 7
    writer.release(snapshot, Path("a"), "a")
    writer.wait()
    assert [(path.name, seen["step"], values["w"].unique().tolist()) for path, seen, values in held.seen] == [
        ("a", 7, [1.0])]
    assert source["step"] == 1 and [o.tag for o in writer.outcomes()] == ["a"] and writer.pending == 0
    dropped = writer.hold(state(2.0))
    assert dropped is not None and writer.pending == 1
    writer.drop(dropped)
    assert writer.pending == 0 and len(held.seen) == 1
    writer.close()


def test_the_writer_waits_while_the_training_thread_copies_and_goes_on_when_it_is_waited_for() -> None:
    order: list[str] = []
    started = threading.Event()

    def save(state: dict[str, Any], path: Path, between: Any) -> None:
        order.append(f"{path} started")
        started.set()
        between()
        order.append(f"{path} piece")

    writer = Writer(save, remove)
    with writer.aside():  # as Checkpoint.save builds and copies a snapshot
        writer.submit(state(1.0), Path("a"), "a")
        # a negative cannot be waited for: a writer that did not wait would have started by now
        assert not started.wait(0.2)
        order.append("copied")
    writer.wait()
    assert order == ["copied", "a started", "a piece"]
    with writer.aside():
        writer.submit(state(2.0), Path("b"), "b")
        writer.wait()  # (a save that waits for the writer, a sharded save): it goes on, no deadlock
        order.append("waited")
    assert order[3:] == ["b started", "b piece", "waited"]
    writer.close()


# -- the plugin: training never waits for an earlier write -----------------------------------


class Release:
    """Runs ``action`` in ``batch_end`` of the ``at``-th batch."""

    name = "release"

    def __init__(self, at: int, action: Any) -> None:
        self.at, self.action, self.n = at, action, 0

    @hookfit.hookimpl
    def batch_end(self) -> None:
        self.n += 1
        if self.n == self.at:
            self.action()


def _held_checkpoint(monkeypatch: pytest.MonkeyPatch, **options: Any) -> tuple[Checkpoint, Held]:
    held = Held()

    def save(state: dict[str, Any], path: Path, between: Any) -> None:
        held(state, path)
        write_file(state, path, between)

    monkeypatch.setattr(checkpoint_plugin, "write_file", save)
    return Checkpoint(every_n_epochs=None, every_n_steps=1, keep_last=100, **options), held


def test_training_goes_on_while_a_write_is_held_and_a_save_asked_then_is_skipped_with_skip(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first write is held until the 4th batch: the 2nd batch's save is staged, the 3rd's
    skipped, the run never waits; released (and written) before the 4th's save."""
    ckpt, held = _held_checkpoint(monkeypatch, when_busy="skip")

    def release() -> None:
        held.release.set()
        ckpt.writer.wait()

    with pytest.warns(CheckpointWarning, match=r"save at step 3 was skipped.*when_busy='skip'.*skipped_saves"):
        loop, _, _ = train(tmp_path, checkpoint=ckpt, epochs=1, stop=5, extra=[Release(4, release)])
    assert loop.state.status == "interrupted" and ckpt.skipped_saves == 1
    assert [read(p)["loop"]["step"] for p in ckpt.saved] == [1, 2, 4, 5]


def test_with_wait_a_save_asked_while_both_snapshots_are_taken_waits_and_every_save_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt, held = _held_checkpoint(monkeypatch)  # when_busy="wait", the default
    releaser = threading.Thread(target=lambda: (until(lambda: ckpt.writer.waiting == 1, "a waiting save"),
                                                held.release.set()))
    releaser.start()
    train(tmp_path, checkpoint=ckpt, epochs=1, stop=4)
    releaser.join(WAIT)
    assert ckpt.skipped_saves == 0 and [read(p)["loop"]["step"] for p in ckpt.saved] == [1, 2, 3, 4]


# -- the run's end waits for the last write and reports its failure --------------------------


@pytest.mark.fault
@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_the_last_writes_failure_is_reported_at_the_runs_end_as_configured(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    def full(state: dict[str, Any], path: Path, between: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(checkpoint_plugin, "write_file", full)
    ckpt = Checkpoint(on_save_error=policy)  # a background save at the end of the only epoch
    if policy == "raise":
        with pytest.raises(OSError, match="No space left on device"):
            train(tmp_path, checkpoint=ckpt, epochs=1)
    else:
        with pytest.warns(CheckpointWarning, match=r"could not write .*epoch0001-step000000007.pt.*No space left"):
            loop, _, _ = train(tmp_path, checkpoint=ckpt, epochs=1)
        assert loop.state.status == "completed"
    assert ckpt.failed_saves == 1 and ckpt.saved == [] and ckpt.last is None



def _failing_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint's first write fails once its temporary file is started (the disk is
    full then, not later)."""
    writes = [0]

    def save(state: dict[str, Any], path: Path, between: Any) -> None:
        writes[0] += 1
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")

        def full() -> None:
            between()
            if writes[0] == 1 and temporary.exists():
                raise OSError(errno.ENOSPC, "No space left on device", str(path))

        write_file(state, path, full)

    monkeypatch.setattr(checkpoint_plugin, "write_file", save)


class WaitFor(Settle):
    """Waits, before the ``at``-th batch, for the checkpoint writer to finish every write
    asked (its outcomes told); counts the batches started."""

    def __init__(self, ckpt: Checkpoint, at: int) -> None:
        super().__init__(ckpt)
        self.at, self.started = at, 0

    @hookfit.hookimpl
    def batch_start(self) -> None:
        self.started += 1
        if self.started == self.at:
            self.ckpt.writer.wait()


@pytest.mark.fault
def test_with_warn_a_failed_background_write_leaves_no_file_and_the_next_saves_are_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _failing_once(monkeypatch)
    ckpt = Checkpoint(every_n_epochs=None, every_n_steps=2, keep_last=100)
    with pytest.warns(CheckpointWarning, match=r"could not write .*step000000002.pt.*No space left") as caught:
        loop, _, _ = train(tmp_path, checkpoint=ckpt, epochs=1)
    assert loop.state.status == "completed" and ckpt.failed_saves == 1
    assert len([w for w in caught if w.category is CheckpointWarning]) == 1
    assert [read(p)["loop"]["step"] for p in ckpt.saved] == [4, 6, 7]  # (7: the run's end)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [p.name for p in ckpt.saved]  # no .tmp


@pytest.mark.fault
def test_a_failed_background_writes_warning_names_the_saves_step_and_the_step_its_failure_was_found_at(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The save at step 2 fails while the 3rd batch waits for it; the warning comes after that
    batch, and run.jsonl records it at step 3, where it was shown: its text says which save it
    was, so ``hookfit show``'s line is not read as a failure of step 3's."""
    from hookfit.plugins.tui.replay import recorded_warnings

    _failing_once(monkeypatch)
    ckpt = Checkpoint(every_n_epochs=None, every_n_steps=2, keep_last=100)
    which = "step000000002.pt, the save at step 2 (written in the background, its failure found at step 3) ("
    with pytest.warns(CheckpointWarning, match="could not write ") as caught:
        train(tmp_path, checkpoint=ckpt, epochs=1, extra=[WaitFor(ckpt, 3)])
    (warned,) = [str(w.message) for w in caught if w.category is CheckpointWarning]
    assert which in warned, warned
    lines = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    (line,) = [line for line in lines if line["event"] == "warning" and "could not write" in line["message"]]
    assert line["step"] == 3 and which in line["message"]
    (shown,) = [text for text in recorded_warnings(tmp_path) if "could not write" in text]
    assert which in shown and shown.endswith("training goes on (step 3)"), shown


@pytest.mark.fault
def test_with_raise_a_failed_background_write_stops_training_at_the_first_batch_after_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The save at step 2 fails while the 3rd batch waits for it: the error is raised on the
    training thread after that batch, not at the run's end; no file is left."""
    _failing_once(monkeypatch)
    ckpt = Checkpoint(every_n_epochs=None, every_n_steps=2, on_save_error="raise")
    waiter = WaitFor(ckpt, 3)
    with pytest.raises(OSError, match="No space left on device"):
        train(tmp_path, checkpoint=ckpt, epochs=2, extra=[waiter])
    assert waiter.started == 3 and ckpt.failed_saves == 1 and ckpt.saved == []
    assert list((tmp_path / "checkpoints").iterdir()) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_device_the_state_is_staged_in_pinned_host_memory_with_no_copy_on_the_device() -> None:
    device = torch.device("cuda")
    weights = {"w": torch.randn(1 << 20, device=device), "s": torch.tensor(3, device=device)}
    staging = Staging()
    staging.stage(weights)  # the first: buffers made
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    staged = staging.stage(weights)
    weights["w"].add_(1.0)  # queued after the copy: the copy holds the values before
    staging.ready()
    assert torch.cuda.max_memory_allocated() == before  # nothing allocated on the device
    assert staged["w"].device.type == "cpu" and staged["w"].is_pinned()
    assert torch.equal(staged["w"], (weights["w"] - 1.0).cpu()) and staged["s"].item() == 3
