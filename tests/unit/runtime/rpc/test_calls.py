"""Server and client in one event loop on 127.0.0.1: calls, payloads, errors."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pydantic
import pytest

from dynagraph.errors import InstanceUnavailable, InvalidRequest, RemoteError
from dynagraph.runtime.rpc import ProtocolError, RequestContext, RpcClient, RpcServer, RpcStream
from tests.support.poll import collect, until


async def test_streams_all_items_then_ends(server: RpcServer, client: RpcClient) -> None:
    assert await collect(client.call(server.address, "count", {"n": 1000})) == list(range(1000))
    assert await collect(client.call(server.address, "count", {"n": 0})) == []


async def test_address_is_loopback_with_a_real_port(server: RpcServer) -> None:
    host, port = server.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0


async def test_request_id_comes_from_header_or_is_generated(
        server: RpcServer, client: RpcClient) -> None:
    [given] = await collect(client.call(server.address, "echo", [1, "a"],
                                        headers={"x-request-id": "req-7", "k": "v"}))
    assert given["request_id"] == "req-7"
    assert given["headers"] == {"x-request-id": "req-7", "k": "v"}
    assert given["payload"] == [1, "a"] and given["endpoint"] == "echo"
    [generated] = await collect(client.call(server.address, "echo", None))
    assert len(generated["request_id"]) == 32
    assert generated["headers"] == {"x-request-id": generated["request_id"]}


async def test_large_payloads_cross_in_both_directions(
        server: RpcServer, client: RpcClient) -> None:
    blob = bytes(range(256)) * (4 << 12)  # 4 MiB: many socket reads, paused reading
    [got] = await collect(client.call(server.address, "echo", blob))
    assert got["payload"] == blob


async def test_connection_is_reused_by_sequential_calls(
        server: RpcServer, client: RpcClient) -> None:
    peers = {(await collect(client.call(server.address, "echo", i)))[0]["peer"] for i in range(5)}
    assert len(peers) == 1


async def test_closing_at_the_last_item_keeps_the_connection_pooled(
        server: RpcServer, client: RpcClient) -> None:
    """A consumer that stops at its own end marker, just before END, reuses the socket."""
    peers = set()
    for _ in range(5):
        stream = client.call(server.address, "echo", "x")
        peers.add((await anext(stream))["peer"])
        await stream.aclose()  # END not read yet
    assert len(peers) == 1


async def test_closing_mid_stream_still_cancels(server: RpcServer, client: RpcClient) -> None:
    produced: list[int] = []
    cancelled = asyncio.Event()

    async def counting(payload: Any, ctx: RequestContext) -> AsyncIterator[int]:
        try:
            for i in range(payload["n"]):
                produced.append(i)
                yield i
                await asyncio.sleep(0.001)  # endless for this test: it must be cancelled
        except (asyncio.CancelledError, GeneratorExit):
            cancelled.set()
            raise

    server.add_endpoint("counting", counting)
    stream = client.call(server.address, "counting", {"n": 10**9})
    assert await anext(stream) == 0
    t0 = time.monotonic()
    await stream.aclose()
    assert time.monotonic() - t0 < 0.5
    await asyncio.wait_for(cancelled.wait(), 1.0)  # the cancel reached the handler
    stopped_at = len(produced)
    await asyncio.sleep(0.05)
    assert len(produced) == stopped_at  # and it produces nothing more
    assert await collect(client.call(server.address, "count", {"n": 3})) == [0, 1, 2]


async def test_concurrent_calls_each_get_their_own_stream(
        server: RpcServer, client: RpcClient) -> None:
    results = await asyncio.gather(
        *(collect(client.call(server.address, "count", {"n": n})) for n in range(1, 30)))
    assert results == [list(range(n)) for n in range(1, 30)]


class Usage(pydantic.BaseModel):
    prompt_tokens: int


class Chunk(pydantic.BaseModel):
    token_ids: list[int]
    usage: Usage | None = None


async def test_handlers_may_yield_pydantic_models(client: RpcClient) -> None:
    async def gen(payload: Any, ctx: RequestContext) -> AsyncIterator[Chunk]:
        yield Chunk(token_ids=[1, 2])
        yield Chunk(token_ids=[3], usage=Usage(prompt_tokens=5))

    srv = RpcServer()
    srv.add_endpoint("gen", gen)
    await srv.start()
    try:
        got = await collect(client.call(srv.address, "gen", Chunk(token_ids=[])))
    finally:
        await srv.stop()
    assert got == [{"token_ids": [1, 2], "usage": None},
                   {"token_ids": [3], "usage": {"prompt_tokens": 5}}]


async def test_unknown_endpoint_names_it(server: RpcServer, client: RpcClient) -> None:
    with pytest.raises(RemoteError, match="no endpoint 'nope'") as info:
        await collect(client.call(server.address, "nope", None))
    assert info.value.remote_type == "UnknownEndpoint"
    assert "count" in info.value.remote_message  # lists what is served
    assert await collect(client.call(server.address, "count", {"n": 2})) == [0, 1]


async def test_handler_exception_arrives_as_remote_error(
        server: RpcServer, client: RpcClient) -> None:
    got: list[Any] = []
    with pytest.raises(RemoteError) as info:
        async for item in client.call(server.address, "fail", "x"):
            got.append(item)
    assert got == ["before"]
    assert (info.value.remote_type, info.value.remote_message) == ("ValueError",
                                                                  "cannot handle 'x'")


async def test_wire_errors_are_reraised_as_their_own_type(
        server: RpcServer, client: RpcClient) -> None:
    with pytest.raises(InvalidRequest, match="max_tokens must be positive") as info:
        await collect(client.call(server.address, "fail", "invalid"))
    assert type(info.value) is InvalidRequest and info.value.param == "max_tokens"


async def test_unencodable_items_and_payloads(server: RpcServer, client: RpcClient) -> None:
    with pytest.raises(RemoteError) as info:
        await collect(client.call(server.address, "bad_item", None))
    assert info.value.remote_type == "TypeError"
    with pytest.raises(TypeError):
        client.call(server.address, "echo", object())
    assert await collect(client.call(server.address, "count", {"n": 1})) == [0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_dead_address_fails_fast_with_instance_unavailable(client: RpcClient) -> None:
    start = time.monotonic()
    with pytest.raises(InstanceUnavailable, match="cannot connect"):
        await collect(client.call(f"127.0.0.1:{free_port()}", "count", {"n": 1}))
    assert time.monotonic() - start < 0.1


async def test_malformed_address_is_a_value_error(client: RpcClient) -> None:
    with pytest.raises(ValueError, match="host:port"):
        await collect(client.call("localhost", "count", None))


async def test_oversized_response_frame_is_a_protocol_error(server: RpcServer) -> None:
    small = RpcClient(max_frame_bytes=64)
    try:
        with pytest.raises(ProtocolError, match="exceeds max_frame_bytes"):
            await collect(small.call(server.address, "echo", "x" * 100))
    finally:
        await small.close()


async def test_closed_client_refuses_calls(server: RpcServer) -> None:
    cl = RpcClient()
    await cl.close()
    with pytest.raises(InstanceUnavailable, match="closed"):
        await collect(cl.call(server.address, "count", {"n": 1}))


async def test_a_handler_that_is_not_an_async_generator_is_reported(client: RpcClient) -> None:
    async def coroutine(payload: Any, ctx: RequestContext) -> int:
        return 1

    srv = RpcServer()
    srv.add_endpoint("coro", coroutine)  # type: ignore[arg-type]
    await srv.start()
    try:
        with pytest.raises(RemoteError, match="must be an async generator function"):
            await collect(client.call(srv.address, "coro", None))
    finally:
        await srv.stop()


async def test_duplicate_endpoint_is_refused() -> None:
    srv = RpcServer()
    srv.add_endpoint("a", _one)
    with pytest.raises(ValueError, match="already registered"):
        srv.add_endpoint("a", _one)
    with pytest.raises(RuntimeError, match="after start"):
        _ = srv.address


async def _one(payload: Any, ctx: RequestContext) -> AsyncIterator[int]:
    yield 1


async def test_items_that_have_arrived_can_be_taken_without_waiting(
        server: RpcServer, client: RpcClient) -> None:
    """take_ready: what piled up while the reader was busy, never blocking; the END
    it comes upon waits for __anext__, and the connection is pooled as after any END."""
    from dynagraph.runtime.rpc import NOT_READY

    stream = client.call(server.address, "count", {"n": 5})
    assert isinstance(stream, RpcStream)
    assert stream.take_ready() is NOT_READY  # nothing sent yet
    assert await anext(stream) == 0
    conn = stream._conn
    taken: list[Any] = []

    def take() -> bool:
        item = stream.take_ready()
        if item is not NOT_READY:
            taken.append(item)
        return len(taken) == 4

    await until(take)  # the rest, as they arrive
    assert taken == [1, 2, 3, 4]
    # the END comes next: kept aside for __anext__
    assert stream._inbox is not None
    inbox = stream._inbox
    await until(lambda: stream.take_ready() is NOT_READY and inbox.ended)
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
    assert conn is not None and not conn.streams and client._open[server.address] is conn


async def test_closing_a_stream_whose_end_was_taken_aside_pools_it(
        server: RpcServer, client: RpcClient) -> None:
    from dynagraph.runtime.rpc import NOT_READY

    stream = client.call(server.address, "count", {"n": 2})
    assert isinstance(stream, RpcStream)
    assert await anext(stream) == 0
    await until(lambda: stream.take_ready() is not NOT_READY)  # 1; then END is kept aside
    inbox = stream._inbox
    assert inbox is not None
    await until(lambda: stream.take_ready() is NOT_READY and inbox.ended)
    conn = stream._conn
    await stream.aclose()  # no CANCEL: the stream had ended
    assert conn is not None and not conn.streams and client._open[server.address] is conn
