"""Runs started from notebooks (issue 28), executed for real through ``nbclient`` in a Jupyter
kernel: a run is named after its notebook (``JPY_SESSION_NAME``, VS Code's
``__vsc_ipynb_file__``), two notebooks in one folder never continue each other's runs, one is
resumed, and a kernel that names no notebook continues only its own run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("ipykernel", reason="executing notebooks needs ipykernel (the test extra)")
nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

TRAIN = '''
import json, torch, hookfit
from hookfit.data import Batches
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim


def train(epochs, resume=None):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(40, 4, generator=g), torch.randn(40, 1, generator=g)

    def step(loop, batch):
        loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    loop = hookfit.Loop(step, Batches(x, y, batch_size=10, shuffle=True, seed=2), model=model,
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.1), max_epochs=epochs, resume=resume,
                        plugins=[Optim(), Metrics(), Checkpoint(background=False)])
    state = loop.fit()
    return {"name": loop.run.name, "identity": loop.run.identity.key, "run_dir": str(loop.run.run_dir),
            "step": state.step, "status": state.status,
            "resumed_from": None if state.resumed_from is None else str(state.resumed_from.source)}
'''


def _execute(folder: Path, name: str, *cells: str, session: str | None = None) -> list[dict]:
    """Write ``name`` (a notebook of ``cells``) in ``folder``, execute it in a fresh kernel of
    this Python whose working folder is ``folder`` (``JPY_SESSION_NAME`` set to ``session``, as
    Jupyter sets it, or unset), and return what each cell printed as JSON lines."""
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(TRAIN), *map(nbformat.v4.new_code_cell, cells)]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    (folder / name).write_text(nbformat.writes(notebook))
    env = {k: v for k, v in os.environ.items() if k not in ("JPY_SESSION_NAME", "HOOKFIT_RESUME")}
    if session is not None:
        env["JPY_SESSION_NAME"] = session
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(folder)}})
    client.execute(env=env)
    printed = []
    for cell in notebook.cells[1:]:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream" and output.get("name") == "stdout":
                printed += [json.loads(line) for line in output["text"].splitlines() if line.startswith("{")]
    return printed


@pytest.mark.slow
def test_notebooks_are_runs_of_their_own_and_one_is_resumed(tmp_path: Path) -> None:
    folder = tmp_path / "notebooks"
    folder.mkdir()
    a_path, b_path = folder / "a.ipynb", folder / "b.ipynb"
    # a.ipynb under Jupyter (JPY_SESSION_NAME): a run named "a"
    (a1,) = _execute(folder, "a.ipynb", "print(json.dumps(train(1)))", session=str(a_path))
    assert a1["name"] == "a" and a1["identity"] == f"notebook:{a_path}" and a1["resumed_from"] is None
    assert Path(a1["run_dir"]).parent == folder / "runs" / "a"
    # b.ipynb under VS Code (__vsc_ipynb_file__, no JPY_SESSION_NAME): its own name, and "latest" is not a's
    (b1,) = _execute(folder, "b.ipynb", f"__vsc_ipynb_file__ = {str(b_path)!r}",
                     "print(json.dumps(train(1, resume='latest')))")
    assert b1["name"] == "b" and b1["resumed_from"] is None and Path(b1["run_dir"]).parent == folder / "runs" / "b"
    # a.ipynb again, resumed: it continues its own run, in its folder
    (a2,) = _execute(folder, "a.ipynb", "print(json.dumps(train(2, resume='latest')))", session=str(a_path))
    assert a2["resumed_from"] is not None and Path(a2["resumed_from"]).parent.parent == Path(a1["run_dir"])
    assert a2["run_dir"] == a1["run_dir"] and a2["step"] == 8 and a2["status"] == "completed"


@pytest.mark.slow
def test_a_kernel_that_names_no_notebook_continues_only_its_own_run(tmp_path: Path) -> None:
    """Without JPY_SESSION_NAME or __vsc_ipynb_file__ the run is named "notebook", and its
    identity is the kernel: in the same kernel "latest" continues it; another unnamed kernel
    (another notebook) starts afresh, never in the first one's folder."""
    folder = tmp_path / "notebooks"
    folder.mkdir()
    first, again = _execute(folder, "c.ipynb", "print(json.dumps(train(1)))",
                            "print(json.dumps(train(2, resume='latest')))")
    assert first["name"] == "notebook" and first["identity"].startswith("kernel:")
    assert again["resumed_from"] is not None and again["run_dir"] == first["run_dir"] and again["step"] == 8
    (other,) = _execute(folder, "d.ipynb", "print(json.dumps(train(1, resume='latest')))")
    assert other["resumed_from"] is None and other["run_dir"] != first["run_dir"] and other["step"] == 4
