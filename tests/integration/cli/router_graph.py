"""The real Router in front of two light workers, for ``dynamo status`` / ``settings`` tests.

``Router`` here is the project's Router (`components.kv_router.Router`, same live
settings) in its own namespace, so the settings a test writes never reach another test's
graph; it depends on ``Worker``, which serves what the Router reads from a decode worker
(``kv_events``, ``load_metrics``) under the name ``VllmWorker`` in namespace ``dynamo``,
where the Router looks for its workers, and exports the worker load gauges with a fixed
load so ``dynamo status`` has numbers to show. No engine: the graph is up in seconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from components.kv_router import Router as KvRouter
from dynagraph.llm.engines.base import EngineLoad
from dynagraph.llm.engines.metrics import register_engine_load
from dynagraph.llm.protocol import Subscribe
from dynagraph.llm.router.events import RelayBatch
from dynagraph.sdk import async_on_start, depends, endpoint, service

LOAD = EngineLoad(running=1, waiting=2, kv_blocks_used=25, kv_blocks_total=100)


@service(dynamo={"namespace": "dynamo"}, name="VllmWorker", workers=2)
class Worker:
    @async_on_start
    async def start(self) -> None:
        register_engine_load(lambda: LOAD, worker=f"{self.runtime.instance_id:x}",
                             registry=self.runtime.registry)

    @endpoint()
    async def kv_events(self, request: Subscribe) -> AsyncGenerator[RelayBatch, None]:
        yield RelayBatch(seq=0, snapshot=True)  # caches nothing
        await asyncio.sleep(3600)

    @endpoint()
    async def load_metrics(self, request: Subscribe) -> AsyncGenerator[EngineLoad, None]:
        while True:
            yield LOAD
            await asyncio.sleep(0.5)


@service(dynamo={"namespace": "opstest"}, name="Router")
class Router(KvRouter):
    worker = depends(Worker)


graph = Router.link(Worker)
