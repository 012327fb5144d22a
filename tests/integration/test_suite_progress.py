"""The suite says how far it is while its slow tests run first (``conftest.Progress``), and the
README says how long CI takes."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pytest
from conftest import REPO
from progress import Progress


@dataclass
class Report:
    nodeid: str
    when: str = "teardown"
    failed: bool = False
    keywords: dict = field(default_factory=dict)


def test_a_line_comes_early_then_every_minute_counting_tests_slow_ones_and_failures() -> None:
    now = [100.0]
    lines: list[str] = []
    progress = Progress(lines.append, clock=lambda: now[0])
    progress.pytest_xdist_node_collection_finished(None, [f"t{i}" for i in range(1701)])
    for i in range(3):  # slow tests, one failing in its call
        progress.pytest_runtest_logreport(Report(f"s{i}", when="call", failed=i == 1, keywords={"slow": 1}))
        now[0] += 9
        progress.pytest_runtest_logreport(Report(f"s{i}", keywords={"slow": 1}))
    assert lines == []  # 27 s: not yet
    now[0] += 4
    progress.pytest_runtest_logreport(Report("q0"))
    assert lines == ["hookfit tests: 4 of 1701 done (3 slow, which run first), 1 failed, 0:31 elapsed"]
    now[0] += 59
    progress.pytest_runtest_logreport(Report("q1"))
    assert len(lines) == 1  # a minute after the last line, not before
    now[0] += 1
    progress.pytest_runtest_logreport(Report("q2"))
    assert lines[-1] == "hookfit tests: 6 of 1701 done (3 slow, which run first), 1 failed, 1:31 elapsed"
    assert "a line every 60 s says how far the suite is" in progress.pytest_report_header()


def test_the_process_that_reports_counts_the_tests(request: pytest.FixtureRequest) -> None:
    """Registered where pytest reports (xdist's controller, or the one process of ``-n 0``),
    never in a worker."""
    registered = request.config.pluginmanager.get_plugin("hookfit-progress")
    assert (registered is None) == hasattr(request.config, "workerinput")


def test_the_readme_says_what_ci_measures_on_2_cores() -> None:
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    said = re.search(r"(\d+) to (\d+) minutes on 2 cores", readme)
    assert said and (said[1], said[2]) == ("10", "35"), (
        "the README's suite time is CI's: 624 s and 1303 s on 2 cores (2026-11-29), 1177 s (2026-11-30), "
        "966 s (2026-12-01), 1990 s on a day a raw step took 4 times as long (2026-12-02)")
    assert "a line every minute says how far it is" in readme
