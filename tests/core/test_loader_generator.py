"""A DataLoader that shuffles with a generator of its own (``generator=``, as many published
scripts seed their data) resumes exactly: the run's state holds that generator's state as the
epoch's iterator was made and as the position left it, mid-epoch and at an epoch's end, with
and without workers, and such a resume says nothing about an order it cannot rebuild. With
persistent workers, on its own generator or the global one, the resumed run's iterators are
reset as the run it continues had them (no workers' base seed drawn before the order), and the
workers' own random state, which it cannot rebuild, is named in one warning."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.optim import Optim

from conftest import StopAfter, mse_step

BATCHES = 6  # training batches an epoch


class Noisy(Dataset):
    """Samples with noise drawn where the sample is made: in a worker, from the seed the
    loader's base seed gives it; without workers, from the global generator."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(4 * BATCHES, 3, generator=g), torch.randn(4 * BATCHES, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i] + 0.01 * torch.randn(3), self.y[i]


class StopAtEpochEnd:
    """Asks for a stop at the end of the first epoch: the run's last checkpoint is then the
    epoch boundary's."""

    name = "stop_at_epoch_end"

    @hookfit.hookimpl
    def epoch_end(self, loop):
        loop.request_stop("test stop at an epoch's end")


def samplers(kind: str, g: torch.Generator) -> torch.utils.data.Sampler:
    """torch's other samplers that draw an epoch's order when it begins: with the loader's generator ``g``, or
    (``-global``) from the global generator."""
    own = None if kind.endswith("-global") else g
    if kind.startswith("weighted"):
        return torch.utils.data.WeightedRandomSampler(torch.linspace(1, 2, 4 * BATCHES), 4 * BATCHES, generator=own)
    return torch.utils.data.SubsetRandomSampler(range(0, 4 * BATCHES, 2), generator=own)


def train(run_dir: Path, workers: int, *, stopper=None, resume=None, sampler: bool | str = False,
          unbatched: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    g = torch.Generator().manual_seed(5)
    if unbatched:  # batch_size=None: the loader has no batch sampler, its sampler shuffles the items
        data = DataLoader(Noisy(), batch_size=None, shuffle=True, generator=g, num_workers=workers)
    elif isinstance(sampler, str):
        data = DataLoader(Noisy(), batch_size=4, sampler=samplers(sampler, g), num_workers=workers)
    elif sampler:  # the generator on a RandomSampler the script makes
        data = DataLoader(Noisy(), batch_size=4, sampler=torch.utils.data.RandomSampler(Noisy(), generator=g),
                          num_workers=workers)
    else:
        data = DataLoader(Noisy(), batch_size=4, shuffle=True, generator=g, num_workers=workers)

    def step(loop, batch):
        loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1]) + 0 * torch.rand(())
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return loss

    plugins = [Optim(), Checkpoint(every_n_epochs=1, background=False), *([stopper] if stopper else [])]
    loop = hookfit.Loop(step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                        max_epochs=3, run_dir=run_dir, resume=resume, plugins=plugins)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = loop.fit()
    return state, [p.detach().clone() for p in model.parameters()], [str(w.message) for w in caught]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted runs, by number of workers and where the generator is given."""
    runs = {}

    def get(workers: int, sampler: bool):
        if (workers, sampler) not in runs:
            state, params, _ = train(tmp_path_factory.mktemp("straight"), workers, sampler=sampler)
            assert state.status == "completed"
            runs[workers, sampler] = params
        return runs[workers, sampler]

    return get


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("where", ["first epoch", "second epoch", "epoch boundary", "sampler's generator"])
def test_a_loader_with_its_own_generator_resumes_to_bitwise_equal_parameters_without_a_warning(
        tmp_path: Path, straight, workers: int, where: str) -> None:
    sampler = where == "sampler's generator"
    stopper = {"first epoch": StopAfter(3), "second epoch": StopAfter(BATCHES + 2),
               "epoch boundary": StopAtEpochEnd(), "sampler's generator": StopAfter(BATCHES + 4)}[where]
    stopped, _, _ = train(tmp_path, workers, stopper=stopper, sampler=sampler)
    assert stopped.status == "interrupted"
    resumed, params, said = train(tmp_path, workers, resume="latest", sampler=sampler)
    assert resumed.resumed_from is not None and resumed.status == "completed" and resumed.step == 3 * BATCHES
    assert not [m for m in said if "cannot be rebuilt" in m], said
    assert all(torch.equal(p, q) for p, q in zip(params, straight(workers, sampler)))


@pytest.mark.parametrize("kind", ["weighted", "weighted-global", "subset", "subset-global"])
def test_torchs_weighted_and_subset_samplers_resume_to_bitwise_equal_parameters_without_a_warning(
        tmp_path: Path, straight, kind: str) -> None:
    """They draw an epoch's order when it begins, from their generator or the global one, as a
    ``RandomSampler`` does: the run replays it; they are not custom samplers to warn of."""
    stopped, _, _ = train(tmp_path, 0, stopper=StopAfter(BATCHES + 1), sampler=kind)
    assert stopped.status == "interrupted"
    resumed, params, said = train(tmp_path, 0, resume="latest", sampler=kind)
    assert resumed.resumed_from is not None and resumed.status == "completed"
    assert not [m for m in said if "cannot be rebuilt" in m], said
    assert all(torch.equal(p, q) for p, q in zip(params, straight(0, kind)))


def test_a_loader_without_batching_that_shuffles_with_its_own_generator_resumes_without_a_warning(
        tmp_path: Path) -> None:
    straight, expected, _ = train(tmp_path / "straight", 0, unbatched=True)
    stopped, _, _ = train(tmp_path, 0, stopper=StopAfter(30), unbatched=True)
    assert (straight.status, stopped.status, stopped.step) == ("completed", "interrupted", 30)
    resumed, params, said = train(tmp_path, 0, resume="latest", unbatched=True)
    assert resumed.status == "completed" and resumed.step == straight.step == 3 * 4 * BATCHES
    assert not [m for m in said if "cannot be rebuilt" in m], said
    assert all(torch.equal(p, q) for p, q in zip(params, expected))


def test_the_run_state_holds_the_loaders_generator_as_the_iterator_was_made_and_now(tmp_path: Path) -> None:
    seen = {}

    class Look:
        name = "look"

        @hookfit.hookimpl
        def batch_end(self, loop, batch_idx):
            if loop.state.epoch == 1 and batch_idx == 2:
                seen["state"], seen["generator"] = loop.state_dict(), loop.train_data.generator.get_state()

    g = torch.Generator().manual_seed(5)
    data = DataLoader(list(range(12)), batch_size=2, shuffle=True, generator=g)
    hookfit.Loop(lambda loop, batch: None, data, max_epochs=2, run_dir=tmp_path, plugins=[Look()]).fit()
    state = seen["state"]
    assert torch.equal(state["rng"]["data"]["generator"], seen["generator"])
    made = torch.Generator().manual_seed(5)  # the first epoch's iterator drew from it: a seed, a shuffle
    list(DataLoader(list(range(12)), batch_size=2, shuffle=True, generator=made))
    assert torch.equal(state["data_rng"]["data"]["generator"], made.get_state())
    assert not torch.equal(state["data_rng"]["data"]["generator"], seen["generator"])


# -- persistent workers ---------------------------------------------------------------------

WORKERS_SAY = "the random state of the persistent worker processes of train_data, val_data"


def persistent(run_dir: Path, own: bool, *, stopper=None, resume=None, loaders=None):
    """Three epochs over loaders with one persistent worker each: training data shuffled with
    a generator of its own (``own``) or the global one, a validation each epoch, dropout (the
    global stream); a checkpoint at each epoch's end and at a stop. ``loaders``: the
    ``(train, valid)`` to use instead of new ones (the run ends their workers)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    mine = loaders is None
    if mine:
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(4 * BATCHES, 3, generator=g), torch.randn(4 * BATCHES, 1, generator=g))
        kw = {"generator": torch.Generator().manual_seed(5)} if own else {}
        loaders = (DataLoader(data, batch_size=4, shuffle=True, num_workers=1, persistent_workers=True, **kw),
                   DataLoader(data, batch_size=12, num_workers=1, persistent_workers=True))

    def val_step(loop, batch):
        return torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])

    plugins = [Optim(), Checkpoint(every_n_epochs=1, background=False), *([stopper] if stopper else [])]
    loop = hookfit.Loop(mse_step, loaders[0], val_step=val_step, val_data=loaders[1], model=model,
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.1), max_epochs=3, run_dir=run_dir,
                        resume=resume, plugins=plugins, disable=["console"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = loop.fit()
    if mine:
        shut_down(*loaders)
    return state, [p.detach().clone() for p in model.parameters()], [str(w.message) for w in caught]


def shut_down(*loaders) -> None:
    """End the loaders' persistent workers now: torch's iterator ends them as it is freed, and
    one left to the cyclic garbage collector (a run holds its data in cycles) waits 5 s for each."""
    for loader in loaders:
        loader._iterator = None


@pytest.fixture(scope="module")
def straight_persistent(tmp_path_factory):
    """The uninterrupted runs with persistent workers, by whether the loader has a generator."""
    runs = {}

    def get(own: bool):
        if own not in runs:
            state, params, _ = persistent(tmp_path_factory.mktemp("persistent"), own)
            assert state.status == "completed"
            runs[own] = params
        return runs[own]

    return get


# training and validation batches each stop counts: BATCHES and 2 (validation batches of 12) an epoch
# (the second stop of "resumed twice" is in the epoch it resumed, the third in the next one)
STOPS = {"first epoch": [3], "second epoch": [BATCHES + 2 + 3], "epoch boundary": ["end"],
         "resumed twice": [BATCHES + 2 + 3, 1, 1 + 2 + 2]}


@pytest.mark.parametrize("own", [True, False], ids=["generator", "global RNG"])
@pytest.mark.parametrize("where", list(STOPS))
def test_loaders_with_persistent_workers_resume_to_bitwise_equal_parameters(
        tmp_path: Path, straight_persistent, own: bool, where: str) -> None:
    said = []
    for stop in STOPS[where]:
        stopper = StopAtEpochEnd() if stop == "end" else StopAfter(stop)
        stopped, _, told = persistent(tmp_path, own, stopper=stopper, resume="latest")
        assert stopped.status == "interrupted"
        said += told
    resumed, params, told = persistent(tmp_path, own, resume="latest")
    said += told
    assert resumed.resumed_from is not None and resumed.status == "completed" and resumed.step == 3 * BATCHES
    assert all(torch.equal(p, q) for p, q in zip(params, straight_persistent(own)))
    # the run it continues had started its workers in the first epoch: only then can they not be rebuilt
    workers = [m for m in said if "persistent worker processes" in m]
    assert len(workers) == (0 if where == "first epoch" else len(STOPS[where])), said
    assert all(WORKERS_SAY in m for m in workers), workers
    assert not [m for m in said if "cannot be rebuilt" in m and m not in workers], said


def test_the_run_state_names_the_data_whose_persistent_iterator_the_position_resumes_with(tmp_path: Path) -> None:
    seen = {}

    class Look:
        name = "look"

        @hookfit.hookimpl
        def batch_end(self, loop, batch_idx):
            if loop.state.stage == "train" and batch_idx == 1:
                seen[loop.state.epoch] = loop.state_dict().get("persistent_iterators")

        @hookfit.hookimpl
        def epoch_end(self, loop, epoch):
            seen[epoch, "end"] = loop.state_dict().get("persistent_iterators")

    def loader():
        return DataLoader(list(range(8)), batch_size=2, num_workers=1, persistent_workers=True)

    train, noisy, clean = loader(), loader(), DataLoader(list(range(8)), batch_size=2, num_workers=1)
    hookfit.Loop(lambda loop, batch: None, train, val_step=lambda loop, batch: None,
                 val_data={"noisy": noisy, "clean": clean}, max_epochs=2, run_dir=tmp_path,
                 plugins=[Look()], disable=["console", "checkpoint"]).fit()
    shut_down(train, noisy)
    # the first epoch made the training iterator anew, and no validation had run (at its epoch_end too: the
    # position still has its validation to run, from its start); the second reset them
    assert seen == {0: None, (0, "end"): ["train"], 1: ["train", "valid/noisy"],
                    (1, "end"): ["train", "valid/noisy"]}


def test_a_loader_whose_persistent_iterator_this_process_made_before_the_resume_is_named(tmp_path: Path) -> None:
    """A run over a persistent loader ends its workers (a resumed run over the same loader in the
    same process is exact, with no word); a loader the script iterated itself before the resume
    (a batch looked at in a notebook) still holds its iterator: the resume names it."""
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(4 * BATCHES, 3, generator=g), torch.randn(4 * BATCHES, 1, generator=g))
    loaders = (DataLoader(data, batch_size=4, shuffle=True, num_workers=1, persistent_workers=True),
               DataLoader(data, batch_size=12))
    stopped, _, _ = persistent(tmp_path, False, stopper=StopAfter(3), loaders=loaders)  # in the first epoch
    assert stopped.status == "interrupted" and loaders[0]._iterator is None
    _, _, said = persistent(tmp_path, False, resume="latest", loaders=loaders)
    assert not [m for m in said if "in this process" in m], said

    stopped, _, _ = persistent(tmp_path / "peeked", False, stopper=StopAfter(3), loaders=loaders)
    next(iter(loaders[0]))  # the script looks at a batch: the loader makes its iterator and keeps it
    _, _, said = persistent(tmp_path / "peeked", False, resume="latest", loaders=loaders)
    shut_down(*loaders)
    stale = [m for m in said if "had made its iterator with persistent workers in this process" in m]
    assert len(stale) == 1 and stale[0].startswith("resume='latest': train_data had made its iterator"), said
    assert "cannot be rebuilt" in stale[0] and "give the resumed run a new DataLoader" in stale[0]


def test_a_stateful_loader_with_persistent_workers_restores_its_own_iterator(tmp_path: Path) -> None:
    """torchdata's StatefulDataLoader restores its iterator from its own state (the run makes
    none for it before): resumed in its second epoch, it trains on each batch once, as the
    uninterrupted run did."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(4 * BATCHES, 3, generator=g), torch.randn(4 * BATCHES, 1, generator=g))

    def run(run_dir: Path, stopper=None):
        torch.manual_seed(0)
        seen = []
        loader = stateful.StatefulDataLoader(data, batch_size=4, shuffle=True, num_workers=1, persistent_workers=True)
        loop = hookfit.Loop(lambda loop, batch: seen.append(batch[1].sum().item()), loader, max_epochs=2,
                            model=torch.nn.Linear(3, 1), run_dir=run_dir, resume="latest", disable=["console"],
                            plugins=[Checkpoint(background=False), *([stopper] if stopper else [])])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loop.fit()
        shut_down(loader)
        return seen, [str(w.message) for w in caught if issubclass(w.category, hookfit.HookfitWarning)]

    straight, _ = run(tmp_path / "straight")
    first, _ = run(tmp_path / "stopped", StopAfter(BATCHES + 2))
    rest, said = run(tmp_path / "stopped")
    assert first + rest == straight and said == []


# -- the validation data's own generators ------------------------------------------------------

def validated(run_dir: Path, *, sets: bool, stopper=None, resume=None) -> tuple[hookfit.State, list]:
    """A run whose validation draws from generators of its own: a random subset each time
    (a sampler with replacement), and with ``sets``, a second set shuffled by its loader's generator.
    Returns the state and every validation batch seen, with its epoch and set."""
    items = torch.arange(40.0).unsqueeze(1)
    subset = DataLoader(items, batch_size=4, sampler=torch.utils.data.RandomSampler(
        items, replacement=True, num_samples=8, generator=torch.Generator().manual_seed(2)))
    shuffled = DataLoader(items, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3))
    seen: list = []

    def valid(loop, batch):
        seen.append((loop.state.epoch, loop.state.val_set, batch.flatten().tolist()))
        return {"loss": batch.mean()}

    loop = hookfit.Loop(lambda loop, batch: None, [torch.zeros(1)] * BATCHES, model=torch.nn.Linear(1, 1),
                        val_step=valid, val_data={"subset": subset, "shuffled": shuffled} if sets else subset,
                        max_epochs=3, run_dir=run_dir, resume=resume,
                        plugins=[Checkpoint(every_n_epochs=1, background=False), *([stopper] if stopper else [])])
    return loop.fit(), seen


@pytest.mark.parametrize("sets", [False, True], ids=["one set", "two sets"])
@pytest.mark.parametrize("where", ["training", "validation"])
def test_validation_data_with_its_own_generators_validates_as_the_uninterrupted_run_after_a_resume(
        tmp_path: Path, sets: bool, where: str) -> None:
    """A validation on a random subset drew the first epoch's subset again after a resume: only the
    training data's generators were kept."""
    straight, expected = validated(tmp_path / "straight", sets=sets)
    per_epoch = BATCHES + (2 + 5 if sets else 2)  # training batches, then the validation's
    stop = per_epoch + (3 if where == "training" else BATCHES + 1)  # in the second epoch, its training or validation
    stopped, _ = validated(tmp_path / "run", sets=sets, stopper=StopAfter(stop))
    assert stopped.status == "interrupted" and stopped.epoch == 1
    resumed, seen = validated(tmp_path / "run", sets=sets, resume="latest")
    assert resumed.status == "completed" and resumed.resumed_from is not None
    assert seen == [batch for batch in expected if batch[0] >= 1]
