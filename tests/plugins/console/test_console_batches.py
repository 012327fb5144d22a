"""The console takes part in ``batch_end`` itself, and only when it prints lines by batch: no
helper plugin, and batches cost it nothing otherwise."""

from __future__ import annotations

import io
from typing import Any

import pytest

import hookfit
from hookfit.plugins.console import Console


class Probe:
    """What the run's first training batch sees: its plugins and the batch_end handlers."""

    name = "probe"

    def __init__(self, claim: bool = False) -> None:
        self.claim = claim
        self.seen: dict[str, Any] = {}

    @hookfit.hookimpl
    def batch_start(self, loop: Any, batch_idx: int) -> None:
        if not self.seen:
            self.seen = {"plugins": [name for name, _ in loop.pm.list_name_plugin()],
                         "batch_end": len(loop.hooks.handlers("batch_end"))}

    @hookfit.hookimpl(optionalhook=True)
    def claim_output(self, loop: Any) -> Any:
        return "probe" if self.claim else None


def probe(console: Console, claim: bool = False) -> tuple[dict[str, Any], list[str]]:
    watcher = Probe(claim)
    hookfit.Loop(lambda loop, batch: None, list(range(6)), plugins=[watcher, console]).fit()
    stream = console.stream
    return watcher.seen, stream.getvalue().splitlines() if isinstance(stream, io.StringIO) else []


@pytest.mark.parametrize("claim", [False, True])
def test_only_a_console_printing_by_batch_takes_part_in_batch_end(claim: bool, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HOOKFIT_PLUGINS", "console")
    without, _ = probe(Console(stream=io.StringIO()))
    assert without["batch_end"] == 0
    given = Console(every_n_batches=2) if claim else Console(stream=io.StringIO(), every_n_batches=2)
    seen, lines = probe(given, claim=claim)
    assert sorted(seen["plugins"]) == ["console", "probe"]  # no helper plugin
    if claim:  # a dashboard owns the terminal: the console prints nothing, so takes no batch
        assert seen["batch_end"] == 0 and "hookfit train" not in capsys.readouterr().out
    else:
        assert seen["batch_end"] == 1
        assert [line.split()[3] for line in lines if " batch=" in line] == ["batch=2/6", "batch=4/6", "batch=6/6"]
