"""The smoke plugin (hookfit.plugins.smoke): two batches a stage through every plugin, nothing
kept, a report; the core knows only the flag, and a smoke run without the plugin fails at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim

from conftest import Recorder


@pytest.fixture(autouse=True)
def _smoke_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite's runs see only the plugins a test gives (HOOKFIT_PLUGINS is empty); these
    also get the discovered smoke plugin, which makes smoke runs."""
    monkeypatch.setenv("HOOKFIT_PLUGINS", "smoke")


class Folder:
    """Remembers the run folder the run was given."""

    name = "folder"
    seen: Path | None = None

    @hookfit.hookimpl
    def fit_start(self, loop):
        Folder.seen = loop.run_dir


def regression(batches: int = 10):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(batches)]

    def step(loop, batch):
        loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss, "mae": (loop.model(batch[0]) - batch[1]).abs().mean()}

    return model, data, step


def test_a_smoke_run_runs_two_batches_a_stage_through_every_plugin_and_keeps_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, data, step = regression()
    recorder = Recorder()
    state = hookfit.Loop(step, data, val_step=lambda l, b: {"loss": torch.tensor(0.5)}, val_data=data, model=model,
                         optimizers=torch.optim.SGD(model.parameters(), lr=0.1), max_epochs=5, smoke=True,
                         plugins=[Optim(), Metrics(), Checkpoint(dir=tmp_path / "kept", background=False), Folder(),
                                  recorder]).fit()
    assert (state.status, state.step, state.epoch) == ("completed", 2, 0)
    names = recorder.names()
    assert names.count("batch_end") == 4 and names.count("epoch_end") == 1  # 2 train + 2 valid batches
    assert not (tmp_path / "kept").exists(), "a smoke run writes no checkpoint where it would be kept"
    assert Folder.seen is not None and Folder.seen.name.startswith("hookfit-smoke-")
    assert not Folder.seen.exists(), "the temporary run folder is removed"
    assert sorted(os.listdir(tmp_path)) == [], "nothing in the folder the run started in"
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("hookfit smoke: completed after 2 training batch(es) and validation in ")
    assert "hookfit smoke: train step 'regression.<locals>.step' returned: loss, mae" in err
    assert any(line.startswith("hookfit smoke: valid step '") and line.endswith("<lambda>' returned: loss")
               for line in err), err
    assert "hookfit smoke: plugins (5), with the events each handled:" in err
    assert "hookfit smoke:   optim: backward, epoch_end, epoch_metrics, fit_end, fit_start, results, save_state, stage_end, stage_start" in err
    assert any(line.startswith("hookfit smoke:   checkpoint: ") and "after_epoch" in line  # it saved, in the temporary folder
               for line in err), err


def test_a_smoke_run_resumes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, data, step = regression()
    kwargs = dict(model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1), name="exp")
    hookfit.Loop(step, data, plugins=[Optim(), Checkpoint(background=False)], **kwargs).fit()
    saved = sorted(tmp_path.glob("runs/exp/*/checkpoints/*.pt"))
    assert saved
    state = hookfit.Loop(step, data, plugins=[Optim(), Checkpoint(background=False)], resume="latest", smoke=True,
                         **kwargs).fit()
    assert state.resumed_from is None and state.step == 2
    assert sorted(tmp_path.glob("runs/exp/*/checkpoints/*.pt")) == saved  # nothing added


@pytest.mark.fault
def test_a_failing_smoke_run_still_reports_and_cleans_up(capsys: pytest.CaptureFixture[str]) -> None:
    def step(loop, batch):
        if batch == 1:
            raise RuntimeError("broken step")
        return {"loss": 1.0}

    with pytest.raises(RuntimeError, match="broken step"):
        hookfit.Loop(step, range(10), smoke=True, plugins=[Folder()]).fit()
    err = capsys.readouterr().err
    assert "hookfit smoke: failed: RuntimeError: broken step" in err and "after 1 training batch(es)" in err
    assert not Folder.seen.exists()


def test_data_without_a_length_is_cut_too() -> None:
    seen = []

    class Stream:  # an iterable with no len()
        def __iter__(self):
            return iter(range(100))

    hookfit.Loop(lambda l, b: seen.append((b, hasattr(l.train_data, "__len__"))), Stream(), smoke=True).fit()
    assert seen == [(0, False), (1, False)]


@pytest.mark.slow
def test_hookfit_smoke_in_the_environment_makes_any_script_a_smoke_run(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent('''
        import torch, hookfit
        model = torch.nn.Linear(2, 1)
        data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(50)]
        def step(loop, batch):
            loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
            loop.backward(loss)
            loop.optimizers.step()
            loop.optimizers.zero_grad()
            return loss
        state = hookfit.Loop(step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                             max_epochs=100).fit()
        print("END", state.status, state.step)
    '''))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env={**env, "HOOKFIT_SMOKE": "1"},
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert "END completed 2" in done.stdout
    assert "hookfit smoke: train step 'step' returned: loss" in done.stderr
    for plugin in ("optim", "metrics", "console", "checkpoint"):  # the discovered ones took part
        assert f"hookfit smoke:   {plugin}: " in done.stderr, done.stderr
    assert sorted(os.listdir(tmp_path)) == ["train.py"], "a smoke run keeps nothing"


@pytest.mark.bad_input
def test_the_option_is_checked() -> None:
    with pytest.raises(ValueError, match=r"smoke must be True, False or None \(HOOKFIT_SMOKE decides\), got 'yes'"):
        hookfit.Loop(lambda l, b: None, [1], smoke="yes")


def test_each_validation_set_gets_its_first_batches() -> None:
    seen = []
    hookfit.Loop(lambda l, b: None, range(10), val_step=lambda l, b: seen.append((l.state.val_set, b)),
                 val_data={"a": range(10), "b": range(100, 110)}, smoke=True).fit()
    assert seen == [("a", 0), ("a", 1), ("b", 100), ("b", 101)]


class Helped:
    """A third-party plugin that registers a helper of its own at configure."""

    name = "helped"

    class Helper:
        @hookfit.hookimpl
        def batch_end(self) -> None:
            pass

    @hookfit.hookimpl
    def configure(self, loop):
        loop.pm.register(Helped.Helper(), name="helped.batch_end")


def test_helpers_a_plugin_registers_are_reported_as_such(capsys: pytest.CaptureFixture[str]) -> None:
    model, data, step = regression()
    hookfit.Loop(step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1), smoke=True,
                 plugins=[Optim(), Helped()]).fit()
    err = capsys.readouterr().err.splitlines()
    assert "hookfit smoke:   helped.batch_end (registered by a plugin): batch_end" in err, err
    assert "hookfit smoke: plugins (2), with the events each handled:" in err


def test_a_smoke_run_validates_inside_training_when_asked(capsys: pytest.CaptureFixture) -> None:
    """(Moved from tests/core/test_step_validation.py, where the smoke plugin is not enabled.)"""
    seen = []
    loop = hookfit.Loop(lambda l, b: None, list(range(10)),
                        val_step=lambda l, b: seen.append(l.state.step) or {"v": 1.0},
                        val_data=list(range(10)), val_every_n_steps=500, smoke=True)
    assert loop.fit().status == "completed"
    assert seen == [1, 1, 2, 2]  # two validation batches after each of the two training batches
    assert "and validation" in capsys.readouterr().err


@pytest.mark.bad_input
@pytest.mark.parametrize("how", ["HOOKFIT_PLUGINS", "disable", "hookfit.toml", "HOOKFIT_SMOKE"])
def test_a_smoke_run_without_the_smoke_plugin_fails_at_once_naming_it(
        how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Without the plugin that makes smoke runs, smoke=True would train for real (100 epochs
    here): it fails after configure instead, before any batch, naming the plugin."""
    steps = []
    smoke: bool | None = True
    disable = ["smoke"] if how == "disable" else []
    if how == "HOOKFIT_PLUGINS":
        monkeypatch.setenv("HOOKFIT_PLUGINS", "")
    if how == "hookfit.toml":
        (tmp_path / "off.toml").write_text("[plugins.smoke]\nenabled = false\n")
        monkeypatch.setenv("HOOKFIT_CONFIG", str(tmp_path / "off.toml"))
    if how == "HOOKFIT_SMOKE":
        monkeypatch.setenv("HOOKFIT_PLUGINS", "")
        monkeypatch.setenv("HOOKFIT_SMOKE", "1")
        smoke = None
    loop = hookfit.Loop(lambda l, b: steps.append(b), range(10), max_epochs=100, smoke=smoke, disable=disable,
                        plugins=[Folder()])
    asked = "HOOKFIT_SMOKE=1" if how == "HOOKFIT_SMOKE" else r"Loop\(smoke=True\)"
    with pytest.raises(RuntimeError, match=asked + r" asks for a smoke run, and no enabled plugin made one at "
                       r"configure: the built-in plugin 'smoke' \(hookfit.plugins.smoke\) does; enable it.*"
                       r"disabled plugins: [^)]*\bsmoke\b"):
        loop.fit()
    assert steps == [] and loop.state.status == "failed" and loop.state.step == 0
    assert "hookfit smoke:" not in capsys.readouterr().err


def test_a_run_that_is_not_a_smoke_run_has_no_smoke_plugin_in_it(tmp_path: Path) -> None:
    """Discovered in every run, the plugin unregisters itself at configure unless a smoke run is
    asked: not a participant, nothing on the per-batch path, run.jsonl does not list it."""
    seen = []

    class Look:
        name = "look"

        @hookfit.hookimpl
        def fit_start(self, loop):
            seen.append((loop.pm.participants(), loop.hooks.per_batch.step_output or None, loop.smoke, loop.run_dir_given))
            loop.run_dir  # noqa: B018 - the folder, with its run.jsonl

    state = hookfit.Loop(lambda l, b: {"loss": 1.0}, range(4), max_epochs=3, run_dir=tmp_path / "run",
                         plugins=[Look()]).fit()
    assert (state.status, state.step) == ("completed", 12)
    assert seen == [(["look"], None, False, True)]
    assert json.loads((tmp_path / "run" / "run.jsonl").read_text().splitlines()[0])["plugins"] == ["look"]


def test_a_smoke_run_gets_its_temporary_folder_even_with_a_run_dir(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    Folder.seen = None
    state = hookfit.Loop(lambda l, b: None, range(10), run_dir=tmp_path / "kept", smoke=True, max_steps=7,
                         plugins=[Folder()]).fit()
    assert (state.status, state.step, state.epoch) == ("completed", 2, 0)
    assert Folder.seen is not None and Folder.seen.name.startswith("hookfit-smoke-") and not Folder.seen.exists()
    assert not (tmp_path / "kept").exists()
    assert capsys.readouterr().err.startswith("hookfit smoke: completed after 2 training batch(es) in ")
