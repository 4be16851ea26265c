"""Many streams over one connection: sharing, one write per loop turn, per-stream flow
control and cancellation, and what ends the whole connection (one event loop)."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest

from dynagraph.errors import InstanceUnavailable, StreamBroken
from dynagraph.runtime.rpc import ProtocolError, RequestContext, RpcClient, RpcServer, RpcStream
from dynagraph.runtime.rpc._framing import (
    ALIVE,
    END,
    ITEM,
    STREAM_WINDOW,
    FrameDecoder,
    FrameEncoder,
)
from tests.support.poll import collect, until

from .test_lifecycle import FakeServer, Slow, serving


async def test_concurrent_streams_share_one_connection(
        server: RpcServer, client: RpcClient) -> None:
    """The first calls to an address arrive together: one connect, shared by all."""
    echoed = await asyncio.gather(*(collect(client.call(server.address, "echo", i))
                                    for i in range(20)))
    assert {e[0]["peer"] for e in echoed} == {echoed[0][0]["peer"]}
    assert [e[0]["payload"] for e in echoed] == list(range(20))
    counts = await asyncio.gather(*(collect(client.call(server.address, "count", {"n": n}))
                                    for n in range(50)))
    assert counts == [list(range(n)) for n in range(50)]
    assert len(client._connections) == 1 and len(server._connections) == 1


async def test_the_items_of_one_loop_turn_go_in_one_write(client: RpcClient) -> None:
    """A worker's engine step feeds every stream at once: one socket write for all."""
    step = asyncio.Event()
    started = 0

    async def tokens(payload: Any, ctx: RequestContext) -> AsyncIterator[int]:
        nonlocal started
        started += 1
        for i in range(3):
            await step.wait()
            yield i

    async with serving("tokens", tokens) as srv:
        streams = [client.call(srv.address, "tokens", None) for _ in range(16)]
        readers = [asyncio.create_task(collect(s)) for s in streams]
        await until(lambda: started == 16)
        [conn] = srv._connections
        assert conn._transport is not None
        writes: list[int] = []
        write = conn._transport.write

        def counting(data: Any) -> None:
            writes.append(len(data))
            write(data)

        conn._transport.write = counting  # type: ignore[method-assign]
        step.set()
        assert await asyncio.gather(*readers) == [[0, 1, 2]] * 16
    # three steps' items (16 each, back to back in this test) and 16 ENDs: a few writes,
    # never one per stream
    assert 1 <= len(writes) <= 6, writes


async def test_a_slow_reader_holds_only_its_own_stream(client: RpcClient) -> None:
    produced: dict[str, int] = {}

    async def firehose(payload: Any, ctx: RequestContext) -> AsyncIterator[bytes]:
        produced[ctx.request_id] = 0
        while True:
            produced[ctx.request_id] += 1
            yield b"x" * 1000  # a 1,010-byte frame

    srv = RpcServer()
    srv.add_endpoint("firehose", firehose)
    await srv.start()
    try:
        unread = client.call(srv.address, "firehose", None, headers={"x-request-id": "unread"})
        await anext(unread)
        await until(lambda: produced["unread"] * 1010 >= STREAM_WINDOW)
        held_at = produced["unread"]
        other = client.call(srv.address, "firehose", None)  # same connection
        for _ in range(5 * STREAM_WINDOW // 1000):  # reads far past the window
            assert await anext(other) == b"x" * 1000
        assert len(client._connections) == 1
        assert produced["unread"] == held_at < STREAM_WINDOW // 1010 + 2
        assert isinstance(unread, RpcStream) and unread._inbox is not None
        assert sum(size for _, size in unread._inbox.frames) <= STREAM_WINDOW
        await other.aclose()
        await unread.aclose()
    finally:
        await srv.stop(grace=0.1)


async def test_cancelling_one_stream_leaves_the_others_running(client: RpcClient) -> None:
    first, second = Slow(), Slow()
    srv = RpcServer()
    srv.add_endpoint("first", first)
    srv.add_endpoint("second", second)
    await srv.start()
    try:
        a = client.call(srv.address, "first", None)
        b = client.call(srv.address, "second", None)
        assert await anext(a) == "first" and await anext(b) == "first"
        await a.aclose()
        await until(lambda: first.cancelled_at is not None, within=1.0)
        assert second.cancelled_at is None
        assert first.ctx is not None and second.ctx is not None
        assert first.ctx.peer == second.ctx.peer  # they shared the connection
        stopping = asyncio.create_task(srv.stop(grace=0.1))
        with pytest.raises(StreamBroken):  # the stop's grace ran out, not the cancel of a
            await anext(b)
        await stopping
    finally:
        await srv.stop(grace=0.1)


async def test_a_stopping_server_retires_the_connection(client: RpcClient) -> None:
    """New calls are refused on the open connection, which closes after its last stream
    (drained within the grace)."""
    release = asyncio.Event()

    async def finishing(payload: Any, ctx: RequestContext) -> AsyncIterator[int]:
        yield 1
        await release.wait()
        yield 2

    async with serving("finishing", finishing) as srv:
        stream = client.call(srv.address, "finishing", None)
        assert await anext(stream) == 1
        [conn] = client._connections
        stopping = asyncio.create_task(srv.stop(grace=2.0))
        await until(lambda: srv.stopping)
        with pytest.raises(InstanceUnavailable, match="stopping"):
            await collect(client.call(srv.address, "finishing", None))
        assert conn.retired and srv.address not in client._open
        release.set()
        assert await collect(stream) == [2]
        await until(lambda: conn.closed)
        await stopping


async def test_idle_timeout_retires_the_connection() -> None:
    slow = Slow()
    impatient = RpcClient(idle_timeout=0.05)
    async with serving("slow", slow) as srv:
        try:
            stream = impatient.call(srv.address, "slow", None)
            assert await anext(stream) == "first"
            [conn] = impatient._connections
            with pytest.raises(StreamBroken, match="idle_timeout"):
                await anext(stream)
            await until(lambda: conn.closed)  # retired, and its only stream is gone
            await until(lambda: slow.cancelled_at is not None)
        finally:
            await impatient.close()


def raw_frame(body: Any) -> bytes:
    data: bytes = msgpack.packb(body)
    return struct.pack(">I", len(data)) + data


@pytest.mark.parametrize("garbage", [[ITEM], [ITEM, [1], "x"], "not an array"])
async def test_a_frame_without_a_stream_id_ends_the_connection(
        client: RpcClient, garbage: Any) -> None:
    async with FakeServer(lambda sid: raw_frame([ALIVE, sid]) + raw_frame(garbage),
                          stay_open=True) as address:
        with pytest.raises(ProtocolError):
            await collect(client.call(address, "x", None))
        assert not client._connections


async def test_an_unexpected_frame_kind_ends_the_connection(client: RpcClient) -> None:
    async with FakeServer(lambda sid: raw_frame([ALIVE, sid]) + raw_frame([9, sid]),
                          stay_open=True) as address:
        with pytest.raises(ProtocolError, match="unexpected frame kind 9"):
            await collect(client.call(address, "x", None))


async def test_frames_of_streams_it_does_not_know_are_dropped(client: RpcClient) -> None:
    enc = FrameEncoder()
    async with FakeServer(lambda sid: enc.item(sid + 1, "stray") + enc.item(sid, "mine")
                          + enc.end(sid), stay_open=True) as address:
        assert await collect(client.call(address, "x", None)) == ["mine"]


async def test_server_refuses_a_request_for_an_open_stream_id(server: RpcServer) -> None:
    """And ignores CANCEL and CREDIT for streams it does not have (they crossed an END)."""
    enc = FrameEncoder()
    host, port = server.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(enc.cancel(5) + enc.credit(5, 100)
                     + enc.request(1, enc.request_tail("count", {}, {"n": 10**9})))
        dec = FrameDecoder(1 << 20)
        while (frame := dec.next()) is None:
            dec.feed(await reader.read(65536))
        assert frame == [ALIVE, 1]
        writer.write(enc.request(1, enc.request_tail("count", {}, {"n": 1})))
        async with asyncio.timeout(5):  # dropped: the reads end
            while await reader.read(65536):
                pass
    finally:
        writer.close()


async def test_a_reused_stream_id_after_its_end_is_fine(server: RpcServer) -> None:
    enc = FrameEncoder()
    host, port = server.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    dec = FrameDecoder(1 << 20)
    try:
        for _ in range(2):
            writer.write(enc.request(1, enc.request_tail("count", {}, {"n": 1})))
            frames: list[list[Any]] = []
            while not frames or frames[-1][0] != END:
                dec.feed(await reader.read(65536))
                while (frame := dec.next()) is not None:
                    frames.append(frame)
            assert frames == [[ALIVE, 1], [ITEM, 1, 0], [END, 1]]
    finally:
        writer.close()
