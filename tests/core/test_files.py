"""hookfit.files: the one policy for files a run writes (warn once, keep training)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from hookfit.files import FileWarning, RunFile


def test_every_write_is_flushed_and_the_folder_is_made(tmp_path: Path) -> None:
    log = RunFile(tmp_path / "a" / "b" / "log.txt", owner="logger")
    assert log.write("one\n") and log.write("two\n")
    # another reader sees both lines before the file is closed (a kill -9 loses nothing)
    assert (tmp_path / "a" / "b" / "log.txt").read_text() == "one\ntwo\n"
    log.close()
    assert log.write("three\n"), "a closed file opens again on the next write"
    assert (tmp_path / "a" / "b" / "log.txt").read_text() == "one\ntwo\nthree\n"
    log.close()


def test_binary_files_take_bytes(tmp_path: Path) -> None:
    out = RunFile(tmp_path / "out.bin", owner="capture", binary=True)
    assert out.write(b"\x00\xff")
    out.close()
    assert (tmp_path / "out.bin").read_bytes() == b"\x00\xff"


@pytest.mark.fault
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_full_disk_warns_once_naming_the_plugin_and_the_file_then_drops_writes() -> None:
    """/dev/full fails every write with ENOSPC, as a full disk does."""
    full = RunFile("/dev/full", owner="metrics")
    with pytest.warns(FileWarning) as caught:
        assert full.write("x" * 10) is False
    assert len(caught) == 1 and caught[0].filename == __file__  # the caller's line, not core/files.py's
    message = str(caught[0].message)
    assert message.startswith("metrics: could not write /dev/full (OSError: [Errno 28] No space left on device")
    assert "training goes on without it" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        assert full.write("more") is False
        full.close()
        assert full.write("and more") is False, "a failed file stays failed"
    assert isinstance(full.failed, OSError)


@pytest.mark.fault
def test_a_file_that_cannot_be_opened_warns_once(tmp_path: Path) -> None:
    (tmp_path / "not-a-folder").write_text("")
    log = RunFile(tmp_path / "not-a-folder" / "log.txt", owner="tui")
    with pytest.warns(FileWarning, match=r"^tui: could not write .*not-a-folder/log.txt \((FileExistsError|NotADirectoryError)"):
        assert log.write("line") is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert log.write("line") is False
