"""Handing back a request before its first output."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from dynagraph.errors import Requeued
from dynagraph.llm.waiting import WaitingRequests


class Source:
    """An engine's output stream: items put by the test; records whether it was closed."""

    def __init__(self) -> None:
        self.items: asyncio.Queue[int | None] = asyncio.Queue()
        self.closed = False

    async def stream(self) -> AsyncIterator[int]:
        try:
            while (item := await self.items.get()) is not None:
                yield item
        finally:
            self.closed = True


async def test_the_first_output_passes_and_the_request_is_no_longer_releasable() -> None:
    waiting, src = WaitingRequests(), Source()
    outs = src.stream()
    first = asyncio.ensure_future(waiting.first("r1", outs))
    await asyncio.sleep(0)
    assert len(waiting) == 1
    src.items.put_nowait(7)
    assert await first == 7
    assert len(waiting) == 0 and waiting.release(1) == []
    src.items.put_nowait(None)
    assert [x async for x in outs] == []


async def test_the_newest_are_released_and_their_streams_aborted() -> None:
    waiting = WaitingRequests()
    sources = [Source() for _ in range(3)]
    firsts = [asyncio.ensure_future(waiting.first(f"r{i}", s.stream()))
              for i, s in enumerate(sources)]
    await asyncio.sleep(0)
    assert waiting.release(2) == ["r1", "r2"]
    for f in firsts[1:]:
        with pytest.raises(Requeued):
            await f
    assert [s.closed for s in sources] == [False, True, True]
    sources[0].items.put_nowait(None)
    with pytest.raises(StopAsyncIteration):  # an empty stream
        await firsts[0]
    assert len(waiting) == 0


async def test_a_caller_gone_while_waiting_cancels_the_stream() -> None:
    waiting, src = WaitingRequests(), Source()
    first = asyncio.ensure_future(waiting.first("r1", src.stream()))
    await asyncio.sleep(0)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.sleep(0)
    assert src.closed and len(waiting) == 0
