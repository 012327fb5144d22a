"""ema: a moving average of the weights, checked against one computed here from the weights
after each step; validation with it, the training weights given back bit for bit, exact resume."""

from __future__ import annotations

import gc
import math
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import hookfit
from hookfit import HookfitWarning, hookimpl
from hookfit.plugins.checkpoint import Checkpoint, read
from hookfit.plugins.distributed import Distributed
from hookfit.plugins.ema import EMA
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim

from conftest import Recorder, StopAt, mse_step

BATCHES = 4  # training batches per epoch: one optimizer step each


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # batch norm: its running statistics are buffers, averaged too
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU(),
                               torch.nn.Linear(4, 1))


def make_data() -> tuple[list[Any], list[Any]]:
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 3, generator=generator), torch.randn(8, 1, generator=generator))
               for _ in range(BATCHES + 2)]
    return batches[:BATCHES], batches[BATCHES:]


step = mse_step


def val_step(loop: Any, batch: Any) -> dict[str, Any]:
    return {"loss": torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])}


def run(*plugins: Any, max_epochs: int = 2, val: Any = val_step, model: Any = None,
        fails: type[BaseException] | None = None, **kwargs: Any) -> tuple[hookfit.Loop, torch.nn.Module]:
    model = make_model() if model is None else model
    train, valid = make_data()
    loop = hookfit.Loop(step, train, val_step=val, val_data=valid, model=model, max_epochs=max_epochs,
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                        plugins=[Optim(), *plugins], **kwargs)
    if fails is None:
        loop.fit()
    else:
        with pytest.raises(fails):
            loop.fit()
    return loop, model


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit for bit, every entry (parameters and buffers, integer counters included)."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def reference(weights: list[dict[str, torch.Tensor]], decay: float,
              every: int = 1) -> list[dict[str, torch.Tensor] | None]:
    """The EMA after each step, computed here in float64 from the weights after each step:
    the first update takes the weights, each later one ``decay * average + (1 - decay) * weights``.
    Integer buffers (batch norm's step counter) are left out: they are not weights."""
    average: dict[str, torch.Tensor] | None = None
    out = []
    for i, w in enumerate(weights, 1):
        if i % every == 0:
            floats = {k: v.double() for k, v in w.items() if v.is_floating_point()}
            average = floats if average is None else {k: decay * average[k] + (1 - decay) * floats[k] for k in floats}
        out.append(average)
    return out


def assert_matches(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(expected) <= set(actual) and expected
    for key, value in expected.items():
        torch.testing.assert_close(actual[key].double(), value, rtol=0, atol=1e-6, msg=key)


class Probe:
    """Records the model after each real optimizer step, the average after each training batch
    (both hooks of the batch have run), the model at each epoch end and the valid loss."""

    name = "probe"

    def __init__(self, ema: EMA | None = None, optimizer: str | None = None) -> None:
        self.ema = ema
        self.optimizer = optimizer
        self.weights: list[dict[str, torch.Tensor]] = []
        self.averages: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.at_epoch_end: list[dict[str, torch.Tensor]] = []
        self.valid_loss: list[float] = []

    @hookimpl
    def after_optimizer_step(self, loop: Any, name: str) -> None:
        if self.optimizer in (None, name):
            self.weights.append(snapshot(_module(loop.model)))

    @hookimpl
    def batch_end(self, loop: Any) -> None:
        if loop.training and self.ema is not None:
            self.averages.append((self.ema.n_averaged, snapshot(self.ema.module)))

    @hookimpl
    def epoch_end(self, loop: Any) -> None:
        self.at_epoch_end.append(snapshot(_module(loop.model)))

    @hookimpl
    def epoch_metrics(self, stage: str, metrics: Any) -> None:
        if stage == "valid":
            self.valid_loss.append(metrics.values["loss"].epoch)


def _module(model: Any) -> torch.nn.Module:
    """The user's module(s): inside a DDP wrapper, a dict of them as the average holds them."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module
    return torch.nn.ModuleDict(model) if isinstance(model, dict) else model


class Seen:
    """A validation step that records the weights it validates with."""

    def __init__(self, raise_at: int | None = None, stop_at: tuple[int, int] | None = None) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []
        self.raise_at = raise_at
        self.stop_at = stop_at

    def __call__(self, loop: Any, batch: Any) -> dict[str, Any]:
        self.weights.append(snapshot(loop.model))
        if self.raise_at is not None and len(self.weights) == self.raise_at:
            raise RuntimeError("validation broke")
        if self.stop_at == (loop.state.epoch, loop.state.batch_idx):
            loop.request_stop("test stop in validation")
        return val_step(loop, batch)


# -- the average --------------------------------------------------------------------------


@pytest.mark.parametrize("decay, every", [(0.5, 1), (0.8, 3)])
def test_the_average_is_the_ema_of_the_weights_after_each_step(decay: float, every: int) -> None:
    ema = EMA(decay=decay, every_n_steps=every)
    probe = Probe(ema)
    run(ema, probe, max_epochs=3)
    steps = 3 * BATCHES
    assert len(probe.weights) == len(probe.averages) == steps
    assert [n for n, _ in probe.averages] == [i // every for i in range(1, steps + 1)]
    assert ema.n_averaged == steps // every and ema.steps == steps
    for (_, average), expected in zip(probe.averages, reference(probe.weights, decay, every)):
        if expected is not None:
            assert_matches(average, expected)
    # buffers are averaged too, and the average is not just the last weights
    assert "1.running_mean" in reference(probe.weights, decay, every)[-1]
    last, final = probe.weights[-1], snapshot(ema.module)
    assert max((final[k] - last[k]).abs().max().item() for k in last if last[k].is_floating_point()) > 1e-3


def test_with_several_models_the_named_optimizer_updates_every_model_it_steps_a_parameter_of() -> None:
    torch.manual_seed(0)
    models = {"g": torch.nn.Linear(3, 1), "d": torch.nn.Linear(3, 1)}
    train, _ = make_data()

    def two_step(loop: Any, batch: Any) -> None:
        x, y = batch
        loss = torch.nn.functional.mse_loss(loop.model["g"](x) + loop.model["d"](x), y)
        loop.backward(loss)
        if loop.state.batch_idx % 2 == 0:  # g steps every other batch, d every batch
            loop.optimizers["g"].step()
            loop.optimizers["g"].zero_grad()
        loop.optimizers["d"].step()
        loop.optimizers["d"].zero_grad()

    ema = EMA(decay=0.5, optimizer="g")
    probe = Probe(optimizer="g")
    # g steps the parameters of both models (d its own as well): the average is of both
    hookfit.Loop(two_step, train, model=models, max_epochs=2, plugins=[Optim(), ema, probe],
                 optimizers={"g": torch.optim.SGD([*models["g"].parameters(), *models["d"].parameters()], lr=0.1),
                             "d": torch.optim.SGD(models["d"].parameters(), lr=0.1)}).fit()
    assert ema.n_averaged == len(probe.weights) == BATCHES  # g's steps only: 2 of 4 batches, 2 epochs
    assert list(ema.module) == ["g", "d"]
    assert_matches(snapshot(ema.module), reference(probe.weights, 0.5)[-1])
    assert not torch.equal(ema.module["d"].weight, models["d"].weight)


def test_of_several_models_it_averages_those_the_named_optimizer_steps_and_validates_with_the_others() -> None:
    """A GAN's generator and discriminator, each stepped by its optimizer: ``EMA(optimizer="gen")`` averages
    the generator alone (the discriminator's weights are no average of anything the "gen" steps make);
    validation runs the averaged generator with the trained discriminator, both given back after it; the
    saved state holds the generator's average only."""
    torch.manual_seed(0)
    models = {"gen": torch.nn.Linear(3, 3), "disc": torch.nn.Linear(3, 1)}
    train, valid = make_data()

    def gan_step(loop: Any, batch: Any) -> None:
        x, _ = batch
        gen, disc, opts = loop.model["gen"], loop.model["disc"], loop.optimizers
        with opts.toggle("disc"):
            loop.backward(disc(gen(x).detach()).pow(2).mean() + (disc(x) - 1).pow(2).mean())
            opts["disc"].step()
            opts["disc"].zero_grad()
        with opts.toggle("gen"):
            loop.backward((disc(gen(x)) - 1).pow(2).mean())
            opts["gen"].step()
            opts["gen"].zero_grad()

    seen: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []

    def validated(loop: Any, batch: Any) -> None:
        seen.append((snapshot(loop.model["gen"]), snapshot(loop.model["disc"])))

    ema = EMA(decay=0.5, optimizer="gen")
    probe = Probe(optimizer="gen")
    hookfit.Loop(gan_step, train, val_step=validated, val_data=valid[:1], model=models, max_epochs=2,
                 plugins=[Optim(), ema, probe],
                 optimizers={n: torch.optim.SGD(m.parameters(), lr=0.1) for n, m in models.items()}).fit()
    assert ema.module is not None and list(ema.module) == ["gen"]
    assert ema.n_averaged == len(probe.weights) == 2 * BATCHES
    assert_matches(snapshot(ema.module), {k: v for k, v in reference(probe.weights, 0.5)[-1].items()
                                          if k.startswith("gen.")})
    gen_validated, disc_validated = seen[-1]
    assert same({f"gen.{k}": v for k, v in gen_validated.items()}, snapshot(ema.module))
    assert same({f"disc.{k}": v for k, v in disc_validated.items()}, {k: v for k, v in probe.at_epoch_end[-1].items()
                                                                       if k.startswith("disc.")})
    assert not same(gen_validated, snapshot(models["gen"]))  # the generator's training weights are back
    state = ema.save_state(None)  # type: ignore[arg-type]
    assert state is not None and sorted(state["state_dict"]) == ["gen.bias", "gen.weight"]


class Announced(torch.optim.Optimizer):
    """A replacement's managed optimizer, itself a ``torch.optim.Optimizer`` as SAM-style
    wrappers are: it steps the optimizer it wraps and announces each step
    (``after_optimizer_step``, under the name ``"default"`` of a single optimizer)."""

    def __init__(self, inner: torch.optim.Optimizer, loop: Any) -> None:
        super().__init__(inner.param_groups, inner.defaults)
        self.inner, self.loop = inner, loop

    def step(self, closure: Any = None) -> None:
        self.inner.step()
        announce = self.loop.hooks.after_optimizer_step
        if announce is not None:
            announce(self.loop, "default", self)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)


class Replacement:
    """An optimizer plugin written from core/hooks.md alone, in place of optim: it owns the
    backward pass and puts its managed optimizer in ``loop.optimizers`` at ``configure``
    (``replace=False``: it leaves them as the user gave them, so nothing manages them)."""

    def __init__(self, name: str, replace: bool = True) -> None:
        self.name = name
        self.replace = replace

    @hookimpl
    def configure(self, loop: Any) -> None:
        if self.replace:
            loop.optimizers = Announced(loop.optimizers, loop)

    @hookimpl
    def backward(self, loop: Any, loss: torch.Tensor) -> None:
        loss.backward()


@pytest.mark.parametrize("name", ["asam", "zsam"])  # named before 'ema' and after it
def test_a_replacement_whose_managed_optimizer_is_a_torch_optimizer_updates_the_average(name: str) -> None:
    ema = EMA(decay=0.5)
    probe = Probe(ema)
    model = make_model()
    train, valid = make_data()
    hookfit.Loop(step, train, val_step=val_step, val_data=valid, model=model, max_epochs=2,
                 optimizers=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                 plugins=[Replacement(name), ema, probe]).fit()
    steps = 2 * BATCHES
    assert ema.n_averaged == ema.steps == len(probe.weights) == len(probe.averages) == steps
    for (_, average), expected in zip(probe.averages, reference(probe.weights, 0.5)):
        assert expected is not None
        assert_matches(average, expected)


# -- validation with the average ----------------------------------------------------------


def test_validation_sees_the_average_and_training_gets_its_weights_back_bit_for_bit() -> None:
    ema = EMA(decay=0.5)
    probe = Probe(ema)
    seen = Seen()
    _, model = run(ema, probe, Metrics(), val=seen, max_epochs=3)
    expected = reference(probe.weights, 0.5)
    _, valid = make_data()
    model.eval()
    for epoch in range(3):
        after = (epoch + 1) * BATCHES - 1  # the epoch's last step
        for batch in range(2):
            validated = seen.weights[2 * epoch + batch]
            assert same(validated, probe.averages[after][1])  # exactly the average...
            assert_matches(validated, expected[after])  # ...which is the EMA of the weights
            assert not same(validated, probe.weights[after])
        # training goes on with its own weights, buffers and counters, bit for bit
        assert same(probe.at_epoch_end[epoch], probe.weights[after])
        # the metrics of validation are the averaged model's
        floats = {k: v.float() for k, v in expected[after].items()}
        with torch.no_grad():
            losses = [torch.nn.functional.mse_loss(torch.func.functional_call(model, floats, (x,)), y)
                      for x, y in valid]
        assert probe.valid_loss[epoch] == pytest.approx(sum(losses).item() / 2, abs=1e-5)

    # the training itself is that of a run without the plugin, bit for bit
    _, alone = run(max_epochs=3)
    assert same(snapshot(model), snapshot(alone))


def test_validate_false_validates_with_the_training_weights() -> None:
    ema = EMA(decay=0.5, validate=False)
    probe = Probe(ema)
    seen = Seen()
    run(ema, probe, val=seen)
    assert same(seen.weights[0], probe.weights[BATCHES - 1]) and same(seen.weights[3], probe.weights[-1])
    assert ema.n_averaged == 2 * BATCHES


@pytest.mark.fault
def test_a_validation_that_raises_gives_the_training_weights_back_and_a_failure_checkpoint_has_them(
        tmp_path: Path) -> None:
    ema = EMA(decay=0.5)
    probe = Probe(ema)
    seen = Seen(raise_at=2)
    checkpoint = Checkpoint(every_n_epochs=None, on_failure=True, background=False)
    loop, model = run(ema, probe, checkpoint, val=seen, run_dir=tmp_path, fails=RuntimeError)
    assert loop.run.state.status == "failed"
    assert same(seen.weights[0], probe.averages[-1][1])  # it was validating with the average
    assert same(snapshot(model), probe.weights[-1])  # and the model has its training weights back
    failed = read(next((tmp_path / "checkpoints").glob("failed-*.pt")))
    assert same(failed["model"], probe.weights[-1])
    assert same(failed["plugins"]["ema"]["state_dict"], snapshot(ema.module))


@pytest.mark.fault
def test_a_stop_during_validation_checkpoints_the_training_weights_and_resumes_exactly(tmp_path: Path) -> None:
    """The stop ends the run without stage_end("valid"): the weights go back before any
    fit_end, so the interrupt checkpoint holds the training weights, and the resumed run,
    which validates that epoch again, ends as the uninterrupted one, bit for bit."""
    whole_ema = EMA(decay=0.5)
    _, whole = run(whole_ema, max_epochs=3)

    ema, probe, checkpoint = EMA(decay=0.5), Probe(), Checkpoint(every_n_epochs=None, background=False)
    loop, model = run(ema, probe, checkpoint, val=Seen(stop_at=(1, 0)), max_epochs=3, run_dir=tmp_path / "cut")
    assert loop.run.state.status == "interrupted" and loop.run.state.stop_reason == "test stop in validation"
    assert same(snapshot(model), probe.weights[-1])
    saved = read(checkpoint.saved[-1])
    assert saved["loop"]["resume_stage"] == "valid"
    assert same(saved["model"], probe.weights[-1]) and not same(saved["model"], snapshot(ema.module))

    resumed_ema = EMA(decay=0.5)
    _, resumed = run(resumed_ema, Checkpoint(every_n_epochs=None, background=False), max_epochs=3,
                     run_dir=tmp_path / "cut", resume="latest")
    assert same(snapshot(resumed), snapshot(whole))
    assert same(snapshot(resumed_ema.module), snapshot(whole_ema.module))


# -- checkpoints --------------------------------------------------------------------------


class NoResume(EMA):
    """The plugin without its load_state hook: the saved average is not restored."""

    def load_state(self, loop: Any, state: Any) -> None:  # not marked: not a hook
        pass


@pytest.mark.fault
def test_a_run_stopped_mid_epoch_and_resumed_ends_with_the_same_average_bit_for_bit(tmp_path: Path) -> None:
    """Cut after step 5 of 12 (between two updates of every_n_steps=3), resumed through the
    checkpoint plugin: the same average, its update count and step count as the uninterrupted
    run. Without load_state the resumed average is another one: the test can tell."""
    def checkpoint() -> Checkpoint:
        return Checkpoint(every_n_epochs=None, background=False)  # only the stop's checkpoint

    whole = EMA(decay=0.8, every_n_steps=3)
    _, whole_model = run(whole, max_epochs=3)
    assert whole.n_averaged == 4

    cut = EMA(decay=0.8, every_n_steps=3)
    loop, _ = run(cut, checkpoint(), StopAt(5), max_epochs=3, run_dir=tmp_path)
    assert loop.run.state.step == 5 and cut.n_averaged == 1 and cut.steps == 5
    resumed = EMA(decay=0.8, every_n_steps=3)
    loop, model = run(resumed, checkpoint(), max_epochs=3, run_dir=tmp_path, resume="latest")
    assert loop.run.state.resumed_from.step == 5
    assert (resumed.n_averaged, resumed.steps) == (whole.n_averaged, whole.steps) == (4, 12)
    assert same(snapshot(resumed.module), snapshot(whole.module))
    assert same(snapshot(model), snapshot(whole_model))

    forgetful = NoResume(decay=0.8, every_n_steps=3)  # from the same checkpoint, still the latest
    with pytest.warns(HookfitWarning, match=r"saved state of plugin\(s\) 'ema' that no enabled plugin of this run "
                                            r"restores"):
        run(forgetful, checkpoint(), max_epochs=3, run_dir=tmp_path, resume="latest")
    assert not same(snapshot(forgetful.module), snapshot(whole.module))


class Restore:
    """Gives the ema plugin, once it has started, its own saved state changed by ``change``."""

    name = "restore"

    def __init__(self, change: Any) -> None:
        self.change = change

    @hookimpl(trylast=True)  # after the ema plugin's fit_start
    def fit_start(self, loop: Any) -> None:
        state = self.change(loop.plugin_states()["ema"])
        loop.hooks.call_plugin("load_state", "ema", loop, state)


def _without(key: str) -> Any:
    return lambda state: {k: v for k, v in state.items() if k != key}


def _reshaped(state: dict[str, Any]) -> dict[str, Any]:
    return {**state, "state_dict": {**state["state_dict"], "0.weight": torch.zeros(5, 3)}}


@pytest.mark.bad_input
@pytest.mark.parametrize("change, message", [
    (_without("state_dict"), "ema: the saved state is not an average this plugin saved (KeyError: 'state_dict')"),
    (_without("n_averaged"), "ema: the saved state is not an average this plugin saved (KeyError: 'n_averaged')"),
    (_reshaped, "ema: the averaged weights in the checkpoint do not fit this run's model: Error(s) in loading "
                "state_dict for Sequential:\n\tsize mismatch for 0.weight"),
])
def test_a_saved_state_that_does_not_fit_is_an_error_naming_what_is_wrong(change: Any, message: str) -> None:
    recorder = Recorder()
    with pytest.raises(ValueError) as error:
        run(EMA(decay=0.5), Restore(change), recorder)
    assert str(error.value).startswith(message)
    assert "batch_start" not in recorder.names()


# -- inert, discovered --------------------------------------------------------------------


class Costs:
    """What the run resolved once it started: is the plugin there, does any hook of it run?"""

    name = "costs"

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    @hookimpl
    def fit_start(self, loop: Any) -> None:
        plugin = self.seen["plugin"] = loop.pm.infos["ema"].plugin
        self.seen.update(
            registered=loop.pm.get_plugin("ema") is not None,
            hooks=sorted(n for n, c in vars(loop.pm.hook).items()
                         if any(i.plugin is plugin for i in c.get_hookimpls())),
            # what optim's fast path needs: nothing around optimizer steps
            steps_watched=(loop.hooks.before_optimizer_step, loop.hooks.after_optimizer_step) != (None, None),
        )


def test_without_a_decay_it_unregisters_itself_costs_nothing_and_changes_nothing() -> None:
    ema, costs = EMA(), Costs()
    _, model = run(ema, costs, Metrics())
    assert costs.seen["plugin"] is ema
    assert costs.seen["registered"] is False and costs.seen["hooks"] == []
    assert costs.seen["steps_watched"] is False  # optim keeps its fast path
    assert ema.module is None and ema.n_averaged == 0
    _, alone = run(Metrics())
    assert same(snapshot(model), snapshot(alone))

    # the same probe sees an active one
    ema, costs = EMA(decay=0.9), Costs()
    run(ema, costs)
    assert costs.seen["registered"] is True and costs.seen["steps_watched"] is True
    assert {"after_optimizer_step", "stage_start", "stage_end", "save_state", "load_state"} <= set(costs.seen["hooks"])


def test_it_is_discovered_like_every_built_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOKFIT_PLUGINS", "ema,optim")
    model = make_model()
    train, _ = make_data()
    loop = hookfit.Loop(step, train, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # inert: not a word
        loop.fit()
    assert isinstance(loop.run.pm.infos["ema"].plugin, EMA)
    assert loop.run.pm.get_plugin("ema") is None


# -- under DDP --------------------------------------------------------------------------


@pytest.fixture
def process_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A one-process gloo group initialised by the 'script' (this test), as a user may do."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_under_ddp_it_averages_the_module_inside_the_wrapper(process_group: Any) -> None:
    ema = EMA(decay=0.5)
    probe = Probe(ema)
    _, model = run(Distributed(), ema, probe)
    assert type(ema.module) is torch.nn.Sequential  # not the DistributedDataParallel wrapper
    assert ema.module.state_dict().keys() == model.state_dict().keys()
    assert_matches(snapshot(ema.module), reference(probe.weights, 0.5)[-1])


def test_of_a_compiled_model_it_averages_the_plain_module() -> None:
    """``torch.compile``'s wrapper is looked through as DDP's is: the average is a plain
    ``Sequential`` with the module's own keys (none with ``_orig_mod.``), equal to a plain run's."""
    plain_ema, compiled_ema = EMA(decay=0.5), EMA(decay=0.5)
    _, plain = run(plain_ema)
    _, compiled = run(compiled_ema, model=torch.compile(make_model(), backend="eager"))
    assert type(compiled_ema.module) is torch.nn.Sequential
    assert compiled_ema.module.state_dict().keys() == plain.state_dict().keys()
    assert same(snapshot(compiled_ema.module), snapshot(plain_ema.module))


# -- bad input ----------------------------------------------------------------------------


DECAY = "decay must be a number with 0 < decay < 1 (like 0.999), or None to switch the plugin off, got "
EVERY = "every_n_steps must be a positive integer (optimizer steps), got "
OPTIMIZER = "optimizer must be the name of one of the run's optimizers, or None, got "


@pytest.mark.bad_input
@pytest.mark.parametrize("options, message", [
    ({"decay": 0}, DECAY + "0"),
    ({"decay": 1}, DECAY + "1"),
    ({"decay": 1.5}, DECAY + "1.5"),
    ({"decay": -0.1}, DECAY + "-0.1"),
    ({"decay": math.nan}, DECAY + "nan"),
    ({"decay": True}, DECAY + "True"),
    ({"decay": "0.99"}, DECAY + "'0.99'"),
    ({"decay": 0.9, "every_n_steps": 0}, EVERY + "0"),
    ({"decay": 0.9, "every_n_steps": 2.0}, EVERY + "2.0"),
    ({"decay": 0.9, "every_n_steps": True}, EVERY + "True"),
    ({"decay": 0.9, "validate": "yes"}, "validate must be True or False, got 'yes'"),
    ({"decay": 0.9, "optimizer": ""}, OPTIMIZER + "''"),
    ({"decay": 0.9, "optimizer": 0}, OPTIMIZER + "0"),
])
def test_options_are_checked_when_it_is_built(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match="^ema: " + re.escape(message) + "$"):
        EMA(**options)


def _no_model(*plugins: Any) -> hookfit.Loop:
    return hookfit.Loop(lambda loop, batch: None, [1], plugins=[Optim(), EMA(decay=0.9), *plugins])


def _without_optim(*plugins: Any) -> hookfit.Loop:
    model = make_model()
    return hookfit.Loop(step, make_data()[0], model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                        plugins=[EMA(decay=0.9), *plugins])


def _two_optimizers(name: str | None) -> Any:
    def build(*plugins: Any) -> hookfit.Loop:
        a, b = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
        return hookfit.Loop(step, make_data()[0], model=[a, b],
                            plugins=[Optim(), EMA(decay=0.9, optimizer=name), *plugins],
                            optimizers={"g": torch.optim.SGD(a.parameters(), lr=0.1),
                                        "d": torch.optim.SGD(b.parameters(), lr=0.1)})
    return build


def _unmanaged(*plugins: Any) -> hookfit.Loop:
    """A plugin owns the backward pass but leaves ``loop.optimizers`` as the user gave them
    (torch optimizers, or a wrapper of the user's own): nothing announces their steps."""
    model = make_model()
    optimizer = Announced(torch.optim.SGD(model.parameters(), lr=0.1), None)
    return hookfit.Loop(step, make_data()[0], model=model, optimizers=optimizer,
                        plugins=[Replacement("asam", replace=False), EMA(decay=0.9), *plugins])


def _no_optimizer(*plugins: Any) -> hookfit.Loop:
    return hookfit.Loop(step, make_data()[0], model=make_model(), plugins=[Optim(), EMA(decay=0.9), *plugins])


def _dotted_key(*plugins: Any) -> hookfit.Loop:
    model = make_model()
    return hookfit.Loop(step, make_data()[0], model={"net.main": model}, plugins=[Optim(), EMA(decay=0.9), *plugins],
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.bad_input
@pytest.mark.parametrize("build, message", [
    (_no_model, "ema: this run has no model to average: give Loop(model=...)"),
    (_without_optim, "ema: the average is updated after each optimizer step, which an optimizer plugin announces"),
    (_unmanaged, "ema: the average is updated after each optimizer step, which an optimizer plugin announces"),
    (_two_optimizers(None), "ema: this run has 2 optimizers ('g', 'd'); name the one whose steps update the average"),
    (_two_optimizers("e"), "ema: optimizer='e' names no optimizer of this run; its optimizers are 'g', 'd'"),
    (_no_optimizer, "ema: this run has no optimizer, so nothing would update the average"),
    (_dotted_key, "ema: the models of Loop(model={...}) are averaged as a ModuleDict, whose keys are non-empty "
                  "strings without '.'; got the key 'net.main'"),
])
def test_a_run_it_cannot_average_fails_before_any_batch_saying_why(build: Any, message: str) -> None:
    recorder = Recorder()
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        build(recorder).fit()
    assert "batch_start" not in recorder.names() and "fit_end" in recorder.names()


def test_a_buffer_holding_infinities_is_copied_not_averaged(tmp_path: Path) -> None:
    """A constant mask buffer with ``-inf`` (padding, causal attention): averaged, ``-inf`` with
    ``-inf`` is NaN, and the validation with the average published a NaN loss (a newcomer's). It
    is copied from the model at every update instead, and its finite buffers and the parameters
    are still averaged."""

    class Masked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("mask", torch.tensor([0.0, 0.0, -math.inf, -math.inf]))
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen += 1
            return torch.log_softmax(self.lin(x) + self.mask, -1)[:, 0]

    torch.manual_seed(0)
    model, data = Masked(), [torch.randn(8, 4) for _ in range(4)]

    def step(loop: Any, batch: Any) -> Any:
        loss = -loop.model(batch).mean()
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return loss

    ema = EMA(decay=0.5)
    state = hookfit.Loop(step, data, val_step=lambda loop, b: {"loss": -loop.model(b).mean()}, val_data=data[:1],
                         model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1), max_epochs=2,
                         run_dir=tmp_path, plugins=[Optim(), Metrics(), ema]).fit()
    assert ema.module is not None and torch.equal(ema.module.mask, model.mask)
    assert math.isfinite(state.results["metrics"]["valid/loss"])
    assert 0 < float(ema.module.seen) < float(model.seen)  # a finite buffer is still averaged
    assert not torch.equal(ema.module.lin.weight, model.lin.weight)
