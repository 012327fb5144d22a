"""The built wheel, installed as a user installs it.

The wheel is built from the project's files, installed with pip into a throw-away virtual
environment that has torch, numpy, pluggy and pytest (the README's set-up) but neither urwid nor
scikit-learn nor the suite's editable hookfit, and every command a new user meets is run as a user
runs it, from an unrelated folder: ``hookfit plugins``, ``hookfit hooks``, ``hookfit demo``
(before and after ``pip install 'hookfit[demo]'``, without a terminal), ``hookfit runs``,
``hookfit show --text``, ``hookfit show`` on a real terminal without urwid, a test of the user's
own that uses ``hookfit.testing``, ``mypy --strict`` over a script that imports hookfit, and
``hookfit new-plugin``'s package installed the way the command says and its tests run.

The environment sees the suite's packages through a folder of links to the suite's
site-packages in which hookfit, urwid and (until the ``[demo]`` extra is installed) scikit-learn
are left out: :class:`tests.venvs.Venv` alone would show the throw-away environment all of them.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from conftest import REPO
from venvs import TIMEOUT, Venv, check, copy_project, running_site_packages

pytestmark = pytest.mark.slow

HIDDEN = ("hookfit", "urwid")
"""Distributions of the suite's environment that the user's environment never sees."""

DEMO_EXTRA = "scikit-learn"
"""What ``pip install 'hookfit[demo]'`` adds (checked against pyproject.toml below)."""

NUMPY_WARNING = "Failed to initialize NumPy"


def build_wheel(where: Path) -> Path:
    """The wheel of a copy of the project's files (no build isolation, offline)."""
    source = copy_project(REPO, where / "source")
    check(subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                          "-w", str(where / "dist"), str(source)], capture_output=True, text=True, timeout=TIMEOUT))
    [wheel] = (where / "dist").glob("hookfit-*.whl")
    return wheel


def top_level_entries(distribution: str) -> set[str]:
    """The names in the suite's site-packages that belong to ``distribution`` (its RECORD);
    none where the suite does not have it."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return set()
    return {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}


def link_view(view: Path, hidden: tuple[str, ...]) -> None:
    """``view`` holds a link to every entry of the suite's site-packages except ``.pth`` files,
    caches and the entries of the ``hidden`` distributions."""
    left_out = set().union(*(top_level_entries(name) for name in hidden))
    view.mkdir(exist_ok=True)
    for folder in running_site_packages():
        for entry in sorted(os.listdir(folder)):
            if entry in left_out or entry.endswith(".pth") or entry == "__pycache__" or (view / entry).exists():
                continue
            (view / entry).symlink_to(Path(folder) / entry)


class UserVenv(Venv):
    """A :class:`Venv` that sees the suite's packages but not hookfit, urwid or scikit-learn."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.view = root.parent / "suite-packages"
        link_view(self.view, (*HIDDEN, DEMO_EXTRA))
        (self.site_packages / "zz_running_environment.pth").write_text(f"{self.view}\n")

    def add(self, distribution: str) -> None:
        """Make ``distribution`` of the suite's environment visible here (as an index would serve it)."""
        link_view(self.view, HIDDEN)
        assert self.has(distribution), f"{distribution} is not installed in the suite's environment"

    def command(self, *args: str, cwd: Path, check_rc: bool = True,
                timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
        """``hookfit ARGS`` as a user types it: the venv's console script, found on ``PATH``,
        no terminal."""
        env = self.env()
        env.pop("CI", None)  # a user's shell, not the CI's (where the dashboard stays off by CI=true)
        result = subprocess.run(["hookfit", *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, timeout=timeout)
        return check(result) if check_rc else result


def no_noise(result: subprocess.CompletedProcess[str]) -> None:
    """Nothing in a command's output that a user should not see: no traceback, no torch
    warning about a missing NumPy."""
    both = result.stdout + result.stderr
    assert "Traceback" not in both, both
    assert NUMPY_WARNING not in both, both


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_the_wheel_holds_the_package_its_plugins_and_the_markers_installed_commands_need(wheel: Path) -> None:
    """Every module of core/ and plugins/, ``py.typed`` (so that mypy reads hookfit's types),
    the entry points pyproject.toml declares, and none of the tests."""
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {f"hookfit/{p.relative_to(REPO / 'core')}" for p in (REPO / "core").rglob("*.py")}
    modules |= {f"hookfit/plugins/{p.relative_to(REPO / 'plugins')}" for p in (REPO / "plugins").rglob("*.py")}
    assert modules - names == set(), "modules missing from the wheel"
    assert "hookfit/py.typed" in names, "no py.typed: mypy reports hookfit as untyped in a user's script"
    assert "hookfit/loop.md" in names, "no loop.md: `hookfit hooks --markdown` has no opening to read"
    assert "hookfit/plugins/optim/README.md" in names, "no optim README.md: its package docstring points there"
    assert not any(n.startswith("tests/") or "/tests/" in n for n in names), sorted(names)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    [info] = {n.split("/")[0] for n in names if ".dist-info/" in n}
    entry_points = zipfile.ZipFile(wheel).read(f"{info}/entry_points.txt").decode()
    for name, value in project["entry-points"]["hookfit"].items():
        assert f"{name} = {value}" in entry_points
    assert "hookfit = hookfit.tools.cli:main" in entry_points
    assert project["optional-dependencies"]["demo"] == [f"{DEMO_EXTRA}>=1.3"], "DEMO_EXTRA is out of date"


def test_a_user_installs_the_wheel_and_runs_every_command_from_an_unrelated_folder(
        wheel: Path, tmp_path: Path) -> None:
    venv = UserVenv(tmp_path / "venv")
    # pip resolves the wheel's own requirements: numpy, pluggy and torch are enough, nothing is fetched
    installed = venv.pip("install", "--no-index", str(wheel))
    assert "Successfully installed hookfit-" in installed.stdout, installed.stdout
    assert not venv.has("urwid") and not venv.has(DEMO_EXTRA)
    work = tmp_path / "somewhere"  # the user's folder: no hookfit.toml, no project files
    work.mkdir()
    assert shutil.which("hookfit", path=venv.env()["PATH"]) == str(venv.root / "bin" / "hookfit")
    where = venv.run("-c", "import hookfit; print(hookfit.__file__)", cwd=work).stdout.strip()
    assert Path(where).is_relative_to(venv.site_packages), where  # the wheel's copy, not the suite's

    # hookfit plugins: every built-in plugin of the wheel, each with its state
    listing = venv.command("plugins", cwd=work)
    no_noise(listing)
    states = dict(re.findall(r"^(\w+)  \[(\w+)\]  hookfit \S+  \(hookfit\.plugins\.", listing.stdout, re.M))
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["hookfit"]
    assert set(states) == set(declared), listing.stdout
    assert {name for name, state in states.items() if state == "active"} >= {"optim", "metrics", "console",
                                                                              "interrupter", "tui"}
    assert states["csv"] == states["tensorboard"] == "inert", listing.stdout  # each says what turns it on:
    assert listing.stdout.count("    inert until: ") == list(states.values()).count("inert"), listing.stdout

    # hookfit hooks: the core's events, each plugin's, and the types they carry, read from the installed package
    hooks = venv.command("hooks", cwd=work)
    no_noise(hooks)
    for text in ("fit_start(loop: Run) -> None", "-- events of the plugin 'optim'", "-- events of the plugin 'tui'",
                 "claim_output(loop: Run) -> str | None (first result)", "hookfit.run.Run  # made by Loop.fit()"):
        assert text in hooks.stdout, text

    # hookfit --help: the commands of the wheel's plugins too, in plain words
    usage = venv.command("--help", cwd=work)
    no_noise(usage)
    assert re.search(r"\{plugins,hooks,new-plugin,demo,runs,.*\bshow\b.*\}", usage.stdout), usage.stdout
    assert "export" in usage.stdout and "``" not in usage.stdout, usage.stdout

    # hookfit demo in the base install: one line on what to install, no traceback
    demo = venv.command("demo", cwd=work, check_rc=False)
    no_noise(demo)
    assert demo.returncode != 0
    assert demo.stderr.strip() == "hookfit demo needs scikit-learn: pip install 'hookfit[demo]'", demo.stderr
    assert not (work / "runs").exists()

    # pip install 'hookfit[demo]': scikit-learn, and still no urwid
    venv.add(DEMO_EXTRA)
    extra = venv.pip("install", "--no-index", f"{wheel}[demo]")
    assert "Requirement already satisfied: scikit-learn" in extra.stdout, extra.stdout
    assert not venv.has("urwid")
    demo = venv.command("demo", "--epochs", "1", cwd=work)
    no_noise(demo)
    out = demo.stdout
    assert 'hookfit end status=completed reason="max_epochs=1 reached"' in out, out
    [folder] = [p.relative_to(work) for p in (work / "runs" / "demo").iterdir()]
    # why there is no dashboard, said once, with what to install for one
    said = [line for line in out.splitlines() + demo.stderr.splitlines() if "no dashboard" in line]
    assert said == ["hookfit demo: no dashboard: stdin is not a terminal; and urwid is not installed "
                    "(pip install urwid, or the tui extra: pip install 'hookfit[tui]')"], out + demo.stderr
    assert out.rstrip().endswith(
        f"hookfit demo: this run's files are in {folder}; look at it again with: hookfit show {folder}"), out

    # hookfit runs: the demo's run, completed after 1 epoch
    runs = venv.command("runs", cwd=work)
    no_noise(runs)
    [header, row] = runs.stdout.splitlines()
    assert header.split()[:4] == ["RUN", "STARTED", "TIME", "STATUS"]
    assert row.startswith(str(folder)) and "completed: max_epochs=1 reached" in row, runs.stdout

    # hookfit show --text, as the demo's last line says: the run's summary
    show = venv.command("show", str(folder), "--text", cwd=work)
    no_noise(show)
    assert show.stdout.startswith(f"run {folder}\nhookfit: training completed (max_epochs=1 reached)"), show.stdout
    assert re.search(r"^  accuracy +[\d.]+ +[\d.]+$", show.stdout, re.M), show.stdout
    assert show.stderr == ""

    # a test of the user's own with hookfit's pytest plugin, run by the environment's pytest
    (work / "test_mine.py").write_text(
        "import hookfit\n"
        "pytest_plugins = ['hookfit.testing']\n\n"
        "def test_a_run_fires_the_events_in_order(hookfit_run, hookfit_recorder):\n"
        "    loop = hookfit_run(hookfit_recorder, max_epochs=2)\n"
        "    assert loop.state.status == 'completed'\n"
        "    names = hookfit_recorder.names()\n"
        "    assert names[0] == 'configure' and names[-1] == 'fit_end' and names.count('epoch_end') == 2\n\n"
        "def test_it_is_the_installed_hookfit():\n"
        f"    assert hookfit.__file__.startswith({str(venv.site_packages)!r})\n")
    tests = venv.run("-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "test_mine.py", cwd=work)
    assert "2 passed" in tests.stdout, tests.stdout

    # mypy --strict over a script of the user's: hookfit is a typed package (py.typed)
    if importlib.util.find_spec("mypy") is not None:
        (work / "train.py").write_text(
            "import hookfit\n\nstate: hookfit.State = hookfit.Loop(lambda loop, b: None, [1]).fit()\n")
        typed = venv.run("-m", "mypy", "--strict", "--follow-imports=skip", "--no-incremental", "train.py",
                         cwd=work, check_rc=False)
        assert typed.returncode == 0, typed.stdout + typed.stderr

    # hookfit show on a real terminal without urwid: the text summary, after one line on what to install
    import terminal as tui  # here: skips only this part's test when tmux is missing

    screen = tui.Terminal(tmp_path / "terminal")
    (tmp_path / "terminal").mkdir()
    try:
        screen.launch(venv.root / "bin" / "hookfit", "show", work / folder,
                      env="PYTHONNOUSERSITE=1", unset=("PYTHONPATH", "VIRTUAL_ENV", "PIP_"))
        code, flags, text = screen.wait_exit(timeout=120)
    finally:
        screen.kill()
    assert code == 0, text
    assert "hookfit show: no dashboard: urwid is not installed (pip install urwid, or the tui extra: pip install " \
           "'hookfit[tui]'); the text summary follows" in text, text
    assert "hookfit: training completed (max_epochs=1 reached)" in text and "Traceback" not in text, text

def test_new_plugin_from_the_wheel_installs_as_it_says_and_its_tests_pass(wheel: Path, tmp_path: Path) -> None:
    venv = UserVenv(tmp_path / "venv")
    venv.pip("install", "--no-index", str(wheel))
    work = tmp_path / "somewhere"
    work.mkdir()
    made = venv.command("new-plugin", "lap", cwd=work)
    no_noise(made)
    root = work / "hookfit-lap"
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert files == ["README.md", "pyproject.toml", "src/hookfit_lap/__init__.py", "tests/test_lap.py"], files
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["hookfit"] == {"lap": "hookfit_lap:LapPlugin"}
    assert project["dependencies"] == ["hookfit>=0.1.0"]  # met by the installed wheel: nothing to fetch
    assert "https://" not in (root / "README.md").read_text()  # no page that does not exist

    # installed offline as its README says (pip offline: --no-index), next to the wheel's hookfit
    [next_line] = [line for line in made.stdout.splitlines() if line.startswith("next: ")]
    assert f"'{root.relative_to(work)}[test]'" in next_line and "python -m pytest" in next_line, next_line
    readme = (root / "README.md").read_text()
    [install] = [line.partition("#")[0] for line in readme.splitlines() if line.lstrip().startswith("pip install")]
    argv = shlex.split(install)
    assert argv[:2] == ["pip", "install"] and "--no-build-isolation" in argv, readme
    venv.pip("install", "--no-index", *argv[2:], cwd=root)
    listing = venv.command("plugins", cwd=work)
    assert re.search(r"^lap  \[active\]  hookfit-lap 0\.1\.0  \(hookfit_lap:LapPlugin\)$", listing.stdout, re.M), \
        listing.stdout
    tests = venv.run("-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", cwd=root)
    assert "2 passed" in tests.stdout, tests.stdout
