"""One accepted request-plane connection: the asyncio protocol that runs any number of
streams from one caller process, each handler in its own task.

Owned by ``RpcServer`` (which makes one per accepted socket, tracks it while it is open
and, on ``stop()``, calls ``stopping``, ``cancel_streams`` and ``close``; its heartbeat
task calls ``heartbeat``). Callers of this module may rely on:

- a stream's ALIVE frame is on the wire before its handler runs, so a caller whose
  connection dies before any frame of the stream arrived knows it was never handled;
- a stream's id is forgotten before its terminal frame (END or ERROR) is written, so the
  caller may reuse it at once; a handler's exception reaches the caller typed;
- a wire-format violation (``ProtocolError``) cancels every stream and closes the
  connection.

Output: the frames of all the streams of a connection are buffered together and handed
to the transport once, at the end of the current event-loop iteration (or every
``FLUSH_BYTES``): one socket write per engine step for all the streams a worker feeds,
where a connection per stream took one write (and one wake-up of the reader) each.

Backpressure, two levels. A stream whose caller has not credited ``STREAM_WINDOW``
bytes of its items waits before asking its handler for the next item (a slow reader
holds only its own stream). When the transport's buffer passes its high-water mark
(the whole caller process is slow), every stream of the connection waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any, cast

from dynagraph.errors import InstanceUnavailable

from ._context import Handler, RequestContext
from ._framing import (
    CANCEL,
    CREDIT,
    REQUEST,
    STREAM_WINDOW,
    FrameDecoder,
    FrameEncoder,
    ProtocolError,
)

if TYPE_CHECKING:
    from ._server import RpcServer

log = logging.getLogger(__name__)

FLUSH_BYTES = 64 * 1024
"""Buffered response bytes that force a write before the loop iteration ends."""
WRITE_HIGH_WATER = 256 * 1024
"""Transport buffer size above which the handlers are paused (TCP window full)."""


class _Stream:
    """One stream of a connection: its handler's task and flow-control state."""

    __slots__ = ("sid", "ctx", "task", "unacked", "credit", "answer_cancel", "quiet")

    def __init__(self, sid: int, ctx: RequestContext) -> None:
        self.sid = sid
        self.ctx = ctx
        self.task: asyncio.Task[None] | None = None
        self.unacked = 0  # ITEM bytes sent and not credited
        self.credit: asyncio.Future[None] | None = None  # set when credit comes back
        self.answer_cancel = False  # the caller's CANCEL: end the stream with END
        self.quiet = True  # nothing sent since the last heartbeat tick

    def cancel(self, *, answer: bool) -> None:
        """Cancel the handler (the caller's CANCEL if ``answer``: END follows once it is
        gone). Only once: a second cancel would interrupt the handler's own clean-up."""
        if self.task is not None and not self.ctx.cancelled:
            self.ctx.cancelled = True
            self.answer_cancel = answer
            self.task.cancel()

    def add_credit(self, nbytes: int) -> None:
        self.unacked -= nbytes
        if self.credit is not None and self.unacked < STREAM_WINDOW:
            if not self.credit.done():
                self.credit.set_result(None)
            self.credit = None


class _ServerConnection(asyncio.Protocol):
    """One accepted connection: decodes requests, runs their streams side by side."""

    def __init__(self, server: RpcServer, max_frame_bytes: int) -> None:
        self._server = server
        self._decoder = FrameDecoder(max_frame_bytes)
        self._encoder = FrameEncoder()
        self._transport: asyncio.Transport | None = None
        self._peer = ""
        self._out = bytearray()
        self._flush_scheduled = False
        self._drain: asyncio.Future[None] | None = None
        self._paused = False
        self._closed = False
        self._stopping = False
        self.streams: dict[int, _Stream] = {}

    # -- asyncio.Protocol callbacks ---------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        peer = transport.get_extra_info("peername")
        self._peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        self._server._track(self, True)

    def data_received(self, data: bytes) -> None:
        try:
            self._decoder.feed(data)
            while (frame := self._decoder.next()) is not None:
                kind = frame[0]
                sid = frame[1] if len(frame) > 1 else None
                if type(sid) is not int:
                    raise ProtocolError(f"frame without a stream id: {frame!r}")
                if kind == CREDIT and len(frame) == 3 and type(frame[2]) is int:
                    if (stream := self.streams.get(sid)) is not None:
                        stream.add_credit(frame[2])
                elif kind == REQUEST:
                    self._start_stream(sid, frame)
                elif kind == CANCEL:
                    # answered with END once the handler is gone (the caller then forgets
                    # the sid); a CANCEL that crossed our END or ERROR is ignored
                    if (stream := self.streams.get(sid)) is not None:
                        stream.cancel(answer=True)
                else:
                    raise ProtocolError(f"unexpected frame kind {kind!r} from a caller")
        except ProtocolError as exc:
            log.warning("dropping connection from %s: %s", self._peer, exc)
            self.cancel_streams()
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self.cancel_streams()
        self._wake_drain()
        self._server._track(self, False)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_drain()

    # -- streams ----------------------------------------------------------------------

    def _start_stream(self, sid: int, frame: list[Any]) -> None:
        if len(frame) != 5 or not isinstance(frame[2], str) or not isinstance(frame[3], dict):
            raise ProtocolError("malformed request frame")
        if sid in self.streams:
            raise ProtocolError(f"request for stream {sid}, which is still open")
        _, _, endpoint, headers, payload = frame
        if self._server.stopping:
            self._write(self._encoder.plane_error(
                sid, InstanceUnavailable, f"server {self._server.address} is stopping"))
            if not self.streams:
                self.close()
            return
        ctx = RequestContext.from_headers(headers, endpoint=endpoint, peer=self._peer)
        handler = self._server.handler(endpoint)
        if handler is None:
            from ._server import UnknownEndpoint

            self._write(self._encoder.error(sid, UnknownEndpoint(
                f"no endpoint {endpoint!r} on {self._server.address} "
                f"(serving: {', '.join(self._server.endpoints) or 'none'})")))
            return
        stream = self.streams[sid] = _Stream(sid, ctx)
        # On the wire before the handler runs: a caller whose connection dies before any
        # frame of the stream arrived knows the request was never handled (safe to send
        # elsewhere).
        self._write(self._encoder.alive(sid))
        self._flush()
        stream.task = asyncio.get_running_loop().create_task(
            self._run(stream, handler, payload), name=f"rpc:{endpoint}:{ctx.request_id}")

    async def _run(self, stream: _Stream, handler: Handler, payload: Any) -> None:
        ctx, sid = stream.ctx, stream.sid
        try:
            agen = handler(payload, ctx)
            if not hasattr(agen, "__anext__"):
                if hasattr(agen, "close"):
                    agen.close()  # a coroutine: close it so it is not reported as never awaited
                raise TypeError(f"the handler of endpoint {ctx.endpoint!r} must be an async "
                                f"generator function, it returned {type(agen).__name__}")
            async with contextlib.aclosing(agen):  # type: ignore[type-var]
                out = self._out
                append = self._encoder.append_item
                async for item in agen:
                    if not self._flush_scheduled:
                        self._schedule_flush()
                    stream.unacked += append(out, sid, item)
                    stream.quiet = False
                    if len(out) >= FLUSH_BYTES:
                        self._flush()
                        await asyncio.sleep(0)  # a tight producer must not starve the loop
                    if self._paused:
                        await self._wait_drain()
                    if stream.unacked >= STREAM_WINDOW:
                        await self._wait_credit(stream)
        except asyncio.CancelledError:
            log.debug("request %s on %s cancelled", ctx.request_id, ctx.endpoint)
            self._end_stream(stream)
            if stream.answer_cancel:  # only to the caller's CANCEL: after a stop, END would lie
                self._write(self._encoder.end(sid))
            self._after_stream()
            raise
        except Exception as exc:  # the handler's error goes to the caller, typed
            self._server.log_handler_error(ctx, exc)
            self._end_stream(stream)
            self._write(self._encoder.error(sid, exc))
        else:
            self._end_stream(stream)
            self._write(self._encoder.end(sid))
        self._after_stream()

    def _end_stream(self, stream: _Stream) -> None:
        # Before the terminal frame is written: the caller may reuse the sid as soon as
        # it reads END.
        if self.streams.get(stream.sid) is stream:
            del self.streams[stream.sid]

    def _after_stream(self) -> None:
        if self._stopping and not self.streams:
            self.close()

    async def _wait_credit(self, stream: _Stream) -> None:
        while stream.unacked >= STREAM_WINDOW and not self._closed:
            stream.credit = asyncio.get_running_loop().create_future()
            await stream.credit

    def stopping(self) -> None:
        """The server stops: close now if idle, else once the last stream has ended;
        subscriptions are cancelled at once (they are not drained)."""
        self._stopping = True
        if not self.streams:
            self.close()
            return
        for stream in list(self.streams.values()):
            if stream.ctx.endpoint in self._server._subscriptions:
                stream.cancel(answer=False)

    def cancel_streams(self) -> None:
        """Cancel every running handler (the caller left, or the server stops).

        Only once per stream: a second cancel would interrupt the handler's own clean-up.
        """
        for stream in list(self.streams.values()):
            stream.cancel(answer=False)

    # -- output -----------------------------------------------------------------------

    def heartbeat(self) -> None:
        """Called every ``heartbeat_s``: ALIVE on each stream that was quiet since the
        last call.

        Skipped for a stream whose caller is not reading (backpressure): the frames
        queued for it already prove this process alive once it reads them.
        """
        if self._closed:
            return
        for stream in self.streams.values():
            if stream.quiet and not self._paused and stream.unacked < STREAM_WINDOW:
                self._write(self._encoder.alive(stream.sid))
            stream.quiet = True

    def _write(self, frame: bytes) -> None:
        self._out += frame
        if not self._flush_scheduled:
            self._schedule_flush()

    def _schedule_flush(self) -> None:
        self._flush_scheduled = True
        asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._out or self._closed or self._transport is None:
            self._out.clear()
            return
        # bytes(): the transport may keep a reference to what it could not send yet,
        # and self._out is reused.
        self._transport.write(bytes(self._out))
        self._out.clear()

    async def _wait_drain(self) -> None:
        while self._paused and not self._closed:
            if self._drain is None or self._drain.done():
                self._drain = asyncio.get_running_loop().create_future()
            await self._drain

    def _wake_drain(self) -> None:
        if self._drain is not None:
            if not self._drain.done():
                self._drain.set_result(None)
            self._drain = None

    def close(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._flush()
            self._transport.close()
