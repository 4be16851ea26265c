"""A three-component graph for the end-to-end SDK tests: Entry -> Relay -> Source."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

from pydantic import BaseModel, ConfigDict, Field

from dynagraph.sdk import current_request_id, depends, endpoint, service


class Count(BaseModel):
    n: int = Field(ge=0)
    hold: bool = False  # after n items, wait until cancelled


class SourceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    step: int = 1


@service(dynamo={"namespace": "demo"}, workers=2)
class Source:
    def __init__(self, config: SourceConfig) -> None:
        self.step = config.step

    @endpoint()
    async def generate(self, request: Count) -> AsyncIterator[list[int]]:
        pid = os.getpid()
        try:
            for i in range(request.n):
                yield [i * self.step, pid]
            if request.hold:
                await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await self.runtime.discovery.put(f"/demo/cancelled/{current_request_id()}", pid)
            raise


@service(dynamo={"namespace": "demo"})
class Relay:
    source = depends(Source)

    @endpoint()
    async def generate(self, request: Count) -> AsyncIterator[list[int]]:
        async for item in self.source.generate(request):
            yield item


@service(dynamo={"namespace": "demo"})
class Entry:
    relay = depends(Relay)

    @endpoint()
    async def generate(self, request: Count) -> AsyncIterator[list[int]]:
        async for item in self.relay.generate(request):
            yield item


graph = Entry.link(Relay).link(Source)
