"""hookfit.reproducibility: Loop(seed=...) and Loop(deterministic=True)."""

from __future__ import annotations

import copy
import json
import os
import random
import warnings
from pathlib import Path

import numpy
import pytest
import torch

import hookfit
from hookfit.plugins.optim import Optim


def train(model: torch.nn.Module, folder: Path, disturb: int, **loop_kwargs) -> tuple[list[torch.Tensor], list]:
    """A run whose every step draws random numbers: dropout, a shuffled DataLoader (its order
    and noise from torch's generator), Python's and NumPy's generators. ``disturb`` draws from
    all of them first, as unrelated code before ``fit()`` would."""
    random.random(), numpy.random.rand(disturb), torch.rand(disturb)
    g = torch.Generator().manual_seed(7)
    dataset = torch.utils.data.TensorDataset(torch.randn(24, 3, generator=g), torch.randn(24, 1, generator=g))
    draws = []

    def step(loop, batch):
        x, y = batch
        draws.append((random.random(), float(numpy.random.rand())))
        loss = torch.nn.functional.mse_loss(loop.model(x + 0.01 * torch.randn_like(x)), y)
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    hookfit.Loop(step, torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=True), model=model,
                 optimizers=torch.optim.SGD(model.parameters(), lr=0.1), max_epochs=2, run_dir=folder,
                 plugins=[Optim()], **loop_kwargs).fit()
    return [p.detach().clone() for p in model.parameters()], draws


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))


def test_two_runs_with_the_same_seed_end_bitwise_equal_and_without_one_they_do_not(tmp_path: Path) -> None:
    base = model()
    a, draws_a = train(copy.deepcopy(base), tmp_path / "a", disturb=3, seed=123)
    b, draws_b = train(copy.deepcopy(base), tmp_path / "b", disturb=11, seed=123)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and draws_a == draws_b
    c, draws_c = train(copy.deepcopy(base), tmp_path / "c", disturb=5, seed=124)
    assert not all(torch.equal(x, y) for x, y in zip(a, c)) and draws_a != draws_c
    # without a seed, the same disturbance as the first run leaves different states behind
    d, _ = train(copy.deepcopy(base), tmp_path / "d", disturb=7)
    assert not all(torch.equal(x, y) for x, y in zip(a, d))


def test_the_seed_and_determinism_are_recorded_in_the_run_folder(tmp_path: Path) -> None:
    from hookfit.plugins.metrics import Metrics
    from hookfit.plugins.metrics_log import MetricsLog

    hookfit.Loop(lambda l, b: {"loss": 1.0}, [1, 2], run_dir=tmp_path / "run", name="exp", seed=5,
                 deterministic=True, plugins=[Metrics(), MetricsLog()]).fit()
    lines = [json.loads(line) for line in (tmp_path / "run" / "run.jsonl").read_text().splitlines()]
    assert [r["event"] for r in lines] == ["run", "end"]  # the core's end line follows (see test_time_split)
    (record,) = [r for r in lines if r["event"] == "run"]
    assert (record["event"], record["name"], record["seed"], record["deterministic"]) == ("run", "exp", 5, True)
    assert record["plugins"] == ["metrics", "metrics_log"] and record["versions"]["torch"] == torch.__version__
    assert record["argv"] and record["resume"] is None


def test_deterministic_algorithms_are_on_during_the_run_and_put_back_after(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    seen = []

    def step(loop, batch):
        seen.append((torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
                     torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG")))

    before = torch.are_deterministic_algorithms_enabled()
    hookfit.Loop(step, [1], deterministic=True).fit()
    assert seen == [(True, True, False, ":4096:8")]
    assert torch.are_deterministic_algorithms_enabled() is before and not torch.backends.cudnn.deterministic
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ

    # and after a step that fails too
    def failing(loop, batch):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        hookfit.Loop(failing, [1], deterministic=True).fit()
    assert torch.are_deterministic_algorithms_enabled() is before
    seen.clear()
    hookfit.Loop(step, [1]).fit()
    assert seen[0][0] is before  # not switched on without the option


def test_seed_everything_is_public_for_the_model_s_own_weights() -> None:
    hookfit.seed_everything(3)
    first = torch.nn.Linear(4, 4).weight.detach().clone(), random.random(), numpy.random.rand()
    hookfit.seed_everything(3)
    second = torch.nn.Linear(4, 4).weight.detach().clone(), random.random(), numpy.random.rand()
    assert torch.equal(first[0], second[0]) and first[1:] == second[1:]


@pytest.mark.bad_input
@pytest.mark.parametrize("options, message", [
    ({"seed": -1}, r"seed must be an integer from 0 to 2\*\*32 - 1 \(or None\), got -1"),
    ({"seed": 2**32}, r"seed must be an integer from 0 to 2\*\*32 - 1"),
    ({"seed": 1.5}, r"seed must be an integer"),
    ({"seed": "0"}, r"seed must be an integer"),
    ({"seed": True}, r"seed must be an integer"),
    ({"deterministic": "yes"}, r"deterministic must be True or False, got 'yes'"),
])
def test_bad_options_are_named_when_the_loop_is_built(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        hookfit.Loop(lambda l, b: None, [1], **options)


def fits(loader, val_data=None, **options) -> tuple[list[list[float]], list[warnings.WarningMessage]]:
    """The first values of each training batch of a ``fit()`` on ``loader``, and the warnings it gave."""
    order: list[list[float]] = []

    def step(loop, batch):
        order.append(batch[0][:, 0].tolist())

    validation = {"val_step": lambda loop, batch: None, "val_data": val_data} if val_data is not None else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hookfit.Loop(step, loader, plugins=[], **validation, **options).fit()
    return order, [w for w in caught if "reseed" in str(w.message)]


@pytest.mark.bad_input
def test_a_loader_whose_own_generator_an_earlier_run_drew_is_named_once_by_a_seeded_run() -> None:
    """Loop(seed=...) leaves a DataLoader's own generator= as the script seeded it (as Lightning's
    seed_everything does): the same loader run again in one process (a notebook cell, a sweep) gets
    another order, which the seeded run says, naming the loader and the fix; reseeded, or set back to
    a state saved before, it gets the first order again and nothing is said, nor by a run without seed=."""
    dataset = torch.utils.data.TensorDataset(torch.arange(16.0)[:, None])
    g = torch.Generator().manual_seed(3)
    saved = g.get_state()
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=True, generator=g)
    first, said = fits(loader, seed=0)
    assert said == []
    again, said = fits(loader, seed=0)
    assert again != first
    (warning,) = said
    assert warning.category is hookfit.HookfitWarning and warning.filename == __file__
    assert str(warning.message) == (
        "seed=0 does not reseed a DataLoader's own generator, and train_data.generator goes on from where an earlier "
        "run in this process left it (a notebook cell run again, a sweep reusing the loader), so this run's data "
        "order is not a fresh script's: seed it before each fit(), g.manual_seed(N), or give the loader a new "
        "torch.Generator().manual_seed(N) each run")
    assert fits(loader)[1] == []  # no seed=, nothing promised
    g.manual_seed(3)
    assert fits(loader, seed=0) == (first, [])
    g.set_state(saved)
    assert fits(loader, seed=0) == (first, [])
    # a validation set's sampler with a generator of its own, named by its set
    sampler = torch.utils.data.RandomSampler(dataset, num_samples=4, generator=torch.Generator().manual_seed(1))
    valid = {"clean": [torch.ones(1, 1)], "sub": torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler)}
    g.manual_seed(3)
    assert fits(loader, valid, seed=0)[1] == []
    g.manual_seed(3)
    (warning,) = fits(loader, valid, seed=0)[1]
    assert "and val_data['sub'].sampler.generator goes on from where an earlier run" in str(warning.message)


def test_a_generator_the_script_drew_from_before_any_run_is_not_warned_of() -> None:
    """A generator drawn before the first run gives the same order from one fresh script to the next, so a
    seeded run says nothing of it: torch's random_split sharing the loader's seeded generator, a look at one
    batch before fit(). The same loader run again is still named."""
    dataset = torch.utils.data.TensorDataset(torch.arange(16.0)[:, None])
    g = torch.Generator().manual_seed(42)
    train, _ = torch.utils.data.random_split(dataset, [0.75, 0.25], generator=g)
    split = torch.utils.data.DataLoader(train, batch_size=4, shuffle=True, generator=g)
    first, said = fits(split, seed=0)
    assert len(first) == 3 and said == []
    again, said = fits(split, seed=0)
    assert again != first and len(said) == 1 and "train_data.generator goes on from" in str(said[0].message)
    looked = torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))
    next(iter(looked))
    assert fits(looked, seed=0)[1] == []


def test_a_resumed_run_whose_loader_drew_before_is_not_warned_of(tmp_path: Path) -> None:
    """A run resumed from a checkpoint takes its loader's generator state from it: seed= has nothing to say."""
    from hookfit.plugins.checkpoint import Checkpoint

    from conftest import StopAfter, mse_step

    dataset = torch.utils.data.TensorDataset(torch.randn(16, 2), torch.randn(16, 1))
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    model = torch.nn.Linear(2, 1)

    def run(*plugins, **options):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = hookfit.Loop(mse_step, loader, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                                 max_epochs=2, seed=0, run_dir=tmp_path, plugins=[Optim(), *plugins], **options).fit()
        return state, [str(w.message) for w in caught if "reseed" in str(w.message)]

    stopped, said = run(Checkpoint(every_n_steps=1, background=False), StopAfter(3))
    assert stopped.status == "interrupted" and said == []
    resumed, said = run(Checkpoint(background=False), resume="latest")
    assert resumed.resumed_from is not None and resumed.status == "completed" and said == []
