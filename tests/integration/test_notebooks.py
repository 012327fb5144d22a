"""Runs started from notebooks, executed for real through ``nbclient`` in a Jupyter
kernel: a run is named after its notebook (``JPY_SESSION_NAME``, VS Code's
``__vsc_ipynb_file__``), two notebooks in one folder never continue each other's runs, one is
resumed, and a kernel that names no notebook continues only its own run; a training cell
stopped by a real kernel interrupt, resumed exactly in the same kernel."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("ipykernel", reason="executing notebooks needs ipykernel (the test extra)")
nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

TRAIN = '''
import json, time, torch, hookfit
from pathlib import Path
from hookfit.data import Batches
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim


def train(epochs, resume=None, *, interrupt_at=None, run_dir=None, weights=None, plugins=()):
    """``interrupt_at``: in the batch that follows that many steps, write the file "training" and
    go on with the step (a long one) until a stop is requested; ``weights``: where the trained
    weights are saved; ``plugins``: given besides optim, metrics and the checkpoint."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(40, 4, generator=g), torch.randn(40, 1, generator=g)

    def step(loop, batch):
        loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        if loop.state.step == interrupt_at:
            Path("training").write_text(str(loop.state.step))
            deadline = time.monotonic() + 120
            while loop.stop_requested is None and time.monotonic() < deadline:
                time.sleep(0.01)
        return {"loss": loss}

    loop = hookfit.Loop(step, Batches(x, y, batch_size=10, shuffle=True, seed=2), model=model,
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.1), max_epochs=epochs, resume=resume,
                        run_dir=run_dir, plugins=[Optim(), Metrics(), Checkpoint(background=False), *plugins])
    state = loop.fit()
    if weights is not None:
        torch.save(model.state_dict(), weights)
    return {"name": loop.run.name, "identity": loop.run.identity.key, "run_dir": str(loop.run.run_dir),
            "step": state.step, "status": state.status,
            "resumed_from": None if state.resumed_from is None else str(state.resumed_from.source)}
'''


def _execute(folder: Path, name: str, *cells: str, session: str | None = None, cwd: Path | None = None) -> list[dict]:
    """Write ``name`` (a notebook of ``cells``) in ``folder``, execute it in a fresh kernel of
    this Python whose working folder is ``cwd``, else ``folder`` (``JPY_SESSION_NAME`` set to ``session``,
    as Jupyter sets it, or unset), and return what each cell printed as JSON lines."""
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(TRAIN), *map(nbformat.v4.new_code_cell, cells)]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    (folder / name).write_text(nbformat.writes(notebook))
    env = {k: v for k, v in os.environ.items() if k not in ("JPY_SESSION_NAME", "HOOKFIT_RESUME")}
    if session is not None:
        env["JPY_SESSION_NAME"] = session
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(cwd or folder)}})
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


CONFIGURED = """
import os
os.environ["HOOKFIT_PLUGINS"] = "checkpoint"  # discovered, its options from a hookfit.toml
model = torch.nn.Linear(4, 1)
loop = hookfit.Loop(lambda loop, batch: None, [0], model=model, max_epochs=1)
loop.fit()
print(json.dumps({"name": loop.run.name, "keep_last": loop.run.pm.get_plugin("checkpoint").keep_last,
                  "cwd": os.getcwd()}))
"""


@pytest.mark.slow
def test_a_notebook_s_hookfit_toml_is_read_next_to_it_whatever_folder_its_kernel_started_in(tmp_path: Path) -> None:
    """A kernel started in another folder (JupyterLab's root, VS Code's workspace) than the notebook's: the
    run is named after the notebook, and the hookfit.toml beside the notebook configures it, not the folder
    of ipykernel's launcher (sys.argv[0]) or the kernel's working folder, which has none."""
    folder, elsewhere = tmp_path / "notebooks", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    (folder / "hookfit.toml").write_text("[plugins.checkpoint]\nkeep_last = 1\n")
    (said,) = _execute(folder, "e.ipynb", CONFIGURED, session=str(folder / "e.ipynb"), cwd=elsewhere)
    assert said == {"name": "e", "keep_last": 1, "cwd": str(elsewhere)}


INTERRUPTED = """
import signal
kernels = signal.getsignal(signal.SIGINT)
print(json.dumps(train(5, interrupt_at=5)))
print(json.dumps({"handler_restored": signal.getsignal(signal.SIGINT) is kernels}))
"""
PLAIN_WAIT = """
Path("waiting").write_text("a cell of the user's own, no hookfit")
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    time.sleep(0.01)
print("not interrupted")
"""
RESUMED = "print(json.dumps(train(5, resume='latest', weights='resumed.pt')))"
EXITING = """
from hookfit.plugins.interrupter import Interrupter
print(json.dumps(train(5, interrupt_at=3, run_dir="exiting", plugins=[Interrupter(exit=True)])))
print("after the run")
"""


def _lines(cell: dict, stream: str) -> list[str]:
    return [line for output in cell.get("outputs", []) if output.get("output_type") == "stream"
            and output.get("name") == stream for line in output["text"].splitlines() if line]


async def _interrupt_when(client: nbclient.NotebookClient, cell: dict, index: int, marker: Path) -> None:
    """Execute ``cell`` and interrupt the kernel (``interrupt_kernel()``: a SIGINT, as the
    notebook's stop button sends) once ``marker`` exists; return when the cell has ended."""
    running = asyncio.ensure_future(client.async_execute_cell(cell, index))
    deadline = time.monotonic() + 120
    while not marker.exists() and not running.done():
        assert time.monotonic() < deadline, f"{marker.name} never appeared"
        await asyncio.sleep(0.01)
    assert marker.exists(), f"the cell ended before it wrote {marker.name}: {cell.get('outputs')}"
    await client.km.interrupt_kernel()
    await running


@pytest.mark.slow
@pytest.mark.fault
def test_a_kernel_interrupt_stops_the_cell_gracefully_and_the_same_kernel_resumes_it_exactly(tmp_path: Path) -> None:
    """The notebook's interrupt (a real SIGINT sent by the kernel manager) while a training cell
    runs: the cell ends with hookfit's one line on stderr and no traceback, the run ends
    ``interrupted`` with a checkpoint where it stopped (mid-epoch), the kernel's own SIGINT
    handler is back (a later cell of the user's is interrupted as usual, with
    ``KeyboardInterrupt``), and ``resume="latest"`` in a next cell of the same kernel ends with
    the weights of an uninterrupted run, bit for bit. A cell that gives ``Interrupter(exit=True)``
    has ``fit()`` raise ``KeyboardInterrupt`` after the graceful stop, as in a script."""
    folder = tmp_path / "notebooks"
    folder.mkdir()
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(code) for code in (TRAIN, INTERRUPTED, PLAIN_WAIT, RESUMED, EXITING)]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    # the plugins a user has: the interrupter, the console... discovered (HOOKFIT_PLUGINS unset)
    env = {k: v for k, v in os.environ.items() if k not in ("HOOKFIT_RESUME", "HOOKFIT_PLUGINS")}
    env["JPY_SESSION_NAME"] = str(folder / "i.ipynb")
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3", allow_errors=True,
                                     resources={"metadata": {"path": str(folder)}})
    train, interrupted, plain, resumed, exiting = notebook.cells

    async def session() -> None:
        async with client.async_setup_kernel(env=env):
            await client.async_execute_cell(train, 0)
            await _interrupt_when(client, interrupted, 1, folder / "training")
            await _interrupt_when(client, plain, 2, folder / "waiting")
            await client.async_execute_cell(resumed, 3)
            (folder / "training").unlink()
            await _interrupt_when(client, exiting, 4, folder / "training")

    asyncio.run(session())
    assert [o["output_type"] for o in interrupted.outputs if o["output_type"] != "stream"] == []  # no traceback
    assert _lines(interrupted, "stderr") == ["hookfit: SIGINT received, stopping after this batch; "
                                             "interrupt the kernel again to abort"]
    stopped, restored = (json.loads(line) for line in _lines(interrupted, "stdout") if line.startswith("{"))
    assert stopped["status"] == "interrupted" and stopped["step"] == 6, stopped
    assert restored == {"handler_restored": True}
    (error,) = [o for o in plain.outputs if o["output_type"] == "error"]  # the kernel's own handler, as before
    assert error["ename"] == "KeyboardInterrupt" and "not interrupted" not in _lines(plain, "stdout")
    (again,) = (json.loads(line) for line in _lines(resumed, "stdout") if line.startswith("{"))
    # from the checkpoint the interrupt wrote, mid-epoch (every_n_epochs=1 writes none there)
    assert again["resumed_from"] == str(Path(stopped["run_dir"]) / "checkpoints" / "epoch0002-step000000006.pt")
    assert again["status"] == "completed" and again["step"] == 20 and again["run_dir"] == stopped["run_dir"]
    (raised,) = [o for o in exiting.outputs if o["output_type"] == "error"]
    assert raised["ename"] == "KeyboardInterrupt" and "after the run" not in _lines(exiting, "stdout"), exiting.outputs
    assert _lines(exiting, "stderr")[0].startswith("hookfit: SIGINT received, stopping after this batch")
    namespace: dict = {}
    exec(TRAIN, namespace)  # the same run uninterrupted, in this process
    namespace["train"](5, run_dir=tmp_path / "whole", weights=tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    after = torch.load(folder / "resumed.pt", weights_only=True)
    assert after.keys() == whole.keys() and all(torch.equal(after[k], whole[k]) for k in whole)
