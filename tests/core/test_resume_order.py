"""A resume whose data order cannot be rebuilt says so once, naming the data and what to use
instead; data whose order the run rebuilds (lists, Batches, a DataLoader shuffled
by the global generator) resumes without a word."""

from __future__ import annotations

import random
import re
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

import hookfit
from hookfit.data import Batches

from conftest import saved_run


class Resumer:
    """Puts the run mid-epoch, as a checkpoint plugin does."""

    name = "resumer"

    @hookfit.hookimpl
    def resume(self, loop, source):
        loop.load_state_dict(saved_run(0, 2, 2))
        return "ckpt.pt"


class ShuffledSampler(Sampler):
    """A custom sampler with a generator of its own."""

    def __init__(self, n: int) -> None:
        self.n, self.g = n, torch.Generator().manual_seed(0)

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=self.g).tolist())

    def __len__(self) -> int:
        return self.n


class OwnShuffle:
    """An iterable that shuffles with a random.Random of its own."""

    def __init__(self) -> None:
        self.rng = random.Random(0)

    def __iter__(self):
        order = list(range(6))
        self.rng.shuffle(order)
        return iter(order)


DATA = TensorDataset(torch.arange(12.0))


def fit(data, **kwargs) -> hookfit.State:
    return hookfit.Loop(lambda loop, batch: None, data, resume="latest", plugins=[Resumer()], **kwargs).fit()


@pytest.mark.bad_input
@pytest.mark.parametrize("data, what", [
    (DataLoader(DATA, batch_size=2, sampler=ShuffledSampler(12)),
     "DataLoader with the custom sampler ShuffledSampler"),
    (DataLoader(DATA, batch_size=2, shuffle=True, generator=torch.Generator()),
     "DataLoader with a generator of its own"),
    (OwnShuffle(), r"OwnShuffle, which draws from a random generator of its own \(rng\)"),
])
def test_a_resume_whose_order_cannot_be_rebuilt_warns_once_naming_the_data_and_what_to_use(data, what) -> None:
    with pytest.warns(hookfit.HookfitWarning) as caught:
        state = fit(data)
    mine = [w for w in caught if "cannot be rebuilt" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    message = str(mine[0].message)
    assert message.startswith("resume='latest': the order of the training data's batches cannot be rebuilt")
    assert re.search(what, message), message
    assert "use torchdata's StatefulDataLoader" in message and "hookfit.data.Batches" in message
    assert mine[0].filename == __file__  # the fit() call
    assert state.status == "completed"


@pytest.mark.parametrize("data", [
    list(range(6)),
    DataLoader(DATA, batch_size=2, shuffle=True),
    DataLoader(DATA, batch_size=2),
    Batches(torch.arange(12.0), batch_size=2, shuffle=True),
])
def test_data_whose_order_is_rebuilt_resumes_without_a_word(data) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fit(data).status == "completed"


def test_a_loader_with_its_own_generator_resumes_without_a_word_when_the_state_holds_it() -> None:
    from hookfit.position import iterator_rng_state, rng_state

    data = DataLoader(DATA, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(1))

    class Holding(Resumer):
        @hookfit.hookimpl
        def resume(self, loop, source):
            loop.load_state_dict({**saved_run(0, 2, 2), "rng": rng_state(data), "data_rng": iterator_rng_state(data)})
            return "ckpt.pt"

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = hookfit.Loop(lambda loop, batch: None, data, resume="latest", plugins=[Holding()]).fit()
    assert state.status == "completed"


@pytest.mark.bad_input
@pytest.mark.parametrize("answer", [None, False])
def test_a_resume_that_gives_the_position_but_returns_no_source_is_an_error_naming_the_plugin(answer) -> None:
    """A replacement that forgot `return path`: the run continued, but `resumed` never fired, so no
    "resumed from" line, no resume line in metrics.jsonl, and the CSV logger kept the rows after the
    checkpoint (a duplicate row)."""

    class Forgetful:
        name = "forgetful"

        @hookfit.hookimpl
        def resume(self, loop, source):
            loop.load_state_dict(saved_run(0, 1, 1))
            return answer

    with pytest.raises(RuntimeError, match=rf"plugin forgetful gave the run its position \(loop.load_state_dict\) "
                                           rf"but returned {answer}: return what it resumed from"):
        hookfit.Loop(lambda l, b: None, [1, 2], resume="latest", plugins=[Forgetful()]).fit()


@pytest.mark.bad_input
def test_resumes_apart_called_once_the_run_resumed_is_an_error_naming_the_plugin() -> None:
    """``state.continues`` is decided when the resume implementation returns, and the loggers read it at
    ``resumed``: a plugin that says ``loop.resumes_apart()`` there or later is refused, the error naming it,
    where it was ignored and the run went on continuing the folder's records."""

    class Late:
        name = "late"

        @hookfit.hookimpl
        def resumed(self, loop, info):
            loop.resumes_apart()

    with pytest.raises(RuntimeError, match=r"resumes_apart\(\) was called after the run resumed") as raised:
        hookfit.Loop(lambda loop, batch: None, [1, 2], resume="latest", plugins=[Resumer(), Late()]).fit()
    assert any("plugin 'late'" in note and "'resumed'" in note for note in raised.value.__notes__), \
        raised.value.__notes__


def stateful_resumer(data):
    """Puts the run mid-epoch with the loader's own state saved after two batches, as a checkpoint does."""
    from hookfit.position import iterator_rng_state, rng_state

    made = iterator_rng_state(data)
    iterator = iter(data)
    next(iterator), next(iterator)
    saved = {**saved_run(0, 2, 2), "data": {"train": data.state_dict()}, "rng": rng_state(data), "data_rng": made}

    class Restoring(Resumer):
        @hookfit.hookimpl
        def resume(self, loop, source):
            loop.load_state_dict(saved)
            return "ckpt.pt"

    return Restoring()


@pytest.mark.bad_input
def test_a_stateful_loader_whose_sampler_has_no_state_warns_that_its_order_is_not_rebuilt() -> None:
    """torchdata's loader fast-forwards a sampler without state from a new iterator: a custom sampler
    drawing at random gives another order, and the warning that advised this loader went quiet."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = StatefulDataLoader(DATA, batch_size=2, sampler=ShuffledSampler(12))
    with pytest.warns(hookfit.HookfitWarning, match=r"cannot be rebuilt.*train_data is a DataLoader with the "
                      r"custom sampler ShuffledSampler.*use torchdata's StatefulDataLoader \(it saves its sampler's "
                      r"state: its own samplers, or one with state_dict\(\)/load_state_dict\(\)\)"):
        state = hookfit.Loop(lambda loop, batch: None, data, resume="latest", plugins=[stateful_resumer(data)]).fit()
    assert state.status == "completed"


@pytest.mark.parametrize("kind", ["shuffled with its own generator", "sequential", "distributed sampler",
                                  "torch's sampler with its own generator"])
def test_a_stateful_loader_with_samplers_it_restores_resumes_without_a_word(kind: str) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = {"shuffled with its own generator": lambda: StatefulDataLoader(
                DATA, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(1)),
            "sequential": lambda: StatefulDataLoader(DATA, batch_size=2),
            "distributed sampler": lambda: StatefulDataLoader(DATA, batch_size=2, sampler=torch.utils.data.
                                                              DistributedSampler(DATA, num_replicas=1, rank=0)),
            "torch's sampler with its own generator": lambda: StatefulDataLoader(DATA, batch_size=2, sampler=torch.utils.
                                                              data.RandomSampler(DATA, generator=torch.Generator()))
            }[kind]()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = hookfit.Loop(lambda loop, batch: None, data, resume="latest", plugins=[stateful_resumer(data)]).fit()
    assert state.status == "completed"
