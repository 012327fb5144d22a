"""lr_find: the learning-rate range test on real runs. The sweep leaves no trace on the training
that follows (bitwise), its suggestion on the digits data lies where the loss falls, it stops on
divergence, ends the run with then="stop", and bad options fail at construction."""

from __future__ import annotations

import json
import math
import random
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch

import hookfit
from hookfit import discovery, hookimpl
from hookfit.config import ConfigError
from hookfit.data import Batches
from hookfit.plugins.ema import EMA
from hookfit.plugins.lr_find import LRFinder, suggest
from hookfit.plugins.optim import Optim
from hookfit.tools.demo import load_digits

from conftest import make_dist, mse_step


def regression(batches: int = 6) -> tuple[torch.nn.Module, list[Any]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 8, generator=generator), torch.randn(8, 1, generator=generator)) for _ in range(batches)]
    return model, data


def noisy_step(loop: hookfit.Run, batch: Any) -> dict[str, Any]:
    """mse_step that also draws from every random generator a script uses (dropout: torch's)."""
    loss = mse_step(loop, batch)["loss"] + 0 * (random.random() + float(numpy.random.rand()))
    return {"loss": loss}


def raw_step(loop: hookfit.Run, batch: Any) -> dict[str, Any]:
    """Without an optimizer plugin: the torch optimizer itself."""
    loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
    loss.backward()
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    return {"loss": loss}


class Reshuffled:
    """Data that keeps its own state: every pass over it is shuffled anew (by the passes made
    so far, which ``state_dict`` holds), as a loader that reshuffles by itself does."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches, self.passes = batches, 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Any:
        order = torch.randperm(len(self.batches), generator=torch.Generator().manual_seed(self.passes))
        self.passes += 1
        return (self.batches[i] for i in order)

    def state_dict(self) -> dict[str, int]:
        return {"passes": self.passes}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.passes = state["passes"]


def plain(optimizer: torch.optim.Optimizer) -> Optim:
    return Optim()


def fit(*plugins: Any, data: Any = None, epochs: int = 2, optim: Any = plain,
        **kwargs: Any) -> tuple[torch.nn.Module, hookfit.State]:
    """A run with ``optim(optimizer)`` as its optimizer plugin (``None``: the torch optimizer alone)."""
    model, batches = regression()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    random.seed(3)
    numpy.random.seed(3)
    managed = [optim(optimizer)] if optim is not None else []
    loop = hookfit.Loop(noisy_step if optim else raw_step, batches if data is None else data(batches), model=model,
                        optimizers=optimizer, max_epochs=epochs, plugins=[*managed, *plugins], run_dir="run",
                        **kwargs)
    state = loop.fit()
    return model, state


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def one_cycle(optimizer: torch.optim.Optimizer) -> Optim:
    """A per-step schedule the sweep's 15 steps fit in, with the run's 12."""
    return Optim(schedulers=torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=27))


@pytest.mark.parametrize("data, optim", [
    (None, plain),
    (lambda b: Batches(torch.cat([x for x, _ in b]), torch.cat([y for _, y in b]), batch_size=8, shuffle=True, seed=5),
     plain),
    (Reshuffled, plain),
    (None, None),
    (None, lambda optimizer: Optim(accumulate=4)),  # 15 sweep batches leave a window open
    (None, one_cycle),
    (None, lambda optimizer: Optim(precision="16-mixed")),  # the scale updated after each sweep step, put back
], ids=["list", "shuffled Batches", "data with its own state", "torch optimizer without optim", "accumulate=4",
        "per-step scheduler", "16-mixed"])
def test_training_after_the_sweep_is_bitwise_the_run_without_it(data: Any, optim: Any) -> None:
    plain, state = fit(data=data, optim=optim)
    finder = LRFinder(num_steps=15, end_lr=1.0)
    swept, swept_state = fit(finder, data=data, optim=optim)
    assert len(finder.rates) > 5  # the sweep ran, and changed the weights while it ran
    assert state.status == swept_state.status == "completed"
    assert swept_state.step == state.step
    assert same(plain, swept)


def test_plugin_states_are_put_back_too() -> None:
    """EMA's average follows every optimizer step, the sweep's too: it is restored with the rest."""
    ema_plain = EMA(decay=0.5)
    plain, _ = fit(ema_plain)
    ema_swept = EMA(decay=0.5)
    swept, _ = fit(ema_swept, LRFinder(num_steps=12, end_lr=1.0))
    assert same(plain, swept)
    assert same(ema_plain.module, ema_swept.module)


def digits_finder(capfd: pytest.CaptureFixture[str], **options: Any) -> tuple[LRFinder, hookfit.State]:
    torch.manual_seed(0)
    train, _ = load_digits()
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

    def step(loop: hookfit.Run, batch: Any) -> dict[str, Any]:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(loop.model(x), y)
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    finder = LRFinder(**options)
    loop = hookfit.Loop(step, train, model=model, optimizers=torch.optim.Adam(model.parameters()), max_epochs=3,
                        plugins=[Optim(), finder], run_dir="run")
    return finder, loop.fit()


class StepWatch:
    """Sees every optimizer step: the stage it comes in and the rate it steps at (after every
    ``before_optimizer_step`` implementation, read in ``after_optimizer_step``); with ``lr`` a
    per-step schedule of its own that sets that rate before each step, as SWA's cyclic one does."""

    def __init__(self, name: str, lr: float | None = None) -> None:
        self.name, self.lr = name, lr
        self.steps: list[tuple[str | None, float]] = []

    @hookimpl
    def before_optimizer_step(self, loop: hookfit.Run, optimizer: Any) -> None:
        if self.lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = self.lr

    @hookimpl
    def after_optimizer_step(self, loop: hookfit.Run, optimizer: Any) -> None:
        self.steps.append((loop.state.stage, optimizer.param_groups[0]["lr"]))


def test_a_plugin_setting_the_rate_before_each_step_does_not_replace_the_sweep_s_rates() -> None:
    """A plugin that sets the rate in before_optimizer_step (a cyclic schedule, 1e-3) does not replace the swept
    rates 1e-7..1 the finder reports: the sweep's steps fire the optimizer events outside any stage (how the
    plugin can tell them), each steps at the sweep's rate, and one warning names the plugin; the run's own steps,
    in stage 'train', keep the plugin's rate."""
    finder, schedule = LRFinder(num_steps=15, end_lr=1.0, diverge=None), StepWatch("schedule", lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, state = fit(finder, schedule)
    assert state.status == "completed"
    sweep = [lr for stage, lr in schedule.steps if stage is None]
    assert sweep == finder.rates and len(sweep) == 15
    assert [lr for stage, lr in schedule.steps if stage is not None] == [1e-3] * 12
    said = [str(w.message) for w in caught if issubclass(w.category, hookfit.HookfitWarning)]
    assert said == ["lr_find: optimizer 'default' was about to step in the sweep at the learning rate 0.001, not the "
                    "sweep's 1e-07: set after the sweep's by one of the plugins that implement before_optimizer_step "
                    "('schedule') or the step; the sweep's rate is put back for each of its steps. A plugin tells "
                    "the sweep's steps by loop.state.stage being None (outside any stage)"], said


def test_a_step_that_sets_the_rate_itself_is_named_alone_where_no_plugin_implements_before_optimizer_step() -> None:
    model, batches = regression()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step(loop: hookfit.Run, batch: Any) -> dict[str, Any]:
        for group in optimizer.param_groups:  # a hand-written schedule
            group["lr"] = 1e-3
        return mse_step(loop, batch)

    loop = hookfit.Loop(step, batches, model=model, optimizers=optimizer, max_epochs=1, run_dir="run",
                        plugins=[Optim(), LRFinder(num_steps=6, end_lr=1.0, diverge=None)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert loop.fit().status == "completed"
    said = [str(w.message) for w in caught if issubclass(w.category, hookfit.HookfitWarning)]
    assert len(said) == 1 and "1e-07: set after the sweep's by the step; the sweep's rate is put back" in said[0], said


def test_a_plugin_that_leaves_the_rate_alone_sees_the_sweep_s_steps_without_a_word() -> None:
    finder, watch = LRFinder(num_steps=15, end_lr=1.0, diverge=None), StepWatch("watch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit(finder, watch)
    assert [lr for stage, lr in watch.steps if stage is None] == finder.rates
    assert [stage for stage, _ in watch.steps if stage is not None] == ["train"] * 12


def test_digits_suggestion_lies_where_the_loss_falls(capfd: pytest.CaptureFixture[str]) -> None:
    finder, state = digits_finder(capfd, start_lr=1e-5, end_lr=10.0, num_steps=60, then="stop")
    assert state.status == "completed"
    assert state.stop_reason.startswith("lr_find: learning-rate range test done (then='stop'); suggested lr=")
    assert state.step == 0  # no training batch ran
    assert finder.diverged  # Adam at lr 10 blows up the loss before the sweep's end
    losses, rates, s = finder.losses, finder.rates, finder.suggestion
    assert s is not None and s in rates
    i, lowest = rates.index(s), losses.index(min(losses))
    assert 0 < i < lowest  # before the loss is lowest ...
    assert losses[i + 1] < losses[i - 1] < losses[0]  # ... where it falls
    assert min(losses) < 0.8 * losses[0]
    assert state.results["lr_find"] == {"suggestion": s, "steps": len(rates), "diverged": True}
    err = capfd.readouterr().err
    assert f"hookfit lr_find: suggested lr={s:.3g}" in err
    assert "learning rate (log scale)" in err and "1e-05" in err
    lines = err.splitlines()
    mark = next(line for line in lines if line.strip() == "^")
    plot_rows = [line for line in lines if "│" in line]
    assert len(plot_rows) == 12 and 12 <= mark.index("^") < 12 + 60


def test_divergence_stops_the_sweep_early(capfd: pytest.CaptureFixture[str]) -> None:
    finder, state = digits_finder(capfd, start_lr=1e-2, end_lr=1e4, num_steps=80, diverge=2.0, then="stop")
    assert finder.diverged and len(finder.rates) < 80
    last = finder.losses[-1]
    assert last > 2.0 * min(finder.losses) or not math.isfinite(finder.raw_losses[-1])
    assert "stopped early: the loss diverged" in capfd.readouterr().err
    kept, _ = digits_finder(capfd, start_lr=1e-2, end_lr=1e4, num_steps=20, diverge=None, then="stop")
    assert not kept.diverged and len(kept.rates) == 20  # None never stops it on a finite loss
    assert max(kept.losses) > 2.0 * min(kept.losses)


def test_then_train_goes_on_training_and_stop_ends_the_run(capfd: pytest.CaptureFixture[str]) -> None:
    _, state = fit(LRFinder(num_steps=8, end_lr=1.0))
    assert state.status == "completed" and state.step == 12
    _, stopped = fit(LRFinder(num_steps=8, end_lr=1.0, then="stop"))
    assert stopped.status == "completed" and stopped.step == 0 and stopped.stopped_by == "lr_find"
    assert "then='stop'" in stopped.stop_reason


def test_several_optimizers_need_a_name() -> None:
    model, batches = regression()
    first, second = model[0], model[3]

    def step(loop: hookfit.Run, batch: Any) -> Any:
        loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
        loop.backward(loss)
        for optimizer in loop.optimizers.values():
            optimizer.step()
            optimizer.zero_grad()
        return loss

    def loop(finder: LRFinder) -> hookfit.Loop:
        optimizers = {"a": torch.optim.SGD(first.parameters(), lr=0.1),
                      "b": torch.optim.SGD(second.parameters(), lr=0.1)}
        return hookfit.Loop(step, batches, model=model, optimizers=optimizers, plugins=[Optim(), finder], run_dir="run")

    with pytest.raises(ValueError, match=r"lr_find: the run has several optimizers \('a', 'b'\): say whose"):
        loop(LRFinder(num_steps=5)).fit()
    with pytest.raises(ValueError, match=r"lr_find: optimizer must name one of the run's optimizers \('a', 'b'\), "
                                         r"got 'c'"):
        loop(LRFinder(num_steps=5, optimizer="c")).fit()
    chosen = LRFinder(num_steps=6, optimizer="b", then="stop")
    loop(chosen).fit()
    assert len(chosen.rates) == 6
    assert [g["lr"] for g in loop(LRFinder()).optimizers["a"].param_groups] == [0.1]


def test_a_schedule_too_short_for_the_sweep_fails_with_a_note_naming_it() -> None:
    def short(optimizer: torch.optim.Optimizer) -> Optim:
        return Optim(schedulers=torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.05, total_steps=12))

    with pytest.raises(ValueError, match="Tried to step 13 times") as error:
        fit(LRFinder(num_steps=15, end_lr=1.0), optim=short)
    assert any("lr_find: raised during the learning-rate range test, at its batch 13" in note
               and "OneCycleLR" in note for note in error.value.__notes__)


def test_an_iterator_cannot_be_swept_and_then_trained_on() -> None:
    with pytest.raises(ValueError, match="lr_find: the training data is an iterator"):
        fit(LRFinder(num_steps=5), data=lambda b: iter(b), epochs=1)  # one epoch: the Loop takes it


def test_suggest_is_the_steepest_descent_on_the_log_axis() -> None:
    rates = [10.0 ** (k / 2) for k in range(-10, 0)]
    losses = [5, 5, 5, 4.9, 4.5, 3.0, 2.5, 2.4, 2.45, 9]
    assert suggest(rates, losses) == rates[5]  # 4.5 -> 2.5 around it
    assert suggest(rates[:4], losses[:4]) is None


@pytest.mark.bad_input
@pytest.mark.parametrize("options, message", [
    ({"start_lr": 0}, "lr_find: start_lr must be a positive finite number (the first rate of the sweep), got 0"),
    ({"end_lr": float("inf")}, "lr_find: end_lr must be a positive finite number"),
    ({"start_lr": 1.0, "end_lr": 0.5}, "lr_find: end_lr must be greater than start_lr (1), got 0.5"),
    ({"num_steps": 1}, "lr_find: num_steps must be at least 2"),
    ({"num_steps": 2.5}, "lr_find: num_steps must be a positive integer"),
    ({"diverge": 0.5}, "lr_find: diverge must be a finite number >= 1"),
    ({"diverge": 1}, "lr_find: diverge must be greater than 1"),
    ({"smoothing": 1.0}, "lr_find: smoothing must be below 1"),
    ({"smoothing": -0.1}, "lr_find: smoothing must be a finite number >= 0"),
    ({"then": "fit"}, "lr_find: then must be 'train' or 'stop', got 'fit'"),
    ({"optimizer": 3}, "lr_find: optimizer must be a non-empty string"),
    ({"key": ""}, "lr_find: key must be a non-empty string"),
])
def test_bad_options_fail_at_construction(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as error:
        LRFinder(**options)
    assert str(error.value).startswith(message)


@pytest.mark.bad_input
def test_a_step_without_the_loss_key_is_named() -> None:
    def step(loop: hookfit.Run, batch: Any) -> dict[str, Any]:
        return {"error": mse_step(loop, batch)["loss"]}

    model, batches = regression()
    loop = hookfit.Loop(step, batches, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                        plugins=[Optim(), LRFinder(num_steps=5)], run_dir="run")
    with pytest.raises(ValueError, match=r"lr_find: the step's output has no 'loss' \(it has 'error'\)"):
        loop.fit()
    before = regression()[0]
    assert same(model, before)  # the failed sweep still put the model back


# -- inert unless configured ------------------------------------------------------------------


@pytest.fixture
def entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``lr_find`` entry point: hookfit's own once the project is installed with it, else
    the same one from a distribution made here (an install older than the plugin)."""
    if not any(ep.name == "lr_find" for ep in discovery.entry_points()):
        root = make_dist(tmp_path / "site", "hookfit-lr-find-ep", {"lr_find": "hookfit.plugins.lr_find:LRFinder"}, {})
        monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("HOOKFIT_PLUGINS", "optim,lr_find")


class Probe:
    name = "probe"

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    @hookimpl
    def fit_start(self, loop: Any) -> None:
        plugin = loop.pm.infos["lr_find"].plugin
        self.seen.update(plugin=plugin, registered=loop.pm.get_plugin("lr_find") is not None)


def discovered_fit(probe: Probe) -> hookfit.State:
    model, batches = regression()
    return hookfit.Loop(mse_step, batches, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                        plugins=[probe], run_dir="run").fit()


def test_discovered_without_options_it_does_nothing(entry_point: None, capfd: pytest.CaptureFixture[str]) -> None:
    probe = Probe()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # inert: not a word
        state = discovered_fit(probe)
    assert isinstance(probe.seen["plugin"], LRFinder) and probe.seen["registered"] is False
    assert state.step == 6 and "lr_find" not in state.results and "lr_find" not in capfd.readouterr().err


def test_hookfit_plugins_says_what_turns_it_on() -> None:
    from hookfit.discovery import inert

    assert "[plugins.lr_find] table in hookfit.toml (even empty)" in inert(LRFinder(), False)
    assert inert(LRFinder(), True) is None


@pytest.mark.parametrize("table", ["", "num_steps = 5\n"])
def test_a_table_in_the_configuration_file_switches_it_on(entry_point: None, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch, table: str) -> None:
    (tmp_path / "run.toml").write_text(f"[plugins.lr_find]\nthen = 'stop'\nend_lr = 1.0\n{table}")
    monkeypatch.setenv("HOOKFIT_CONFIG", str(tmp_path / "run.toml"))
    probe = Probe()
    state = discovered_fit(probe)
    assert probe.seen["registered"] is True
    assert state.status == "completed" and state.step == 0 and state.stopped_by == "lr_find"
    assert state.results["lr_find"]["steps"] == (5 if table else 100)


@pytest.mark.bad_input
def test_a_bad_option_in_the_configuration_file_names_the_file_and_the_option(
        entry_point: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "run.toml").write_text("[plugins.lr_find]\nnum_steps = 0\n")
    monkeypatch.setenv("HOOKFIT_CONFIG", str(tmp_path / "run.toml"))
    with pytest.raises(ConfigError, match=r"run.toml \[plugins.lr_find\]: lr_find: num_steps must be a positive"):
        discovered_fit(Probe())


@pytest.mark.bad_input
def test_several_processes_are_refused_at_configure() -> None:
    class Rank0Of2:
        name = "two_ranks"

        @hookimpl(tryfirst=True)
        def configure(self, loop: Any) -> None:
            loop.state.world_size = 2

    model, batches = regression()
    loop = hookfit.Loop(mse_step, batches, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                        plugins=[Optim(), LRFinder(), Rank0Of2()], run_dir="run")
    with pytest.raises(RuntimeError, match="lr_find: the learning-rate range test runs on one process, and this run "
                                           "has 2: run it with plain python"):
        loop.fit()


# -- on a terminal with the dashboard ---------------------------------------------------------


@pytest.mark.slow
def test_the_dashboard_keeps_the_plot_and_writes_it_back(tmp_path: Path) -> None:
    pytest.importorskip("urwid")
    from terminal import PLUGINS, Terminal

    from conftest import TESTS

    term = Terminal(tmp_path)
    try:
        result = tmp_path / "result.json"
        term.launch(sys.executable, TESTS / "scripts" / "lr_find_dashboard.py", result, tmp_path / "run",
                    env=f"HOOKFIT_PLUGINS={PLUGINS}")
        code, _, text = term.wait_exit()
    finally:
        term.kill()
    assert code == 0
    outcome = json.loads(result.read_text())
    assert outcome["status"] == "completed" and outcome["step"] == 16 and outcome["suggestion"] is not None
    suggested = f"hookfit lr_find: suggested lr={outcome['suggestion']:.3g}"
    # the dashboard captured it (only the dashboard writes output.log) ...
    log = (tmp_path / "run" / "output.log").read_text()
    assert "hookfit lr_find: " in log and "learning rate (log scale)" in log and suggested in log
    # ... and wrote it back to the terminal when it closed
    assert suggested in text and "learning rate (log scale)" in text
