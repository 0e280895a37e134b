"""The chaos suite's report: each test adds a line (fault, stall, time added beyond the fault, resumes),
printed in pytest's terminal summary so a plain run shows what resuming cost."""

from __future__ import annotations

from collections.abc import Callable

import pytest

_LINES: list[str] = []


@pytest.fixture
def chaos_report() -> Callable[[str], None]:
    """`chaos_report(line)`: add a line to the summary printed after the run."""
    return _LINES.append


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _LINES:
        terminalreporter.section("chaos: what each fault cost")
        for line in _LINES:
            terminalreporter.write_line(line)
