from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from dynagraph.errors import InvalidRequest
from dynagraph.runtime.rpc import RequestContext, RpcClient, RpcServer


async def count(payload: Any, ctx: RequestContext) -> AsyncIterator[Any]:
    for i in range(payload["n"]):
        yield i


async def echo(payload: Any, ctx: RequestContext) -> AsyncIterator[Any]:
    yield {"payload": payload, "request_id": ctx.request_id, "headers": ctx.headers,
           "endpoint": ctx.endpoint, "peer": ctx.peer}


async def fail(payload: Any, ctx: RequestContext) -> AsyncIterator[Any]:
    yield "before"
    if payload == "invalid":
        raise InvalidRequest("max_tokens must be positive", param="max_tokens")
    raise ValueError(f"cannot handle {payload!r}")


async def bad_item(payload: Any, ctx: RequestContext) -> AsyncIterator[Any]:
    yield object()


@pytest.fixture
async def server() -> AsyncIterator[RpcServer]:
    srv = RpcServer()
    srv.add_endpoint("count", count)
    srv.add_endpoint("echo", echo)
    srv.add_endpoint("fail", fail)
    srv.add_endpoint("bad_item", bad_item)
    await srv.start()
    yield srv
    await srv.stop(grace=0.5)


@pytest.fixture
async def client() -> AsyncIterator[RpcClient]:
    cl = RpcClient()
    yield cl
    await cl.close()
