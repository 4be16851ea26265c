"""Helpers shared by the request-plane unit tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any


async def collect(stream: AsyncIterator[Any]) -> list[Any]:
    return [item async for item in stream]


async def wait_until(predicate: Any, within: float = 2.0) -> None:
    """Poll ``predicate()`` until it is true (fails the test after ``within`` s)."""
    async with asyncio.timeout(within):
        while not predicate():  # noqa: ASYNC110 - polling state owned by another task
            await asyncio.sleep(0.005)
