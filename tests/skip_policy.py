"""A pytest plugin: a skipped test is a test that did not run.

The one acceptable reason is an optional package that is not installed
(``pytest.importorskip`` of a module whose top-level package cannot be found). Any
other skip (an installed package that fails to import, such as triton without numpy;
a kernel library that was not built) is listed and fails the run, so a green run
means every test of what is installed ran. conftest.py loads it for the whole suite.
"""

from __future__ import annotations

import importlib.util
import re

import pytest

_ALLOWED_SKIP = re.compile(r"could not import '([\w.]+)'")
_BAD_SKIPS: list[str] = []


def skip_is_allowed(reason: str) -> bool:
    match = _ALLOWED_SKIP.search(reason)
    if match is None:
        return False
    return importlib.util.find_spec(match.group(1).split(".")[0]) is None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):  # an expected failure ran
        reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else ""
        if not skip_is_allowed(reason):
            _BAD_SKIPS.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _BAD_SKIPS and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if _BAD_SKIPS:
        terminalreporter.section("skipped tests of installed code (these fail the run)")
        for line in _BAD_SKIPS:
            terminalreporter.write_line(line)
