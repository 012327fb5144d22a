"""hookfit.plugins.support.referenced: the modules a step function reads from outside itself."""

from __future__ import annotations

import functools
import sys
from types import SimpleNamespace

import pytest
import torch

from hookfit.plugins.support.referenced import held_modules, referenced_modules

GLOBAL_NET: torch.nn.Module | None = None
MODELS: dict[str, torch.nn.Module] = {}
CFG = SimpleNamespace()


def _helper(x):
    return GLOBAL_NET(x)


def _reads_a_global(loop, batch):
    return _helper(batch) + sum(MODELS[k](batch) for k in MODELS) + CFG.head(batch)


def _found(step, skip=()):
    return [(r.name, r.where, r.reader, r.module) for r in referenced_modules(step, skip=skip)]


@pytest.fixture
def nets(monkeypatch: pytest.MonkeyPatch) -> list[torch.nn.Module]:
    """Three modules as the test module's globals: ``GLOBAL_NET``, ``MODELS["teacher"]`` and ``CFG.head``."""
    made = [torch.nn.Linear(2, 2) for _ in range(3)]
    here = sys.modules[__name__]
    monkeypatch.setattr(here, "GLOBAL_NET", made[0])
    monkeypatch.setattr(here, "MODELS", {"teacher": made[1]})
    monkeypatch.setattr(here, "CFG", SimpleNamespace(head=made[2], lr=0.1))
    return made


def test_globals_of_the_step_and_of_its_module_s_helpers_one_level_down(nets) -> None:
    assert _found(_reads_a_global) == [
        ("GLOBAL_NET", "global", "_helper", nets[0]), ("MODELS['teacher']", "global", "_reads_a_global", nets[1]),
        ("CFG.head", "global", "_reads_a_global", nets[2])]
    assert _found(_reads_a_global, skip=(nets[1], CFG)) == [("GLOBAL_NET", "global", "_helper", nets[0])]


def test_closure_cells_nested_code_and_a_module_read_twice_once() -> None:
    teacher, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    pair = [teacher, other]

    def step(loop, batch):
        return [teacher(b) for b in batch] + [(lambda m: m(batch))(pair[1])]

    assert _found(step) == [("pair[0]", "closure", "test_closure_cells_nested_code_and_a_module_read_twice_once."
                             "<locals>.step", teacher),
                            ("pair[1]", "closure", "test_closure_cells_nested_code_and_a_module_read_twice_once."
                             "<locals>.step", other)]


def test_what_the_step_gets_as_arguments_is_not_found_and_a_decorated_step_is_read_through() -> None:
    teacher = torch.nn.Linear(2, 2)

    def decorate(function):
        @functools.wraps(function)
        def wrapper(loop, batch):
            return function(loop, batch)
        return wrapper

    @decorate
    def step(loop, batch):
        return loop.model(batch) + teacher(batch)

    assert [(name, where) for name, where, _, _ in _found(step)] == [("teacher", "closure")]
    assert _found(lambda loop, batch: loop.model["teacher"](batch)) == []


def test_an_instance_s_attributes_a_partial_s_arguments_and_a_module_written_as_the_step() -> None:
    class Trainer:
        def __init__(self) -> None:
            self.teacher, self.rate = torch.nn.Linear(2, 2), 0.1

        def step(self, loop, batch):
            return self.teacher(batch)

    trainer = Trainer()
    assert [(n, w, m) for n, w, _, m in _found(trainer.step)] == [("self.teacher", "self", trainer.teacher)]

    def step(loop, batch, teacher):
        return teacher(batch)

    net = torch.nn.Linear(2, 2)
    assert [(n, w) for n, w, _, _ in _found(functools.partial(step, teacher=net))] == [("teacher", "argument")]

    class Step(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.teacher = torch.nn.Linear(2, 2)

        def forward(self, loop, batch):
            return self.teacher(batch)

    module = Step()
    assert [(n, w, m) for n, w, _, m in _found(module)] == [("self.teacher", "self", module.teacher)]


def test_held_modules_are_a_value_s_modules_one_level_down() -> None:
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    assert held_modules(a) == [a] and held_modules({"a": a, "x": 1}) == [a]
    assert held_modules(SimpleNamespace(a=a, b=b, again=a, deeper={"c": torch.nn.Linear(2, 2)})) == [a, b]
