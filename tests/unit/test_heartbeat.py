"""The progress line a quiet test run prints (tests/support/heartbeat.py)."""

from __future__ import annotations

from tests.support.heartbeat import heartbeat_line


def test_heartbeat_line_says_where_the_run_stands() -> None:
    assert heartbeat_line(250.0, 230, 568, "tests/e2e/test_x.py::test_y", 65.0) == (
        "[still running: 4m10s, 230/568 tests done (40%), ~6m07s left at this pace; "
        "tests/e2e/test_x.py::test_y for 1m05s]")
    assert heartbeat_line(61.0, 0, 10, None, 0.0) == (
        "[still running: 1m01s, 0/10 tests done (0%)]")
    assert heartbeat_line(5.0, 0, 0, "a::b", 5.0) == "[still running: 5s; a::b for 5s]"
