"""hookfit.records: a run's name and its folder; continue_in."""

from __future__ import annotations

import gc
import re
import signal
import threading
import tracemalloc
from collections import OrderedDict

import pytest
import torch

import hookfit
import hookfit.payloads
from conftest import saved_run
from conftest import Recorder


def test_a_run_is_named_and_gets_a_folder_of_its_name(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    folders = []

    def step(loop, b):
        folders.append((loop.name, loop.run_dir))

    hookfit.Loop(step, [1], name="exp").fit()
    hookfit.Loop(step, [1], name="exp").fit()
    hookfit.Loop(step, [1], run_dir=tmp_path / "given").fit()
    (name1, dir1), (name2, dir2), (name3, dir3) = folders
    assert name1 == name2 == "exp" and dir1 != dir2
    assert dir1.parent == dir2.parent == tmp_path / "runs" / "exp"  # runs/<name>/<date>-<time>
    assert (name3, dir3) == ("given", tmp_path / "given")


@pytest.mark.bad_input
@pytest.mark.parametrize("name", ["", " ", "a/b", "..", 3])
def test_a_bad_name_is_refused(name) -> None:
    with pytest.raises(ValueError, match="name must be a non-empty string usable as a folder name"):
        hookfit.Loop(lambda l, b: None, [1], name=name)


@pytest.mark.bad_input
def test_continue_in_is_refused_once_the_folder_is_used(tmp_path) -> None:
    class Late:
        name = "late"

        @hookfit.hookimpl
        def fit_start(self, loop):
            loop.run_dir  # a plugin already writes here
            loop.continue_in(tmp_path / "elsewhere")

    with pytest.raises(RuntimeError, match="already writes to .*call it at configure"):
        hookfit.Loop(lambda l, b: None, [1], name="x", plugins=[Late()]).fit()

    class Early:
        name = "early"

        @hookfit.hookimpl
        def configure(self, loop):
            loop.continue_in(tmp_path / "earlier-run")

    seen = []
    hookfit.Loop(lambda l, b: seen.append(l.run_dir), [1], plugins=[Early()]).fit()
    assert seen == [tmp_path / "earlier-run"]
