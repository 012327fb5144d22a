"""hookfit.runwarnings: the warnings a run showed are lines of its ``run.jsonl``, once each,
before its end line, as the warnings filters let them through."""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path

import pytest
import torch

import hookfit
from hookfit.errors import HookfitWarning
from hookfit.tools import runs


class Warns:
    """Warns at fit_start (before the run folder is made), and twice the same at each train
    epoch's end; uses the run folder at the first epoch's end."""

    name = "warns"

    @hookfit.hookimpl
    def fit_start(self, loop) -> None:
        warnings.warn("WARNS AT FIT START", UserWarning)

    @hookfit.hookimpl
    def stage_end(self, loop, stage) -> None:
        if stage == "train":
            loop.run_dir  # noqa: B018 - the folder, and run.jsonl, from here
            for _ in range(2):
                warnings.warn(f"warns: epoch {loop.state.epoch + 1} of {loop.max_epochs}", HookfitWarning)


def lines(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "run.jsonl").read_text().splitlines()]


def test_each_warning_is_one_line_between_the_run_and_end_lines(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = warnings.showwarning
        state = hookfit.Loop(lambda l, b: None, [1, 2], max_epochs=2, run_dir=tmp_path, plugins=[Warns()]).fit()
        assert warnings.showwarning is before  # put back after the run
    assert state.status == "completed"
    assert [str(w.message) for w in caught].count("warns: epoch 1 of 2") == 2  # shown as before, each time
    found = lines(tmp_path)
    assert [line["event"] for line in found] == ["run", "warning", "warning", "warning", "end"]
    assert [(line["category"], line["message"], line["step"]) for line in found[1:4]] == [
        ("UserWarning", "WARNS AT FIT START", 0),  # shown before the folder was made: after the run line
        ("hookfit.errors.HookfitWarning", "warns: epoch 1 of 2", 2),  # (the same one twice: recorded once)
        ("hookfit.errors.HookfitWarning", "warns: epoch 2 of 2", 4)]
    assert found[1]["where"].startswith(f"{__file__}:")
    info = runs.load(tmp_path)  # the readers pass over them
    assert (info.status, info.fits, info.notes) == ("completed", 1, ())


def test_a_warning_the_filters_leave_out_is_not_recorded(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message="warns: epoch", category=HookfitWarning)
        hookfit.Loop(lambda l, b: None, [1], run_dir=tmp_path, plugins=[Warns()]).fit()
    assert [str(w.message) for w in caught] == ["WARNS AT FIT START"]
    assert [line["message"] for line in lines(tmp_path) if line["event"] == "warning"] == ["WARNS AT FIT START"]


@pytest.mark.fault
def test_an_error_while_the_run_ends_is_recorded_before_the_end_line(tmp_path: Path) -> None:
    class Breaks:
        name = "breaks"

        @hookfit.hookimpl
        def fit_start(self, loop) -> None:
            loop.run_dir  # noqa: B018 - a plugin that writes there

        @hookfit.hookimpl
        def fit_end(self, loop) -> None:
            raise OSError("BREAKS AT FIT END")

    def step(loop, batch) -> None:
        raise RuntimeError("the step broke")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="the step broke"):
            hookfit.Loop(step, [1], run_dir=tmp_path, plugins=[Breaks()]).fit()
    said = [str(w.message) for w in caught if "BREAKS AT FIT END" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("fit_end failed")  # shown, as before
    found = lines(tmp_path)
    assert [line["event"] for line in found] == ["run", "warning", "end"]
    assert found[1]["message"] == said[0] and found[1]["category"] == "hookfit.errors.HookfitWarning"
    assert found[-1]["status"] == "failed"


def test_a_run_without_a_folder_records_nothing_and_makes_none(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)

    def step(loop, batch) -> None:
        warnings.warn("A STEP WARNS", UserWarning)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hookfit.Loop(step, [1]).fit()
    assert [str(w.message) for w in caught] == ["A STEP WARNS"]
    assert not (tmp_path / "runs").exists()


class UsesFolder:
    name = "uses_folder"

    @hookfit.hookimpl
    def fit_start(self, loop) -> None:
        loop.run_dir  # noqa: B018 - the folder, and run.jsonl, from here


def test_a_recorder_kept_after_the_run_holds_nothing_of_it(tmp_path: Path) -> None:
    """``logging.captureWarnings(True)`` turned on during the run saves the recorder's function,
    and turning it off after the run puts that function back: it must not keep the run (and its
    model) alive, nor record into the finished run's folder."""
    import gc
    import io
    import logging
    import weakref

    def step(loop, batch) -> None:
        logging.captureWarnings(True)

    model = torch.nn.Linear(2, 1)
    alive = weakref.ref(model)
    before = warnings.showwarning
    try:
        hookfit.Loop(step, [1], model=model, run_dir=tmp_path, plugins=[UsesFolder()]).fit()
    finally:
        logging.captureWarnings(False)
    kept = warnings.showwarning
    try:
        assert kept is not before  # the recorder's function, put back by logging
        del model
        gc.collect()
        assert alive() is None
        out = io.StringIO()
        with contextlib.redirect_stderr(out), warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = kept
            warnings.warn("AFTER THE RUN", UserWarning)
        assert "UserWarning: AFTER THE RUN" in out.getvalue()  # shown as Python would
    finally:
        warnings.showwarning = before
    assert [line["event"] for line in lines(tmp_path)] == ["run", "end"]


def test_a_run_inside_another_records_its_warnings_alone(tmp_path: Path) -> None:
    def inner_step(loop, batch) -> None:
        warnings.warn("THE INNER RUN WARNS", UserWarning)

    def outer_step(loop, batch) -> None:
        if loop.state.step == 0:
            hookfit.Loop(inner_step, [1], run_dir=tmp_path / "inner", plugins=[UsesFolder()]).fit()
        else:
            warnings.warn("THE OUTER RUN WARNS", UserWarning)

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        hookfit.Loop(outer_step, [1, 2], run_dir=tmp_path / "outer", plugins=[UsesFolder()]).fit()
    said = {name: [line["message"] for line in lines(tmp_path / name) if line["event"] == "warning"]
            for name in ("inner", "outer")}
    assert said == {"inner": ["THE INNER RUN WARNS"], "outer": ["THE OUTER RUN WARNS"]}


def test_the_warnings_past_the_limit_are_counted_before_the_end_line(tmp_path: Path) -> None:
    from hookfit.runwarnings import KEPT

    def step(loop, batch) -> None:
        for i in range(KEPT + 50):
            warnings.warn(f"DISTINCT WARNING {i}", UserWarning)
        warnings.warn(f"DISTINCT WARNING {KEPT + 49}", UserWarning)  # a repeat: counted once

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        hookfit.Loop(step, [1], run_dir=tmp_path, plugins=[UsesFolder()]).fit()
    found = lines(tmp_path)
    assert [line["event"] for line in found] == ["run"] + ["warning"] * KEPT + ["warnings_dropped", "end"]
    assert found[-2]["count"] == 50
