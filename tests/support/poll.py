"""Waiting for a condition in tests: poll it, never sleep a fixed time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def until(cond: Callable[[], Any], within: float = 2.0, what: str = "the condition",
                interval: float = 0.005) -> float:
    """Poll ``cond()`` until it is truthy; return the seconds it took.

    Fails the test (AssertionError naming ``what``) after ``within`` seconds.
    """
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > within:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(interval)
    return time.monotonic() - t0


def wait_until(cond: Callable[[], T], timeout: float, what: str, interval: float = 0.25) -> T:
    """Blocking form of :func:`until` for synchronous tests; returns the truthy value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last  # type: ignore[no-any-return]
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


async def collect(stream: Any) -> list[Any]:
    """Every item of an async iterator."""
    return [item async for item in stream]
