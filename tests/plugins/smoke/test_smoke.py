"""hookfit.smoke: two batches a stage through every plugin, nothing kept, a report."""

from __future__ import annotations

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
    assert "hookfit smoke:   optim: backward, epoch_end, epoch_metrics, fit_end, results, save_state, stage_end, stage_start" in err
    assert any(line.startswith("hookfit smoke:   checkpoint: ") and "epoch_checkpoint" in line  # it saved, in the temporary folder
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


def test_helpers_a_plugin_registers_are_reported_as_such(capsys: pytest.CaptureFixture[str]) -> None:
    model, data, step = regression()
    hookfit.Loop(step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1), smoke=True,
                 plugins=[Optim(accumulate=2)]).fit()
    err = capsys.readouterr().err.splitlines()
    assert "hookfit smoke:   optim.batch_end (registered by a plugin): batch_end" in err, err
    assert "hookfit smoke: plugins (1), with the events each handled:" in err
