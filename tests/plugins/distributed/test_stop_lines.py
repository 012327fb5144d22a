"""A stop under ``torchrun`` is said once, by rank 0, however many ranks asked or were
signalled: the end line names the ranks that asked, and the ``KeyboardInterrupt`` with which
every rank's ``fit()`` ends after a graceful Ctrl-C is printed by rank 0 alone (the other ranks
end killed by SIGINT too, without printing the same traceback again).

``examples/ddp.py``, two processes, 31 batches an epoch each: one job stopped by Ctrl-C (SIGINT
to torchrun, which passes it on to every rank), one by ``loop.request_stop`` on rank 1; both
jobs run at the same time.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from test_distributed import Run, _not_launched, dumps  # noqa: F401 - _not_launched: autouse

ARGS = ("--samples", "1984", "--batch-size", "32", "--dump", "dump")


def _ranks_lines(out: str, err: str, text: str) -> list[str]:
    """The lines of the ranks (``[default<rank>]:``, torchrun's prefix) that hold ``text``."""
    return [line for line in (out + err).splitlines() if line.startswith("[default") and text in line]


@pytest.mark.slow
def test_a_stop_is_said_once_by_rank_0(tmp_path: Path) -> None:
    interrupted = Run(tmp_path / "sigint", *ARGS, "--epochs", "1000", tee="3")
    asked = Run(tmp_path / "asked", *ARGS, "--epochs", "2", "--stop-on-rank", "1", "--stop-at-batch", "3", tee="3")
    assert interrupted.process.stdout is not None
    for line in interrupted.process.stdout:  # both ranks train once rank 0 reports an epoch
        if line.startswith("[default0]:hookfit train epoch="):
            break
    else:
        pytest.fail("torchrun ended before the first epoch: " + interrupted.process.stderr.read())  # type: ignore[union-attr]
    interrupted.process.send_signal(signal.SIGINT)

    _, out, err, _ = interrupted.finish()
    assert [rank["status"] for rank in dumps(tmp_path / "sigint")] == ["interrupted"] * 2, out + err
    assert _ranks_lines(out, err, "SIGINT received") == [
        "[default0]:hookfit: SIGINT received, stopping after this batch; press Ctrl-C again to abort"], out + err
    ended = _ranks_lines(out, err, "hookfit end ")
    assert len(ended) == 1 and ended[0].startswith("[default0]:hookfit end status=interrupted "), ended
    # every rank's fit() raised the KeyboardInterrupt; rank 0 alone printed it (torch prefixes [rank0]:)
    assert _ranks_lines(out, err, "Traceback") == ["[default0]:[rank0]: Traceback (most recent call last):"], out + err
    assert _ranks_lines(out, err, "KeyboardInterrupt") == [
        "[default0]:[rank0]: KeyboardInterrupt: SIGINT: the run stopped gracefully (Interrupter(exit=False) returns "
        "instead)"], out + err

    code, out, err, _ = asked.finish()
    assert code == 0, out + err
    assert [rank["status"] for rank in dumps(tmp_path / "asked")] == ["interrupted"] * 2, out + err
    stop = _ranks_lines(out, err, "stop requested")
    assert len(stop) == 1 and stop[0].startswith(
        '[default0]:hookfit end status=interrupted reason="stop requested on rank 1: injected stop at batch 3" '), stop
