"""``hookfit export --weights NAME``: the weights a plugin offers in its saved state (a
``state_dict`` entry with the model's keys), laid out as the model is; any plugin's, not only
ema's; refused, naming what is wrong, when they are not there or not the model's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit import hookimpl
from hookfit.plugins.checkpoint import Checkpoint, CheckpointError, read
from hookfit.plugins.checkpoint.export import export
from hookfit.plugins.ema import EMA
from hookfit.plugins.optim import Optim


def two_model_step(loop: Any, batch: Any) -> dict[str, Any]:
    x, y = batch
    models = loop.model.values() if isinstance(loop.model, dict) else loop.model
    loss = sum(torch.nn.functional.mse_loss(m(x), y) for m in models)
    loop.backward(loss)
    for optimizer in loop.optimizers.values():
        optimizer.step()
        optimizer.zero_grad()
    return {"loss": loss}


def data() -> list[Any]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 3, generator=generator), torch.randn(4, 1, generator=generator)) for _ in range(3)]


@pytest.mark.parametrize("as_dict", [True, False])
def test_the_average_of_several_models_is_exported_as_the_model_is(tmp_path: Path, as_dict: bool) -> None:
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 1), torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    model: Any = {"g": a, "d": b} if as_dict else [a, b]
    ema = EMA(decay=0.5, optimizer="g")
    state = hookfit.Loop(two_model_step, data(), model=model, max_epochs=2, run_dir=tmp_path / "run",
                         optimizers={"g": torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1),  # both models
                                     "d": torch.optim.SGD(b.parameters(), lr=0.1)},
                         plugins=[Optim(), ema, Checkpoint(background=False)]).fit()
    done = export(tmp_path / "run", tmp_path / "ema.pt", weights="ema")
    assert done.checkpoint == Path(state.results["last_checkpoint"]) and done.weights == "ema"
    exported = torch.load(tmp_path / "ema.pt", weights_only=True)
    assert ema.module is not None
    averaged = list(ema.module.children())  # the ModuleDict's or ModuleList's models, in order
    parts = [exported["g"], exported["d"]] if as_dict else exported
    assert isinstance(exported, dict if as_dict else list) and len(parts) == 2
    for part, module, trained in zip(parts, averaged, (a, b)):
        assert part.keys() == module.state_dict().keys()
        assert all(torch.equal(part[k], v) for k, v in module.state_dict().items())
        assert not all(torch.equal(part[k], v) for k, v in trained.state_dict().items())  # not the training weights
        trained.load_state_dict(part)


@pytest.mark.parametrize("as_dict", [True, False])
def test_an_average_of_some_of_several_models_exports_those_alone(tmp_path: Path, as_dict: bool) -> None:
    """``EMA(optimizer="g")`` where "g" steps the first model alone: the export holds that model's average,
    by its name (or list position), and nothing of the other model."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 1), torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    model: Any = {"g": a, "d": b} if as_dict else [a, b]
    ema = EMA(decay=0.5, optimizer="g")
    hookfit.Loop(two_model_step, data(), model=model, max_epochs=2, run_dir=tmp_path / "run",
                 optimizers={"g": torch.optim.SGD(a.parameters(), lr=0.1), "d": torch.optim.SGD(b.parameters(), lr=0.1)},
                 plugins=[Optim(), ema, Checkpoint(background=False)]).fit()
    export(tmp_path / "run", tmp_path / "ema.pt", weights="ema")
    exported = torch.load(tmp_path / "ema.pt", weights_only=True)
    key = "g" if as_dict else 0
    assert ema.module is not None and list(exported) == [key]
    averaged = next(iter(ema.module.children())).state_dict()
    assert exported[key].keys() == averaged.keys() and all(torch.equal(exported[key][k], v) for k, v in averaged.items())
    assert not all(torch.equal(exported[key][k], v) for k, v in a.state_dict().items())  # the average, not a's own


class Offers:
    """A third-party plugin that keeps weights of its own in its saved state."""

    name = "swa_like"

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights

    @hookimpl
    def save_state(self, loop: Any) -> dict[str, Any]:
        return {"state_dict": self.weights, "count": 1}

    @hookimpl
    def load_state(self, loop: Any, state: Any) -> None:
        pass


def mse_step(loop: Any, batch: Any) -> dict[str, Any]:
    loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    return {"loss": loss}


def written(tmp_path: Path, weights: dict[str, torch.Tensor]) -> Path:
    model = torch.nn.Linear(3, 1)
    hookfit.Loop(mse_step, data(), model=model, max_epochs=1, run_dir=tmp_path / "run",
                 optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                 plugins=[Optim(), Offers(weights), Checkpoint(background=False)]).fit()
    return tmp_path / "run"


def test_any_plugin_whose_saved_state_holds_the_models_weights_offers_them(tmp_path: Path) -> None:
    weights = {"weight": torch.full((1, 3), 7.0), "bias": torch.zeros(1)}
    run = written(tmp_path, weights)
    done = export(run, tmp_path / "model.pt")
    assert done.weights is None and done.offered == ("swa_like",)
    export(run, tmp_path / "offered.pt", weights="swa_like")
    exported = torch.load(tmp_path / "offered.pt", weights_only=True)
    assert exported.keys() == weights.keys() and all(torch.equal(exported[k], v) for k, v in weights.items())


@pytest.mark.bad_input
@pytest.mark.parametrize("name, weights, message", [
    ("nope", {"weight": torch.zeros(1, 3), "bias": torch.zeros(1)},
     "holds no saved state of plugin 'nope' (plugins whose weights it holds: 'swa_like')"),
    ("optim", {"weight": torch.zeros(1, 3), "bias": torch.zeros(1)},
     "plugin 'optim''s saved state offers no weights (no 'state_dict' entry with a state dict; plugins whose "
     "weights it holds: 'swa_like')"),
    ("swa_like", {"weight": torch.zeros(1, 3), "other": torch.zeros(1)},
     "plugin 'swa_like''s weights do not have the keys of the model (missing ['bias'], unexpected ['other']): "
     "nothing was written"),
])
def test_weights_a_checkpoint_does_not_offer_are_refused_naming_why(
        tmp_path: Path, name: str, weights: dict[str, torch.Tensor], message: str) -> None:
    run = written(tmp_path, weights)
    checkpoint = sorted((run / "checkpoints").glob("*.pt"))[-1]
    assert read(checkpoint)["plugins"]["swa_like"]["state_dict"].keys() == weights.keys()
    with pytest.raises(CheckpointError) as error:
        export(run, tmp_path / "out.pt", weights=name)
    assert str(error.value) == f"hookfit export --weights {name}: {checkpoint}" + (
        " " if message.startswith("holds") else ": ") + message
    assert not (tmp_path / "out.pt").exists()


def test_best_exports_the_best_checkpoint_by_the_runs_monitor_even_the_newest(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``hookfit export RUN model.pt --best``: the model of the checkpoint with the best score of
    the run's monitor, not the newest; the newest itself where it is the best (its own state
    names the best before it), and an error naming the option where the run monitored nothing."""
    from hookfit.plugins.metrics import Metrics
    from hookfit.tools import cli

    def fitted(scores: list[float], monitor: str | None, folder: str) -> Path:
        m = torch.nn.Linear(3, 1)

        def score(loop: Any, batch: Any) -> dict[str, Any]:
            return {"loss": torch.tensor(scores[loop.state.epoch])}

        hookfit.Loop(two_model_step, data(), val_step=score, val_data=data()[:1], model=[m], max_epochs=len(scores),
                     optimizers={"a": torch.optim.SGD(m.parameters(), lr=0.1)}, run_dir=tmp_path / folder,
                     plugins=[Optim(), Metrics(), Checkpoint(monitor=monitor, keep_last=1, background=False)]).fit()
        return tmp_path / folder / "checkpoints"

    for scores, best in (([3.0, 1.0, 2.0], "epoch0002-step000000006.pt"), ([3.0, 2.0, 1.0], "epoch0003-step000000009.pt")):
        folder = fitted(scores, "valid/loss", f"run{best[8]}")
        assert cli.main(["export", str(folder.parent), str(tmp_path / "best.pt"), "--best"], plugins=[Checkpoint()]) == 0
        exported, saved = torch.load(tmp_path / "best.pt", weights_only=True), read(folder / best)["model"]
        assert len(exported) == 1 and all(torch.equal(exported[0][k], v) for k, v in saved[0].items())
        assert f"the model of {folder / best} (the best by valid/loss: {min(scores):g})" in capsys.readouterr().out
    unscored = fitted([1.0, 2.0], None, "unscored")
    assert cli.main(["export", str(unscored.parent), str(tmp_path / "x.pt"), "--best"], plugins=[Checkpoint()]) == 2
    assert "--best: the run of " in capsys.readouterr().err and not (tmp_path / "x.pt").exists()


def test_an_evaluation_resumes_the_best_checkpoint_of_the_newest_run(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``validate(resume="best")`` in a separate script: the checkpoint ``hookfit export --best`` takes (epoch 2's
    of three, by ``valid/loss``), said on stderr; there was no way to name it but digging its path out of
    ``run.jsonl``. A fit is refused it (training goes on from the newest), and a run that monitored nothing says
    so, pointing at ``"latest"``."""
    from hookfit.plugins.metrics import Metrics

    scores = [3.0, 1.0, 2.0]
    m = torch.nn.Linear(3, 1)

    def score(loop: Any, batch: Any) -> dict[str, Any]:
        return {"loss": torch.tensor(scores[loop.state.epoch])}

    hookfit.Loop(two_model_step, data(), val_step=score, val_data=data()[:1], model=[m], max_epochs=3,
                 optimizers={"a": torch.optim.SGD(m.parameters(), lr=0.1)}, run_dir=tmp_path / "run",
                 plugins=[Optim(), Metrics(), Checkpoint(monitor="valid/loss", keep_last=1, background=False)]).fit()
    best = tmp_path / "run" / "checkpoints" / "epoch0002-step000000006.pt"
    evaluated = torch.nn.Linear(3, 1)
    capsys.readouterr()
    state = hookfit.Loop(None, [], val_step=lambda loop, batch: {"loss": loop.model[0].weight.sum()},
                         val_data=data()[:1], model=[evaluated], run_dir=tmp_path / "run",
                         plugins=[Metrics(), Checkpoint()]).validate(resume="best")
    assert state.resumed_from is not None and Path(state.resumed_from.source) == best
    assert all(torch.equal(evaluated.state_dict()[k], v) for k, v in read(best)["model"][0].items())
    assert f"hookfit checkpoint: resume='best' took {best}" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^checkpoint: resume='best' is for Loop.validate\(\)"):
        hookfit.Loop(two_model_step, data(), model=[m], optimizers={"a": torch.optim.SGD(m.parameters(), lr=0.1)},
                     run_dir=tmp_path / "run", resume="best", plugins=[Optim(), Checkpoint()]).fit()
    hookfit.Loop(two_model_step, data(), val_step=score, val_data=data()[:1], model=[m], max_epochs=1,
                 optimizers={"a": torch.optim.SGD(m.parameters(), lr=0.1)}, run_dir=tmp_path / "unscored",
                 plugins=[Optim(), Metrics(), Checkpoint(background=False)]).fit()
    with pytest.raises(CheckpointError, match=r"^checkpoint: resume='best': the run of .* scored no checkpoint .*: "
                                              r"resume='latest' takes the newest, or a checkpoint by its path\n"):
        hookfit.Loop(None, [], val_step=score, val_data=data()[:1], model=[evaluated], run_dir=tmp_path / "unscored",
                     plugins=[Metrics(), Checkpoint()]).validate(resume="best")


@pytest.mark.bad_input
def test_an_evaluation_that_finds_no_run_to_take_the_best_from_says_where_it_looked_and_how_to_point_it(
        tmp_path: Path) -> None:
    """A run trained with ``run_dir=...`` is not among the runs of the script that an evaluation without it
    searches: the error names the folders searched and how to name the run (its folder as ``run_dir``, or a
    checkpoint's path, ``results["best_checkpoint"]``); given that folder it takes the run's best."""
    from hookfit.plugins.metrics import Metrics

    m = torch.nn.Linear(3, 1)
    scores = [3.0, 1.0]
    state = hookfit.Loop(two_model_step, data(), val_step=lambda loop, batch: {"loss": torch.tensor(
        scores[loop.state.epoch])}, val_data=data()[:1], model=[m], max_epochs=2,
        optimizers={"a": torch.optim.SGD(m.parameters(), lr=0.1)}, run_dir=tmp_path / "exp1",
        plugins=[Optim(), Metrics(), Checkpoint(monitor="valid/loss", background=False)]).fit()

    def evaluation(**options: Any) -> hookfit.Loop:
        return hookfit.Loop(None, [], val_step=lambda loop, batch: {"loss": torch.tensor(0.0)},
                            val_data=data()[:1], model=[torch.nn.Linear(3, 1)], plugins=[Metrics(), Checkpoint()],
                            **options)

    with pytest.raises(FileNotFoundError) as caught:
        evaluation().validate(resume="best")
    said = str(caught.value)
    runs = re.escape(str(Path("runs").absolute()))  # runs/<this script's name>/*/checkpoints
    assert re.match(rf"checkpoint: resume='best' found no checkpoint in {runs}/[^/]+/\*/checkpoints \(runs of ", said)
    assert said.endswith("; to evaluate another run, give Loop(run_dir=<that run's folder>) (a run given a run_dir "
                         "is found there only), or resume=<a checkpoint's path> (a training run's "
                         "state.results['best_checkpoint'])")
    best = state.results["best_checkpoint"]
    assert best is not None and best.name.startswith("epoch0002")
    with pytest.warns(hookfit.HookfitWarning, match="saved state of plugin\\(s\\) 'optim'"):  # (it trains nothing)
        evaluated = evaluation(run_dir=tmp_path / "exp1").validate(resume="best")
    assert evaluated.resumed_from is not None and Path(evaluated.resumed_from.source) == best


@pytest.mark.parametrize("where", ["keep_best", "dir"])
def test_an_evaluation_of_the_best_checkpoint_reports_that_checkpoint_as_its_best_and_last(
        tmp_path: Path, where: str) -> None:
    """After ``validate(resume="best")`` both ``results["best_checkpoint"]`` and ``"last_checkpoint"`` name the
    checkpoint evaluated: the best is the run's best as the checkpoint evaluated knows it, itself included, by the
    monitor its run recorded, not the best that checkpoint's state recorded before it was written (epoch 2's, kept
    by ``keep_best=2``), whether or not the evaluation's ``Checkpoint`` monitors anything."""
    from hookfit.plugins.metrics import Metrics

    scores, m = [3.0, 1.0, 2.0, 0.5], torch.nn.Linear(3, 1)

    def score(loop: Any, batch: Any) -> dict[str, Any]:
        return {"loss": torch.tensor(scores[loop.state.epoch])}

    given: dict[str, Any] = {"keep_best": 2} if where == "keep_best" else {"dir": tmp_path / "kept"}
    folder = tmp_path / "kept" if where == "dir" else tmp_path / "run" / "checkpoints"
    hookfit.Loop(two_model_step, data(), val_step=score, val_data=data()[:1], model=[m], max_epochs=4,
                 optimizers={"a": torch.optim.SGD(m.parameters(), lr=0.1)}, run_dir=tmp_path / "run",
                 plugins=[Optim(), Metrics(), Checkpoint(monitor="valid/loss", keep_last=1, background=False,
                                                         **given)]).fit()
    assert (folder / "epoch0002-step000000006.pt").exists() == (where == "keep_best")
    evaluated = folder / "epoch0004-step000000012.pt"
    for monitor in (None, "valid/loss"):
        state = hookfit.Loop(None, [], val_step=score, val_data=data()[:1], model=[torch.nn.Linear(3, 1)],
                             run_dir=tmp_path / "run", plugins=[Optim(), Metrics(), Checkpoint(
                                 monitor=monitor, **{k: v for k, v in given.items() if k == "dir"})]
                             ).validate(resume="best")
        assert Path(state.resumed_from.source) == evaluated
        assert state.results["best_checkpoint"] == state.results["last_checkpoint"] == evaluated, monitor


@pytest.mark.parametrize("evaluated, best", [("epoch0003-step000000009.pt", None),
                                             ("epoch0004-step000000012.pt", "epoch0004-step000000012.pt")])
def test_an_evaluation_whose_recorded_best_is_gone_names_itself_best_only_where_it_is_better(
        tmp_path: Path, evaluated: str, best: str | None) -> None:
    """The best a checkpoint recorded (epoch 2's, scored 1.0) was removed by ``keep_last=2``: after
    ``validate(resume=<that checkpoint>)`` ``results["best_checkpoint"]`` is the checkpoint evaluated where its own
    score is better than the recorded one (epoch 4's, 0.5), else ``None`` (epoch 3's, 2.0), as ``hookfit export
    --best`` names no best there; ``"last_checkpoint"`` is the checkpoint evaluated."""
    from hookfit.plugins.metrics import Metrics

    scores, m = [3.0, 1.0, 2.0, 0.5], torch.nn.Linear(3, 1)

    def score(loop: Any, batch: Any) -> dict[str, Any]:
        return {"loss": torch.tensor(scores[loop.state.epoch])}

    folder = tmp_path / "run" / "checkpoints"
    hookfit.Loop(two_model_step, data(), val_step=score, val_data=data()[:1], model=[m], max_epochs=4,
                 optimizers={"a": torch.optim.SGD(m.parameters(), lr=0.1)}, run_dir=tmp_path / "run",
                 plugins=[Optim(), Metrics(), Checkpoint(monitor="valid/loss", keep_last=2, background=False)]).fit()
    assert sorted(p.name for p in folder.glob("*.pt")) == ["epoch0003-step000000009.pt", "epoch0004-step000000012.pt"]
    for monitor in (None, "valid/loss"):
        state = hookfit.Loop(None, [], val_step=score, val_data=data()[:1], model=[torch.nn.Linear(3, 1)],
                             run_dir=tmp_path / "run", plugins=[Optim(), Metrics(), Checkpoint(monitor=monitor)]
                             ).validate(resume=folder / evaluated)
        assert state.results["last_checkpoint"] == folder / evaluated
        assert state.results["best_checkpoint"] == (None if best is None else folder / best), monitor


def test_best_names_its_checkpoint_as_the_newest_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A run given by a relative path: the best is named relative, as the newest is, not by its absolute path."""
    from hookfit.plugins.metrics import Metrics
    from hookfit.tools import cli

    monkeypatch.chdir(tmp_path)
    m = torch.nn.Linear(3, 1)
    hookfit.Loop(two_model_step, data(), val_step=lambda loop, b: {"loss": torch.tensor(1.0)}, val_data=data()[:1],
                 model=[m], optimizers={"a": torch.optim.SGD(m.parameters(), lr=0.1)}, run_dir="run",
                 plugins=[Optim(), Metrics(), Checkpoint(monitor="valid/loss", background=False)]).fit()
    capsys.readouterr()
    for extra in ([], ["--best"]):
        assert cli.main(["export", "run", "out.pt", *extra], plugins=[Checkpoint()]) == 0
        assert capsys.readouterr().out.startswith("wrote out.pt: the model of run/checkpoints/epoch0001-step000000003.pt")


@pytest.mark.bad_input
@pytest.mark.parametrize("given", ["folder", "folder/", "new/"])
def test_an_output_that_is_a_folder_is_refused_naming_a_file_to_give(tmp_path: Path, given: str) -> None:
    """Refused naming a file to give, not failing with the atomic write's own temporary name (``'.exp.2632.tmp' ->
    'exp'``: is a directory)."""
    run = written(tmp_path, {"weight": torch.zeros(1, 3), "bias": torch.zeros(1)})
    (tmp_path / "folder").mkdir()
    out = str(tmp_path / given) + ("/" if given.endswith("/") else "")
    with pytest.raises(CheckpointError, match=r"hookfit export: .* is a folder; give the file to write in it, such "
                                              r"as .*model\.pt"):
        export(run, out)
    assert not (tmp_path / "new").exists()
