"""Request-plane client: calls streaming endpoints on other processes.

One ``RpcClient`` per process. It keeps one connection to each address and runs all its
streams to that address over it (``_framing``): the callee writes the items of all of
them with one socket write per event-loop iteration, and this process reads them with
one wake-up. A stream that is abandoned early sends CANCEL, so the callee's handler is
cancelled at once; the frames still in flight for it are dropped as they arrive.

Backpressure is per stream: items are decoded as they arrive and wait in the stream's
queue; the callee holds a stream's handler once ``STREAM_WINDOW`` bytes wait uncredited,
and the stream credits what its reader has taken (``CREDIT_BYTES`` at a time). A slow
reader holds only its own stream's handler, never the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
from collections import deque
from types import TracebackType
from typing import Any, cast

from dynagraph.errors import InstanceUnavailable, StreamBroken

from ._framing import (
    ALIVE,
    END,
    ERROR,
    ITEM,
    STREAM_WINDOW,
    FrameDecoder,
    FrameEncoder,
    ProtocolError,
    error_from_body,
)
from ._local import LocalStream, local_server

log = logging.getLogger(__name__)

CREDIT_BYTES = STREAM_WINDOW // 4
"""Item bytes a stream's reader takes before the stream credits them to the callee."""
NOT_READY: Any = object()
"""``RpcStream.take_ready``'s answer when no whole item is waiting."""
CANCEL_DRAIN_S = 2.0
"""How long a cancelled stream waits for the callee's terminal frame before its id is
forgotten (the frames of a handler that ignores cancellation are then dropped)."""
IDLE_TIMEOUT_S = 4.0
"""Default ``idle_timeout``: servers send a heartbeat every second on a quiet stream, so
this much silence means the callee is frozen (SIGSTOP, a stalled event loop) or cut off."""


class RpcClient:
    """Calls endpoints served by ``RpcServer``s over one connection per address.

    ``call()`` may be used by many tasks at once; their streams share the connection.
    """

    def __init__(self, *, connect_timeout: float = 2.0, max_frame_bytes: int = 64 << 20,
                 idle_timeout: float | None = IDLE_TIMEOUT_S) -> None:
        """``idle_timeout``: a stream that receives nothing (not even the server's ALIVE
        heartbeat) for that many seconds is cancelled and raises ``StreamBroken``
        (None: wait as long as the connection lives)."""
        self._connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self._max_frame_bytes = max_frame_bytes
        self._encoder = FrameEncoder()
        self._open: dict[str, _ClientConnection] = {}  # the connection new streams use
        self._connecting: dict[str, asyncio.Task[_ClientConnection]] = {}
        self._connections: set[_ClientConnection] = set()
        self._closed = False
        self._waiting: set[RpcStream] = set()  # streams waiting for a frame
        self._watchdog: asyncio.Task[None] | None = None

    def call(self, address: str, endpoint: str, payload: Any, *,
             headers: dict[str, str] | None = None) -> RpcStream | LocalStream:
        """Start a call of ``endpoint`` at ``address`` (``host:port``); iterate the result.

        The payload is encoded now (a TypeError for an unencodable payload is raised
        here); the request is sent on the first ``__anext__``. Raises, while
        iterating: ``InstanceUnavailable`` (not delivered: connect failed or server
        stopping; safe to retry elsewhere), ``StreamBroken`` (connection lost after the
        request was sent, or ``idle_timeout`` passed), ``RemoteError`` or a ``WIRE_ERRORS`` type (handler raised).
        Leaving the iteration early (break + garbage collection, ``aclose()``, or the
        task being cancelled) cancels the remote handler.
        """
        server = local_server(address)
        if server is not None:  # a server of this process: no socket (see _local)
            return LocalStream(server, endpoint, headers or {}, payload)
        tail = self._encoder.request_tail(endpoint, headers or {}, payload)
        return RpcStream(self, address, endpoint, tail)

    async def close(self) -> None:
        """Close every connection; streams still open see ``StreamBroken``."""
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._open.clear()
        for conn in list(self._connections):
            conn.abort()
        self._connections.clear()

    async def _acquire(self, address: str, *, fresh: bool = False
                       ) -> tuple[_ClientConnection, bool]:
        """The connection to ``address`` (made if there is none, or if ``fresh``) and
        whether it is new. Callers that arrive while it is being made wait for it; a
        caller's cancellation does not cancel the connect the others wait for."""
        if self._closed:
            raise InstanceUnavailable(f"RpcClient is closed; cannot call {address}")
        if not fresh:
            conn = self._open.get(address)
            if conn is not None and conn.usable:
                return conn, False
        task = None if fresh else self._connecting.get(address)
        if task is None:
            host, sep, port = address.rpartition(":")
            if not sep or not port.isdigit():
                raise ValueError(f"request-plane address must be 'host:port', got {address!r}")
            task = asyncio.get_running_loop().create_task(
                self._connect(address, host.strip("[]"), int(port)))
            if not fresh:
                self._connecting[address] = task
            task.add_done_callback(lambda t: self._connected(address, t))
        return await asyncio.shield(task), True

    def _connected(self, address: str, task: asyncio.Task[_ClientConnection]) -> None:
        if self._connecting.get(address) is task:
            del self._connecting[address]
        if not task.cancelled():
            task.exception()  # retrieved: every caller waiting for it may have left

    async def _connect(self, address: str, host: str, port: int) -> _ClientConnection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _ClientConnection(self, address, self._max_frame_bytes), host, port)
        except TimeoutError as exc:
            raise InstanceUnavailable(
                f"connect to {address} timed out after {self._connect_timeout}s") from exc
        except OSError as exc:
            raise InstanceUnavailable(f"cannot connect to {address}: {exc}") from exc
        if self._closed:
            conn.abort()
            raise InstanceUnavailable(f"RpcClient is closed; cannot call {address}")
        self._connections.add(conn)
        self._open[address] = conn
        return conn

    def _watch(self, stream: RpcStream) -> None:
        """Count ``stream``'s silence while it waits (``idle_timeout``)."""
        self._waiting.add(stream)
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(
                self._watch_silence(), name="rpc-idle-watchdog")

    async def _watch_silence(self) -> None:
        """Break the streams that waited ``idle_timeout`` seconds for a frame, counted only
        while this process runs: the clock advances in steps of an eighth of the limit, and
        a step this process overran (it was starved of CPU, in a long GC, or the whole host
        was paused) counts as at most 1.5
        steps, so a stall of the *caller* is never taken for a frozen callee. After the
        limit, one more loop turn reads what is waiting on the socket.

        One task for all the streams of this client (a timer per wait cost more CPU than
        the rest of the stream's read); it ends when none is waiting.
        """
        assert self.idle_timeout is not None
        loop = asyncio.get_running_loop()
        limit = self.idle_timeout
        step = limit / 8
        last = loop.time()
        try:
            while self._waiting:
                await asyncio.sleep(step)
                now = loop.time()
                expired = []
                for stream in self._waiting:
                    stream._silent += min(now - max(last, stream._wait_began), 1.5 * step)
                    if stream._silent >= limit:
                        expired.append(stream)
                last = now
                if expired:
                    await asyncio.sleep(0)  # one more loop turn: read what has arrived
                    for stream in expired:
                        stream._expire(limit)
        finally:
            self._watchdog = None

    def _forget(self, conn: _ClientConnection) -> None:
        """``conn`` is closed or takes no new streams."""
        if conn.closed:
            self._connections.discard(conn)
        if self._open.get(conn.address) is conn:
            del self._open[conn.address]


class _Inbox:
    """What a connection keeps for one of its streams: the frames that arrived for it
    (with their sizes), its reader's waiter, and, once cancelled, the drain timer."""

    __slots__ = ("sid", "frames", "waiter", "cancelled", "timer")

    def __init__(self, sid: int) -> None:
        self.sid = sid
        self.frames: deque[tuple[list[Any], int]] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.cancelled = False  # CANCEL sent: frames are dropped up to the terminal one
        self.timer: asyncio.TimerHandle | None = None

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    @property
    def ended(self) -> bool:
        """The terminal frame has arrived (it is always the last one queued)."""
        return bool(self.frames) and self.frames[-1][0][0] in (END, ERROR)


class RpcStream:
    """The async iterator returned by ``RpcClient.call``: decoded response items.

    Use ``async for``; or ``async with client.call(...) as stream`` to scope it;
    ``aclose()`` cancels the remote handler if the stream has not ended.
    """

    def __init__(self, client: RpcClient, address: str, endpoint: str, tail: bytes) -> None:
        self._client = client
        self._address = address
        self._endpoint = endpoint
        self._tail: bytes | None = tail  # the request, until a frame proves it delivered
        self._conn: _ClientConnection | None = None
        self._inbox: _Inbox | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done = False
        self._reused = False  # sent on a connection that was already open
        self._sent_at = 0  # the connection's ``received`` count when the request went
        self._uncredited = 0
        self._silent = 0.0  # seconds of the current wait counted by the watchdog
        self._wait_began = 0.0

    def __aiter__(self) -> RpcStream:
        return self

    async def __anext__(self) -> Any:
        conn = self._conn
        if conn is None:
            if self._done:
                raise StopAsyncIteration
            conn = await self._open()
        try:
            while True:
                assert self._inbox is not None
                frames = self._inbox.frames
                if frames:
                    frame, size = frames.popleft()
                    self._tail = None  # delivered; never resend from here on
                    kind = frame[0]
                    if kind == ITEM and len(frame) == 3:
                        self._taken(size)
                        return frame[2]
                    if kind == ALIVE:
                        continue
                    break
                if conn.closed:
                    if conn.error is not None:
                        raise ProtocolError(f"{self._address}: {conn.error}")
                    if self._tail is not None and self._stale(conn):
                        conn = await self._open(fresh=True)  # request not delivered: resend
                        continue
                    reason = f": {conn.lost_reason}" if conn.lost_reason else ""
                    if self._tail is not None:
                        # Servers answer every request with a frame before its handler runs.
                        raise InstanceUnavailable(
                            f"{self._address} closed the connection before taking "
                            f"{self._endpoint!r}{reason}")
                    raise StreamBroken(
                        f"connection to {self._address} lost during {self._endpoint!r}{reason}")
                await self._wait(self._inbox)
        except asyncio.CancelledError:  # the caller's task: the connection is sound
            self._cancel()
            raise
        except BaseException:
            self._abort()
            raise
        self._finish(frame)

    def take_ready(self) -> Any:
        """The next item if it has already arrived whole, else ``NOT_READY``; never waits.

        For a reader that is behind: what has piled up can be taken (and merged) at once.
        A terminal frame met on the way is kept for the next ``__anext__``.
        """
        inbox = self._inbox
        if self._conn is None or inbox is None or self._tail is not None:
            return NOT_READY
        frames = inbox.frames
        while frames:
            frame, size = frames[0]
            kind = frame[0]
            if kind == ITEM and len(frame) == 3:
                frames.popleft()
                self._taken(size)
                return frame[2]
            if kind != ALIVE:
                return NOT_READY
            frames.popleft()
        return NOT_READY

    def _taken(self, size: int) -> None:
        """The reader took an item of ``size`` bytes: credit the callee in batches."""
        self._uncredited += size
        if self._uncredited >= CREDIT_BYTES:
            assert self._conn is not None and self._inbox is not None
            self._conn.send(self._client._encoder.credit(self._inbox.sid, self._uncredited))
            self._uncredited = 0

    def _stale(self, conn: _ClientConnection) -> bool:
        """Sent on an already open connection that the server had closed: reset with
        no byte received after the request, which proves it was not delivered."""
        return self._reused and conn.reset and conn.received == self._sent_at

    async def _wait(self, inbox: _Inbox) -> None:
        """Wait until a frame arrives for this stream or the connection is lost; raises
        StreamBroken after ``idle_timeout`` seconds of silence (``_watch_silence``)."""
        loop = asyncio.get_running_loop()
        waiter = inbox.waiter = loop.create_future()
        client = self._client
        try:
            if client.idle_timeout is not None:
                self._silent = 0.0
                self._wait_began = loop.time()
                client._watch(self)
            await waiter
        finally:
            inbox.waiter = None
            client._waiting.discard(self)

    def _expire(self, limit: float) -> None:
        """The watchdog's verdict: silent for ``limit`` seconds."""
        inbox, conn = self._inbox, self._conn
        if inbox is None or inbox.waiter is None or inbox.waiter.done():
            return  # a frame came in the last loop turn
        if conn is not None:
            conn.retire()  # a frozen or cut-off callee: new calls connect anew
        inbox.waiter.set_exception(StreamBroken(
            f"{self._endpoint!r} at {self._address} sent nothing for {limit}s "
            "(idle_timeout); cancelled"))

    async def _open(self, *, fresh: bool = False) -> _ClientConnection:
        """Send the request on the address's connection (a new one if ``fresh``).

        The request bytes are kept until the stream's first frame: a connection that the
        server had already closed answers the request with a reset and no data, which
        proves it was not delivered, so it is resent once on a new connection.
        """
        tail = self._tail
        assert tail is not None
        self._conn = None
        self._done = True  # until the request is on a connection, nothing to cancel
        conn, new = await self._client._acquire(self._address, fresh=fresh)
        self._loop = asyncio.get_running_loop()
        self._inbox = conn.open_stream(tail)
        self._reused = not new
        self._sent_at = conn.received
        self._conn = conn
        self._done = False
        return conn

    def _finish(self, frame: list[Any]) -> None:
        """Handle a terminal frame: END, ERROR or garbage. Always raises."""
        conn, inbox = self._conn, self._inbox
        assert conn is not None and inbox is not None
        self._conn = None
        self._done = True
        conn.forget(inbox.sid)
        kind = frame[0]
        if kind == END:
            raise StopAsyncIteration
        if kind == ERROR:
            exc = error_from_body(frame[2:])
            if isinstance(exc, InstanceUnavailable):
                conn.retire()  # the server is stopping: new calls connect anew
            raise exc
        error = ProtocolError(f"unexpected frame kind {kind!r} from {self._address}")
        conn.fail(error)
        raise error

    def _cancel(self) -> None:
        """Stop a running stream: CANCEL, and forget it once the callee's terminal
        frame has arrived (or ``CANCEL_DRAIN_S`` has passed)."""
        conn, inbox = self._conn, self._inbox
        self._conn = None
        self._done = True
        if conn is not None and inbox is not None:
            conn.cancel_stream(inbox)

    def _abort(self) -> None:
        """The stream failed on this side: CANCEL without waiting for the answer."""
        conn, inbox = self._conn, self._inbox
        self._conn = None
        self._done = True
        if conn is not None and inbox is not None:
            conn.abandon(inbox.sid)

    async def aclose(self) -> None:
        """End the stream; if it was still running, the remote handler is cancelled.

        Never waits: the frames the callee sends up to its answer to CANCEL are dropped
        as they arrive.
        """
        self._cancel()

    async def __aenter__(self) -> RpcStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        self._cancel()

    def __del__(self) -> None:
        conn, inbox = self._conn, self._inbox
        if conn is not None and inbox is not None and not conn.closed and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # loop already closed
                self._loop.call_soon_threadsafe(conn.abandon, inbox.sid)


class _ClientConnection(asyncio.Protocol):
    """One TCP connection to a server, carrying any number of streams."""

    def __init__(self, client: RpcClient, address: str, max_frame_bytes: int) -> None:
        self._client = client
        self.address = address
        self._encoder = client._encoder
        self._decoder = FrameDecoder(max_frame_bytes)
        self._transport: asyncio.Transport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sids = itertools.count(1)
        self.streams: dict[int, _Inbox] = {}
        self._out = bytearray()
        self._flush_scheduled = False
        self.closed = False
        self.retired = False  # takes no new streams; closed once its last one ends
        self.lost_reason = ""
        self.reset = False
        self.error: ProtocolError | None = None
        self.received = 0  # data_received calls so far

    @property
    def usable(self) -> bool:
        return (not self.closed and not self.retired and self._transport is not None
                and not self._transport.is_closing())

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._loop = asyncio.get_running_loop()
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)

    def data_received(self, data: bytes) -> None:
        self.received += 1
        decoder = self._decoder
        streams = self.streams
        try:
            decoder.feed(data)
            while (frame := decoder.next()) is not None:
                try:
                    inbox = streams.get(frame[1])
                except (IndexError, TypeError):
                    raise ProtocolError(f"frame without a stream id: {frame!r}") from None
                if inbox is None:
                    continue  # a forgotten stream's (cancelled, or failed on this side)
                if inbox.cancelled:
                    if frame[0] in (END, ERROR):
                        self.forget(inbox.sid)
                    continue
                inbox.frames.append((frame, decoder.last_size))
                if inbox.waiter is not None:
                    inbox.wake()
        except ProtocolError as exc:
            self.fail(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if exc is not None:
            self.lost_reason = str(exc) or type(exc).__name__
            self.reset = isinstance(exc, ConnectionResetError | BrokenPipeError)
        for inbox in list(self.streams.values()):
            if inbox.cancelled:
                self.forget(inbox.sid)
            else:
                inbox.wake()
        self._client._forget(self)

    def open_stream(self, tail: bytes) -> _Inbox:
        sid = next(self._sids)
        inbox = self.streams[sid] = _Inbox(sid)
        self.send(self._encoder.request(sid, tail))
        return inbox

    def send(self, frame: bytes) -> None:
        """Queue ``frame``; everything queued in one loop iteration goes in one write."""
        if self.closed:
            return
        self._out += frame
        if not self._flush_scheduled:
            self._flush_scheduled = True
            assert self._loop is not None
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._out and not self.closed and self._transport is not None:
            self._transport.write(bytes(self._out))
        self._out.clear()

    def forget(self, sid: int) -> None:
        """The stream ``sid`` is over: frames still coming for it are dropped."""
        inbox = self.streams.pop(sid, None)
        if inbox is not None and inbox.timer is not None:
            inbox.timer.cancel()
        if self.retired and not self.streams:
            self.abort()

    def cancel_stream(self, inbox: _Inbox) -> None:
        """CANCEL a stream the caller left; its frames are dropped up to the callee's
        answer, or for ``CANCEL_DRAIN_S``."""
        if inbox.ended or self.closed or self.streams.get(inbox.sid) is not inbox:
            self.forget(inbox.sid)  # it had ended (or cannot): nothing to cancel
            return
        inbox.cancelled = True
        inbox.frames.clear()
        self.send(self._encoder.cancel(inbox.sid))
        assert self._loop is not None
        inbox.timer = self._loop.call_later(CANCEL_DRAIN_S, self.forget, inbox.sid)

    def abandon(self, sid: int) -> None:
        """CANCEL ``sid`` (if it is still open) and forget it at once."""
        inbox = self.streams.get(sid)
        if inbox is not None and not inbox.ended and not inbox.cancelled:
            self.send(self._encoder.cancel(sid))
        self.forget(sid)

    def retire(self) -> None:
        """No new streams; the connection closes once its last stream has ended."""
        self.retired = True
        self._client._forget(self)
        if not self.streams:
            self.abort()

    def fail(self, error: ProtocolError) -> None:
        """The peer broke the wire format: every stream of the connection ends with it."""
        log.warning("closing the connection to %s: %s", self.address, error)
        self.error = error
        self.abort()

    def abort(self) -> None:
        """Close the connection; streams still open see it closed."""
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()
