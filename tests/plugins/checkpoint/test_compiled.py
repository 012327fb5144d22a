"""``torch.compile``d models for real, with the ``inductor`` backend where it can
build its C++ kernels here (probed once per session) and always with ``aot_eager`` (AOTAutograd's
traced graphs run eagerly: what a machine without a compiler can use): a compiled run's
checkpoint holds the plain module's keys, resumes compiled and uncompiled, and an uncompiled
one resumes compiled; ``hookfit export`` of it loads into the plain module as the README says;
EMA's average is a plain module; the model summary counts the plain module.

Which comparisons are bitwise: a run resumed with the backend it was written with ends equal,
bit for bit, to the uninterrupted run of that backend. Across backends (compiled, then resumed
plain, or the other way round) ``aot_eager`` is bitwise equal to eager here, and ``inductor``'s
fused kernels may differ from eager in the last bits: those are compared with a tight tolerance
(``TOLERANCE``), after checking that inductor's own drift from eager stays within it too.

Each backend's runs are made once (a module-scoped fixture) and shared by the tests."""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint, digest, read
from hookfit.plugins.ema import EMA
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim
from hookfit.plugins.support.summary import summarize

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
"""How far inductor's results may be from eager's (float32, a few dozen steps)."""

EXACT = {"aot_eager": True, "inductor": False}
"""Whether a backend's results equal eager's bit for bit (see the module's docstring)."""


@functools.cache
def inductor_problem() -> str | None:
    """Why ``inductor`` cannot compile here (no working C++ compiler, say), or ``None`` where it
    can: a module compiled once, forward and backward, the first time a test asks."""
    torch._dynamo.reset()
    try:
        model = torch.compile(torch.nn.Linear(2, 1), backend="inductor", fullgraph=True)
        model(torch.randn(3, 2)).sum().backward()
    except Exception as error:  # noqa: BLE001 - any failure to build is the reason to fall back
        lines = str(error).strip().splitlines() or [""]
        return f"{type(error).__name__}: {lines[0][:200]}"
    finally:
        torch._dynamo.reset()
    return None


def _model() -> torch.nn.Sequential:
    """Parameters, buffers (batch norm's running statistics) and a module without either."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


_g = torch.Generator().manual_seed(1)
TRAIN = [(torch.randn(8, 2, generator=_g), torch.randn(8, 1, generator=_g)) for _ in range(4)]
VALID = [(torch.randn(8, 2, generator=_g), torch.randn(8, 1, generator=_g)) for _ in range(2)]


def step(loop: Any, batch: Any) -> dict[str, torch.Tensor]:
    loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    return {"loss": loss}


def val_step(loop: Any, batch: Any) -> dict[str, torch.Tensor]:
    return {"loss": torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])}


@dataclass
class Trained:
    """What a run left: the plain module (trained in place through its compiled wrapper), EMA's
    average, the epoch metrics, where it resumed from, and its newest checkpoint."""

    model: torch.nn.Sequential
    average: torch.nn.Module
    history: dict[str, list[dict[str, Any]]]
    resumed_from: Path | None
    last: Path | None
    graphs: int  # the graphs dynamo compiled for it (0 for a plain run)


def train(run_dir: Path, backend: str | None, epochs: int, resume: Path | None = None) -> Trained:
    """A run of two epochs at most, with validation (through the compiled model too: its EMA
    weights) and a checkpoint every epoch; compiled with ``backend``, or plain for ``None``."""
    from torch._dynamo.utils import counters

    plain = _model()
    if backend is not None:
        torch._dynamo.reset()  # compiled afresh: this run's graphs are its own
        counters.clear()
    model = plain if backend is None else torch.compile(plain, backend=backend)
    metrics, ema, checkpoint = Metrics(), EMA(decay=0.9), Checkpoint(background=False)
    state = hookfit.Loop(step, TRAIN, val_step=val_step, val_data=VALID, model=model, max_epochs=epochs,
                         optimizers=torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9),
                         run_dir=run_dir, resume=None if resume is None else str(resume),
                         plugins=[Optim(), metrics, ema, checkpoint]).fit()
    assert state.status == "completed", state
    graphs = 0
    if backend is not None:
        assert not counters["graph_break"], dict(counters["graph_break"])
        graphs = counters["stats"]["unique_graphs"]
    assert ema.module is not None
    history = {stage: [dict(entry) for entry in entries] for stage, entries in metrics.history.items()}
    resumed = None if state.resumed_from is None else Path(state.resumed_from.source)
    return Trained(plain, ema.module, history, resumed, checkpoint.last, graphs)


@dataclass
class Runs:
    backend: str
    plain: Trained  # two epochs, never compiled
    compiled: Trained  # two epochs, compiled
    first: Trained  # the first epoch, compiled
    exported: Path  # hookfit export of first's run
    compiled_compiled: Trained  # first, resumed compiled
    compiled_plain: Trained  # first, resumed plain
    plain_compiled: Trained  # one plain epoch, resumed compiled


BACKENDS = [pytest.param(backend, marks=pytest.mark.slow) for backend in ("inductor", "aot_eager")]


@pytest.fixture(scope="module", params=BACKENDS)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    backend: str = request.param
    if backend == "inductor" and (problem := inductor_problem()) is not None:
        pytest.skip(f"inductor cannot compile here ({problem}); the aot_eager runs stand in for it")
    root = tmp_path_factory.mktemp(f"compiled-{backend}")
    plain = train(root / "plain", None, 2)
    compiled = train(root / "compiled", backend, 2)
    first = train(root / "first", backend, 1)
    assert first.last is not None and first.last.name == "epoch0001-step000000004.pt"
    exported = root / "model.pt"
    command = [str(Path(sys.executable).with_name("hookfit")), "export", str(root / "first"), str(exported)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    compiled_compiled = train(root / "compiled-compiled", backend, 2, resume=first.last)
    compiled_plain = train(root / "compiled-plain", None, 2, resume=first.last)
    plain_first = train(root / "plain-first", None, 1)
    assert plain_first.last is not None
    plain_compiled = train(root / "plain-compiled", backend, 2, resume=plain_first.last)
    torch._dynamo.reset()
    yield Runs(backend, plain, compiled, first, exported, compiled_compiled, compiled_plain, plain_compiled)


def tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(module.state_dict())


def assert_equal(a: Trained, b: Trained) -> None:
    """Bit for bit: the weights, batch norm's statistics, EMA's average and every epoch metric."""
    for x, y in ((a.model, b.model), (a.average, b.average)):
        tx, ty = tensors(x), tensors(y)
        assert list(tx) == list(ty)
        different = [k for k in tx if not torch.equal(tx[k], ty[k])]
        assert not different, different
    assert a.history == b.history


def assert_close(a: Trained, b: Trained, exact: bool) -> None:
    """Bit for bit where ``exact``, else within ``TOLERANCE`` (metrics too)."""
    if exact:
        assert_equal(a, b)
        return
    for x, y in ((a.model, b.model), (a.average, b.average)):
        tx, ty = tensors(x), tensors(y)
        assert list(tx) == list(ty)
        for key in tx:
            torch.testing.assert_close(tx[key], ty[key], **TOLERANCE, msg=lambda m, key=key: f"{key}: {m}")
    assert a.history.keys() == b.history.keys()
    for stage in a.history:
        for x, y in zip(a.history[stage], b.history[stage], strict=True):
            assert x.keys() == y.keys()
            torch.testing.assert_close({k: float(v) for k, v in x.items() if isinstance(v, (int, float))},
                                       {k: float(v) for k, v in y.items() if isinstance(v, (int, float))},
                                       **TOLERANCE)


def test_every_compiled_run_was_compiled_by_its_backend_in_one_graph_a_mode(runs: Runs) -> None:
    """The runs below compare something real: dynamo compiled the model (no graph break), once
    for training and once for evaluation, in every compiled run; the plain runs compiled nothing."""
    assert [r.graphs for r in (runs.compiled, runs.first, runs.compiled_compiled, runs.plain_compiled)] == [2] * 4
    assert runs.plain.graphs == runs.compiled_plain.graphs == 0
    assert_close(runs.compiled, runs.plain, EXACT[runs.backend])  # compiled training is the plain one's


def test_a_compiled_runs_checkpoint_holds_the_plain_modules_keys(runs: Runs) -> None:
    plain_keys = list(_model().state_dict())
    assert plain_keys == ["0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
                          "1.num_batches_tracked", "3.weight", "3.bias"]
    assert runs.first.last is not None
    saved = read(runs.first.last)
    assert list(saved["model"]) == plain_keys  # none with "_orig_mod."
    assert list(saved["plugins"]["ema"]["state_dict"]) == plain_keys
    assert all(torch.equal(saved["model"][k], v) for k, v in tensors(runs.first.model).items())


def test_hookfit_export_of_a_compiled_run_loads_into_the_plain_module_as_the_readme_says(runs: Runs) -> None:
    model = _model()
    model.load_state_dict(torch.load(runs.exported))  # the README's recipe: strict, weights_only
    assert all(torch.equal(v, tensors(runs.first.model)[k]) for k, v in tensors(model).items())


def test_a_compiled_run_resumed_compiled_ends_bitwise_equal_to_the_uninterrupted_compiled_run(runs: Runs) -> None:
    assert runs.compiled_compiled.resumed_from == runs.first.last
    assert_equal(runs.compiled_compiled, runs.compiled)


def test_a_compiled_run_resumes_uncompiled_and_an_uncompiled_one_compiled(runs: Runs) -> None:
    """Across backends: bitwise with ``aot_eager``, within ``TOLERANCE`` with ``inductor``."""
    exact = EXACT[runs.backend]
    assert runs.compiled_plain.resumed_from == runs.first.last
    assert_close(runs.compiled_plain, runs.plain, exact)
    assert runs.plain_compiled.resumed_from is not None
    assert runs.plain_compiled.resumed_from.name == "epoch0001-step000000004.pt"
    assert_close(runs.plain_compiled, runs.plain, exact)
    assert_close(runs.plain_compiled, runs.compiled, exact)


def test_emas_average_of_a_compiled_model_is_the_plain_module_and_validates_with_it(runs: Runs) -> None:
    """The average is a plain ``Sequential`` that loads into the plain model (strictly), and the
    validation with it, through the compiled model, is the average's own loss."""
    average = runs.compiled.average
    assert type(average) is torch.nn.Sequential
    model = _model()
    model.load_state_dict(average.state_dict())
    model.eval()
    with torch.no_grad():
        loss = sum(float(torch.nn.functional.mse_loss(model(x), y)) * len(x) for x, y in VALID) / 16
    last = runs.compiled.history["valid"][-1]
    exact = EXACT[runs.backend]
    assert last["loss"] == pytest.approx(loss, rel=1e-6 if exact else TOLERANCE["rtol"], abs=0 if exact else 1e-6)


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_the_model_summary_of_a_compiled_model_is_the_plain_modules(backend: str) -> None:
    plain = _model()
    summary = summarize(torch.compile(plain, backend=backend))  # the wrapper compiles nothing until called
    assert summary == summarize(plain)
    assert summary.type == "Sequential" and summary.parameters == 2 * 8 + 8 + 2 * 8 + 8 + 1
    assert [(row.name, row.type) for row in summary.modules] == [
        ("0", "Linear"), ("1", "BatchNorm1d"), ("2", "ReLU"), ("3", "Linear")]


def _prefixed(path: Path) -> None:
    """Rewrite the checkpoint at ``path`` as one written before the model was unwrapped: each
    module's keys as ``torch.compile``'s wrapper gives them (``_orig_mod.0.weight``)."""
    data = read(path)
    model = data["model"]
    prefix = {"_orig_mod." + k: v for k, v in model.items()} if "0.weight" in model else {
        name: {"_orig_mod." + k: v for k, v in state.items()} for name, state in model.items()}
    data["model"] = prefix
    data["digest"] = digest(data)
    torch.save(data, path)


def test_an_old_checkpoint_with_the_compiled_modules_prefixed_keys_exports_plain_keys(tmp_path: Path) -> None:
    """A checkpoint written before the model was unwrapped held ``_orig_mod.``-prefixed keys;
    ``hookfit export`` writes them as the plain module's."""
    from hookfit.plugins.checkpoint.export import export

    first = train(tmp_path / "run", None, 1)
    assert first.last is not None
    _prefixed(first.last)
    export(tmp_path / "run", tmp_path / "model.pt")
    model = _model()
    model.load_state_dict(torch.load(tmp_path / "model.pt"))
    assert all(torch.equal(v, tensors(first.model)[k]) for k, v in tensors(model).items())


def test_an_old_checkpoint_of_a_dict_of_compiled_models_exports_each_with_plain_keys(tmp_path: Path) -> None:
    from hookfit.plugins.checkpoint.export import export

    models = {"g": torch.nn.Linear(2, 3), "d": torch.nn.Linear(3, 1)}
    checkpoint = Checkpoint(background=False)
    hookfit.Loop(lambda loop, batch: None, [1], model=models, run_dir=tmp_path / "run", plugins=[checkpoint]).fit()
    assert checkpoint.last is not None
    _prefixed(checkpoint.last)
    export(checkpoint.last, tmp_path / "model.pt")
    exported = torch.load(tmp_path / "model.pt")
    assert set(exported) == {"g", "d"}
    for name, module in models.items():
        fresh = torch.nn.Linear(module.in_features, module.out_features)
        fresh.load_state_dict(exported[name])
        assert all(torch.equal(v, tensors(module)[k]) for k, v in tensors(fresh).items())
