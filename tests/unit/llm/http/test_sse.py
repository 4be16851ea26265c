from __future__ import annotations

import asyncio

import msgspec
import pytest

from dynagraph.llm.http.sse import (
    ChatStreamEncoder,
    ClientDisconnected,
    CompletionStreamEncoder,
    DisconnectWatch,
)
from dynagraph.llm.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionChunk,
    Usage,
)

TEXTS = ["plain", 'quo"te\\', "é日本🙂", "\n\t\u2028", ""]


def decode_event(event: bytes) -> object:
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    return msgspec.json.decode(event[6:-2])


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_encoder_matches_the_chunk_model(include_usage: bool) -> None:
    enc = ChatStreamEncoder('id-"1', "mödel", 123, include_usage=include_usage)
    for index, text in enumerate(TEXTS):
        finish = "stop" if index == len(TEXTS) - 1 else None
        delta = ChatDelta(role="assistant" if index == 0 else None, content=text or None)
        if index == 0 or text or finish is None:
            delta.content = text
        expected = ChatCompletionChunk(
            id='id-"1', created=123, model="mödel",
            choices=[ChatChunkChoice(index=0, delta=delta, finish_reason=finish)],
        )  # fmt: skip
        want = msgspec.to_builtins(expected)
        if not include_usage:
            del want["usage"]
        assert decode_event(enc.chunk(text, finish)) == want
    usage = Usage.of(3, 4, 1)
    expected_usage = ChatCompletionChunk(
        id='id-"1', created=123, model="mödel", choices=[], usage=usage
    )
    assert decode_event(enc.usage(usage)) == msgspec.to_builtins(expected_usage)


@pytest.mark.parametrize("include_usage", [False, True])
def test_completion_encoder_matches_the_chunk_model(include_usage: bool) -> None:
    enc = CompletionStreamEncoder("cmpl-1", "m", 5, include_usage=include_usage)
    for text in TEXTS:
        expected = CompletionChunk(
            id="cmpl-1", created=5, model="m",
            choices=[CompletionChoice(index=0, text=text, finish_reason="length")],
        )  # fmt: skip
        want = msgspec.to_builtins(expected)
        if not include_usage:
            del want["usage"]
        assert decode_event(enc.chunk(text, "length")) == want
    assert decode_event(enc.usage(Usage.of(1, 2, None)))["usage"]["total_tokens"] == 3  # type: ignore[index]


class Receiver:
    """An ASGI receive() whose disconnect is triggered by the test."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def __call__(self) -> dict[str, str]:
        await self.gone.wait()
        return {"type": "http.disconnect"}


async def test_disconnect_watch_without_disconnect() -> None:
    receive = Receiver()
    async with DisconnectWatch(receive) as watch:
        await asyncio.sleep(0)
    assert not watch.disconnected


async def test_disconnect_watch_cancels_the_body() -> None:
    receive = Receiver()
    reached_end = False
    with pytest.raises(ClientDisconnected):
        async with DisconnectWatch(receive):
            receive.gone.set()
            await asyncio.sleep(5)
            reached_end = True
    assert not reached_end
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    await asyncio.sleep(0)  # no stray cancellation left behind


async def test_disconnect_watch_lets_outside_cancellation_through() -> None:
    receive = Receiver()
    entered = asyncio.Event()

    async def body() -> None:
        async with DisconnectWatch(receive):
            entered.set()
            await asyncio.sleep(5)

    task = asyncio.ensure_future(body())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
