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

import msgspec

from dynagraph.llm.http.asgi import Receive, Response, Scope, Send
from dynagraph.llm.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    ErrorResponse,
    TextChunk,
    Usage,
)

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


def sse_event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


def sse_error(error: ErrorResponse) -> bytes:
    return sse_event(_encode(error))


def _finish(reason: str | None) -> bytes:
    return b"null" if reason is None else _encode(reason)


class _StreamEncoder:
    """Shared framing of one response's SSE events: ``data: {id, object, ..., choices}``."""

    OBJECT = ""

    def __init__(self, response_id: str, model: str, created: int, *, include_usage: bool) -> None:
        self._head = (
            b'data: {"id":'
            + _encode(response_id)
            + b',"object":"' + self.OBJECT.encode() + b'","created":'
            + str(created).encode()
            + b',"model":'
            + _encode(model)
            + b',"choices":['
        )
        self._tail = b',"usage":null}\n\n' if include_usage else b"}\n\n"

    def _choice(self, body: bytes, finish_reason: str | None) -> bytes:
        return (
            self._head
            + b'{"index":0,'
            + body
            + b',"finish_reason":'
            + _finish(finish_reason)
            + b',"logprobs":null}]'
            + self._tail
        )

    def usage(self, usage: Usage) -> bytes:
        """The final event of a stream with ``stream_options.include_usage``."""
        return self._head + b'],"usage":' + _encode(usage) + b"}\n\n"


class ChatStreamEncoder(_StreamEncoder):
    """Encodes ``chat.completion.chunk`` events for one response."""

    OBJECT = "chat.completion.chunk"

    def __init__(self, response_id: str, model: str, created: int, *, include_usage: bool) -> None:
        super().__init__(response_id, model, created, include_usage=include_usage)
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
        return self._choice(b'"delta":' + delta, finish_reason)


class CompletionStreamEncoder(_StreamEncoder):
    """Encodes streamed ``text_completion`` events for one response."""

    OBJECT = "text_completion"

    def chunk(self, text: str, finish_reason: str | None) -> bytes:
        return self._choice(b'"text":' + _encode(text), finish_reason)


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was complete."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the ASGI server reports ``http.disconnect``."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class DisconnectWatch:
    """``async with DisconnectWatch(receive):`` cancels the body if the client disconnects.

    The body runs in the current task (so a backend iterator is always driven by the one
    task that handles the request: context variables, timeouts and task groups inside it
    stay valid); a watcher task cancels this task on ``http.disconnect``, and the
    cancellation surfaces from the ``async with`` as :class:`ClientDisconnected`.
    Enter only after the request body was read.
    """

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self.disconnected = False
        self._task: asyncio.Task[object] | None = None
        self._watcher: asyncio.Task[None] | None = None

    async def __aenter__(self) -> DisconnectWatch:
        self._task = asyncio.current_task()
        self._watcher = asyncio.ensure_future(self._watch())
        return self

    async def _watch(self) -> None:
        await wait_for_disconnect(self._receive)
        # The body is suspended at an await right now, so the cancellation lands inside it.
        self.disconnected = True
        assert self._task is not None
        self._task.cancel()

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        assert self._watcher is not None and self._task is not None
        self._watcher.cancel()
        if not self.disconnected:
            return
        remaining = self._task.uncancel()  # retract our cancellation request
        if remaining == 0 and (exc_type is None or exc_type is asyncio.CancelledError):
            raise ClientDisconnected


class SSEResponse(Response):
    """Streams ``body`` as ``text/event-stream``, cancelling it if the client disconnects.

    It iterates ``body`` in the request's own task,
    always closes it, then awaits ``on_close(disconnected)`` exactly once, even if the
    body never started (so the caller settles the request in one place).
    """

    def __init__(
        self,
        body: AsyncIterator[bytes],
        *,
        headers: Mapping[str, str] | None = None,
        on_close: Callable[[bool], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(b"", 200, headers={"cache-control": "no-cache", **(headers or {})},
                         media_type="text/event-stream")
        self.body_iterator = body
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnected = False
        try:
            async with DisconnectWatch(receive):
                await send({"type": "http.response.start", "status": self.status,
                            "headers": self.raw_headers()})
                async for chunk in self.body_iterator:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except ClientDisconnected:
            disconnected = True
        except OSError:  # ASGI 2.4 servers raise on send() after a disconnect
            disconnected = True
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            if self._on_close is not None:
                await self._on_close(disconnected)


class ChoiceStreamEncoder:
    """Encodes chunks of requests beyond the fast path: several choices (``index``),
    ``logprobs``, ``tool_calls``, continuous usage. Built from the response Structs per
    chunk (only requests that asked for these features pay for it)."""

    def __init__(self, endpoint: str, response_id: str, model: str, created: int, *,
                 include_usage: bool, continuous_usage: bool) -> None:
        self._chat = endpoint == "chat"
        self._id = response_id
        self._model = model
        self._created = created
        self._include_usage = include_usage
        self._continuous = continuous_usage
        self._role_sent: set[int] = set()

    def chunk(self, c: TextChunk) -> bytes:
        usage = Usage.of(c.prompt_tokens, c.completion_tokens, None) if self._continuous else None
        body: ChatCompletionChunk | CompletionResponse
        if self._chat:
            delta = ChatDelta(tool_calls=c.tool_calls)
            if c.index not in self._role_sent:
                self._role_sent.add(c.index)
                delta.role = "assistant"
            if c.text or (c.tool_calls is None and c.finish_reason is None):
                delta.content = c.text
            body = ChatCompletionChunk(
                id=self._id, created=self._created, model=self._model, usage=usage,
                choices=[ChatChunkChoice(index=c.index, delta=delta,
                                         finish_reason=c.finish_reason, logprobs=c.logprobs)])
        else:
            body = CompletionResponse(
                id=self._id, created=self._created, model=self._model, usage=usage,
                choices=[CompletionChoice(index=c.index, text=c.text,
                                          finish_reason=c.finish_reason, logprobs=c.logprobs)])
        data = msgspec.to_builtins(body)
        if usage is None and not self._include_usage:
            del data["usage"]
        return sse_event(_encode(data))

    def usage(self, usage: Usage) -> bytes:
        """The final event of a stream with ``stream_options.include_usage``."""
        obj = "chat.completion.chunk" if self._chat else "text_completion"
        return sse_event(_encode({"id": self._id, "object": obj, "created": self._created,
                                  "model": self._model, "choices": [], "usage": usage}))
