"""A run whose folder cannot be created trains on with one ``FileWarning`` naming the folder: a
``run_dir`` under a read-only folder, and a script started from a read-only folder with the
default ``runs/``. A folder a plugin places for the run (``loop.place_run_dir``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import hookfit
from hookfit import hookimpl
from hookfit.files import FileWarning
from hookfit.plugins.csv_log import CSVLogger
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.metrics_log import MetricsLog
from hookfit.plugins.optim import Optim
from hookfit.locks import LOCK


def fit(run_dir: Path | None, *plugins: object) -> hookfit.State:
    model = torch.nn.Linear(2, 1)

    def step(loop, batch):
        loss = model(batch).pow(2).mean()
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    return hookfit.Loop(step, [torch.ones(4, 2)] * 3, model=model,
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.1), max_epochs=2, run_dir=run_dir,
                        plugins=[Optim(), Metrics(), MetricsLog(), CSVLogger(), *plugins]).fit()


def file_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, FileWarning)]


@pytest.mark.fault
def test_a_run_dir_under_a_read_only_folder_trains_on_with_one_warning_naming_it(read_only_folder: Path) -> None:
    folder = read_only_folder / "deeper" / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = fit(folder)
    assert (state.status, state.step) == ("completed", 6)
    (message,) = file_warnings(caught)  # one for the run, none for each file it would have written
    assert message.startswith(f"hookfit: could not create the run folder {folder} (")
    assert "Read-only file system" in message or "Permission denied" in message
    assert "trains on without the files" in message
    assert [w.filename for w in caught if issubclass(w.category, FileWarning)] == [__file__]  # fit()'s line
    assert list(read_only_folder.iterdir()) == []


@pytest.mark.fault
def test_a_lock_that_cannot_be_made_is_warned_about_at_the_fit_line(tmp_path: Path) -> None:
    (tmp_path / "run" / LOCK).mkdir(parents=True)  # a folder where the lock file goes
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fit(tmp_path / "run").status == "completed"
    said = [w for w in caught if issubclass(w.category, FileWarning)]
    assert [str(w.message).split(" (")[0] for w in said] == [f"hookfit: could not create {tmp_path / 'run' / LOCK}"]
    assert said[0].filename == __file__  # fit()'s line, not the run folder's code


@pytest.mark.fault
def test_after_a_lost_folder_the_next_run_in_the_process_writes_and_warns_as_ever(read_only_folder: Path,
                                                                                  tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        fit(read_only_folder / "run")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fit(tmp_path / "run").status == "completed"
    assert file_warnings(caught) == []
    assert (tmp_path / "run" / "metrics.jsonl").is_file() and (tmp_path / "run" / "run.jsonl").is_file()
    # a file that then fails in a folder that exists still says so itself
    (tmp_path / "run" / "metrics.csv").unlink()
    (tmp_path / "run" / "metrics.csv").mkdir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fit(tmp_path / "run").status == "completed"
    csv_file = tmp_path / "run" / "metrics.csv"
    assert [m.split(" (")[0] for m in file_warnings(caught)] == [f"csv: could not write {csv_file}"]


@pytest.mark.slow
@pytest.mark.fault
def test_a_script_started_from_a_read_only_folder_trains_on_without_runs(read_only_folder: Path,
                                                                          tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch, hookfit
        from hookfit.plugins.metrics import Metrics
        model = torch.nn.Linear(2, 1)

        def step(loop, batch):
            loss = model(batch).pow(2).mean()
            loop.backward(loss)
            loop.optimizers.step()
            loop.optimizers.zero_grad()
            return {"loss": loss}

        state = hookfit.Loop(step, [torch.ones(4, 2)] * 3, model=model, max_epochs=2, plugins=[Metrics()],
                             optimizers=torch.optim.SGD(model.parameters(), lr=0.1)).fit()
        print("status", state.status, state.step)
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")}
    done = subprocess.run([sys.executable, "-W", "always", str(script)], cwd=read_only_folder, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "status completed 6" in done.stdout
    warned = [line for line in done.stderr.splitlines() if "Warning: " in line]
    ours = [line for line in warned if "FileWarning: " in line]
    assert len(ours) == 1, warned
    assert f"hookfit: could not create the run folder {read_only_folder}/runs/train/" in ours[0]
    # the checkpoint plugin, on by default, says once that its saves fail, in its own category
    assert all("FileWarning: " in line or "CheckpointWarning: checkpoint: " in line for line in warned), warned
    assert list(read_only_folder.iterdir()) == []


class Place:
    """Places the run's folder at configure, and notes what the folder holds when released."""

    name = "place"

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.released: list[tuple[list[str], bool]] = []

    @hookimpl(tryfirst=True)
    def configure(self, loop):
        self.folder.mkdir()
        loop.place_run_dir(self.folder, released=self.release)

    def release(self) -> None:
        lines = (self.folder / "run.jsonl").read_text().splitlines()
        self.released.append(([json.loads(line)["event"] for line in lines], (self.folder / LOCK).exists()))


def test_a_folder_a_plugin_places_is_the_runs_and_released_after_the_end_line(tmp_path: Path) -> None:
    place = Place(tmp_path / "placed")
    given = []

    class Look:
        name = "look"

        @hookimpl
        def fit_start(self, loop):
            given.append((loop.run_dir, loop.run_dir_given))

    state = fit(tmp_path / "configured", place, Look())
    assert state.status == "completed"
    assert given == [(tmp_path / "placed", True)]
    assert (tmp_path / "placed" / "metrics.jsonl").is_file() and not (tmp_path / "configured").exists()
    assert place.released == [(["run", "end"], False)]  # after the end line; the core took no lock there


def test_a_folder_is_placed_before_any_plugin_uses_run_dir(tmp_path: Path) -> None:
    class Early:
        name = "early"

        @hookimpl(tryfirst=True)
        def configure(self, loop):
            loop.run_dir  # noqa: B018

    with pytest.raises(RuntimeError, match=r"place_run_dir\('.*placed'\): the run already writes to .*early; call "
                       r"it at configure, before any plugin uses loop.run_dir"):
        fit(tmp_path / "early", Place(tmp_path / "placed"), Early())
