"""Data without a length and data that gives its batches once.

Streams resume exactly: a ``DataLoader`` over an ``IterableDataset`` with 0 and 2 workers, a
generator factory, torchdata's ``StatefulDataLoader`` over an ``IterableDataset`` that keeps its
position, and Hugging Face streaming datasets, each trained in its own process, stopped from
outside after a checkpoint (``kill -9``, or SIGTERM for a graceful stop), resumed with
``resume="latest"`` and ended bitwise equal to an uninterrupted run. A stream whose order cannot
be rebuilt says so once at the resume. A one-pass iterator given for several epochs or
validations is refused when the ``Loop`` is built, naming the data and what to pass instead.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import hookfit
from hookfit.data import one_pass, tell_epoch
from hookfit.order import unrebuilt_order

from conftest import TESTS, mse_step, run_script_here, saved_run
import warm

CHILD = TESTS / "scripts" / "streaming_child.py"
STEPS = 36  # 3 epochs of 12 batches
DEADLINE = 120.0  # seconds for a child to reach its marker; generous, the machine may be busy


def _env(tmp_path: Path) -> dict[str, str]:
    """The test's environment, with Hugging Face kept offline and its cache in ``tmp_path``."""
    return {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def _run(tmp_path: Path, name: str, *options: str) -> dict:
    """A whole run of the child (fresh, or ``--resume``); what it wrote to its OUT."""
    out = tmp_path / f"{name}.pt"
    done = warm.run([sys.executable, str(CHILD), str(tmp_path / name.split("-")[0]), str(out), *options],
                    capture_output=True, text=True, timeout=300, env=_env(tmp_path))
    assert done.returncode == 0, done.stderr
    return torch.load(out, weights_only=True)


def _interrupt(tmp_path: Path, name: str, pause_at: int, signum: int, *options: str) -> subprocess.CompletedProcess:
    """The child started, signalled from here once its marker says the checkpoint of step
    ``pause_at`` is whole (it waits there), and waited for."""
    marker = tmp_path / f"{name}.marker"
    child = warm.Popen([sys.executable, str(CHILD), str(tmp_path / name), str(tmp_path / f"{name}.pt"),
                        *options, "--marker", str(marker), "--pause-at", str(pause_at)],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(tmp_path))
    try:
        end = time.monotonic() + DEADLINE
        while not marker.exists():
            if child.poll() is not None:
                raise AssertionError(f"the child exited {child.returncode} before its marker:\n{child.stderr.read()}")
            if time.monotonic() > end:
                raise AssertionError(f"no marker after {DEADLINE:g}s")
            time.sleep(0.05)
        assert int(marker.read_text()) == child.pid
        os.kill(child.pid, signum)
        stdout, stderr = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)


CASES = [
    pytest.param(("--data", "iterable", "--workers", "0"), signal.SIGKILL, id="iterable-0-workers-kill-9"),
    pytest.param(("--data", "iterable", "--workers", "2"), signal.SIGKILL, id="iterable-2-workers-kill-9"),
    pytest.param(("--data", "factory"), signal.SIGKILL, id="generator-factory-kill-9"),
    pytest.param(("--data", "factory"), signal.SIGTERM, id="generator-factory-sigterm"),
    pytest.param(("--data", "stateful", "--workers", "0"), signal.SIGKILL, id="stateful-0-workers-kill-9"),
    pytest.param(("--data", "stateful", "--workers", "2"), signal.SIGKILL, id="stateful-2-workers-kill-9"),
]


def _uninterrupted(tmp_path: Path, options: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> dict:
    """The uninterrupted run: in this process (a child would spend seconds importing torch),
    except over Hugging Face's streams, whose library reads its cache and offline settings once
    per process, when imported."""
    if options[1].startswith("hf"):
        return _run(tmp_path, "whole", *options)
    run_script_here(CHILD, str(tmp_path / "whole"), str(tmp_path / "whole.pt"), *options, monkeypatch=monkeypatch)
    return torch.load(tmp_path / "whole.pt", weights_only=True)


def _resumes_exactly(tmp_path: Path, options: tuple[str, ...], signum: int, monkeypatch: pytest.MonkeyPatch,
                     pause_at: int = 17) -> dict:
    whole = _uninterrupted(tmp_path, options, monkeypatch)
    assert (whole["status"], whole["step"]) == ("completed", STEPS)
    assert not whole["warnings"], whole["warnings"]
    epochs = [sorted(i for batch in whole["seen"][e * 12:(e + 1) * 12] for i in batch) for e in range(3)]
    assert all(ids == list(range(60)) for ids in epochs)  # every sample once an epoch
    if options[1] != "hf":  # (Hugging Face's unshuffled stream has one order)
        assert whole["seen"][:12] != whole["seen"][12:24]  # the stream was told the epoch: another order

    stopped = _interrupt(tmp_path, "run", pause_at, signum, *options)
    if signum == signal.SIGKILL:
        assert stopped.returncode == -signal.SIGKILL, stopped.stderr
        # the newest whole checkpoint: the one announced, or one of the two the writer may still hold
        # then (one write in flight, one snapshot staged), written in the background meanwhile
        possible = (pause_at, pause_at + 1, pause_at + 2)
    else:
        assert stopped.returncode == 0, stopped.stderr  # (the child's Interrupter(exit=False): it reports)
        assert torch.load(tmp_path / "run.pt", weights_only=True)["status"] == "interrupted"
        # stopped after the batch in progress as the announcement came (one to three steps on: the
        # announcement waits for the next batch's end), checkpointed there
        possible = (pause_at + 1, pause_at + 2, pause_at + 3)

    got = _run(tmp_path, "run-resumed", *options, "--resume")
    assert (got["status"], got["step"]) == ("completed", STEPS)
    done = STEPS - len(got["seen"])
    assert done in possible, (done, possible)
    assert got["resumed_from"].endswith(f"(epoch 2, after {done - 12} training batches, step {done})")
    assert got["seen"] == whole["seen"][done:]  # the batches the run had left, each once, in order
    assert not [w for w in got["warnings"] if "cannot be rebuilt" in w], got["warnings"]
    for key, value in whole["params"].items():
        assert torch.equal(got["params"][key], value), key
    return got


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.parametrize("options, signum", CASES)
def test_a_stream_stopped_mid_epoch_resumes_bitwise_equal(tmp_path: Path, options: tuple[str, ...],
                                                           signum: int, monkeypatch: pytest.MonkeyPatch) -> None:
    if "stateful" in options:
        pytest.importorskip("torchdata.stateful_dataloader")
    _resumes_exactly(tmp_path, options, signum, monkeypatch)


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.parametrize("options", [
    pytest.param(("--data", "hf"), id="hf-stream-by-its-state"),
    pytest.param(("--data", "hf-loader", "--workers", "0"), id="hf-shuffled-in-a-dataloader-by-skipping"),
])
def test_a_hugging_face_stream_killed_mid_epoch_resumes_bitwise_equal(tmp_path: Path, options: tuple[str, ...],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Hugging Face's ``IterableDataset`` given to the loop keeps its position in its own
    ``state_dict()``, which the run's state saves and restores (nothing is skipped twice);
    shuffled with a buffer inside a ``DataLoader`` it is told the epoch and skipped past."""
    pytest.importorskip("datasets")
    _resumes_exactly(tmp_path, options, signal.SIGKILL, monkeypatch)


# -- a stream whose order cannot be rebuilt -------------------------------------------------


class Resumer:
    """Puts the run mid-epoch, as a checkpoint plugin does."""

    name = "resumer"

    @hookfit.hookimpl
    def resume(self, loop, source):
        loop.load_state_dict(saved_run(0, 2, 2))
        return "ckpt.pt"


class OwnStream(IterableDataset):
    """A stream that draws its order from a generator of its own, never reseeded."""

    def __init__(self) -> None:
        self.rng = torch.Generator().manual_seed(0)

    def __iter__(self):
        return iter(torch.randperm(12, generator=self.rng).tolist())


class SeededStream(OwnStream):
    """The same, reseeded from the epoch: its iteration is a pure function of the epoch."""

    def set_epoch(self, epoch: int) -> None:
        self.rng.manual_seed(epoch)


def _fit(data) -> hookfit.State:
    return hookfit.Loop(lambda loop, batch: None, data, resume="latest", plugins=[Resumer()]).fit()


@pytest.mark.bad_input
def test_a_stream_with_a_generator_of_its_own_warns_once_at_resume_naming_it_and_what_to_use() -> None:
    with pytest.warns(hookfit.HookfitWarning) as caught:
        state = _fit(DataLoader(OwnStream(), batch_size=2))
    mine = [str(w.message) for w in caught if "cannot be rebuilt" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert "DataLoader over the OwnStream dataset, which draws from a random generator of its own (rng)" in mine[0]
    assert "torchdata's StatefulDataLoader over a dataset with state_dict()/load_state_dict()" in mine[0]
    assert "a dataset whose iteration is a pure function of the epoch: set_epoch(epoch)" in mine[0]
    assert state.status == "completed"


@pytest.mark.bad_input
@pytest.mark.parametrize("wrapped", [False, True], ids=["as-it-is", "in-a-StatefulDataLoader"])
def test_a_hugging_face_stream_shuffled_with_a_buffer_warns_once_at_a_resume_by_its_state(
        wrapped: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hugging Face's state of a stream does not hold its shuffle buffer: resumed by that state
    (as it is, or through a ``StatefulDataLoader``), it goes on with other examples. One warning
    says so and what to do; unshuffled, the same resume says nothing."""
    for name, value in _env(tmp_path).items():
        if name.startswith("HF_"):
            monkeypatch.setenv(name, value)
    datasets = pytest.importorskip("datasets")

    def examples():
        for i in range(24):
            yield {"i": i}

    def stream(shuffled: bool):
        data = datasets.IterableDataset.from_generator(examples)
        return (data.shuffle(seed=0, buffer_size=8) if shuffled else data).batch(4)

    def fit(shuffled: bool) -> list[str]:
        data = stream(shuffled)
        if wrapped:
            from torchdata.stateful_dataloader import StatefulDataLoader
            data = StatefulDataLoader(data, batch_size=None)
        before = iter(data)
        next(before)
        saved = {**saved_run(0, 1, 1), "data": {"train": data.state_dict()}}

        class Resume:
            name = "resumer"

            @hookfit.hookimpl
            def resume(self, loop, source):
                loop.load_state_dict(saved)
                return "ckpt.pt"

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = hookfit.Loop(lambda loop, batch: None, data, resume="latest", plugins=[Resume()]).fit()
        assert (state.status, state.step) == ("completed", 6)  # the 5 batches left after the first
        return [str(w.message) for w in caught if "cannot be rebuilt" in str(w.message)]

    mine = fit(shuffled=True)
    assert len(mine) == 1, mine
    assert "IterableDataset shuffled with a buffer, which its state_dict() does not hold" in mine[0]
    assert "give it to a plain torch DataLoader instead" in mine[0]
    assert fit(shuffled=False) == []


class ShardShuffled:
    """A generator factory reading four shards of 40 samples, each shuffled with torch's global generator as the
    stream reaches it (``per_shard``), or once, before its first batch: batches of 8, five a shard."""

    def __init__(self, per_shard: bool) -> None:
        g = torch.Generator().manual_seed(0)
        self.shards = [(torch.randn(40, 8, generator=g), torch.randn(40, 1, generator=g)) for _ in range(4)]
        self.per_shard = per_shard

    def __iter__(self):
        order = torch.randperm(40)
        for x, y in self.shards:
            order = torch.randperm(40) if self.per_shard else order
            for i in range(0, 40, 8):
                yield x[order[i:i + 8]], y[order[i:i + 8]]


class Augmented(torch.utils.data.Dataset):
    """Map-style, with a random augmentation from torch's global generator in ``__getitem__`` (RandomCrop's way)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(160, 8, generator=g), torch.randn(160, 1, generator=g)

    def __len__(self) -> int:
        return 160

    def __getitem__(self, index: int):
        return self.x[index] + 0.1 * torch.randn(8), self.y[index]


@pytest.mark.parametrize("kind", ["a-draw-per-shard", "one-draw-first", "augmented-map-style"])
def test_a_stream_drawing_from_torchs_generator_as_it_goes_is_warned_of_at_resume(tmp_path: Path, kind: str) -> None:
    """The common streaming shuffle, a torch.randperm per shard in __iter__, with dropout in the model: stopped
    mid-shard and resumed, the shard's order was drawn again without the model's draws between and the run
    trained on other batches, without a word. Said now; a stream that draws only before its first batch, and a
    map-style dataset's augmentation (each batch's own draws), resume exactly and say nothing."""
    per_shard = kind == "a-draw-per-shard"
    from hookfit.plugins.checkpoint import Checkpoint
    from hookfit.plugins.optim import Optim
    from conftest import StopAfter

    def fit(run_dir: Path, stop: int | None = None) -> tuple[torch.nn.Module, list[str]]:
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            data = DataLoader(Augmented(), batch_size=8, shuffle=True) if kind == "augmented-map-style" else (
                ShardShuffled(per_shard))
            hookfit.Loop(mse_step, data, model=model, max_steps=20, seed=0, run_dir=run_dir,
                         optimizers=torch.optim.SGD(model.parameters(), lr=0.01), resume="latest",
                         plugins=[Optim(), Checkpoint(background=False), *([StopAfter(stop)] if stop else [])]).fit()
        return model, [str(w.message) for w in caught if "torch's global random generator" in str(w.message)]

    whole, _ = fit(tmp_path / "whole")
    fit(tmp_path / "stopped", stop=13)
    resumed, said = fit(tmp_path / "stopped")
    equal = all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()))
    if per_shard:
        assert not equal  # what the warning says: other batches from the resumed one on
        assert len(said) == 1 and said[0].startswith("resume: the training data drew from torch's global random "
                                                     "generator while the 13 batches done were dropped"), said
    else:
        assert equal and said == []


def test_a_stream_reseeded_by_set_epoch_resumes_without_a_word_and_is_told_each_epoch() -> None:
    stream = SeededStream()
    told = []
    stream.set_epoch = lambda epoch: (told.append(epoch), SeededStream.set_epoch(stream, epoch))  # type: ignore
    assert unrebuilt_order(DataLoader(stream, batch_size=2)) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = hookfit.Loop(lambda loop, batch: None, DataLoader(stream, batch_size=2), max_epochs=3,
                             resume="latest", plugins=[Resumer()]).fit()
    assert (state.status, state.step) == ("completed", 2 + 4 + 6 + 6) and told == [0, 1, 2]


@pytest.mark.bad_input
@pytest.mark.parametrize("persistent", [True, False])
def test_set_epoch_that_persistent_workers_never_see_is_warned_of_once(persistent: bool) -> None:
    """A stream reseeded by set_epoch in a DataLoader with persistent workers: the workers keep their copy of the
    dataset, which set_epoch never reached, silently. One warning, at the run's second epoch."""
    orders: list[list[int]] = []

    def step(loop, batch):
        if loop.state.batch_idx == 0:
            orders.append([])
        orders[-1] += batch.tolist()

    data = DataLoader(SeededStream(), batch_size=2, num_workers=1, persistent_workers=persistent)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hookfit.Loop(step, data, max_epochs=3).fit()
    said = [str(w.message) for w in caught if "persistent workers" in str(w.message)]
    drawn = [torch.randperm(12, generator=torch.Generator().manual_seed(epoch)).tolist() for epoch in range(3)]
    assert (orders == drawn) is not persistent  # what the warning says: each epoch's order as set_epoch drew it
    assert said == ([
        "set_epoch reaches the SeededStream of a DataLoader, not its persistent workers (persistent_workers=True), "
        "which keep their copy of it from the run's first epoch: an order it draws from the epoch is not redrawn "
        "there (nor rebuilt at a resume); give persistent_workers=False (each epoch's workers then get the dataset "
        "as set_epoch left it)"] if persistent else [])


def test_a_hugging_face_stream_in_persistent_workers_is_told_each_epoch_without_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hugging Face's IterableDataset keeps its epoch in memory its persistent workers share: set_epoch reaches
    them, and the persistent-workers warning would have told its users to switch them off for nothing."""
    for name, value in _env(tmp_path).items():
        if name.startswith("HF_"):
            monkeypatch.setenv(name, value)
    datasets = pytest.importorskip("datasets")

    def examples():
        for i in range(8):
            yield {"i": i}

    stream = datasets.IterableDataset.from_generator(examples).shuffle(seed=0, buffer_size=8)
    orders: list[list[int]] = []

    def step(loop, batch):
        if loop.state.batch_idx == 0:
            orders.append([])
        orders[-1] += batch["i"].tolist()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hookfit.Loop(step, DataLoader(stream, batch_size=4, num_workers=1, persistent_workers=True),
                     max_epochs=3).fit()
    assert [str(w.message) for w in caught if "persistent workers" in str(w.message)] == []
    assert orders[0] != orders[1] != orders[2]  # each epoch's own order: the workers saw set_epoch


def test_tell_epoch_reaches_the_data_or_a_dataloaders_stream_and_nothing_else() -> None:
    stream = SeededStream()
    tell_epoch(DataLoader(stream, batch_size=2), 5)
    assert torch.randperm(12, generator=stream.rng).tolist() == torch.randperm(
        12, generator=torch.Generator().manual_seed(5)).tolist()
    tell_epoch([1, 2, 3], 1)  # nothing to tell: no error
    tell_epoch(DataLoader(list(range(4))), 1)


# -- one-pass data ---------------------------------------------------------------------------


def _batches(n: int = 4):
    for i in range(n):
        yield torch.full((2, 1), float(i))


def _step(loop, batch):
    return {"loss": batch.mean()}


def test_one_pass_is_an_iterator_told_without_iterating() -> None:
    assert one_pass(_batches()) and one_pass(iter([1])) and one_pass(map(str, [1]))
    assert not one_pass([1]) and not one_pass(DataLoader(list(range(4)))) and not one_pass(SeededStream())


@pytest.mark.bad_input
@pytest.mark.parametrize("make", [_batches, lambda: iter(list(_batches())), lambda: map(lambda b: b, list(_batches()))],
                         ids=["generator", "list_iterator", "map"])
def test_one_pass_training_data_with_several_epochs_is_refused_when_the_loop_is_built(make) -> None:
    data = make()
    with pytest.raises(ValueError) as error:
        hookfit.Loop(_step, data, max_epochs=2)
    message = str(error.value)
    assert message.startswith(f"train_data is a {type(data).__name__}, an iterator that gives its batches once only")
    assert "max_epochs=2" in message
    assert "generator factory: an object whose __iter__ is a generator function" in message
    assert "a list or a DataLoader" in message
    assert next(data) is not None  # refused before anything was drawn from it


@pytest.mark.bad_input
@pytest.mark.parametrize("kwargs, named, times", [
    ({"max_epochs": 2}, "val_data", 2),
    ({"max_epochs": 4, "val_every_n_epochs": 2}, "val_data", 2),
    ({"max_epochs": 1, "val_every_n_steps": 2}, "val_data", 2),  # 4 training batches: 2 validations
    ({"max_steps": 6, "val_every_n_steps": 3}, "val_data", 2),
])
def test_one_pass_validation_data_run_more_than_once_is_refused(kwargs, named, times) -> None:
    with pytest.raises(ValueError, match=rf"^{named} is a generator, an iterator that gives its batches once only, "
                                         rf"and validation runs {times} times \(") as error:
        hookfit.Loop(_step, list(_batches()), val_step=_step, val_data=_batches(), **kwargs)
    assert "generator factory" in str(error.value)


@pytest.mark.bad_input
def test_a_one_pass_set_among_several_validation_sets_is_named() -> None:
    with pytest.raises(ValueError, match=r"^val_data\['noisy'\] is a generator, an iterator"):
        hookfit.Loop(_step, list(_batches()), val_step=_step, max_epochs=3,
                     val_data={"clean": list(_batches()), "noisy": _batches()})


def test_one_epoch_of_a_generator_still_trains_and_validates() -> None:
    state = hookfit.Loop(_step, _batches(), val_step=_step, val_data=_batches(3)).fit()
    assert (state.status, state.step) == ("completed", 4)
    state = hookfit.Loop(_step, _batches(5), max_steps=5).fit()  # max_steps alone: as many epochs as it takes
    assert (state.status, state.step) == ("completed", 5)
    state = hookfit.Loop(_step, list(_batches()), val_step=_step, val_data=_batches(), max_epochs=3,
                         val_every_n_epochs=2).fit()  # one validation in 3 epochs
    assert state.status == "completed"


@pytest.mark.bad_input
def test_a_function_given_as_data_names_it_and_the_generator_factory() -> None:
    with pytest.raises(TypeError, match=r"got function '_batches'; for data made anew each epoch, pass a generator "
                                        r"factory: an object whose __iter__ is a generator function"):
        hookfit.Loop(_step, _batches)


class Factory:
    """A generator factory without a length: the number of steps cannot be known in advance."""

    def __iter__(self):
        yield from _batches()


@pytest.mark.bad_input
def test_a_generator_used_up_where_the_count_was_unknown_names_it_when_it_runs_dry() -> None:
    """Where the number of passes is not known when the ``Loop`` is built (``max_steps`` alone,
    validations every N steps over data without a length), the pass that finds a generator used
    up fails, naming it and what to pass instead."""
    with pytest.raises(ValueError, match=r"train data yielded no batches in epoch 2 \(the generator iterator is used "
                                         r"up after one pass; pass a list, a DataLoader or a generator factory"):
        hookfit.Loop(_step, _batches(3), max_steps=5).fit()
    with pytest.raises(ValueError, match=r"valid data yielded no batches in epoch 1 \(the generator iterator is used "
                                         r"up after one pass"):
        hookfit.Loop(_step, Factory(), val_step=_step, val_data=_batches(), val_every_n_steps=2).fit()
    with pytest.raises(ValueError, match=r"valid data yielded no batches in epoch 1 \(validation set 'b', a generator "
                                         r"iterator, is used up"):
        hookfit.Loop(_step, Factory(), val_step=_step, val_data={"b": _batches()}, val_every_n_steps=2).fit()


# -- progress without a total ---------------------------------------------------------------


def test_the_console_shows_a_streams_progress_as_a_count_and_a_rate_without_total_or_eta() -> None:
    """The console's progress lines for a training stage without a length: ``batch=<n>``, a rate,
    no ``/<total>``, no ``eta``; the start line gives no batches per epoch."""
    from hookfit.plugins.console import Console
    from hookfit.plugins.metrics import Metrics
    from hookfit.plugins.optim import Optim

    class Stream(IterableDataset):
        def __iter__(self):
            for i in range(12):
                yield torch.full((2,), float(i)), torch.ones(1)

    model = torch.nn.Linear(2, 1)

    def step(loop, batch):
        loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    out = io.StringIO()
    state = hookfit.Loop(step, DataLoader(Stream(), batch_size=2), model=model, max_epochs=2,
                         optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
                         plugins=[Optim(), Metrics(interval=0),
                                  Console(stream=out, interval=0, every_n_batches=2)]).fit()
    assert (state.status, state.step) == ("completed", 12)
    lines = out.getvalue().splitlines()
    start = next(line for line in lines if line.startswith("hookfit start "))
    assert "batches_per_epoch" not in start
    progress = [line for line in lines if re.match(r"hookfit train epoch=\d/2 batch=\d+ ", line)]
    assert len(progress) >= 6, lines  # every second batch of both epochs
    for line in progress:
        assert re.search(r" batch=\d+ samples_per_s=\d+\.\d ", line), line
        assert "eta=" not in line and not re.search(r"batch=\d+/", line), line
    assert any("batch=6 " in line for line in progress)
    done = [line for line in lines if re.match(r"hookfit train epoch=\d/2 done batches=6 ", line)]
    assert len(done) == 2, lines
