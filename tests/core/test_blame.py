"""The note an error gets says where it came from: the data the loop was fetching (which
batch), the plugin whose hook implementation raised (even inside another plugin's hook),
or the step function."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import hookfit
from hookfit import blame
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim


class Broken(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Ten batches; fetching the fourth (index 3) raises."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index == 3:
            raise OSError(f"the stream broke at item {index}")
        return torch.full((4, 2), float(index)), torch.zeros(4, 1)


class Stream:
    """A re-iterable stream whose fourth batch fails (a reader losing its source)."""

    def __iter__(self) -> Any:
        for index in range(10):
            if index == 3:
                raise OSError("the stream broke at item 3")
            yield torch.full((4, 2), float(index)), torch.zeros(4, 1)


def stepping(model: torch.nn.Module) -> Any:
    """A training step of ``model`` on ``(x, y)`` batches through optim."""

    def step(loop: hookfit.Run, batch: Any) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(model(batch[0]), batch[1])
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return loss

    return step


def fit(data: Any, **options: Any) -> BaseException:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)

    step = stepping(model)
    loop = hookfit.Loop(step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                        max_epochs=2, plugins=[Optim(**options)])
    with pytest.raises(Exception) as caught:
        loop.fit()
    return caught.value


@pytest.mark.parametrize("data", [
    Stream(),
    DataLoader(Broken(), batch_size=None, num_workers=0),
    DataLoader(Broken(), batch_size=None, num_workers=2),
], ids=["stream", "0 workers", "2 workers"])
def test_an_error_of_the_training_data_says_so_and_which_fetch_failed(data: Any) -> None:
    error = fit(data)
    assert "the stream broke at item 3" in str(error)
    note = error.__notes__[-1]
    assert note == ("hookfit: raised by the training data when the loop fetched batch 4, fetch 4 of the stage "
                    "(batches 1-3 trained) (epoch 1, stage train)"), note


def test_an_error_of_the_validation_data_names_the_validation_data() -> None:
    model = torch.nn.Linear(2, 1)
    loop = hookfit.Loop(lambda loop, batch: None, [1, 2], val_step=lambda loop, batch: None, val_data=Stream(),
                        model=model, max_epochs=1)
    with pytest.raises(OSError) as caught:
        loop.fit()
    assert caught.value.__notes__[-1].startswith(
        "hookfit: raised by the validation data when the loop fetched batch 4, fetch 4 of the stage "
        "(batches 1-3 validated)")


def test_data_that_fails_to_make_its_iterator_says_so() -> None:
    class Unopenable:
        def __iter__(self) -> Any:
            raise FileNotFoundError("shard-0001.tar")

    error = fit(Unopenable())
    assert error.__notes__[-1] == ("hookfit: raised by the training data when the loop was making its iterator "
                                   "(iter(data)) (epoch 1, stage train)")


def test_a_fetch_after_the_max_steps_limit_says_why_the_loop_fetched() -> None:
    model = torch.nn.Linear(2, 1)
    loop = hookfit.Loop(lambda loop, batch: None, Stream(), model=model, max_steps=3)  # no length: one more is drawn
    with pytest.raises(OSError) as caught:
        loop.fit()
    assert caught.value.__notes__[-1] == (
        "hookfit: raised by the training data when the loop fetched batch 4 to see whether the stage had more "
        "batches after the max_steps limit (epoch 1, stage train)")


def test_the_step_s_own_error_still_names_the_step() -> None:
    def step(loop: hookfit.Run, batch: Any) -> None:
        if batch == 2:
            raise KeyError("the step's own")

    with pytest.raises(KeyError) as caught:
        hookfit.Loop(step, [0, 1, 2, 3], max_epochs=1).fit()
    assert re.fullmatch(r"hookfit: raised in step function '.*step' \(epoch 1, stage train, batch 3\)",
                        caught.value.__notes__[-1])


@pytest.mark.parametrize("hook, epoch", [("configure", 1), ("fit_start", 1), ("epoch_start", 1), ("epoch_start", 2),
                                         ("epoch_end", 2), ("after_epoch", 1)])
def test_an_error_outside_a_stage_says_so_not_stage_none(hook: str, epoch: int) -> None:
    """A plugin raising before the first stage or between stages is said to be outside a stage, not at "stage None,
    batch 0" nor at the stage before ("epoch 2, stage train, batch 2" for epoch 2's start)."""
    class Raising:
        @hookfit.hookimpl(specname=hook)
        def raising(self, loop) -> None:
            if loop.state.epoch + 1 == epoch:
                raise KeyError("the plugin's own")

    with pytest.raises(KeyError) as caught:
        hookfit.Loop(lambda loop, batch: None, [0, 1], max_epochs=2, plugins=[Raising()]).fit()
    assert re.fullmatch(rf"hookfit: raised by plugin 'Raising' \(.*, given to Loop\) in hook '{hook}' \(epoch "
                        rf"{epoch}, outside a stage\)", caught.value.__notes__[-1]), caught.value.__notes__


def test_a_run_refused_before_it_began_says_so_not_epoch_1_outside_a_stage(tmp_path: Path) -> None:
    """A run whose folder another live process holds (its lock taken here) is refused at its start: its note
    says it was refused before it began, not that it "raised during the run (epoch 1, outside a stage)"."""
    from hookfit.locks import FolderInUse, FolderLock

    held = FolderLock(tmp_path, "hookfit")
    held.acquire("another run")
    try:
        for run in ("fit", "validate"):
            loop = hookfit.Loop(lambda loop, batch: None, [0, 1], val_step=lambda loop, batch: None, val_data=[0],
                                run_dir=tmp_path)
            with pytest.raises(FolderInUse) as caught:
                loop.fit() if run == "fit" else loop.validate()
            assert caught.value.__notes__ == ["hookfit: the run was refused before it began (no epoch had started)"]
    finally:
        held.release()


def test_data_that_raises_before_the_first_epoch_says_the_run_raised_before_it_began_not_that_it_was_refused() -> None:
    """A training data whose ``len()`` raises (the user's code, called before the first epoch): its note says the run
    raised before its first epoch began; "refused" is said only where hookfit refused the run (the test above)."""
    class Broken:
        def __len__(self) -> int:
            raise ValueError("the data's own")

        def __iter__(self) -> Any:
            return iter([0])

    with pytest.raises(ValueError, match="the data's own") as caught:
        hookfit.Loop(lambda loop, batch: None, Broken(), model=torch.nn.Linear(1, 1), max_steps=3).fit()
    assert caught.value.__notes__ == ["hookfit: raised before the run's first epoch began"], caught.value.__notes__


def test_a_plateau_monitor_naming_a_missing_metric_blames_optim_not_metrics() -> None:
    """optim's ``epoch_metrics`` raises inside the metrics plugin's ``stage_end``, which fires that
    event: the note blames optim's implementation and says where it was called from."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)

    step = stepping(model)
    data = [(torch.ones(4, 2), torch.zeros(4, 1))] * 3
    loop = hookfit.Loop(step, data, model=model, optimizers=optimizer, max_epochs=1,
                        plugins=[Metrics(), Optim(schedulers=plateau, monitor="train/accuracy")])
    with pytest.raises(ValueError, match="monitor='train/accuracy' names a metric this run does not produce") as caught:
        loop.fit()
    note = caught.value.__notes__[-1]
    assert re.fullmatch(r"hookfit: raised by plugin 'optim' \(.*\) in hook 'epoch_metrics', called from plugin "
                        r"'metrics' \(.*\) in its hook 'stage_end' \(epoch 1, stage train, after batch 3, its "
                        r"last\)", note), note


class Swapper:
    """Swaps other weights in for the validation and back, as ``core/hooks.md`` prescribes (``wrapper=True``
    implementations of stage_start and stage_end); ``fails`` names the part of it that raises, if any."""

    name = "swapper"

    def __init__(self, fails: str = "") -> None:
        self.fails = fails

    def swap_back(self) -> None:
        if self.fails == "swap_back":
            raise ZeroDivisionError("boom in Swapper.swap_back")

    @hookfit.hookimpl(wrapper=True)
    def stage_start(self, loop: hookfit.Run, stage: str) -> Any:
        return (yield)

    @hookfit.hookimpl(wrapper=True)
    def stage_end(self, loop: hookfit.Run, stage: str) -> Any:
        self.swap_back()
        result = yield
        if self.fails == "after":
            raise ZeroDivisionError("boom in Swapper.stage_end")
        return result


class Publisher:
    name = "publisher"

    @hookfit.hookimpl
    def metrics_values(self, loop: hookfit.Run, stage: str) -> Any:
        raise ZeroDivisionError("boom in metrics_values")


class Finisher:
    name = "finisher"

    @hookfit.hookimpl
    def stage_end(self, loop: hookfit.Run, stage: str) -> None:
        raise ZeroDivisionError("boom in Finisher.stage_end")


def note_of(*plugins: Any) -> str:
    model = torch.nn.Linear(2, 1)
    data = [(torch.ones(4, 2), torch.zeros(4, 1))] * 2
    loop = hookfit.Loop(stepping(model), data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                        max_epochs=1, plugins=[Optim(), Metrics(), *plugins])
    with pytest.raises(ZeroDivisionError) as caught:
        loop.fit()
    return caught.value.__notes__[-1]


@pytest.mark.parametrize("swappers", [[], [Swapper()], ["ema"], [Swapper(), "ema"]], ids=["alone", "swapper", "ema",
                                                                                         "both"])
def test_a_wrapper_that_only_yielded_is_not_said_to_have_called_what_raised(swappers: list[Any]) -> None:
    """A plugin swapping weights for a stage wraps stage_end (as ema does); an error raised by an implementation
    it wraps was thrown into it at its yield, and the note never names the wrapper as the caller ('called from
    plugin 'swapper' in its hook 'stage_end''): an error of metrics_values is called from the metrics plugin's
    stage_end, which fires that event, and one of another plugin's own stage_end from nothing, with wrappers or
    without."""
    from hookfit.plugins.ema import EMA

    plugins = [EMA(decay=0.9) if s == "ema" else s for s in swappers]
    assert re.fullmatch(r"hookfit: raised by plugin 'publisher' \(.*\) in hook 'metrics_values', called from plugin "
                        r"'metrics' \(.*\) in its hook 'stage_end' \(epoch 1, stage train, after batch 2, its last\)",
                        note := note_of(Publisher(), *plugins)), note
    assert re.fullmatch(r"hookfit: raised by plugin 'finisher' \(.*\) in hook 'stage_end' \(epoch 1, stage train, "
                        r"after batch 2, its last\)", note := note_of(Finisher(), *plugins)), note


@pytest.mark.parametrize("fails", ["swap_back", "after"])
def test_a_wrapper_that_raises_itself_is_blamed(fails: str) -> None:
    """The wrapper's own code, before its yield (a helper it calls) or after it, is the wrapper's: named alone."""
    note = note_of(Swapper(fails))
    assert re.fullmatch(r"hookfit: raised by plugin 'swapper' \(.*\) in hook 'stage_end' \(epoch 1, stage train, "
                        r"after batch 2, its last\)", note), note


def test_a_guard_s_note_blames_the_implementation_that_raised_inside_another_plugin_s_hook() -> None:
    """``hook_note``, for guards that call each implementation on their own (``fit_end``'s): an
    error raised in an event a plugin fires from its hook is blamed on the implementation of
    that event; one raised by the hook itself on the hook."""
    seen: dict[str, Any] = {}

    class Fires:
        name = "fires"

        @hookfit.hookimpl
        def fit_end(self, loop: hookfit.Run) -> None:
            seen["pm"] = loop.pm
            if seen.get("own"):
                raise LookupError("fit_end's own")
            loop.pm.hook.epoch_metrics(loop=loop, stage="train", metrics=None)

    class Raises:
        name = "raises"

        @hookfit.hookimpl
        def epoch_metrics(self, loop: hookfit.Run, metrics: Any) -> None:
            raise LookupError("no such metric")

    with pytest.raises(LookupError, match="no such metric") as caught:
        hookfit.Loop(lambda loop, batch: None, [1], max_epochs=1, plugins=[Fires(), Raises()]).fit()
    note = blame.hook_note(seen["pm"], caught.value, "fires", "fit_end")
    assert re.fullmatch(r"hookfit: raised by plugin 'raises' \(.*\) in hook 'epoch_metrics', called from plugin "
                        r"'fires' \(.*\) in its hook 'fit_end'", note), note
    seen["own"] = True
    with pytest.raises(LookupError, match="fit_end's own") as caught:
        hookfit.Loop(lambda loop, batch: None, [1], max_epochs=1, plugins=[Fires(), Raises()]).fit()
    note = blame.hook_note(seen["pm"], caught.value, "fires", "fit_end")
    assert re.fullmatch(r"hookfit: raised by plugin 'fires' \(.*\) in hook 'fit_end'", note), note


PLUGIN = '''
from hookfit.errors import UsageError


class Refused(UsageError, TypeError):
    """The caller named nothing."""


class Tool:
    name = "tool"

    def use(self, what=None, callback=None):
        if callback is not None:
            return callback()
        if what is None:
            raise Refused("name one: tool.use(what)")
        return self.check(what)

    def check(self, what):
        if what == "deep":
            raise Refused("deep inside the tool")
        raise ValueError("the tool's own fault")
'''


def test_a_usage_error_raised_by_plugin_code_a_step_calls_blames_the_step(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A :class:`hookfit.errors.UsageError` that a plugin's code raises when the step calls it
    says the step called it wrongly: the step is blamed, the plugin and its refusing function
    named; another error of the same code, or a usage error raised by code the plugin called
    back (not its own), still blames the plugin."""
    (tmp_path / "refusing_tool.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    import refusing_tool

    def note(**use: Any) -> str:
        def step(loop: hookfit.Run, batch: Any) -> None:
            loop.pm.get_plugin("tool").use(**use)

        with pytest.raises(Exception) as caught:
            hookfit.Loop(step, [0, 1], max_epochs=1, plugins=[refusing_tool.Tool()]).fit()
        return str(caught.value.__notes__[-1])

    for use in ({}, {"what": "deep"}):
        assert re.fullmatch(r"hookfit: raised in step function '.*step', which called plugin 'tool' \(.*\) wrongly: "
                            r"Tool\.use refused the call \(epoch 1, stage train, batch 1\)", note(**use)), use
    assert re.fullmatch(r"hookfit: raised by plugin 'tool' \(.*\) in Tool\.use, called from step function '.*step' "
                        r"\(epoch 1, stage train, batch 1\)", note(what="own")), note(what="own")

    def callback() -> None:
        raise refusing_tool.Refused("raised by the script's callback, not by the tool")

    assert note(callback=callback).startswith("hookfit: raised by plugin 'tool'")


def test_a_hook_implementation_called_from_plugin_code_a_step_calls_is_blamed() -> None:
    """An implementation of an event that plugin code fires when the step calls it (a managed
    ``step()`` fires ``before_optimizer_step``) is blamed, with the plugin code and the step
    named as where it was called from, not the plugin that fired the event."""

    class Logger:
        name = "logger"

        @hookfit.hookimpl
        def before_optimizer_step(self) -> None:
            raise LookupError("the logger's own")

    model = torch.nn.Linear(2, 1)
    loop = hookfit.Loop(stepping(model), [(torch.ones(4, 2), torch.zeros(4, 1))] * 2, model=model,
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.1), max_epochs=1,
                        plugins=[Optim(), Logger()])
    with pytest.raises(LookupError, match="the logger's own") as caught:
        loop.fit()
    note = caught.value.__notes__[-1]
    assert re.fullmatch(r"hookfit: raised by plugin 'logger' \(.*\) in hook 'before_optimizer_step', called from "
                        r"plugin 'optim' \(.*\) in \S+\.step, called from step function '.*step' "
                        r"\(epoch 1, stage train, batch 1\)", note), note


WRAPPING = '''
import hookfit


class Wrapping:
    name = "wrapping"

    def __init__(self, fail_on: int, signature_ok: bool = True) -> None:
        self.fail_on, self.signature_ok = fail_on, signature_ok

    def wrap(self, step):
        def wrapped(loop, batch):
            if loop.state.step == self.fail_on:
                raise RuntimeError("the wrapper broke")
            return step(loop, batch)

        return wrapped if self.signature_ok else (lambda batch: step(None, batch))

    @hookfit.hookimpl
    def configure(self, loop):
        loop.wrap_step(self.wrap)
'''


def _wrapping(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    (tmp_path / "wrapping_plugin.py").write_text(WRAPPING)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    return importlib.import_module("wrapping_plugin").Wrapping


@pytest.mark.bad_input
def test_an_error_of_a_plugin_s_step_wrapper_blames_the_plugin_not_the_step(tmp_path, monkeypatch) -> None:
    """A wrap_step wrapper that raises, outside the step it wraps: the note said 'raised in step function
    'step'' (the wrapper carries the step's name); it names the plugin and its wrapper. An error of the
    step itself, inside the wrapper, still names the step."""
    wrapping = _wrapping(tmp_path, monkeypatch)

    def step(loop, batch):
        if batch == 5:
            raise ValueError("the step broke")

    with pytest.raises(RuntimeError, match="the wrapper broke") as caught:
        hookfit.Loop(step, [1, 2, 3], plugins=[wrapping(fail_on=1)]).fit()
    note = " ".join(caught.value.__notes__)
    assert re.search(r"raised in the step wrapper 'Wrapping.wrap.<locals>.wrapped' of plugin 'wrapping'.*"
                     r"around step function '.*step'", note), note
    with pytest.raises(ValueError, match="the step broke") as caught:
        hookfit.Loop(step, [4, 5], plugins=[wrapping(fail_on=-1)]).fit()
    assert "raised in step function" in " ".join(caught.value.__notes__)


@pytest.mark.bad_input
def test_a_step_wrapper_that_cannot_take_loop_and_batch_is_refused_at_wrap_step(tmp_path, monkeypatch) -> None:
    """Refused at wrap_step, not failing at the first batch as 'train_step() takes 1 positional argument', blamed
    on no plugin."""
    wrapping = _wrapping(tmp_path, monkeypatch)
    with pytest.raises(TypeError, match=r"wrap_step: the wrapper returned .*lambda.* for train_step '.*', which "
                                        r"cannot be called as step\(loop, batch\)"):
        hookfit.Loop(lambda loop, batch: None, [1], plugins=[wrapping(fail_on=-1, signature_ok=False)]).fit()


@pytest.mark.parametrize("kind", ["partial", "callable"])
def test_an_error_of_a_partial_or_callable_step_under_a_wrapper_names_the_step(kind: str) -> None:
    """A step whose code is not its own __code__ (a functools.partial, a callable object) under the
    optimizer's autocast wrapper was blamed on the wrapper; it is the step's error, named as given."""
    import functools

    def failing(loop: Any, batch: Any, scale: float) -> Any:
        raise ValueError("boom in the step")

    class Step:
        def __call__(self, loop: Any, batch: Any) -> Any:
            raise ValueError("boom in the step")

    step = functools.partial(failing, scale=2.0) if kind == "partial" else Step()
    with pytest.raises(ValueError, match="boom in the step") as caught:
        hookfit.Loop(step, [1], model=torch.nn.Linear(1, 1), plugins=[Optim(precision="bf16-mixed")]).fit()
    note = " ".join(caught.value.__notes__)
    assert "raised in step function" in note and "step wrapper" not in note, note


@pytest.mark.bad_input
@pytest.mark.parametrize("given", [False, True], ids=["discovered", "given to Loop"])
def test_an_error_of_a_plugin_s_options_from_the_file_names_the_file_and_the_way_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: bool) -> None:
    """A monitor set in hookfit.toml refused at fit_start (a final retrain with no validation data): the error's note
    names the file's table the monitor came from, its options there, and how to run without it (the option in the
    code, or the plugin switched off)."""
    from hookfit.plugins.early_stopping import EarlyStopping

    (tmp_path / "hookfit.toml").write_text('[plugins.early_stopping]\nmonitor = "valid/loss"\npatience = 3\n')
    monkeypatch.setenv("HOOKFIT_CONFIG", str(tmp_path / "hookfit.toml"))
    monkeypatch.setenv("HOOKFIT_PLUGINS", "optim" if given else "optim,early_stopping")
    model = torch.nn.Linear(2, 1)
    loop = hookfit.Loop(stepping(model), [(torch.ones(4, 2), torch.zeros(4, 1))], model=model,
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                        plugins=[EarlyStopping()] if given else [])
    with pytest.raises(ValueError, match="early_stopping: monitor='valid/loss' needs validation") as caught:
        loop.fit()
    (note,) = caught.value.__notes__
    table = f"{tmp_path / 'hookfit.toml'} [plugins.early_stopping]"
    way = ("pass the option in the code, which wins over the file" if given else
           "switch the plugin off for this run: Loop(disable=['early_stopping']) or HOOKFIT_DISABLE_PLUGINS=early_stopping")
    assert note.endswith(f"in hook 'fit_start' (epoch 1, outside a stage); its options monitor='valid/loss', "
                         f"patience=3 come from {table}: "
                         f"change them there, or {way}"), note


def test_an_error_of_a_plugin_s_options_from_the_code_names_no_file() -> None:
    from hookfit.plugins.early_stopping import EarlyStopping

    model = torch.nn.Linear(2, 1)
    loop = hookfit.Loop(stepping(model), [(torch.ones(4, 2), torch.zeros(4, 1))], model=model,
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                        plugins=[Optim(), EarlyStopping(monitor="valid/loss", patience=3)])
    with pytest.raises(ValueError, match="needs validation") as caught:
        loop.fit()
    assert caught.value.__notes__ == ["hookfit: raised by plugin 'early_stopping' (hookfit 0.1.0, hookfit.plugins."
                                      "early_stopping.EarlyStopping, given to Loop) in hook 'fit_start' (epoch 1, "
                                      "outside a stage)"]


@pytest.mark.bad_input
@pytest.mark.parametrize("case", ["torn file", "no model"])
def test_an_error_of_a_plugin_that_names_none_of_the_file_s_options_names_no_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """hookfit.toml gives the checkpoint plugin monitor='valid/loss'; a torn file given to resume, or
    resume='latest' in a run without a model, fails its configure for a cause of the run's, not of those options.
    The note said they came from the file and to switch the plugin off, which drops the resume asked for."""
    (tmp_path / "hookfit.toml").write_text('[plugins.checkpoint]\nmonitor = "valid/loss"\n')
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOOKFIT_CONFIG", str(tmp_path / "hookfit.toml"))
    monkeypatch.setenv("HOOKFIT_PLUGINS", "optim,metrics,checkpoint")
    model = torch.nn.Linear(2, 1)
    data = [(torch.ones(4, 2), torch.zeros(4, 1))]
    loop = hookfit.Loop(stepping(model), data, val_step=stepping(model), val_data=data,
                        model=model if case == "torn file" else None,
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                        resume=str(tmp_path / "bad.pt") if case == "torn file" else "latest")
    with pytest.raises(Exception, match="not a whole hookfit checkpoint" if case == "torn file" else
                       "resume='latest' needs the run's model") as caught:
        loop.fit()
    assert re.fullmatch(r"hookfit: raised by plugin 'checkpoint' \(.*\) in hook 'configure' \(epoch 1, outside a "
                        r"stage\)", note := caught.value.__notes__[-1]), note


class StartFails:
    """Raises in ``stage_start`` of the stage ``stage``."""

    name = "start_fails"

    def __init__(self, stage: str) -> None:
        self.stage = stage

    @hookfit.hookimpl
    def stage_start(self, loop: hookfit.Run, stage: str) -> None:
        if stage == self.stage:
            raise ZeroDivisionError(f"boom in stage_start of {stage}")


@pytest.mark.parametrize("stage", ["train", "valid"])
def test_an_error_of_stage_start_is_placed_before_the_stage_s_first_batch(stage: str) -> None:
    """stage_start runs before the stage draws a batch: its note said 'batch 1', as if one had been drawn."""
    model = torch.nn.Linear(2, 1)
    data = [(torch.ones(4, 2), torch.zeros(4, 1))] * 2
    loop = hookfit.Loop(stepping(model), data, val_step=lambda loop, batch: None, val_data=data, model=model,
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.1), max_epochs=1,
                        plugins=[Optim(), StartFails(stage)])
    with pytest.raises(ZeroDivisionError) as caught:
        loop.fit()
    assert re.fullmatch(rf"hookfit: raised by plugin 'start_fails' \(.*\) in hook 'stage_start' \(epoch 1, stage "
                        rf"{stage}, before its first batch\)", note := caught.value.__notes__[-1]), note


def test_an_error_of_stage_start_in_a_stage_resumed_mid_way_names_the_batch_it_resumes_at(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hookfit.plugins.checkpoint import Checkpoint

    monkeypatch.chdir(tmp_path)
    data = [(torch.ones(4, 2), torch.zeros(4, 1))] * 4

    def fit(max_steps: int | None, *plugins: Any, resume: str | None = None) -> None:
        model = torch.nn.Linear(2, 1)
        hookfit.Loop(stepping(model), data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                     max_epochs=1, max_steps=max_steps, resume=resume,
                     plugins=[Optim(), Checkpoint(every_n_steps=1, background=False), *plugins]).fit()

    fit(2)
    with pytest.raises(ZeroDivisionError) as caught:
        fit(None, StartFails("train"), resume="latest")
    assert re.fullmatch(r"hookfit: raised by plugin 'start_fails' \(.*\) in hook 'stage_start' \(epoch 1, stage "
                        r"train, before batch 3\)", note := caught.value.__notes__[-1]), note
