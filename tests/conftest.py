"""The suite uses hookfit's own pytest plugin, as a plugin author's suite would."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

# One intra-op thread in every process of the suite (the xdist workers, and through the
# environment every child they start: scripts, venvs, torchrun's ranks). Workers and their
# children already share the cores; torch's default of a thread per core then makes a tiny
# model's step 10-30 times slower (threads spin waiting for each other), most of the suite's
# time. Set before torch is imported; a value given from outside is kept.
_THREADS_SET_HERE = "OMP_NUM_THREADS" not in os.environ
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

if _THREADS_SET_HERE:
    torch.set_num_threads(1)  # in case something imported torch before this file

import hookfit  # noqa: E402
from hookfit import discovery, hookimpl  # noqa: E402
from hookfit.data import Batches  # noqa: E402
from hookfit.plugins.checkpoint import Checkpoint  # noqa: E402
from hookfit.plugins.metrics import Metrics  # noqa: E402
from hookfit.plugins.optim import Optim  # noqa: E402

pytest.register_assert_rewrite("hookfit.testing")

from hookfit.testing import Recorder, spec_arguments  # noqa: E402

TESTS = Path(__file__).resolve().parent
"""This folder: its scripts/ and packages/ are the tests' children and packages."""
REPO = TESTS.parent
"""The project's root."""

pytest_plugins = ["hookfit.testing"]

spec_names = spec_arguments  # the name the tests use

__all__ = ["Recorder", "spec_names"]


# -- warm interpreters for the suite's children and torchrun's ranks (tests/warm.py) -------------

_ZYGOTE: list = []  # (process, folder) of this worker's zygote
_LOGS: list[str] = []  # the session's folder for torchrun's logs (the controller's)


def pytest_configure(config: pytest.Config) -> None:
    """Each worker (not xdist's controller) starts a zygote for ``warm.Popen`` and ``warm.run``,
    and puts ``PYTHON_EXEC`` in its environment, so that the ranks of the suite's ``torchrun``
    jobs start warm too (see :mod:`warm`). ``HOOKFIT_TEST_FRESH=1`` starts every process fresh."""
    if not hasattr(config, "workerinput"):  # the process that reports: xdist's controller, or pytest -n 0
        def write(line: str) -> None:
            reporter = config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:  # on a line of its own, also in the middle of a line of dots
                reporter.write("\n")
                reporter.write_line(line)

        from progress import Progress

        config.pluginmanager.register(Progress(write), "hookfit-progress")
        if "PET_LOG_DIR" not in os.environ:  # (torchrun's --log-dir; workers and children inherit it)
            # each torchrun job otherwise leaves a folder torchelastic_* in the temporary folder:
            # the suite's jobs put theirs in one folder of the session's, removed at its end
            import tempfile

            _LOGS.append(tempfile.mkdtemp(prefix="hookfit-torchrun-logs-"))
            os.environ["PET_LOG_DIR"] = _LOGS[-1]
    if os.environ.get("HOOKFIT_TEST_FRESH") or (config.getoption("numprocesses", None)
                                                 and not hasattr(config, "workerinput")):
        return
    import tempfile

    import warm

    folder = tempfile.mkdtemp(prefix="hookfit-warm-")  # short: a socket's path is at most 107 bytes
    process, variables = warm.start(folder)
    _ZYGOTE.append((process, folder))
    os.environ.update(variables)


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil

    for process, folder in _ZYGOTE:
        process.kill()
        process.wait()
        shutil.rmtree(folder, ignore_errors=True)
    _ZYGOTE.clear()
    for folder in _LOGS:
        shutil.rmtree(folder, ignore_errors=True)
    _LOGS.clear()


@pytest.fixture
def recorder(hookfit_recorder: Recorder) -> Recorder:
    return hookfit_recorder


@pytest.fixture(autouse=True)
def _distutils_shim_kept() -> Iterator[None]:
    """A test that turns setuptools' distutils shim off fails, and the shim is put back. On
    Python < 3.12 asking the import system for ``pip`` (``importlib.util.find_spec("pip")``)
    turns it off for the rest of the process; every later ``import setuptools`` in the worker
    then fails an assert, inductor's among them, and the compiled-model tests fell back to
    ``aot_eager`` with a wrong reason ("inductor cannot compile here")."""
    yield
    finder = getattr(sys.modules.get("_distutils_hack"), "DISTUTILS_FINDER", None)
    if finder is not None and "spec_for_distutils" in vars(finder):
        del finder.spec_for_distutils  # the class's own again
        pytest.fail("this test turned setuptools' distutils shim off for the rest of the process "
                    "(importlib.util.find_spec('pip'), or an import of pip?); later imports of "
                    "setuptools (inductor's) would fail", pytrace=False)


@pytest.fixture(autouse=True)
def _isolated(hookfit_isolated: None) -> None:
    """Tests choose their plugins explicitly; a test that wants the discovered ones unsets
    HOOKFIT_PLUGINS itself."""


def saved_run(epoch: int, step: int, batch: int, stage: str = "train") -> dict:
    """A run's state dict (as ``loop.state_dict()`` gives it) at a position, with the random
    state of now: what a resume plugin in a test gives ``loop.load_state_dict()``."""
    from hookfit.position import rng_state

    return {"loop": {"epoch": epoch, "step": step, "resume_batch": batch, "resume_stage": stage},
            "rng": rng_state()}


class StopAt:
    """Stops the run after training step ``step``."""

    name = "stop_at"

    def __init__(self, step: int) -> None:
        self.step = step

    @hookimpl
    def should_stop(self, loop):
        return "test stop" if loop.training and loop.state.step == self.step else None


class StopAfter:
    """Asks for a stop after the run's n-th batch, training and validation batches alike
    (``should_stop``)."""

    name = "stop_after"

    def __init__(self, n: int) -> None:
        self.n = n

    @hookimpl
    def should_stop(self):
        self.n -= 1
        return "test stop" if self.n == 0 else None


class Refuse:
    """Refuses the run at ``fit_start``, after every other plugin's (as the checkpoint plugin refuses
    a run whose processes' options differ)."""

    name = "refuse"

    @hookimpl(trylast=True)
    def fit_start(self, loop):
        raise RuntimeError("refused")


def mse_step(loop, batch):
    """The manual-stepping step many tests share: the MSE of ``loop.model(x)`` against ``y``,
    through ``loop.backward`` and ``loop.optimizers``; reports ``{"loss": loss}``."""
    loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    return {"loss": loss}


# -- distributions made for real: what importlib.metadata discovers for an installed package

def make_dist(root: Path, dist: str, entry_points: dict[str, str], modules: dict[str, str]) -> Path:
    info = root / f"{dist.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
    lines = "\n".join(f"{name} = {value}" for name, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[hookfit]\n{lines}\n")
    for name, source in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))
    return root


PLUGINS = '''
import hookfit

CALLS = []

class Alpha:
    @hookfit.hookimpl
    def batch_end(self, batch_idx):
        CALLS.append(("alpha", batch_idx))

@hookfit.hookimpl
def batch_end(batch_idx):
    CALLS.append(("beta", batch_idx))
'''


BUILTINS = ",".join(ep.name for ep in discovery.entry_points() if ep.dist.name == "hookfit")


@pytest.fixture
def dists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Two plugins of one distribution, one a class and one a module."""
    root = make_dist(
        tmp_path / "site", "fake-plugins",
        {"beta": "fake_plugins_mod", "alpha": "fake_plugins_mod:Alpha"},
        {"fake_plugins_mod": PLUGINS},
    )
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delenv("HOOKFIT_PLUGINS")
    monkeypatch.setenv("HOOKFIT_DISABLE_PLUGINS", BUILTINS)
    sys.modules.pop("fake_plugins_mod", None)
    yield root
    sys.modules.pop("fake_plugins_mod", None)


def calls() -> list:
    return sys.modules["fake_plugins_mod"].CALLS


@pytest.fixture
def read_only_folder(tmp_path: Path):
    """An existing folder nothing can be written in (a read-only tmpfs for root, who can write
    in any folder whatever its mode)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() == 0:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(folder)],
                                 capture_output=True)
        if mounted.returncode:
            pytest.skip(f"root cannot mount a read-only tmpfs here: {mounted.stderr.decode().strip()}")
    else:
        folder.chmod(0o500)
    try:
        yield folder
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(folder)])
        else:
            folder.chmod(0o700)


def resumable_run(run_dir, *, stop=None, resume=None, checkpoint=None, extra=(), accumulate=2, epochs=3, strict=True,
                  **options):
    """A small run where what a resumed run continues from matters: 7 shuffled training batches and 2
    validation batches an epoch, Adam with accumulation windows, dropout, steps that draw from
    the RNG (validation too: a stop inside it resumes before it, RNG included), checkpoints.
    ``stop``: a StopAfter(stop); ``options`` go to the Loop. Returns the loop, the model and the
    metrics history."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(50, 4, generator=g), torch.randn(50, 1, generator=g)

    def step(loop, b):
        loss = torch.nn.functional.mse_loss(loop.model(b[0]), b[1])
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss, "noise": torch.rand(())}  # the RNG is part of the state

    metrics = Metrics()
    plugins = [Optim(accumulate=accumulate), metrics,
               checkpoint or Checkpoint(every_n_epochs=1, background=False, strict=strict), *extra]
    if stop:
        plugins.append(StopAfter(stop))
    loop = hookfit.Loop(
        step, Batches(x, y, batch_size=8, shuffle=True, seed=3),
        val_step=lambda l, b: {"vloss": torch.nn.functional.mse_loss(l.model(b[0]), b[1]), "vnoise": torch.rand(())},
        val_data=Batches(x[:16], y[:16], batch_size=8), model=model,
        optimizers=torch.optim.Adam(model.parameters(), lr=0.01), max_epochs=epochs,
        run_dir=run_dir, resume=resume, plugins=plugins, **options)
    loop.fit()
    history = {k: [dict(e) for e in v] for k, v in metrics.history.items()}
    return loop, model, history


def run_script_here(script: Path, *argv: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs a test script as ``python script ARGV`` runs it, in this process: for the
    uninterrupted runs that faulted child processes are compared with. The worker has torch
    imported already, and a child process spends about 3 s of CPU importing torch (and
    torch._dynamo, which its optimizers import) before its first batch: on the suite's two cores,
    those seconds are the suite's time. What is faulted (killed, signalled, resumed) still runs in
    a process of its own."""
    monkeypatch.setattr(sys, "argv", [str(script), *argv])
    runpy.run_path(str(script), run_name="__main__")


def squeeze(path: str, slack: int) -> str:
    """The source of a plugin for a child process's script: from the second epoch on, no file
    may grow past the size of ``path`` (a Python expression, read then) plus ``slack`` bytes,
    as on a full disk (the kernel answers EFBIG where a full disk answers ENOSPC). The script
    imports ``os``, ``resource`` and ``hookfit``, and ignores SIGXFSZ."""
    return f'''
class Squeeze:
    """From the second epoch on, a file may grow {slack} bytes past {path} (a full disk)."""

    name = "squeeze"

    @hookfit.hookimpl
    def epoch_start(self, epoch):
        if epoch == 1:
            _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize({path}) + {slack}, hard))
'''



# -- scheduling on several workers (pytest -n auto) -------------------------------------------

SHARED_SETUP = {
    "tests/integration/test_role_packages.py": "module",  # a venv with packages installed, two runs
    "tests/integration/test_replaceable.py": "module",  # a venv with packages installed
    "tests/integration/test_third_party_checkpoint.py": "module",  # a venv, an uninterrupted run
    "tests/integration/test_wheel.py": "module",  # the wheel, built
    "tests/plugins/checkpoint/test_sharded_trust.py": "module",  # a 2-process run's checkpoints
    "tests/plugins/checkpoint/test_compiled.py": "param",  # a backend's compiled runs
}
"""Test modules whose module-scoped fixtures cost many seconds: their tests run on one xdist
worker (for ``"param"``, those of one parameter id on one worker), so the fixture is built once."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests marked ``slow`` first, each part in collection order (the sort is stable, so
    every xdist worker collects the same order, and pytest's grouping of the tests of a
    parametrized module fixture is kept): handed out one at a time as workers become free
    (:func:`pytest_xdist_make_scheduler`), the long ones start early and the many short ones
    fill the gaps at the end, instead of a minute-long test starting last."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def shared_scope(nodeid: str) -> str:
    """The unit of scheduling ``nodeid`` belongs to: itself, or its module (or module and
    parameter id) where :data:`SHARED_SETUP` says so."""
    path, _, rest = nodeid.partition("::")
    how = SHARED_SETUP.get(path)
    if how == "module":
        return path
    if how == "param" and rest.endswith("]"):
        return f"{path}[{rest[rest.rindex('[') + 1:]}"
    return nodeid


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: a worker per core and one more. Most tests that take seconds wait on a child
    process (a run, torchrun's ranks, a terminal) part of the time: with a worker per core a
    core idles while its worker waits; the extra worker's test runs then (on two cores, about
    92 % of the cores' time was used with two workers). ``PYTEST_XDIST_AUTO_NUM_WORKERS`` still
    decides where it is set."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # not on macOS
    return (cores or 1) + 1


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: the suite also runs without xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """For xdist's default ``--dist load``: a scheduler that gives each free worker the next
    unit (:func:`shared_scope`) in collection order, keeping two or three tests queued per
    worker. xdist's own ``load`` sends a quarter of the suite to each worker at the start, so a
    worker could be left with a run of slow tests while the other idles at the end; its
    ``loadgroup`` cannot group here (it renames ``item._nodeid``, which pytest 9 no longer reads)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedSetupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return shared_scope(nodeid)

        def remove_node(self, node: Any) -> str | None:
            """A worker that died (killed, crashed): only its units with tests still to run go
            back in the queue (xdist's puts back its whole workload, units done included, and
            hands those out again as empty batches)."""
            workload = self.assigned_work.get(node, {})
            for scope in [scope for scope, unit in workload.items() if all(unit.values())]:
                del workload[scope]
            return super().remove_node(node)

        def _reschedule(self, node: Any) -> None:
            """Top ``node`` up to three tests, and say it is done once the queue is empty. A worker
            starts a test only once it has the next one or the word to stop; xdist's gave a worker
            that replaced a crashed one a single unit, so when a worker died near the end of the
            run the replacement held its one test, the others their last, and the run waited
            forever with no test running."""
            if node.shutting_down:
                return
            while self.workqueue and self._pending_of(self.assigned_work[node]) <= 2:
                self._assign_work_unit(node)
            if not self.workqueue:
                node.shutdown()

    config.option.loadscopereorder = False  # the order of the collection (slow first), not by group size
    return SharedSetupScheduling(config, log)
