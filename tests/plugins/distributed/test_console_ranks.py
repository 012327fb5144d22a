"""The console under ``torchrun``: rank 0 alone prints, and every figure on a line counts the
same thing, the whole job's, as the same script on one process prints it (batches of every
process together, samples summed over them); what rank 0 alone measured says ``rank=0``.

``examples/ddp.py`` with ``--batch-size 32 --samples 1984``: 62 training batches an epoch on
one process, 31 on each of two; 496 validation samples, 16 batches on one process, 8 on each of
two. The console and the metrics plugin are configured by a ``hookfit.toml``
(``HOOKFIT_CONFIG``): a progress line every 8 training batches, and every validation batch
published and printed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_distributed import EXAMPLE, _env, _not_launched, torchrun  # noqa: F401 - _not_launched: autouse

CONFIG = """
[plugins.console]
every_n_batches = 8
interval = 0

[plugins.metrics]
interval = 0
"""
ARGS = ("--samples", "1984", "--batch-size", "32", "--epochs", "2")


def _hookfit_lines(text: str, prefix: str = "") -> list[str]:
    return [line[len(prefix):] for line in text.splitlines() if line.startswith(f"{prefix}hookfit ")]


def _field(line: str, key: str) -> str | None:
    found = re.search(rf"(?:^| ){key}=(\S+)", line)
    return found.group(1) if found else None


@pytest.mark.slow
def test_every_figure_of_a_console_line_counts_the_whole_job_as_one_process_does(tmp_path: Path) -> None:
    config = tmp_path / "hookfit.toml"
    config.write_text(CONFIG)
    single = subprocess.run([sys.executable, str(EXAMPLE), *ARGS], cwd=tmp_path, env=_env(HOOKFIT_CONFIG=str(config)),
                            capture_output=True, text=True, timeout=120)
    assert single.returncode == 0, single.stdout + single.stderr
    one = _hookfit_lines(single.stdout)
    code, out, err, _ = torchrun(tmp_path / "two", *ARGS, HOOKFIT_CONFIG=str(config))
    assert code == 0, out + err
    assert not [line for line in out.splitlines() if line.startswith("[default1]:hookfit ")], out  # rank 0 prints
    two = _hookfit_lines(out, "[default0]:")

    # the start: the job's batches per epoch, those of one process running it, and how many processes
    start = two[0]
    assert _field(start, "batches_per_epoch") == _field(one[0], "batches_per_epoch") == "62", (start, one[0])
    assert _field(start, "processes") == "2" and _field(one[0], "processes") is None, start

    # training progress: every 8 of the job's batches (4 of each process's), counted as one process counts them
    train = [_field(line, "batch") for line in two if line.startswith("hookfit train epoch=1/2 batch=")]
    assert train == [f"{n}/62" for n in range(8, 62, 8)], two
    assert {f"{n}/62" for n in range(8, 62, 8)} <= {_field(line, "batch") for line in one}, one

    # the epoch summaries: the job's batches beside the job's samples per second; a validation,
    # whose parts differ between the processes, counts its samples
    done = [line for line in two if " done " in line]
    assert [_field(line, "batches") for line in done if line.startswith("hookfit train")] == ["62", "62"], done
    valid = [line for line in done if line.startswith("hookfit valid")]
    assert [(_field(line, "samples"), _field(line, "batches")) for line in valid] == [("496", None)] * 2, valid
    assert [_field(line, "batches") for line in one if line.startswith("hookfit valid") and " done " in line] \
        == ["16", "16"], one

    # what rank 0 alone measured says so: a validation's progress (reduced at its end only) and the time lines
    progress = [line for line in two if line.startswith("hookfit valid epoch=1/2 ") and " batch=" in line]
    assert [(_field(line, "rank"), _field(line, "batch")) for line in progress] == \
        [("0", f"{n}/8") for n in range(1, 9)], two
    times = [line for line in two if line.startswith("hookfit time ")]
    assert len(times) == 2 and all(_field(line, "rank") == "0" for line in times), times
    assert all(_field(line, "rank") is None for line in one), one  # one process: nothing to say
