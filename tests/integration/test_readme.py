"""The README cannot rot: its first script runs as written, and CI runs its set-up commands."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO

README = (REPO / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


@pytest.mark.slow
def test_first_script_runs_as_written(tmp_path: Path) -> None:
    script = tmp_path / "first.py"
    script.write_text(blocks("python")[0])
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")}
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "completed 240"
    assert "hookfit end status=completed" in result.stdout  # the console plugin was discovered
    # the run is named after the script: runs/first/<date>-<time>/
    assert [p.parent.parent.name for p in (tmp_path / "runs").glob("*/*/metrics.jsonl")] == ["first"]


def test_ci_runs_exactly_the_readme_setup_commands() -> None:
    commands = [line for line in blocks("sh")[0].splitlines() if line.strip()]
    assert len(commands) == 2
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert ci == commands


def test_no_file_points_outside_the_repository() -> None:
    """The project stands alone: every relative link in its Markdown resolves to a file of the
    repository, and no file names a path of the machine it was written on."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    texts = [REPO / name for name in tracked if name.endswith((".py", ".md", ".toml", ".cfg", ".txt")) or "/.ci/" in f"/{name}"]
    outside = re.compile(r"(?<![\w.])(/work/|/tmp/hookfit|shared/notes|\.\./shared)")
    for path in texts:
        if path == Path(__file__).resolve():  # the patterns themselves
            continue
        text = path.read_text(encoding="utf-8")
        assert not outside.search(text), f"{path.relative_to(REPO)} names a path outside the repository"
        if path.suffix != ".md":
            continue
        for target in re.findall(r"\]\(([^)#\s]+)", text):
            if re.match(r"[a-z]+:", target):  # a web address
                continue
            resolved = (path.parent / target).resolve()
            assert resolved.exists() and REPO in (resolved, *resolved.parents), (
                f"{path.relative_to(REPO)} links to {target}, which is not a file of the repository")


@pytest.mark.slow
def test_the_reliability_counts_are_what_the_suite_exercises() -> None:
    """The README's counts of bad inputs and injected faults are those of the tests pytest
    collects with the markers bad_input and fault (what ``pytest -m bad_input`` and
    ``pytest -m fault`` select), in the whole suite: one collection counts both."""
    said = re.search(r"feeds \*\*(\d+) bad inputs\*\* \(`pytest -m bad_input`\) and injects \*\*(\d+) faults\*\*\s+"
                     r"\(`pytest -m fault`", README)
    assert said, "the README's reliability section gives no counts"
    count = textwrap.dedent(f"""
        import sys, pytest
        class Count:
            def pytest_collection_finish(self, session):
                for marker in ("bad_input", "fault"):
                    print("COUNT", marker, sum(1 for item in session.items if item.get_closest_marker(marker)))
        sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", {str(REPO / "tests")!r}], plugins=[Count()]))
    """)
    done = subprocess.run([sys.executable, "-c", count], cwd=REPO, capture_output=True, text=True, timeout=300)
    collected = dict(re.findall(r"^COUNT (\w+) (\d+)$", done.stdout, re.M))
    assert set(collected) == {"bad_input", "fault"}, done.stdout + done.stderr
    for marker, number in zip(("bad_input", "fault"), said.groups()):
        assert number == collected[marker], (
            f"README says {number} tests marked {marker}, pytest collects {collected[marker]}: update the README")


def test_the_plugin_table_gives_each_built_in_plugins_import_and_it_works() -> None:
    """The README names classes (CSVLogger...), so it says where they live
    (``hookfit.plugins.csv`` fails): each row of the plugin table gives the import, which is
    the entry point's and runs."""
    import importlib
    import tomllib

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `(\w+)` \| `from ([\w.]+ import \w+)` \|", readme, re.M))
    entry_points = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["hookfit"]
    assert set(rows) == set(entry_points)
    for name, statement in rows.items():
        module, cls = statement.split(" import ")
        assert entry_points[name] == f"{module}:{cls}", name
        assert getattr(importlib.import_module(module), cls).name == name


def test_the_readme_names_the_scheduler_option_and_what_a_step_is() -> None:
    """``Optim(scheduler=...)`` is a ``TypeError``: the README names the option as ``Optim``
    takes it, and says that a scheduler steps per optimizer step, which accumulation makes
    fewer than the batches ``state.step`` counts."""
    import inspect

    from hookfit.plugins.optim import Optim

    assert "schedulers" in inspect.signature(Optim).parameters
    assert "Optim(schedulers=...)" in README and "Optim(scheduler=" not in README
    section = README[README.index("### Optimizers: accumulation and schedulers"):]
    section = section[:section.index("\n### ")]
    assert "after every *optimizer step*, not every batch" in section
    assert "`loop.state.step` counts batches" in section
    assert "Optim(accumulate=4, schedulers=scheduler)" in section


def test_blocks_added_to_the_first_script_say_how_they_are_run() -> None:
    """A block that continues ``train.py`` (its directive says ``after train.py``) says so where
    it is shown, naming the script it makes; the README says where ``examples/...`` commands
    run."""
    pattern = r"<!-- readme-test: python (\S+) after (\S+?)(?: slow)? -->"
    continued = re.findall(pattern, README)
    assert len(continued) >= 3
    for name, after in continued:
        directive = README.index(f"<!-- readme-test: python {name} after {after}")
        before = " ".join(README[README.rindex("```", 0, directive):directive].split())  # since the previous block
        assert f"`{after}` followed by this block, saved as `{name}`" in before, name
    assert "Commands that name `examples/...` run from the root of a clone of this repository" in " ".join(README.split())
