"""Cancellation, backpressure, broken streams and server shutdown (one event loop)."""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import msgpack
import pytest

from dynagraph.errors import InstanceUnavailable, StreamBroken
from dynagraph.runtime.rpc import RequestContext, RpcClient, RpcServer
from dynagraph.runtime.rpc._framing import STREAM_WINDOW, FrameEncoder
from tests.support.poll import collect, until


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


@contextlib.asynccontextmanager
async def serving(name: str, handler: Any, heartbeat_s: float | None = None
                  ) -> AsyncIterator[RpcServer]:
    """A started server with ``handler`` as endpoint ``name``, stopped (0.1 s grace) after."""
    srv = RpcServer() if heartbeat_s is None else RpcServer(heartbeat_s=heartbeat_s)
    srv.add_endpoint(name, handler)
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop(grace=0.1)


@pytest.fixture
async def slow_server() -> AsyncIterator[tuple[RpcServer, Slow]]:
    slow = Slow()
    async with serving("slow", slow) as srv:
        yield srv, slow


async def assert_cancelled_promptly(slow: Slow) -> None:
    start = time.monotonic()
    await until(lambda: slow.cancelled_at is not None, within=1.0)
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


async def test_a_cancelled_stream_gives_its_connection_back(
        slow_server: tuple[RpcServer, Slow], client: RpcClient) -> None:
    """CANCEL is answered with END once the handler is gone, so the connection is pooled
    again (closing it cost a TCP connect per Processor request on the Router's hop)."""
    srv, slow = slow_server
    peers = []
    for _ in range(3):
        slow.waiting.clear()
        slow.cancelled_at = None
        stream = client.call(srv.address, "slow", None)
        assert await anext(stream) == "first"
        await asyncio.wait_for(slow.waiting.wait(), 1.0)
        assert slow.ctx is not None
        peers.append(slow.ctx.peer)
        await stream.aclose()
        await assert_cancelled_promptly(slow)
        await until(lambda: not client._open[srv.address].streams, within=1.0)  # END came
    assert len(set(peers)) == 1


async def test_a_handler_that_outlives_the_cancel_drain_is_forgotten(
        client: RpcClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dynagraph.runtime.rpc._connection.CANCEL_DRAIN_S", 0.2)
    release = asyncio.Event()

    async def stubborn(payload: Any, ctx: RequestContext) -> AsyncIterator[str]:
        yield "first"
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await release.wait()

    async with serving("stubborn", stubborn) as srv:
        stream = client.call(srv.address, "stubborn", None)
        assert await anext(stream) == "first"
        conn = client._open[srv.address]
        await stream.aclose()
        assert conn.streams  # waiting for the answer to CANCEL
        await until(lambda: not conn.streams, within=2.0)  # given up on it
        assert client._open[srv.address] is conn and not conn.closed  # others use it on
        release.set()


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
        await until(lambda: slow.cancelled_at is not None, within=1.0)
    finally:
        await impatient.close()


async def test_a_freeze_of_the_whole_host_is_not_taken_for_a_silent_callee() -> None:
    """Caller and callee on one loop: a quiet stream (heartbeats every 0.1 s), then the
    whole host freezes for several idle limits (seen on this VM under an engine's load:
    every process paused 2-7 s). The caller's own stall is not the callee's silence."""
    async def quiet(payload: Any, ctx: RequestContext) -> AsyncIterator[str]:
        yield "first"
        await asyncio.sleep(0.8)
        yield "second"

    impatient = RpcClient(idle_timeout=0.4)
    async with serving("quiet", quiet, heartbeat_s=0.1) as srv:
        try:
            stream = impatient.call(srv.address, "quiet", None)
            assert await anext(stream) == "first"
            asyncio.get_running_loop().call_later(0.15, time.sleep, 1.5)  # everything stops
            assert await anext(stream) == "second"
        finally:
            await impatient.close()


async def test_a_stall_of_the_caller_is_not_taken_for_a_silent_callee() -> None:
    """The server (its own thread and loop) answers in time, but the caller's loop is
    blocked past its idle limit: the bytes waiting on the socket end the wait, no
    StreamBroken (a starved Frontend once broke healthy streams this way)."""
    import threading

    ready = threading.Event()
    box: dict[str, Any] = {}

    async def answers(payload: Any, ctx: RequestContext) -> AsyncIterator[str]:
        yield "first"
        await asyncio.sleep(0.1)
        yield "second"

    def serve() -> None:
        async def main() -> None:
            srv = RpcServer()
            srv.add_endpoint("answers", answers)
            await srv.start()
            box["srv"], box["stop"] = srv, asyncio.Event()
            ready.set()
            await box["stop"].wait()
            await srv.stop(grace=0.1)
        box["loop"] = asyncio.new_event_loop()
        box["loop"].run_until_complete(main())
        box["loop"].close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    impatient = RpcClient(idle_timeout=0.3)
    try:
        stream = impatient.call(box["srv"].address, "answers", None)
        assert await anext(stream) == "first"
        asyncio.get_running_loop().call_later(0.01, time.sleep, 0.6)  # the caller stalls
        assert await anext(stream) == "second"
    finally:
        await impatient.close()
        box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join(10)


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
        # Bounded by the stream's window, not by time.
        assert produced * 100 < STREAM_WINDOW + (64 << 10)
        assert stream._inbox is not None
        assert sum(size for _, size in stream._inbox.frames) <= STREAM_WINDOW
        for _ in range(produced // 2):
            await anext(stream)
        await until(lambda: produced > last)  # reading resumes the producer
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
    await until(lambda: srv.stopping)
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
    """A raw TCP server that answers the first request with ``reply`` (bytes, or a function
    of the request's stream id), then closes; ``stay_open``: waits for the client to."""

    def __init__(self, reply: bytes | Callable[[int], bytes], *, stay_open: bool = False
                 ) -> None:
        self.reply = reply
        self.stay_open = stay_open
        self.server: asyncio.Server | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        (size,) = struct.unpack(">I", await reader.readexactly(4))
        request = msgpack.unpackb(await reader.readexactly(size))
        writer.write(self.reply(request[1]) if callable(self.reply) else self.reply)
        await writer.drain()
        if self.stay_open:
            await reader.read()
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
    return (enc.item(1, i) for i in items)  # 1: the first stream of a connection


async def test_connection_lost_mid_stream_is_stream_broken(client: RpcClient) -> None:
    async with FakeServer(b"".join(frames("a", "b"))) as address:
        got: list[Any] = []
        with pytest.raises(StreamBroken):
            async for item in client.call(address, "x", None):
                got.append(item)
        assert got == ["a", "b"]


async def test_connection_lost_before_the_request_was_taken_is_unavailable(
        client: RpcClient) -> None:
    """No frame at all: the server never started a handler, so the caller may go elsewhere."""
    async with FakeServer(b"") as address:
        with pytest.raises(InstanceUnavailable, match="before taking 'x'"):
            await collect(client.call(address, "x", None))


async def test_connection_lost_after_the_request_was_taken_is_stream_broken(
        client: RpcClient) -> None:
    async with FakeServer(FrameEncoder().alive(1)) as address:
        with pytest.raises(StreamBroken):
            await collect(client.call(address, "x", None))


async def test_heartbeats_keep_a_quiet_stream_alive() -> None:
    async def quiet(payload: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        await asyncio.sleep(0.3)  # thinking, far longer than the caller's idle limit
        yield "late"

    patient = RpcClient(idle_timeout=0.1)
    async with serving("quiet", quiet, heartbeat_s=0.02) as srv:
        try:
            assert await collect(patient.call(srv.address, "quiet", None)) == ["late"]
        finally:
            await patient.close()


async def test_stop_cancels_subscriptions_at_once_and_drains_requests() -> None:
    sub, req = Slow(), Slow()
    srv = RpcServer()
    srv.add_endpoint("events", sub, drain=False)
    srv.add_endpoint("generate", req)
    await srv.start()
    cl = RpcClient()
    try:
        events = cl.call(srv.address, "events", None)
        generate = cl.call(srv.address, "generate", None)
        assert await anext(events) == "first" and await anext(generate) == "first"
        stopping = asyncio.create_task(srv.stop(grace=0.5))
        await until(lambda: sub.cancelled_at is not None, within=0.2)  # not after the grace
        assert req.cancelled_at is None  # a request in flight gets its grace
        await stopping
        assert req.cancelled_at is not None
    finally:
        await cl.close()
