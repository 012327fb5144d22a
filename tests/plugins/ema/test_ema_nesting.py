"""The ema plugin with another plugin that changes the model for validation, written here as
``core/hooks.md`` says such a plugin is written: the two swap in and back nested, in either
registration order, whether validation ends, fails or is stopped; validation runs with the
weights of the plugin registered last; a stop during validation resumes exactly."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit import hookimpl
from hookfit.plugins.checkpoint import Checkpoint, read
from hookfit.plugins.ema import EMA
from hookfit.plugins.optim import Optim

from conftest import make_dist, mse_step
from test_ema_evaluation import make_data, make_model  # a model with batch norm: buffers are swapped too


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


SWAPPER = '''
from collections.abc import Generator
from typing import Any

import torch

import hookfit


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class Swapper:
    """Validates with weights of its own (every floating-point tensor of the model filled with
    0.25), as the contract for a plugin that changes the model for a stage says: swap in after
    ``yield`` in a ``wrapper=True`` ``stage_start``; swap back before ``yield`` in a
    ``wrapper=True`` ``stage_end`` and ``fit_end``, and in ``exception``."""

    def __init__(self) -> None:
        self.kept: dict[str, torch.Tensor] | None = None

    def weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """What it validates with."""
        return {k: v.fill_(0.25) if v.is_floating_point() else v for k, v in snapshot(model).items()}

    @hookfit.hookimpl(wrapper=True)
    def stage_start(self, loop: Any, stage: str) -> Generator[None, object, object]:
        result = yield
        if stage == "valid":
            with torch.inference_mode(False), torch.no_grad():
                self.kept = snapshot(loop.model)
                loop.model.load_state_dict(self.weights(loop.model))
        return result

    def restore(self, loop: Any) -> None:
        kept, self.kept = self.kept, None
        if kept is not None:
            with torch.inference_mode(False), torch.no_grad():
                loop.model.load_state_dict(kept)

    @hookfit.hookimpl(wrapper=True)
    def stage_end(self, loop: Any, stage: str) -> Generator[None, object, object]:
        self.restore(loop)
        return (yield)

    @hookfit.hookimpl(wrapper=True)
    def fit_end(self, loop: Any) -> Generator[None, object, object]:
        self.restore(loop)
        return (yield)

    @hookfit.hookimpl
    def exception(self, loop: Any) -> None:
        self.restore(loop)
'''
"""A third-party plugin validating with weights of its own, installed (an entry point) under a
name sorting before the built-in ``ema`` (registered before it) or after it."""

NAMES = {"swapper registered first": "avg_swap", "ema registered first": "swap"}


@pytest.fixture(params=NAMES.values(), ids=list(NAMES))
def swapper(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The swapper's entry-point name, it alone of the discovered plugins enabled."""
    name = request.param
    root = make_dist(tmp_path / "site", "nesting-swapper", {name: "nesting_swapper:Swapper"},
                     {"nesting_swapper": SWAPPER})
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("HOOKFIT_PLUGINS", name)
    sys.modules.pop("nesting_swapper", None)
    yield name
    sys.modules.pop("nesting_swapper", None)


class Seen:
    """A validation step recording the weights it validates with; it raises or asks for a
    stop at a given validation batch ``(epoch, batch)``."""

    def __init__(self, stop_at: tuple[int, int] | None = None, raise_at: tuple[int, int] | None = None) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []
        self.stop_at, self.raise_at = stop_at, raise_at

    def __call__(self, loop: Any, batch: Any) -> dict[str, Any]:
        self.weights.append(snapshot(loop.model))
        at = (loop.state.epoch, loop.state.batch_idx)
        if at == self.raise_at:
            raise RuntimeError("validation broke")
        if at == self.stop_at:
            loop.request_stop("test stop in validation")
        return {"loss": torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])}


class Trained:
    """The model's weights after each training stage, as training left them."""

    name = "trained"

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []

    @hookimpl(tryfirst=True)
    def stage_end(self, loop: Any, stage: str) -> None:
        if stage == "train":
            self.weights.append(snapshot(loop.model))


def run(*others: Any, val: Any = None, fails: type[BaseException] | None = None,
        **kwargs: Any) -> tuple[hookfit.Loop, torch.nn.Module, EMA]:
    """Three epochs with the ema plugin (and the discovered swapper)."""
    model = make_model()
    train, valid = make_data()
    ema = EMA(decay=0.5)
    loop = hookfit.Loop(mse_step, train, val_step=val or Seen(), val_data=valid, model=model, max_epochs=3,
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                        plugins=[Optim(), ema, *others], **kwargs)
    if fails is None:
        loop.fit()
    else:
        with pytest.raises(fails):
            loop.fit()
    return loop, model, ema


def test_validation_uses_the_weights_of_the_plugin_registered_last_and_training_gets_its_own_back(
        swapper: str) -> None:
    seen, trained = Seen(), Trained()
    loop, model, ema = run(trained, val=seen)
    registered = [name for name, _ in loop.run.pm.list_name_plugin() if name in (swapper, "ema")]
    assert registered == (["avg_swap", "ema"] if swapper == "avg_swap" else ["ema", "swap"])
    assert ema.n_averaged == 12 and len(seen.weights) == 6
    quarter = [all(torch.equal(v, torch.full_like(v, 0.25)) for v in w.values() if v.is_floating_point())
               for w in seen.weights]
    if registered[-1] == "ema":  # the average of the last update before that validation
        assert not any(quarter) and same(seen.weights[-1], snapshot(ema.module))
    else:
        assert all(quarter)
    # training went on from its own weights after each validation: it is that of a run without the plugins
    assert same(snapshot(model), trained.weights[-1])
    plain = make_model()
    train, valid = make_data()
    hookfit.Loop(mse_step, train, val_step=Seen(), val_data=valid, model=plain, max_epochs=3,
                 optimizers=torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9), plugins=[Optim()]).fit()
    assert same(snapshot(model), snapshot(plain))


@pytest.mark.fault
def test_a_stop_during_validation_checkpoints_the_training_weights_and_resumes_exactly(
        swapper: str, tmp_path: Path) -> None:
    """No stage_end("valid") fires: both plugins swap back in their fit_end wrappers, nested,
    before the checkpoint's tryfirst fit_end saves; the resumed run validates that epoch again
    and ends as the uninterrupted one, bit for bit."""
    _, whole, whole_ema = run()

    trained = Trained()
    checkpoint = Checkpoint(every_n_epochs=None, background=False)  # only the stop's checkpoint
    loop, model, ema = run(trained, checkpoint, val=Seen(stop_at=(1, 0)), run_dir=tmp_path / "cut")
    assert loop.run.state.status == "interrupted" and loop.run.state.stop_reason == "test stop in validation"
    assert same(snapshot(model), trained.weights[-1])
    saved = read(checkpoint.saved[-1])
    assert saved["loop"]["resume_stage"] == "valid"
    assert same(saved["model"], trained.weights[-1])

    loop, resumed, resumed_ema = run(Checkpoint(every_n_epochs=None, background=False), run_dir=tmp_path / "cut",
                                     resume="latest")
    assert loop.run.state.status == "completed" and loop.run.state.resumed_from is not None
    assert same(snapshot(resumed), snapshot(whole))
    assert same(snapshot(resumed_ema.module), snapshot(whole_ema.module))


@pytest.mark.fault
def test_a_validation_that_raises_gives_the_training_weights_back_to_the_model_and_the_failure_checkpoint(
        swapper: str, tmp_path: Path) -> None:
    trained = Trained()
    checkpoint = Checkpoint(every_n_epochs=None, on_failure=True, background=False)
    loop, model, _ = run(trained, checkpoint, val=Seen(raise_at=(1, 1)), run_dir=tmp_path, fails=RuntimeError)
    assert loop.run.state.status == "failed"
    assert same(snapshot(model), trained.weights[-1])
    failed = read(next((tmp_path / "checkpoints").glob("failed-*.pt")))
    assert same(failed["model"], trained.weights[-1])
