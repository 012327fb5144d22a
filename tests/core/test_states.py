"""hookfit.states: the run's own state is JSON-safe by construction (string keys, lists never
tuples, tensors apart), so a store that writes tensors apart and the rest as JSON resumes a run
exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import hookfit


def tuples_in(value: Any, where: str = "state") -> list[str]:
    """Where ``value`` holds a tuple or a non-string key."""
    if isinstance(value, tuple):
        return [where]
    if isinstance(value, list):
        return [w for i, v in enumerate(value) for w in tuples_in(v, f"{where}[{i}]")]
    if isinstance(value, dict):
        bad = [f"{where} key {k!r}" for k in value if not isinstance(k, str)]
        return bad + [w for k, v in value.items() for w in tuples_in(v, f"{where}[{k!r}]")]
    return []


def to_json(value: Any, tensors: list[torch.Tensor]) -> str:
    def encode(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            tensors.append(item.clone())
            return {"__tensor__": len(tensors) - 1}
        if isinstance(item, dict):
            return {k: encode(v) for k, v in item.items()}
        if isinstance(item, list):
            return [encode(v) for v in item]
        return item

    return json.dumps(encode(value))


def from_json(text: str, tensors: list[torch.Tensor]) -> Any:
    return json.loads(text, object_hook=lambda d: tensors[d["__tensor__"]] if "__tensor__" in d else d)


class JsonStore:
    """Saves the model and ``loop.state_dict()`` after a chosen step as tensors plus JSON, and
    resumes from them: a non-pickle store."""

    name = "json_store"

    def __init__(self, at: int | None = None, saved=None) -> None:
        self.at, self.saved = at, saved

    @hookfit.hookimpl
    def after_batch(self, loop):
        if loop.state.step == self.at:
            tensors: list[torch.Tensor] = []
            state = loop.state_dict()
            self.tuples = tuples_in(state)
            self.saved = (to_json(state, tensors), tensors, {k: v.clone() for k, v in loop.model.state_dict().items()})
            loop.request_stop("saved")

    @hookfit.hookimpl
    def resume(self, loop, source):
        text, tensors, weights = self.saved
        loop.model.load_state_dict(weights)
        loop.load_state_dict(from_json(text, tensors))
        return "json"


def train(store: JsonStore, resume: str | None = None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Dropout(0.3), torch.nn.Linear(4, 1))
    xs = [torch.randn(2, generator=torch.Generator().manual_seed(i)) for i in range(16)]
    data = DataLoader(xs, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))

    def step(loop, x):
        loss = loop.model(x + torch.rand(x.shape)).square().mean()
        loss.backward()
        with torch.no_grad():
            for p in loop.model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
        return loss

    state = hookfit.Loop(step, data, model=model, max_epochs=3, resume=resume, plugins=[store]).fit()
    return state, [p.detach().clone() for p in model.parameters()]


def test_the_runs_state_has_no_tuples_and_resumes_exactly_through_a_json_store(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _, want = train(JsonStore())
    store = JsonStore(at=6)  # inside the second epoch's training stage: data_rng is there
    assert train(store)[0].status == "interrupted"
    assert store.tuples == []
    assert {"loop", "rng", "data_rng"} <= set(json.loads(store.saved[0]))
    state, got = train(JsonStore(saved=store.saved), resume="json")
    assert state.status == "completed" and state.step == 12
    assert all(torch.equal(p, q) for p, q in zip(got, want))


@pytest.mark.bad_input
def test_a_numpy_number_in_the_carry_is_named_when_the_state_is_taken() -> None:
    """A numpy scalar is a Python float or int by class, but a checkpoint holding it cannot be read back
    (torch.load(weights_only=True) refuses it): named, as any value a checkpoint cannot hold."""
    class Takes:
        name = "takes"

        @hookfit.hookimpl
        def after_batch(self, loop: Any) -> None:
            loop.state_dict()

    def step(loop: Any, batch: Any) -> None:
        loop.carry["h"] = [np.float64(0.5)]

    with pytest.raises(TypeError, match=r"loop\.carry\['h'\]\[0\] is a numpy\.float64: what the step carries is "
                                        r"saved with the run"):
        hookfit.Loop(step, [1, 2], plugins=[Takes()]).fit()
