"""Checkpoint(dir=...) that cannot be a folder is refused at fit_start with a message that says
what is wrong and names the option, before any batch trains; a resume from one names it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def test_resume_latest_and_best_name_the_given_dir_they_took_their_checkpoint_from(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The stderr line of ``resume="latest"`` and ``resume="best"`` with ``Checkpoint(dir=...)`` names that folder,
    where the checkpoint was looked for, not a run folder the checkpoints are not in; ``"latest"`` in a training run
    names the run's identity too, whose checkpoints alone it takes there."""
    from hookfit.plugins.metrics import Metrics

    kept, data = tmp_path / "kept", [(torch.ones(4, 2), torch.zeros(4, 1))] * 2

    def valid(loop: hookfit.Loop, batch: Any) -> dict[str, Any]:
        return {"loss": torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])}

    def loop(epochs: int = 2, resume: str | None = None) -> hookfit.Loop:
        model = torch.nn.Linear(2, 1)
        return hookfit.Loop(mse_step, data, val_step=valid, val_data=data[:1], model=model, max_epochs=epochs,
                            optimizers=torch.optim.SGD(model.parameters(), lr=0.1), run_dir=tmp_path / "run",
                            resume=resume, plugins=[Optim(), Metrics(), Checkpoint(dir=kept, monitor="valid/loss",
                                                                                   background=False)])

    loop(epochs=1).fit()
    capsys.readouterr()
    loop(resume="latest").fit()
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hookfit checkpoint: resume=")]
    (line,) = said  # whose and where: the run's identity (the test's own here), in the dir searched
    assert line.startswith(f"hookfit checkpoint: resume='latest' took {kept / 'epoch0001-step000000002.pt'} (the "
                           f"newest checkpoint of ") and line.endswith(f" in {kept})"), line
    loop().validate(resume="best")
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hookfit checkpoint: resume=")]
    assert len(said) == 1 and said[0].endswith(f" (the best checkpoint of the newest run in {kept})"), said
