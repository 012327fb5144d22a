"""Metrics(best=...): a metric's direction is configured, checked at construction, published in
every snapshot's ``best``, never guessed from a name; ``loss`` is "min" unless configured
otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit.payloads import MetricsSnapshot
from hookfit.plugins.metrics import Metrics


class Collect:
    name = "collect"

    def __init__(self) -> None:
        self.updates: list[MetricsSnapshot] = []
        self.epochs: list[MetricsSnapshot] = []

    @hookfit.hookimpl
    def metrics_update(self, metrics: MetricsSnapshot) -> None:
        self.updates.append(metrics)

    @hookfit.hookimpl
    def epoch_metrics(self, metrics: MetricsSnapshot) -> None:
        self.epochs.append(metrics)


def step(loop, batch):
    return {"loss": torch.tensor(1.0), "acc": 0.5, "mae": 0.1, "perplexity": 3.0}


def published(best: Any = None, val_data: Any = (1, 2)) -> dict[str, dict[str, str]]:
    collect = Collect()
    metrics = Metrics(interval=0) if best is None else Metrics(interval=0, best=best)
    hookfit.Loop(step, [1, 2], val_step=step, val_data=val_data, plugins=[metrics, collect]).fit()
    assert collect.updates and all(u.best == collect.epochs[0].best for u in collect.updates if u.stage == "train")
    return {s.stage: dict(s.best) for s in collect.epochs}


def test_only_loss_has_a_direction_unless_configured() -> None:
    # accuracy, mae, perplexity: no direction is guessed from their names
    assert published() == {"train": {"loss": "min"}, "valid": {"loss": "min"}}


def test_configured_directions_by_name_and_by_stage_the_stage_winning() -> None:
    best = {"acc": "max", "valid/acc": "min", "perplexity": "min", "loss": "max"}
    assert published(best) == {
        "train": {"loss": "max", "acc": "max", "perplexity": "min"},
        "valid": {"loss": "max", "acc": "min", "perplexity": "min"},
    }
    assert published({"train/loss": "max"}) == {"train": {"loss": "max"}, "valid": {"loss": "min"}}


def test_several_validation_sets_take_the_sets_keys_then_the_names_within_them() -> None:
    best = {"acc": "max", "noisy/acc": "min", "valid/clean/mae": "max"}
    got = published(best, val_data={"clean": [1, 2], "noisy": [3]})
    assert got["valid"] == {"clean/loss": "min", "clean/acc": "max", "clean/mae": "max",
                            "noisy/loss": "min", "noisy/acc": "min"}
    assert got["train"] == {"loss": "min", "acc": "max"}


def test_the_option_is_kept_read_only_and_from_a_config_file(tmp_path, monkeypatch) -> None:
    metrics = Metrics(best={"valid/acc": "max"})
    assert dict(metrics.best) == {"valid/acc": "max"}
    with pytest.raises(TypeError):
        metrics.best["acc"] = "min"  # type: ignore[index]
    (tmp_path / "hookfit.toml").write_text('[plugins.metrics]\nbest = { "valid/acc" = "max", mae = "min" }\n')
    monkeypatch.setenv("HOOKFIT_PLUGINS", "metrics")
    monkeypatch.setenv("HOOKFIT_CONFIG", str(tmp_path / "hookfit.toml"))
    collect = Collect()
    hookfit.Loop(step, [1], val_step=step, val_data=[1], plugins=[collect]).fit()
    assert {s.stage: dict(s.best) for s in collect.epochs} == {
        "train": {"loss": "min", "mae": "min"}, "valid": {"loss": "min", "acc": "max", "mae": "min"}}


@pytest.mark.bad_input
@pytest.mark.parametrize("best, message", [
    (["acc"], r"metrics: best must be a mapping of metric names \('loss', 'valid/acc'\) to 'min' or 'max', or "
              r"None, got \['acc'\]"),
    ({"acc": "maximum"}, r"metrics: best\['acc'\] must be 'min' \(lower is better\) or 'max' \(higher is "
                         r"better\), got 'maximum'"),
    ({"valid/acc": None}, r"metrics: best\['valid/acc'\] must be 'min' .*, got None"),
    ({"acc": 1}, r"metrics: best\['acc'\] must be 'min' .*, got 1"),
    ({"": "max"}, r"metrics: best must have metric names as keys .*got the key ''"),
    ({3: "max"}, r"metrics: best must have metric names as keys .*got the key 3"),
    ({"valid/": "max"}, r"metrics: best must have metric names as keys .*got the key 'valid/'"),
    ({"valid": "max"}, r"metrics: best must name a metric after the stage, got 'valid'"),
])
def test_bad_directions_are_refused_at_construction(best: Any, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        Metrics(best=best)


def test_directions_come_in_the_order_the_user_gave_them_then_the_loss() -> None:
    """A snapshot's ``best`` lists the configured directions in the order of ``Metrics(best=...)``,
    whatever the order of the step's keys (``loss``, ``acc``, ``mae``, ``perplexity``), and the
    loss's default after them: a reader judges a run by the first (``hookfit runs``), where it
    took the step's first key that had a direction."""
    got = published({"perplexity": "min", "valid/acc": "max", "mae": "min"})
    assert list(got["valid"]) == ["perplexity", "acc", "mae", "loss"]
    assert list(got["train"]) == ["perplexity", "mae", "loss"]


def test_an_evaluation_of_a_runs_checkpoint_judges_as_the_run_did_its_own_directions_first(tmp_path, capsys) -> None:
    """``Loop.validate(resume=<a run's checkpoint>)`` with ``Metrics()`` given no direction takes
    those the run's metrics log records (``valid/clean/acc``: higher is better): its snapshots, its
    results and the console's result line say ``best=``, not ``min=``/``max=``; a direction the
    evaluation gives wins, and a checkpoint in no run folder brings none."""
    from hookfit.plugins.checkpoint import Checkpoint
    from hookfit.plugins.console import Console
    from hookfit.plugins.metrics_log import MetricsLog

    sets, model = {"clean": [1, 2], "noisy": [3]}, torch.nn.Linear(1, 1)
    run = tmp_path / "run"
    hookfit.Loop(step, [1, 2], val_step=step, val_data=sets, model=model, run_dir=run,
                 plugins=[Metrics(best={"valid/clean/acc": "max", "mae": "min"}), MetricsLog(),
                          Checkpoint(background=False)]).fit()
    checkpoint = str(next((run / "checkpoints").glob("*.pt")))

    def evaluated(metrics: Metrics, resume: str) -> tuple[dict[str, str], Any, str]:
        collect = Collect()
        capsys.readouterr()
        plugins = [metrics, Console(), collect, Checkpoint(background=False)]
        state = hookfit.Loop(val_step=step, val_data=sets, model=model, run_dir=tmp_path / "evaluation",
                             plugins=plugins).validate(resume=resume)
        return dict(collect.epochs[-1].best), state.results["best"], capsys.readouterr().out

    best, results, out = evaluated(Metrics(), checkpoint)
    assert best == {"clean/acc": "max", "clean/mae": "min", "noisy/mae": "min", "clean/loss": "min",
                    "noisy/loss": "min"}
    assert "valid/clean/acc" in results and "valid/noisy/acc" not in results
    assert "hookfit result stage=valid metric=clean/acc last=0.5 best=0.5 best_epoch=1" in out, out
    assert "metric=noisy/acc last=0.5 min=0.5" in out, out  # the run gave it no direction either
    best, _, _ = evaluated(Metrics(best={"acc": "min"}), checkpoint)
    assert best["clean/acc"] == "min" and best["noisy/acc"] == "min" and best["clean/mae"] == "min"
    elsewhere = tmp_path / "copied.pt"
    elsewhere.write_bytes(Path(checkpoint).read_bytes())
    best, _, _ = evaluated(Metrics(), str(elsewhere))
    assert best == {"clean/loss": "min", "noisy/loss": "min"}
