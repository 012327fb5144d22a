"""Every block of the README runs as written, in order, as a reader would.

The README is read from top to bottom and each fenced block is treated as the reader treats it:
scripts are saved and run, shell lines are typed, files are written. What the test does with a
block is said by an HTML comment (invisible on a rendered page) on the line before it::

    <!-- readme-test: python NAME.py -->             the block is NAME.py: saved and run with `python NAME.py`
    <!-- readme-test: python NAME.py after A.py -->  NAME.py is A.py followed by the block (it uses A.py's
                                                     names, as the README presents it): saved and run
    <!-- readme-test: sh -->                         the lines are typed into a shell (bash -e)
    <!-- readme-test: file NAME then COMMAND -->     the block is saved as NAME, then COMMAND is typed
                                                     (`then COMMAND` is optional)
    <!-- readme-test: output -->                     what the previous block printed, run by the `$ `
                                                     command on its first line: its lines outside the
                                                     plot match, numbers with a decimal point aside
    <!-- readme-test: skip: WHY -->                  not run, and WHY says why (the network, two machines)

``python``, ``sh`` and ``file`` directives may end in ``slow``: those blocks (processes started by
``torchrun``, installs, longer runs) run in :func:`test_the_slow_blocks_run`; the others in
:func:`test_the_readme_runs_in_order` (both marked slow: each runs a minute of real processes).
Both read the whole README in order and save every script and file, so a slow block may use the
files an earlier block writes (not what an earlier block's run made). A block without a directive,
or with one this module does not know, fails :func:`test_every_block_says_how_it_runs`.

The reader works in a temporary folder holding a copy of ``examples/`` (as a clone does), with
a fresh virtual environment first on ``PATH`` (:class:`venvs.Venv`: it sees the suite's packages,
hookfit installed editable among them, and keeps its own installs): ``python``, ``hookfit``,
``torchrun`` and ``pip`` are that environment's, and ``pip install`` installs into it, offline and
without build isolation, never into the suite's environment. A block passes when its commands
exit 0 and nothing on stderr is a Python warning or a traceback.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO
from venvs import TIMEOUT, Venv

README = REPO / "README.md"
DIRECTIVE = re.compile(r"^\s*<!-- readme-test: (?P<what>.*?) -->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<language>[\w-]*)\s*$")
RUNS = ("python", "sh", "file")
WARNING = re.compile(r"^\S+:\d+: \w*Warning: .*|^Traceback \(most recent call last\)", re.M)
DECIMAL = re.compile(r"\d+\.\d+")
PLOT = re.compile(r"[│└┤┼─]")


@dataclass(frozen=True)
class Block:
    """One fenced block of the README and what its directive asks."""

    line: int  # of the opening fence, from 1
    language: str
    text: str
    kind: str  # python, sh, file, output or skip
    name: str = ""  # the script or file (python, file)
    after: str = ""  # the script this one continues (python)
    then: str = ""  # the command typed after saving the file (file)
    slow: bool = False

    def where(self) -> str:
        return f"README.md line {self.line} ({self.language or 'no language'} block)"


class ReadmeError(ValueError):
    """A block of the README whose directive is missing or not understood."""


def parse(text: str) -> list[Block]:
    """The fenced blocks of ``text`` with their directives; :class:`ReadmeError` names the
    first block with none, or with one that is not understood."""
    lines = text.splitlines()
    blocks: list[Block] = []
    scripts: set[str] = set()
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:  # blocks are skipped whole: a fence met here opens one
            index += 1
            continue
        indent = len(opening["indent"])
        end = next((k for k in range(index + 1, len(lines)) if lines[k].strip() == "```"), None)
        if end is None:
            raise ReadmeError(f"README.md line {index + 1}: a fenced block that is never closed")
        body = "\n".join(line[indent:] for line in lines[index + 1:end]) + "\n"
        block = _block(index + 1, opening["language"], body, _directive(lines, index), scripts)
        if block.kind == "python":
            scripts.add(block.name)
        blocks.append(block)
        index = end + 1
    return blocks


def _directive(lines: list[str], index: int) -> str | None:
    found = DIRECTIVE.match(lines[index - 1]) if index else None
    return found["what"].strip() if found else None


def _block(line: int, language: str, body: str, what: str | None, scripts: set[str]) -> Block:
    where = f"README.md line {line} ({language or 'no language'} block)"
    if what is None:
        raise ReadmeError(f"{where} has no <!-- readme-test: ... --> line before it saying how it runs "
                          f"(see tests/integration/test_readme_blocks.py)")
    if what.startswith("skip:"):
        reason = what.removeprefix("skip:").strip()
        if len(reason.split()) < 3:
            raise ReadmeError(f"{where} is skipped without saying why in a few words: {what!r}")
        return Block(line, language, body, "skip")
    if what == "output":
        if not body.startswith("$ "):
            raise ReadmeError(f"{where}: an output block starts with the `$ ` command that prints it")
        return Block(line, language, body, "output")
    words = what.split()
    slow = words[-1] == "slow"
    words = words[:-1] if slow else words
    kind, rest = words[0], words[1:]
    if kind == "python" and language == "python" and len(rest) in (1, 3) and rest[0].endswith(".py"):
        if len(rest) == 3 and (rest[1] != "after" or rest[2] not in scripts):
            raise ReadmeError(f"{where}: {what!r} continues no earlier script (earlier: {sorted(scripts)})")
        return Block(line, language, body, "python", name=rest[0], after=rest[2] if len(rest) == 3 else "",
                     slow=slow)
    if kind == "sh" and not rest and language in ("sh", "console", "bash"):
        return Block(line, language, body, "sh", slow=slow)
    if kind == "file" and rest and (len(rest) == 1 or rest[1] == "then" and len(rest) > 2):
        return Block(line, language, body, "file", name=rest[0], then=" ".join(rest[2:]), slow=slow)
    raise ReadmeError(f"{where}: directive {what!r} is not one of: python NAME.py [after EARLIER.py], sh, "
                      f"file NAME [then COMMAND], output, skip: WHY (each but the last two may end in slow)")


def test_every_block_says_how_it_runs() -> None:
    blocks = parse(README.read_text(encoding="utf-8"))
    assert sum(block.kind != "skip" for block in blocks) >= 10
    assert {block.kind for block in blocks} == {"python", "sh", "file", "output", "skip"}


@pytest.mark.parametrize("readme, message", [
    ("Text\n\n```python\nprint(1)\n```\n", "line 3 (python block) has no <!-- readme-test"),
    ("<!-- readme-test: run it -->\n```sh\nls\n```\n", "directive 'run it' is not one of"),
    ("<!-- readme-test: skip: net -->\n```sh\npip install x\n```\n", "without saying why"),
    ("<!-- readme-test: python b.py after a.py -->\n```python\nx\n```\n", "continues no earlier script"),
    ("<!-- readme-test: output -->\n```text\nnothing\n```\n", "starts with the `$ ` command"),
    ("<!-- readme-test: sh -->\n```sh\nls\n", "never closed"),
])
def test_a_block_without_a_directive_it_understands_fails(readme: str, message: str) -> None:
    with pytest.raises(ReadmeError, match=re.escape(message)):
        parse(readme)


# -- the reader -----------------------------------------------------------------------------------

class Reader:
    """Someone following the README in ``folder``, with ``venv`` on ``PATH``."""

    def __init__(self, folder: Path, venv: Venv) -> None:
        self.folder, self.venv = folder, venv
        self.scripts: dict[str, str] = {}
        self.printed = ""  # stdout of the last block run
        bin_ = venv.root / "bin"
        shims = {
            "hookfit": "from hookfit.tools.cli import main",
            "torchrun": "from torch.distributed.run import main",
        }
        for command, load in shims.items():  # console scripts of the venv's interpreter
            (bin_ / command).write_text(f"#!{venv.python}\nimport sys\n{load}\nsys.exit(main())\n")
        pip = (f'#!/bin/sh\nif [ "$1" = install ]; then shift; set -- install --no-index --no-build-isolation "$@"; fi\n'
               f'exec {shlex.quote(sys.executable)} -m pip --python {shlex.quote(str(venv.python))} "$@"\n')
        (bin_ / "pip").write_text(pip)
        for command in (*shims, "pip"):
            (bin_ / command).chmod(0o755)
        shutil.copytree(REPO / "examples", folder / "examples", ignore=shutil.ignore_patterns(
            "build", "dist", "*.egg-info", "__pycache__"))

    def read(self, blocks: list[Block], slow: bool) -> None:
        """Save every script and file in order; run the blocks that are (not) slow."""
        ran: Block | None = None
        for block in blocks:
            if block.kind == "python":
                self.scripts[block.name] = (self.scripts[block.after] + "\n" if block.after else "") + block.text
                (self.folder / block.name).write_text(self.scripts[block.name])
            elif block.kind == "file":
                (self.folder / block.name).write_text(block.text)
            runs = block.kind in RUNS and block.slow == slow
            if runs:
                command = {"python": f"python {block.name}", "sh": block.text, "file": block.then}[block.kind]
                if command:
                    self.type(block, command)
                ran = block
            elif block.kind == "output" and ran is not None and blocks[blocks.index(block) - 1] is ran:
                self.check_output(block)

    def type(self, block: Block, command: str, warns: str | None = None) -> None:
        """Run ``command`` as the reader types it: it succeeds and shows no warning, but one whose message has
        ``warns`` in it, which it must show once."""
        result = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", command], cwd=self.folder,
                                env=self.venv.env(), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                timeout=TIMEOUT)
        said = f"{block.where()}:\n{command}\nexited {result.returncode}\n--- stdout\n{result.stdout[-6000:]}" \
               f"\n--- stderr\n{result.stderr[-6000:]}"
        assert result.returncode == 0, said
        shown = WARNING.findall(result.stderr)
        if warns is not None:
            assert len([line for line in shown if warns in line]) == 1, f"{said}\n--- one warning of {warns!r} expected"
        warned = next((line for line in shown if warns is None or warns not in line), None)
        assert warned is None, f"{said}\n--- a warning or traceback: {warned}"
        self.printed = result.stdout

    def check_output(self, block: Block) -> None:
        """The sample's command, run now, prints the sample's lines (outside the plot, decimal
        numbers aside)."""
        command, *sample = block.text.splitlines()
        self.type(block, command.removeprefix("$ "))
        printed = {_masked(line) for line in self.printed.splitlines()}
        for line in sample:
            if line.strip() and not PLOT.search(line):
                assert _masked(line) in printed, f"{block.where()}: {line!r} is not printed:\n{self.printed}"


def _masked(line: str) -> tuple[str, ...]:
    return tuple(DECIMAL.sub("<n>", word) for word in line.split())


@pytest.fixture
def reader(tmp_path: Path) -> Reader:
    folder = tmp_path / "reader"
    folder.mkdir()
    return Reader(folder, Venv(tmp_path / "venv"))


@pytest.mark.slow
def test_the_readme_runs_in_order(reader: Reader) -> None:
    reader.read(parse(README.read_text(encoding="utf-8")), slow=False)


@pytest.mark.slow
def test_the_slow_blocks_run(reader: Reader) -> None:
    reader.read(parse(README.read_text(encoding="utf-8")), slow=True)


@pytest.mark.slow
def test_the_checkpoint_block_started_again_counts_the_epochs_hookfit_runs_counts(reader: Reader) -> None:
    """The README's checkpoint script, started again once its run is complete, resumes at the
    end and trains nothing, one warning saying so: the console's end line, ``metrics.jsonl`` and
    ``run.jsonl`` count the epochs the run has, as ``hookfit runs`` does (20, not 21)."""
    blocks = parse(README.read_text(encoding="utf-8"))
    resumable = next(b for b in blocks if b.kind == "python" and 'resume="latest"' in b.text)
    epochs = int(re.search(r"max_epochs=(\d+)", resumable.text).group(1))
    folder = re.search(r'run_dir="([^"]+)"', resumable.text).group(1)
    first = next(b for b in blocks if b.kind == "python" and b.name == resumable.after)
    reader.scripts[first.name] = first.text  # what the resumable script continues; its own run is not needed
    reader.read([resumable], slow=False)
    reader.type(resumable, f"python {resumable.name}", warns="HookfitWarning: resume='latest': the run resumed from "
                f"{folder}/checkpoints/epoch{epochs:04d}-step")
    assert re.search(r"^hookfit resumed from=", reader.printed, re.M), reader.printed
    said = re.findall(r"^hookfit end status=completed .*\bepochs=(\d+) steps=(\d+)$", reader.printed, re.M)
    reader.type(resumable, "hookfit runs --json")
    run = next(r for r in json.loads(reader.printed) if Path(r["folder"]) == Path(folder))
    assert run["epochs"] == epochs and run["status"] == "completed"
    assert said[-1] == (str(epochs), str(run["steps"]))
    run_dir = reader.folder / folder
    ends = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"end"' in line]
    assert [end["epoch"] for end in ends] == [epochs, epochs]
    ends = [json.loads(line) for line in (run_dir / "run.jsonl").read_text().splitlines() if '"end"' in line]
    assert [end["epochs"] for end in ends] == [epochs, epochs]
