"""A progress line whenever a test run has been quiet for `QUIET_AFTER` seconds.

pytest prints a dot per finished test; a test or fixture that takes minutes (the model
build, a vLLM engine start) leaves a log silent meanwhile. This plugin (loaded by
``tests/conftest.py``) then writes where the run stands, e.g.::

    [still running: 4m10s, 230/568 tests done (40%), ~6m left at this pace;
     tests/e2e/test_agg_openai.py::test_stream for 1m05s]

so CI's log of a first run has a line at least every minute. ``DYNAGRAPH_HEARTBEAT=0``
turns it off.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

QUIET_AFTER = 50.0


def heartbeat_line(elapsed: float, done: int, total: int, current: str | None,
                   current_for: float) -> str:
    """The text of one heartbeat (pure)."""
    parts = [f"still running: {_clock(elapsed)}"]
    if total:
        parts.append(f"{done}/{total} tests done ({100 * done // total}%)")
        if 0 < done < total:
            parts[-1] += f", ~{_clock(elapsed / done * (total - done))} left at this pace"
    text = "[" + ", ".join(parts)
    if current:
        text += f"; {current} for {_clock(current_for)}"
    return text + "]"


def _clock(seconds: float) -> str:
    s = max(0, int(seconds))
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s"


class Heartbeat:
    """Registered at configure time, when fd 1 is still the terminal (pytest suspends its
    capture between loading conftests and running tests)."""

    def __init__(self) -> None:
        self.fd = os.dup(1)
        self.reporter: Any = None
        self.t0 = self.last = time.monotonic()
        self.total = 0
        self.done = 0
        self.done_at_beat = -1
        self.current: str | None = None
        self.since = self.t0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(5.0):
            now = time.monotonic()
            if now - self.last >= QUIET_AFTER:
                self.last = now
                text = heartbeat_line(now - self.t0, self.done, self.total, self.current,
                                      now - self.since)
                # While a test runs, pytest captures fd 1: write to the terminal's own fd,
                # on a line of its own (a line of dots may be open).
                lead = "" if self.done == self.done_at_beat else "\n"
                self.done_at_beat = self.done
                os.write(self.fd, f"{lead}{text}\n".encode())
                self.reporter.currentfspath = None  # pytest starts a fresh line of dots

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if self.reporter is None:
            return
        self.total = len(session.items)
        self.last = time.monotonic()
        self._thread.start()

    def pytest_runtest_logstart(self, nodeid: str, location: object) -> None:
        self.current, self.since = nodeid, time.monotonic()

    def pytest_runtest_logfinish(self, nodeid: str, location: object) -> None:
        self.done += 1
        self.current = None
        self.last = time.monotonic()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=6)
        os.close(self.fd)


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("DYNAGRAPH_HEARTBEAT") != "0":
        config.pluginmanager.register(Heartbeat(), "dynagraph-heartbeat")
