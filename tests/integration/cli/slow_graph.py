"""One component whose start hook waits until etcd holds ``/opsslow/gate``: a process that
stays ``starting`` as long as a test wants, like a worker loading its engine."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from dynagraph.sdk import async_on_start, endpoint, service

GATE = "/opsslow/gate"


@service(dynamo={"namespace": "opsslow"})
class Slow:
    @async_on_start
    async def start(self) -> None:
        updates = self.runtime.discovery.watch_prefix(GATE)
        async with asyncio.timeout(120), contextlib.aclosing(updates):
            async for _key, value in updates:
                if value is not None:
                    return

    @endpoint()
    async def generate(self, request: dict[str, Any]) -> AsyncIterator[int]:
        yield 1
