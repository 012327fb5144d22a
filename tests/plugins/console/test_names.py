"""The console's ``key=value`` lines stay one line each, split into their fields, whatever the
metric names and the free text hold (a space, ``=``, a quote, a line break, an escape code):
one quoting rule for keys and values, read back as the module's docstring says."""

from __future__ import annotations

import ast
import io
import re
from pathlib import Path

import pytest
import torch

import hookfit
from hookfit.plugins import console as console_module
from hookfit.plugins.console import Console, quote
from hookfit.plugins.metrics import Metrics

FIELD = re.compile(r'("(?:\\.|[^"\\])*"|[^\s=]+)=("(?:\\.|[^"\\])*"|\S*)')
"""A field as the console's module documentation gives it."""

NAMES = ["loss", "top 1 acc", "f=1", 'say "hi"', "it's", "two\nlines", "tab\there", "esc\x1b[31m", "back\\slash",
         "x\r", "é"]


def unquote(part: str) -> str:
    return ast.literal_eval(part) if part.startswith('"') else part


def fields(line: str) -> tuple[list[str], dict[str, str]]:
    """A console line as its bare words and its fields; every character is accounted for."""
    words, found, at = [], {}, 0
    for token in re.finditer(r'(?:"(?:\\.|[^"\\])*"|\S)+', line):
        match = FIELD.fullmatch(token.group())
        if match:
            found[unquote(match[1])] = unquote(match[2])
        else:
            words.append(token.group())
        assert line[at:token.start()].strip() == "", line
        at = token.end()
    return words, found


@pytest.mark.parametrize("text", NAMES + ["", "a b=c \"d\" 'e' \\ \n\t\x00\u2028\u200b"])
def test_quote_is_plain_for_plain_names_and_reads_back_otherwise(text: str) -> None:
    quoted = quote(text)
    if text in ("loss", "é"):
        assert quoted == text
    else:
        assert quoted.startswith('"') and quoted.endswith('"')
        assert ast.literal_eval(quoted) == text
    assert quoted.isprintable() and not any(c in quoted for c in "\n\r\t\x1b")
    assert FIELD.fullmatch(f"{quoted}={quoted}")


def test_the_module_documents_the_rule_it_follows() -> None:
    doc = console_module.__doc__ or ""
    assert "Quoting, one rule for keys and values" in doc
    assert FIELD.pattern in doc


def test_metric_names_with_spaces_equals_quotes_and_line_breaks_keep_every_line_whole(tmp_path: Path) -> None:
    out = io.StringIO()

    def step(loop, batch):
        return {name: torch.tensor(float(i)) for i, name in enumerate(NAMES)}

    def stop_step(loop, batch):
        if loop.state.epoch == 1:  # in the second epoch, once both stages have results
            loop.request_stop('stopped: "why"\nsecond line', by="me\nand=you")
        return step(loop, batch)

    hookfit.Loop(stop_step, [torch.zeros(2, 1)] * 3, val_step=step, val_data=[torch.zeros(2, 1)], max_epochs=2,
                 run_dir=tmp_path, plugins=[Metrics(interval=0), Console(out, interval=0)]).fit()
    lines = out.getvalue().splitlines()
    assert lines and all(line.startswith("hookfit ") for line in lines), lines
    expected = {name: str(i) for i, name in enumerate(NAMES)}
    summaries = [fields(line)[1] for line in lines if " done " in line or " partial " in line]
    progress = [fields(line)[1] for line in lines if " batch=" in line]
    assert summaries and progress
    for found in summaries + progress:
        assert {k: v for k, v in found.items() if k in expected} == expected, found
    results = [fields(line)[1] for line in lines if line.startswith("hookfit result ")]
    assert sorted(r["metric"] for r in results) == sorted(NAMES * 2)  # train and valid
    (end,) = [fields(line) for line in lines if line.startswith("hookfit end ")]
    assert end[0] == ["hookfit", "end"]
    assert end[1]["reason"] == 'stopped: "why"\nsecond line' and end[1]["by"] == "me\nand=you"
    assert end[1]["status"] == "interrupted"
