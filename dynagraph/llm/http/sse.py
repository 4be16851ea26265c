"""Server-sent events: per-chunk encoders and a disconnect-aware streaming response.

Chunks are assembled from byte templates fixed per request, with only the text delta
(and the finish reason) JSON-encoded per chunk; the result is exactly the JSON of
:class:`~dynagraph.llm.protocol.ChatCompletionChunk` / ``CompletionChunk`` (tests hold
the two in step).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TypeVar

import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from dynagraph.llm.protocol import ErrorResponse, Usage

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode
T = TypeVar("T")


def sse_event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


def sse_error(error: ErrorResponse) -> bytes:
    return sse_event(_encode(error))


def _finish(reason: str | None) -> bytes:
    return b"null" if reason is None else _encode(reason)


class ChatStreamEncoder:
    """Encodes ``chat.completion.chunk`` events for one response."""

    def __init__(self, response_id: str, model: str, created: int, *, include_usage: bool) -> None:
        self._head = (
            b'data: {"id":'
            + _encode(response_id)
            + b',"object":"chat.completion.chunk","created":'
            + str(created).encode()
            + b',"model":'
            + _encode(model)
            + b',"choices":['
        )
        self._tail = b',"usage":null}\n\n' if include_usage else b"}\n\n"
        self._role_sent = False

    def chunk(self, text: str, finish_reason: str | None) -> bytes:
        """The event for one text delta; the first one also carries the assistant role."""
        if not self._role_sent:
            self._role_sent = True
            delta = b'{"role":"assistant","content":' + _encode(text) + b"}"
        elif text or finish_reason is None:
            delta = b'{"content":' + _encode(text) + b"}"
        else:
            delta = b"{}"
        return (
            self._head
            + b'{"index":0,"delta":'
            + delta
            + b',"finish_reason":'
            + _finish(finish_reason)
            + b',"logprobs":null}]'
            + self._tail
        )

    def usage(self, usage: Usage) -> bytes:
        """The final event of a stream with ``stream_options.include_usage``."""
        return self._head + b'],"usage":' + _encode(usage) + b"}\n\n"


class CompletionStreamEncoder:
    """Encodes streamed ``text_completion`` events for one response."""

    def __init__(self, response_id: str, model: str, created: int, *, include_usage: bool) -> None:
        self._head = (
            b'data: {"id":'
            + _encode(response_id)
            + b',"object":"text_completion","created":'
            + str(created).encode()
            + b',"model":'
            + _encode(model)
            + b',"choices":['
        )
        self._tail = b',"usage":null}\n\n' if include_usage else b"}\n\n"

    def chunk(self, text: str, finish_reason: str | None) -> bytes:
        return (
            self._head
            + b'{"index":0,"text":'
            + _encode(text)
            + b',"finish_reason":'
            + _finish(finish_reason)
            + b',"logprobs":null}]'
            + self._tail
        )

    def usage(self, usage: Usage) -> bytes:
        return self._head + b'],"usage":' + _encode(usage) + b"}\n\n"


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was complete."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the ASGI server reports ``http.disconnect``."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(receive: Receive, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` unless the client disconnects first; then cancel it, wait for
    it to unwind and raise :class:`ClientDisconnected`. Use after the body was read."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            await asyncio.wait((work,))
    if work.cancelled():
        raise ClientDisconnected
    return work.result()


class SSEResponse(Response):
    """Streams ``body`` as ``text/event-stream``, cancelling it if the client disconnects.

    Unlike Starlette's StreamingResponse it always closes the body iterator, then awaits
    ``on_close(disconnected)`` exactly once, even if the body never started (so the
    caller can close the backend request and settle its bookkeeping in one place).
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        body: AsyncIterator[bytes],
        *,
        headers: Mapping[str, str] | None = None,
        on_close: Callable[[bool], Awaitable[None]] | None = None,
    ) -> None:
        self.body_iterator = body
        self.status_code = 200
        self.background = None
        self._on_close = on_close
        self.init_headers({"cache-control": "no-cache", **(headers or {})})

    async def _pump(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        disconnected = False
        error: BaseException | None = None
        try:
            await asyncio.wait((pump, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not pump.done():
                disconnected = True
                pump.cancel()
                await asyncio.wait((pump,))
            error = None if pump.cancelled() else pump.exception()
            if isinstance(error, OSError):  # ASGI 2.4 servers raise on send() after a disconnect
                disconnected, error = True, None
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            if self._on_close is not None:
                await self._on_close(disconnected)
        if error is not None:
            raise error
