"""A five-component graph of light components (no engine) for ``serve_lifecycle.py``.

    dynamo serve benchmarks._lifecycle_graph:First

``First -> Second -> Third -> Fourth -> Fifth``: each ``generate`` forwards the request
to the next component and relays its answers, adding its own name; ``Fifth`` answers
``count`` items. So one request crosses every hop, which shows the graph really works.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel

from dynagraph.sdk import Component, depends, endpoint, service

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


class Relay(Component):
    """Forwards a request to ``next`` and relays its answers, adding its own name."""

    next: Any  # the depends() client of the next component

    @endpoint()
    async def generate(self, request: Ping) -> AsyncIterator[dict[str, object]]:
        fwd = Ping(count=request.count, path=[*request.path, type(self).__name__])
        async for item in self.next.generate(fwd.model_dump()):
            yield item


@service(dynamo={"namespace": NAMESPACE})
class Fourth(Relay):
    next = depends(Fifth)


@service(dynamo={"namespace": NAMESPACE})
class Third(Relay):
    next = depends(Fourth)


@service(dynamo={"namespace": NAMESPACE})
class Second(Relay):
    next = depends(Third)


@service(dynamo={"namespace": NAMESPACE})
class First(Relay):
    next = depends(Second)


graph = First.link(Second).link(Third).link(Fourth).link(Fifth)
