"""Cancellation, backpressure, broken streams and server shutdown (one event loop)."""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from dynagraph.errors import InstanceUnavailable, StreamBroken
from dynagraph.runtime.rpc import RequestContext, RpcClient, RpcServer
from dynagraph.runtime.rpc._client import READ_HIGH_WATER
from dynagraph.runtime.rpc._framing import FrameEncoder

from ._support import collect, wait_until


class Slow:
    """A handler that yields once, then waits 'forever' and records how it ended."""

    def __init__(self) -> None:
        self.waiting = asyncio.Event()
        self.cancelled_at: float | None = None
        self.ctx: RequestContext | None = None

    async def __call__(self, payload: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        self.ctx = ctx
        try:
            yield "first"
            self.waiting.set()
            await asyncio.sleep(30)
            yield "never"
        except asyncio.CancelledError:
            self.cancelled_at = time.monotonic()
            raise


@pytest.fixture
async def slow_server() -> AsyncIterator[tuple[RpcServer, Slow]]:
    slow = Slow()
    srv = RpcServer()
    srv.add_endpoint("slow", slow)
    await srv.start()
    yield srv, slow
    await srv.stop(grace=0.1)


async def assert_cancelled_promptly(slow: Slow) -> None:
    start = time.monotonic()
    await wait_until(lambda: slow.cancelled_at is not None, within=1.0)
    assert slow.cancelled_at is not None and slow.cancelled_at - start < 0.1
    assert slow.ctx is not None and slow.ctx.cancelled


async def test_break_cancels_the_remote_handler(
        slow_server: tuple[RpcServer, Slow], client: RpcClient) -> None:
    srv, slow = slow_server
    async for item in client.call(srv.address, "slow", None):
        assert item == "first"
        await asyncio.wait_for(slow.waiting.wait(), 1.0)
        break
    await assert_cancelled_promptly(slow)


async def test_aclose_cancels_the_remote_handler(
        slow_server: tuple[RpcServer, Slow], client: RpcClient) -> None:
    srv, slow = slow_server
    stream = client.call(srv.address, "slow", None)
    assert await anext(stream) == "first"
    await asyncio.wait_for(slow.waiting.wait(), 1.0)
    await stream.aclose()
    await assert_cancelled_promptly(slow)
    with pytest.raises(StopAsyncIteration):
        await anext(stream)


async def test_cancelling_the_callers_task_cancels_the_remote_handler(
        slow_server: tuple[RpcServer, Slow], client: RpcClient) -> None:
    srv, slow = slow_server
    task = asyncio.create_task(collect(client.call(srv.address, "slow", None)))
    await asyncio.wait_for(slow.waiting.wait(), 1.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await assert_cancelled_promptly(slow)


async def test_idle_timeout_breaks_and_cancels_a_silent_stream(
        slow_server: tuple[RpcServer, Slow]) -> None:
    srv, slow = slow_server
    impatient = RpcClient(idle_timeout=0.05)
    try:
        stream = impatient.call(srv.address, "slow", None)
        assert await anext(stream) == "first"
        with pytest.raises(StreamBroken, match="sent nothing for 0.05s"):
            await anext(stream)
        await wait_until(lambda: slow.cancelled_at is not None, within=1.0)
    finally:
        await impatient.close()


async def test_a_cancelled_connection_is_not_reused(
        slow_server: tuple[RpcServer, Slow], client: RpcClient, server: RpcServer) -> None:
    srv, slow = slow_server
    async with client.call(srv.address, "slow", None) as stream:
        assert await anext(stream) == "first"
    await assert_cancelled_promptly(slow)
    assert await collect(client.call(server.address, "count", {"n": 3})) == [0, 1, 2]


async def test_slow_consumer_holds_a_fast_producer(client: RpcClient) -> None:
    produced = 0

    async def firehose(payload: Any, ctx: RequestContext) -> AsyncIterator[bytes]:
        nonlocal produced
        while True:
            produced += 1
            yield b"x" * 100

    srv = RpcServer()
    srv.add_endpoint("firehose", firehose)
    await srv.start()
    try:
        stream = client.call(srv.address, "firehose", None)
        await anext(stream)
        last = -1
        async with asyncio.timeout(5):  # the producer must come to a stop
            while produced != last:
                last = produced
                await asyncio.sleep(0.1)
        # Bounded by socket buffers + the two 256 KiB user-space buffers, not by time.
        assert produced * 100 < 32 << 20
        conn = stream._conn
        assert conn is not None and conn._decoder.buffered <= READ_HIGH_WATER + (256 << 10)
        for _ in range(produced // 2):
            await anext(stream)
        await wait_until(lambda: produced > last)  # reading resumes the producer
        await stream.aclose()
    finally:
        await srv.stop(grace=0.1)


async def test_server_stop_lets_streams_finish_within_grace(client: RpcClient) -> None:
    release = asyncio.Event()

    async def finishing(payload: Any, ctx: RequestContext) -> AsyncIterator[int]:
        yield 1
        await release.wait()
        yield 2

    srv = RpcServer()
    srv.add_endpoint("finishing", finishing)
    await srv.start()
    stream = client.call(srv.address, "finishing", None)
    assert await anext(stream) == 1
    stopping = asyncio.create_task(srv.stop(grace=2.0))
    await wait_until(lambda: srv.stopping)
    with pytest.raises(InstanceUnavailable):  # no new connections while stopping
        await collect(client.call(srv.address, "finishing", None))
    release.set()
    assert await collect(stream) == [2]
    await asyncio.wait_for(stopping, 2.0)


async def test_server_stop_cancels_streams_after_grace(
        slow_server: tuple[RpcServer, Slow], client: RpcClient) -> None:
    srv, slow = slow_server
    stream = client.call(srv.address, "slow", None)
    assert await anext(stream) == "first"
    await asyncio.wait_for(slow.waiting.wait(), 1.0)
    start = time.monotonic()
    await srv.stop(grace=0.2)
    assert 0.2 <= time.monotonic() - start < 1.0
    assert slow.cancelled_at is not None
    with pytest.raises(StreamBroken, match="lost during 'slow'"):
        await anext(stream)


async def test_pooled_connection_to_a_restarted_server_is_not_used(client: RpcClient) -> None:
    srv = RpcServer()
    srv.add_endpoint("count", _count)
    await srv.start()
    assert await collect(client.call(srv.address, "count", 2)) == [0, 1]
    await srv.stop()
    # The pooled connection is dead; whether or not the client has noticed yet, the
    # request must reach the new server (a reset before any reply proves non-delivery).
    port = int(srv.address.rsplit(":", 1)[1])
    again = RpcServer(port=port)
    again.add_endpoint("count", _count)
    await again.start()
    try:
        assert await collect(client.call(srv.address, "count", 3)) == [0, 1, 2]
    finally:
        await again.stop()
    with pytest.raises(InstanceUnavailable):
        await collect(client.call(srv.address, "count", 2))


async def _count(payload: Any, ctx: RequestContext) -> AsyncIterator[int]:
    for i in range(payload):
        yield i


class FakeServer:
    """A raw TCP server that answers any request with ``reply`` bytes, then closes."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.server: asyncio.Server | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        (size,) = struct.unpack(">I", await reader.readexactly(4))
        await reader.readexactly(size)
        writer.write(self.reply)
        await writer.drain()
        writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


def frames(*items: Any) -> Iterator[bytes]:
    enc = FrameEncoder()
    return (enc.item(i) for i in items)


async def test_connection_lost_mid_stream_is_stream_broken(client: RpcClient) -> None:
    async with FakeServer(b"".join(frames("a", "b"))) as address:
        got: list[Any] = []
        with pytest.raises(StreamBroken):
            async for item in client.call(address, "x", None):
                got.append(item)
        assert got == ["a", "b"]


async def test_connection_lost_before_any_response_is_stream_broken(client: RpcClient) -> None:
    async with FakeServer(b"") as address:
        with pytest.raises(StreamBroken):
            await collect(client.call(address, "x", None))
