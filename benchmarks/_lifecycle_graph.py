"""A five-component graph of light components (no engine) for ``serve_lifecycle.py``.

    dynamo serve benchmarks._lifecycle_graph:First

``First -> Second -> Third -> Fourth -> Fifth``: each ``generate`` forwards the request
to the next component and relays its answers, adding its own name; ``Fifth`` answers
``count`` items. So one request crosses every hop, which shows the graph really works.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from pydantic import BaseModel

from dynagraph.sdk import depends, endpoint, service

NAMESPACE = "lifecycle"


class Ping(BaseModel):
    count: int = 1
    path: list[str] = []


@service(dynamo={"namespace": NAMESPACE})
class Fifth:
    @endpoint()
    async def generate(self, request: Ping) -> AsyncIterator[dict[str, object]]:
        for i in range(request.count):
            yield {"i": i, "path": [*request.path, "Fifth"]}


@service(dynamo={"namespace": NAMESPACE})
class Fourth:
    next = depends(Fifth)

    @endpoint()
    async def generate(self, request: Ping) -> AsyncIterator[dict[str, object]]:
        fwd = Ping(count=request.count, path=[*request.path, "Fourth"])
        async for item in self.next.generate(fwd.model_dump()):
            yield item


@service(dynamo={"namespace": NAMESPACE})
class Third:
    next = depends(Fourth)

    @endpoint()
    async def generate(self, request: Ping) -> AsyncIterator[dict[str, object]]:
        fwd = Ping(count=request.count, path=[*request.path, "Third"])
        async for item in self.next.generate(fwd.model_dump()):
            yield item


@service(dynamo={"namespace": NAMESPACE})
class Second:
    next = depends(Third)

    @endpoint()
    async def generate(self, request: Ping) -> AsyncIterator[dict[str, object]]:
        fwd = Ping(count=request.count, path=[*request.path, "Second"])
        async for item in self.next.generate(fwd.model_dump()):
            yield item


@service(dynamo={"namespace": NAMESPACE})
class First:
    next = depends(Second)

    @endpoint()
    async def generate(self, request: Ping) -> AsyncIterator[dict[str, object]]:
        fwd = Ping(count=request.count, path=[*request.path, "First"])
        async for item in self.next.generate(fwd.model_dump()):
            yield item


graph = First.link(Second).link(Third).link(Fourth).link(Fifth)
