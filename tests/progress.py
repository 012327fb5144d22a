"""How far the suite is, said while its slow tests run first: :class:`Progress`, registered by
``conftest.py`` in the process that reports."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import pytest


class Progress:
    """A line now and then saying how far the suite is: the slow tests run first
    (``conftest.pytest_collection_modifyitems``), each for seconds to a minute, so for the first
    minutes few tests finish and pytest's dots barely move. The first line comes after
    :attr:`FIRST` seconds, then one every :attr:`EVERY` seconds, each written through ``write``
    (the terminal reporter's ``write_line``)::

        hookfit tests: 106 of 1701 done (98 slow, which run first), 3 failed, 2:05 elapsed

    Registered in the process that reports (xdist's controller, or the only one with ``-n 0``),
    it counts the reports the workers send: one per test, at its teardown."""

    FIRST = 30.0
    EVERY = 60.0

    def __init__(self, write: Callable[[str], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.write, self.clock = write, clock
        self.started = clock()
        self.due = self.started + self.FIRST
        self.total: int | None = None
        self.done = self.slow = 0
        self.failed: set[str] = set()  # the tests with a failed setup, call or teardown

    def pytest_report_header(self) -> str:
        return ("hookfit tests: the slow tests (real processes, terminals, torchrun) run first, so few tests "
                f"finish in the first minutes; a line every {self.EVERY:.0f} s says how far the suite is")

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.total = len(session.items)  # pytest -n 0 (xdist's controller collects nothing)

    @pytest.hookimpl(optionalhook=True)  # xdist's hook: a run without -n has no such hook
    def pytest_xdist_node_collection_finished(self, node: object, ids: Sequence[str]) -> None:
        self.total = len(ids)  # every worker collects the whole suite

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            self.failed.add(report.nodeid)
        if report.when != "teardown":
            return
        self.done += 1
        self.slow += "slow" in report.keywords
        now = self.clock()
        if now >= self.due:
            self.due = now + self.EVERY
            self.write(self.line(now))

    def line(self, now: float) -> str:
        seconds = int(now - self.started)
        of = f" of {self.total}" if self.total else ""
        failed = f", {len(self.failed)} failed" if self.failed else ""
        return (f"hookfit tests: {self.done}{of} done ({self.slow} slow, which run first){failed}, "
                f"{seconds // 60}:{seconds % 60:02d} elapsed")
