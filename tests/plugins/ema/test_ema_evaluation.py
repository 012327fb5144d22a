"""The ema plugin in an evaluation (``Loop.validate(resume=...)``): the checkpoint's average is
validated with no optimizer, or, without the plugin's decay, one warning says plainly that the
training weights are validated; and ``hookfit export --weights ema`` writes the average."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit import HookfitWarning
from hookfit.plugins.checkpoint import Checkpoint, read
from hookfit.plugins.ema import EMA
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim

from conftest import mse_step


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU(),
                               torch.nn.Linear(4, 1))


def make_data() -> tuple[list[Any], list[Any]]:
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 3, generator=generator), torch.randn(8, 1, generator=generator)) for _ in range(6)]
    return batches[:4], batches[4:]


def val_step(loop: Any, batch: Any) -> dict[str, Any]:
    return {"loss": torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])}


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def trained(tmp_path: Path, ema: EMA | None = None) -> tuple[Path, float, EMA]:
    """A run of 3 epochs validated with the average (decay 0.5, far from the training
    weights); returns its last checkpoint, its last validation loss and the plugin."""
    ema = EMA(decay=0.5) if ema is None else ema
    model = make_model()
    train, valid = make_data()
    state = hookfit.Loop(mse_step, train, val_step=val_step, val_data=valid, model=model, max_epochs=3,
                         optimizers=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                         run_dir=tmp_path / "run", plugins=[Optim(), Metrics(), ema, Checkpoint(background=False)]).fit()
    return Path(state.results["last_checkpoint"]), state.results["metrics"]["valid/loss"], ema


def evaluate(checkpoint: Path, *plugins: Any) -> tuple[float, torch.nn.Module]:
    """``Loop.validate(resume=checkpoint)`` with no optimizer; its loss and its model."""
    model = make_model()
    train, valid = make_data()
    loop = hookfit.Loop(mse_step, train, val_step=val_step, val_data=valid, model=model,
                        plugins=[Metrics(), Checkpoint(), *plugins])
    return loop.validate(resume=str(checkpoint)).results["metrics"]["valid/loss"], model


def test_an_evaluation_with_the_plugin_validates_the_checkpoints_average_without_optimizers(tmp_path: Path) -> None:
    """The loss is the training run's own last validation (made with the average), not the
    training weights' loss; the model ends with the checkpoint's training weights."""
    checkpoint, run_loss, ema = trained(tmp_path)
    with pytest.warns(HookfitWarning, match="saved state of plugin\\(s\\) 'ema' that no enabled plugin"):
        training_loss, _ = evaluate(checkpoint, Optim())  # no ema plugin at all: the training weights
    assert training_loss != pytest.approx(run_loss, rel=1e-3)  # the test can tell the two apart

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the average is there: not a word
        loss, model = evaluate(checkpoint, Optim(), EMA(decay=0.9))  # the decay is not used
    assert loss == run_loss
    assert same(snapshot(model), read(checkpoint)["model"])


def test_an_evaluation_without_the_plugins_decay_says_it_validates_the_training_weights(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint, run_loss, _ = trained(tmp_path)
    monkeypatch.setenv("HOOKFIT_PLUGINS", "optim,metrics,checkpoint,ema")  # ema discovered, without a decay
    with pytest.warns(HookfitWarning) as caught:
        loss, _ = evaluate(checkpoint)
    messages = [str(w.message) for w in caught]
    assert any(m.startswith("ema: the checkpoint holds an exponential moving average of the weights (12 update(s)), "
                            "and this evaluation validates the training weights, not the average; to validate "
                            "the average, give Loop(plugins=[EMA(decay=...)])") for m in messages), messages
    assert not any("no enabled plugin of this run restores" in m for m in messages), messages
    assert caught[0].filename == __file__  # at the script's validate() line
    assert loss != pytest.approx(run_loss, rel=1e-3)


def test_an_evaluation_of_a_checkpoint_without_an_average_warns_and_validates_the_training_weights(
        tmp_path: Path) -> None:
    model = make_model()
    train, valid = make_data()
    state = hookfit.Loop(mse_step, train, val_step=val_step, val_data=valid, model=model, max_epochs=1,
                         optimizers=torch.optim.SGD(model.parameters(), lr=0.1), run_dir=tmp_path / "plain",
                         plugins=[Optim(), Metrics(), Checkpoint(background=False)]).fit()
    checkpoint = Path(state.results["last_checkpoint"])
    plain, _ = evaluate(checkpoint, Optim())
    with pytest.warns(HookfitWarning, match=r"^ema: this evaluation has no average to validate \(the checkpoint it "
                                            r"read holds none.*\): it validates the training weights$"):
        loss, _ = evaluate(checkpoint, Optim(), EMA(decay=0.9))
    assert loss == plain


def test_hookfit_export_weights_ema_writes_the_average_laid_out_as_the_model(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hookfit.tools import cli

    checkpoint, _, ema = trained(tmp_path)
    assert ema.module is not None
    average = snapshot(ema.module)
    assert cli.main(["export", str(tmp_path / "run"), str(tmp_path / "model.pt")], plugins=[Checkpoint()]) == 0
    out = capsys.readouterr().out
    assert f"also holds the weights of plugin 'ema': --weights ema writes those" in out, out
    assert same(torch.load(tmp_path / "model.pt", weights_only=True), read(checkpoint)["model"])

    assert cli.main(["export", str(tmp_path / "run"), str(tmp_path / "ema.pt"), "--weights", "ema"],
                    plugins=[Checkpoint()]) == 0
    assert f"wrote {tmp_path / 'ema.pt'}: the weights of plugin 'ema' in {checkpoint}" in capsys.readouterr().out
    exported = torch.load(tmp_path / "ema.pt", weights_only=True)
    assert same(exported, average) and not same(exported, read(checkpoint)["model"])
    make_model().load_state_dict(exported)  # the model's keys: it loads


def test_an_evaluation_of_an_average_of_some_of_several_models_validates_it_with_the_others(tmp_path: Path) -> None:
    """A run averaged the generator alone (``EMA(optimizer="gen")``); its evaluation, which knows no optimizer,
    validates that average with the checkpoint's training discriminator (the average narrowed to the models
    the checkpoint's holds), and gives the training weights back."""

    def models() -> dict[str, torch.nn.Module]:
        torch.manual_seed(0)
        return {"gen": torch.nn.Linear(3, 1), "disc": torch.nn.Linear(3, 1)}

    def step(loop: Any, batch: Any) -> None:
        x, y = batch
        loop.backward(sum(torch.nn.functional.mse_loss(m(x), y) for m in loop.model.values()))
        for optimizer in loop.optimizers.values():
            optimizer.step()
            optimizer.zero_grad()

    seen: list[dict[str, torch.Tensor]] = []

    def validated(loop: Any, batch: Any) -> None:
        seen.append(snapshot(torch.nn.ModuleDict(loop.model)))

    train, valid = make_data()
    first = models()
    state = hookfit.Loop(step, train, model=first, max_epochs=2, run_dir=tmp_path / "run",
                         optimizers={n: torch.optim.SGD(m.parameters(), lr=0.1) for n, m in first.items()},
                         plugins=[Optim(), EMA(decay=0.5, optimizer="gen"), Checkpoint(background=False)]).fit()
    saved = read(Path(state.results["last_checkpoint"]))
    average = saved["plugins"]["ema"]["state_dict"]
    assert sorted(average) == ["gen.bias", "gen.weight"]
    second = models()
    loop = hookfit.Loop(step, train, val_step=validated, val_data=valid[:1], model=second,
                        plugins=[Optim(), Checkpoint(), EMA(decay=0.9)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loop.validate(resume=str(state.results["last_checkpoint"]))
    trained_weights = {f"{name}.{k}": v for name, part in saved["model"].items() for k, v in part.items()}
    assert same(seen[0], {**trained_weights, **average})  # the averaged generator, the trained discriminator
    assert same(snapshot(torch.nn.ModuleDict(second)), trained_weights)


def test_one_model_that_is_a_module_dict_is_averaged_whole_and_exported(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One model that is itself a ``ModuleDict`` (a frozen encoder, a trained head; the optimizer steps the
    head alone) is one model, not several: the average holds all of it, and ``--weights ema`` exports it."""
    from hookfit.tools import cli

    torch.manual_seed(0)
    encoder = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)).requires_grad_(False)
    model = torch.nn.ModuleDict({"enc": encoder, "head": torch.nn.Linear(3, 1)})
    train, _ = make_data()

    def step(loop: Any, batch: Any) -> None:
        loop.backward(torch.nn.functional.mse_loss(loop.model["head"](loop.model["enc"](batch[0])), batch[1]))
        loop.optimizers.step()
        loop.optimizers.zero_grad()

    ema = EMA(decay=0.5)
    hookfit.Loop(step, train, model=model, max_epochs=1, run_dir=tmp_path / "run",
                 optimizers=torch.optim.SGD(model["head"].parameters(), lr=0.1),
                 plugins=[Optim(), ema, Checkpoint(background=False)]).fit()
    assert ema.module is not None and sorted(ema.module.state_dict()) == sorted(model.state_dict())
    assert cli.main(["export", str(tmp_path / "run"), str(tmp_path / "ema.pt"), "--weights", "ema"],
                    plugins=[Checkpoint()]) == 0, capsys.readouterr()
    exported = torch.load(tmp_path / "ema.pt", weights_only=True)
    assert same(exported, snapshot(ema.module))
    model.load_state_dict(exported)  # the model's keys, all of them: it loads
