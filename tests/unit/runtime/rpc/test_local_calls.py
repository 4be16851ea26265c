"""Calls to an embedded component's server from its own process skip the socket
(``dynagraph.runtime.rpc._local``) and behave as the wire does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from dynagraph.errors import InstanceUnavailable, InvalidRequest, RemoteError
from dynagraph.runtime.rpc import (
    LocalStream,
    RequestContext,
    RpcClient,
    RpcServer,
    RpcStream,
    local_server,
)
from tests.unit.runtime.rpc.conftest import count, echo, fail


async def collect(stream: Any) -> list[Any]:
    return [item async for item in stream]


@pytest.fixture(params=["local", "socket"])
async def served(request: pytest.FixtureRequest) -> AsyncIterator[tuple[RpcServer, RpcClient]]:
    """The same server reached through its own process's fast path or the socket."""
    srv = RpcServer(local_calls=request.param == "local")
    for name, handler in (("count", count), ("echo", echo), ("fail", fail)):
        srv.add_endpoint(name, handler)
    await srv.start()
    client = RpcClient()
    try:
        yield srv, client
    finally:
        await client.close()
        await srv.stop(grace=0.5)


async def test_only_an_opted_in_server_is_reached_locally(
        served: tuple[RpcServer, RpcClient]) -> None:
    srv, client = served
    stream = client.call(srv.address, "count", {"n": 3})
    assert isinstance(stream, LocalStream if srv.local_calls else RpcStream)
    assert (local_server(srv.address) is srv) == srv.local_calls
    assert await collect(stream) == [0, 1, 2]
    assert not client._connections if srv.local_calls else client._connections


async def test_the_handler_gets_what_the_wire_would_give_it(
        served: tuple[RpcServer, RpcClient]) -> None:
    srv, client = served
    payload = {"ids": (1, 2), "nested": {"a": [1]}}
    stream = client.call(srv.address, "echo", payload, headers={"x-request-id": "r1"})
    payload["nested"]["a"].append(2)  # the caller reuses its object: the callee has a copy
    (got,) = await collect(stream)
    assert got["payload"] == {"ids": [1, 2], "nested": {"a": [1]}}  # a tuple arrives as a list
    assert got["request_id"] == "r1" and got["endpoint"] == "echo"
    with pytest.raises(TypeError):
        client.call(srv.address, "echo", object())


async def test_errors_arrive_as_over_the_wire(served: tuple[RpcServer, RpcClient]) -> None:
    srv, client = served
    with pytest.raises(RemoteError) as info:
        await collect(client.call(srv.address, "fail", "x"))
    assert (info.value.remote_type, info.value.remote_message) == ("ValueError",
                                                                  "cannot handle 'x'")
    with pytest.raises(InvalidRequest) as invalid:
        await collect(client.call(srv.address, "fail", "invalid"))
    assert type(invalid.value) is InvalidRequest and invalid.value.param == "max_tokens"
    with pytest.raises(RemoteError, match="no endpoint 'nope'") as unknown:
        await collect(client.call(srv.address, "nope", None))
    assert unknown.value.remote_type == "UnknownEndpoint"


async def test_closing_early_cancels_the_handler() -> None:
    seen: list[RequestContext] = []
    finished = asyncio.Event()

    async def endless(payload: Any, ctx: RequestContext) -> AsyncIterator[int]:
        seen.append(ctx)
        try:
            i = 0
            while True:
                yield i
                i += 1
                await asyncio.sleep(0)
        finally:
            finished.set()

    srv = RpcServer(local_calls=True)
    srv.add_endpoint("endless", endless)
    await srv.start()
    client = RpcClient()
    try:
        stream = client.call(srv.address, "endless", None)
        assert [await anext(stream) for _ in range(3)] == [0, 1, 2]
        await stream.aclose()
        assert finished.is_set() and seen[0].cancelled
    finally:
        await client.close()
        await srv.stop(grace=0.5)


async def test_a_stopping_server_refuses_new_calls_and_drains_those_running() -> None:
    release = asyncio.Event()

    async def slow(payload: Any, ctx: RequestContext) -> AsyncIterator[str]:
        yield "started"
        await release.wait()
        yield "done"

    srv = RpcServer(local_calls=True)
    srv.add_endpoint("slow", slow)
    await srv.start()
    address = srv.address
    client = RpcClient()
    running = client.call(address, "slow", None)
    assert await anext(running) == "started"
    stopping = asyncio.create_task(srv.stop(grace=5))
    await asyncio.sleep(0.05)
    assert not stopping.done()  # waits for the local stream, as for a remote one
    with pytest.raises(InstanceUnavailable):
        await collect(LocalStream(srv, "slow", {}, None))
    assert local_server(address) is None  # and new callers no longer find it here
    release.set()
    assert await collect(running) == ["done"]
    await asyncio.wait_for(stopping, 2)
    await client.close()
