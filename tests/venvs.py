"""Throw-away virtual environments for tests that install packages.

Project rule: a test that ``pip install``-s something does it in a temporary environment of
its own, never in the one running the suite. :class:`Venv` makes one cheaply:

* ``python -m venv --without-pip`` in a temporary folder (no pip bootstrap: fast);
* a ``.pth`` file in its site-packages that adds the running environment's site-packages with
  ``site.addsitedir``, so torch, pytest, setuptools and hookfit are importable there (hookfit is
  installed editable: its finder is itself a ``.pth`` in that folder, which ``addsitedir``
  processes), while whatever is installed into the new environment lands in its own
  site-packages only, which comes first on ``sys.path``;
* packages are installed with the running pip, pointed at the new interpreter with
  ``pip --python`` (pip >= 22.3), offline and without build isolation;
* commands run with the new interpreter and a clean environment (no ``PIP_*``, ``HOOKFIT_*``
  or ``PYTHONPATH`` from the test's; ``PYTHONNOUSERSITE=1``).

Fixtures: ``venv`` (one per test) and :func:`make_venv` for a module-scoped one
(``make_venv(tmp_path_factory.mktemp("venv"))``). :func:`assert_not_in_running_env` checks,
from a fresh interpreter of the running environment, that an installed distribution did not
leak into it.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest

TIMEOUT = 300  # seconds for one pip or python command; generous, the machine may be busy
DROPPED_PREFIXES = ("PIP_", "HOOKFIT_")
DROPPED = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "__PYVENV_LAUNCHER__", "PYTHON_EXEC",
           # torchrun's variables, in case the suite itself runs under a launcher
           "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
           "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without pip's and hookfit's knobs, ``PYTHONPATH`` or torchrun's
    variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(DROPPED_PREFIXES) and k not in DROPPED}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", PYTHONNOUSERSITE="1")
    env.update(extra)
    return env


def running_site_packages() -> list[str]:
    """The running environment's site-packages folders (purelib and platlib, deduplicated)."""
    found: list[str] = []
    for path in [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]:
        if os.path.isdir(path) and path not in found:
            found.append(path)
    return found


def check(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    """``result``, or an assertion error with the command, its exit code and its output."""
    args = result.args if isinstance(result.args, str) else " ".join(map(str, result.args))
    assert result.returncode == 0, (
        f"{args} exited {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    )
    return result


class Venv:
    """A virtual environment in ``root`` that sees the running environment's packages and keeps
    its own installs to itself."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(self.root)], check=True,
                       env=clean_env(), capture_output=True, timeout=TIMEOUT)
        self.python = self.root / "bin" / "python"
        self.site_packages = Path(self.run("-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                                           isolated=True).stdout.strip())
        lines = [f"import site; site.addsitedir({path!r})" for path in running_site_packages()]
        (self.site_packages / "zz_running_environment.pth").write_text("\n".join(lines) + "\n")

    # -- running --------------------------------------------------------------------------
    def env(self, **extra: str) -> dict[str, str]:
        """A clean environment for commands of this venv, with ``bin`` first on ``PATH``."""
        env = clean_env(**extra)
        env["PATH"] = f"{self.root / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        return env

    def run(self, *args: Any, cwd: Path | None = None, check_rc: bool = True, timeout: float = TIMEOUT,
            isolated: bool = False, **extra: str) -> subprocess.CompletedProcess[str]:
        """``<venv python> ARGS`` with a clean environment plus ``extra``; fails the test on a
        non-zero exit unless ``check_rc=False``."""
        argv = [str(self.python), *(["-I"] if isolated else []), *map(str, args)]
        result = subprocess.run(argv, cwd=cwd or self.root, env=self.env(**extra), stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, timeout=timeout)
        return check(result) if check_rc else result

    def popen(self, *args: Any, cwd: Path | None = None, **extra: str) -> subprocess.Popen[str]:
        """``<venv python> ARGS`` started in the background, in a session of its own (so that
        ``os.killpg(process.pid, ...)`` reaches its children), stdout and stderr piped."""
        return subprocess.Popen([str(self.python), *map(str, args)], cwd=cwd or self.root, env=self.env(**extra),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)

    # -- installing -------------------------------------------------------------------------
    def pip(self, *args: str, cwd: Path | None = None, check_rc: bool = True) -> subprocess.CompletedProcess[str]:
        """The running environment's pip, acting on this venv (``pip --python``)."""
        argv = [sys.executable, "-m", "pip", "--python", str(self.python), *args]
        result = subprocess.run(argv, cwd=cwd or self.root, env=clean_env(), capture_output=True, text=True,
                                timeout=TIMEOUT)
        return check(result) if check_rc else result

    def install(self, source: Path, editable: bool = False, copy: bool = True) -> Path:
        """Install the package in ``source`` (offline, no dependencies, no build isolation).

        With ``copy`` (default) the source is copied next to the venv first, so that building
        writes nothing (``build/``, ``*.egg-info``) into the original folder. Returns the folder
        installed from."""
        source = Path(source)
        if copy:
            target = self.root.parent / f"src-{source.name}"
            shutil.copytree(source, target, ignore=shutil.ignore_patterns(
                "build", "dist", "*.egg-info", "__pycache__"))
            source = target
        self.pip("install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                 *(["-e"] if editable else []), str(source))
        return source

    def uninstall(self, distribution: str) -> None:
        self.pip("uninstall", "-y", "-q", distribution)

    def has(self, distribution: str) -> bool:
        """Whether this venv's interpreter sees ``distribution``."""
        return _visible(self.python, distribution, self.env())


def _visible(python: Path | str, distribution: str, env: dict[str, str]) -> bool:
    code = ("import importlib.metadata as m, sys\n"
            f"try:\n    m.distribution({distribution!r})\nexcept m.PackageNotFoundError:\n    sys.exit(3)\n")
    result = subprocess.run([str(python), "-c", code], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode in (0, 3), result.stderr
    return result.returncode == 0


def assert_not_in_running_env(distribution: str, module: str | None = None) -> None:
    """The running environment (``sys.executable``, in a fresh interpreter) has neither
    ``distribution`` nor ``module``, and its site-packages holds nothing named after them."""
    env = clean_env()
    assert not _visible(sys.executable, distribution, env), (
        f"{distribution} is installed in the running environment ({sys.prefix})")
    if module is not None:
        code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is not None)"
        found = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=TIMEOUT)
        assert found.returncode == 0, f"module {module} is importable from the running environment"
    stems = {distribution.replace("-", "_").lower(), *([module.lower()] if module else [])}
    for folder in running_site_packages():
        leaked = [p for p in os.listdir(folder) if any(p.lower().replace("-", "_").startswith(s) or
                                                         p.lower().startswith(f"__editable__.{s}") for s in stems)]
        assert not leaked, f"{folder} holds {leaked}"


def make_venv(root: Path) -> Venv:
    """A :class:`Venv` in ``root`` (created)."""
    return Venv(root)


@pytest.fixture
def venv(tmp_path: Path) -> Venv:
    """A fresh virtual environment for this test, in ``tmp_path / "venv"``."""
    return make_venv(tmp_path / "venv")


def assert_installed_copy_needs_no_builtin(venv: "Venv", module: str, cwd: Path) -> None:
    """``module`` imports from the venv's own site-packages (the installed copy, not the
    source tree) and pulls in none of hookfit's built-in plugins."""
    code = (f"import sys, {module}; print({module}.__file__); "
            "print(sorted(m for m in sys.modules if m.startswith('hookfit.plugins')))")
    where, plugins = venv.run("-c", code, cwd=cwd).stdout.splitlines()
    assert Path(where).is_relative_to(venv.site_packages), where
    assert plugins == "[]"



def copy_project(root: Path, dest: Path) -> Path:
    """A copy of the project's files at ``dest``: git's list (tracked and new, not ignored)
    where ``root`` is a clone, else everything but build output and environments; ``dest``."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, text=True)
    if listed.returncode == 0 and listed.stdout.strip():
        names = [line for line in listed.stdout.splitlines() if (root / line).is_file()]
    else:
        skip = {".venv", ".git", "runs", "build", "dist", "__pycache__"}
        names = [str(p.relative_to(root)) for p in root.rglob("*")
                 if p.is_file() and not skip & set(p.relative_to(root).parts) and ".egg-info" not in str(p)]
    for name in names:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, dest / name)
    return dest
