"""Checkpoint(dir=...) that cannot be a folder is refused at fit_start with a message that says
what is wrong and names the option, before any batch trains."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.optim import Optim

from conftest import mse_step


def fit(directory: str | Path) -> hookfit.Loop:
    model = torch.nn.Linear(2, 1)
    data = [(torch.ones(4, 2), torch.zeros(4, 1))] * 2
    return hookfit.Loop(mse_step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                        max_epochs=1, plugins=[Optim(), Checkpoint(dir=directory)], run_dir="run")


@pytest.mark.bad_input
@pytest.mark.parametrize("path, kind", [("/dev/null", "not a regular file"), ("a-file", "a file")])
def test_a_dir_that_is_not_a_folder_is_refused_saying_so(tmp_path: Path, path: str, kind: str) -> None:
    if path == "a-file":
        path = str(tmp_path / path)
        Path(path).write_text("not a folder")
    loop = fit(path)
    with pytest.raises(NotADirectoryError) as caught:
        loop.fit()
    message = str(caught.value)
    assert message.startswith(f"checkpoint(dir={path!r}): the checkpoints' folder is {kind}")
    assert "give the path of a folder" in message
    assert loop.state.step == 0


@pytest.mark.bad_input
def test_a_folder_that_cannot_be_made_is_named(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    inside = tmp_path / "a-file" / "checkpoints"
    with pytest.raises(OSError) as caught:
        fit(inside).fit()
    assert f"checkpoint(dir={str(inside)!r}): could not make the checkpoints' folder" in " ".join(caught.value.__notes__)


@pytest.mark.bad_input
def test_a_dir_a_live_process_holds_is_refused_with_advice_that_fits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                     ) -> None:
    """Two jobs, each with a run_dir of its own, given one ``Checkpoint(dir=...)``: the second is refused, told to
    give its Checkpoint a dir of its own, not a run_dir (it has one), and nothing is written there."""
    from hookfit.locks import FolderInUse, FolderLock

    monkeypatch.chdir(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    other = FolderLock(shared, "another job")
    other.acquire()
    try:
        with pytest.raises(FolderInUse) as caught:
            fit(shared).fit()
    finally:
        other.release()
    message = str(caught.value)
    assert message.startswith(f"checkpoint: {shared} is in use by another live process"), message
    assert message.endswith("Wait for it to end, or give this run's checkpoint a dir of its own, or leave dir out "
                            "to save into the run folder"), message
    assert sorted(p.name for p in shared.iterdir()) == ["run.lock"]
