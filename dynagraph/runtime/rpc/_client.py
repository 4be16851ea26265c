"""Request-plane client: calls streaming endpoints on other processes.

One ``RpcClient`` per process. It keeps a pool of idle connections per address; a
call takes one (or connects), sends its REQUEST, and gives the connection back after
a clean END or ERROR. A stream that is abandoned early sends CANCEL, so the callee's
handler is cancelled at once, and reads on in the background up to the terminal frame
the callee answers with, then pools the connection (closed instead if none comes within
``CANCEL_DRAIN_S``). Every Processor request abandons the Router's tracking stream when
it ends; closing that connection instead cost a TCP connect and close per request.

Backpressure: received bytes are decoded lazily as the caller iterates; when more
than ``READ_HIGH_WATER`` bytes wait undecoded, the socket stops being read, TCP's
window fills and the callee's handler is held at its ``yield``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from types import TracebackType
from typing import Any, cast

from dynagraph.errors import InstanceUnavailable, StreamBroken

from ._framing import (
    ALIVE,
    END,
    ERROR,
    ITEM,
    FrameDecoder,
    FrameEncoder,
    ProtocolError,
    error_from_frame,
)
from ._local import LocalStream, local_server

log = logging.getLogger(__name__)

READ_HIGH_WATER = 256 * 1024
"""Undecoded bytes above which the client stops reading the socket."""
READ_LOW_WATER = 64 * 1024
"""Undecoded bytes below which reading resumes."""
NOT_READY: Any = object()
"""``RpcStream.take_ready``'s answer when no whole item is waiting."""
CANCEL_DRAIN_S = 2.0
"""How long a cancelled stream's connection waits for the callee's terminal frame before
it is closed instead of pooled."""
IDLE_TIMEOUT_S = 4.0
"""Default ``idle_timeout``: servers send a heartbeat every second on a quiet stream, so
this much silence means the callee is frozen (SIGSTOP, a stalled event loop) or cut off."""


class RpcClient:
    """Calls endpoints served by ``RpcServer``s; pools connections per address.

    ``call()`` may be used by many tasks at once; each concurrent stream to an address
    uses its own connection.
    """

    def __init__(self, *, connect_timeout: float = 2.0, max_frame_bytes: int = 64 << 20,
                 max_idle_per_address: int = 64,
                 idle_timeout: float | None = IDLE_TIMEOUT_S) -> None:
        """``idle_timeout``: a stream that receives nothing (not even the server's ALIVE
        heartbeat) for that many seconds is cancelled and raises ``StreamBroken``
        (None: wait as long as the connection lives)."""
        self._connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self._max_frame_bytes = max_frame_bytes
        self._max_idle = max_idle_per_address
        self._encoder = FrameEncoder()
        self._idle: dict[str, list[_ClientConnection]] = {}
        self._connections: set[_ClientConnection] = set()
        self._closed = False

    def call(self, address: str, endpoint: str, payload: Any, *,
             headers: dict[str, str] | None = None) -> RpcStream | LocalStream:
        """Start a call of ``endpoint`` at ``address`` (``host:port``); iterate the result.

        The payload is encoded now (a TypeError for an unencodable payload is raised
        here); the connection is made on the first ``__anext__``. Raises, while
        iterating: ``InstanceUnavailable`` (not delivered: connect failed or server
        stopping; safe to retry elsewhere), ``StreamBroken`` (connection lost after the
        request was sent, or ``idle_timeout`` passed), ``RemoteError`` or a ``WIRE_ERRORS`` type (handler raised).
        Leaving the iteration early (break + garbage collection, ``aclose()``, or the
        task being cancelled) cancels the remote handler.
        """
        server = local_server(address)
        if server is not None:  # a server of this process: no socket (see _local)
            return LocalStream(server, endpoint, headers or {}, payload)
        request = self._encoder.request(endpoint, headers or {}, payload)
        return RpcStream(self, address, endpoint, request)

    async def close(self) -> None:
        """Close every connection; streams still open see ``StreamBroken``."""
        self._closed = True
        self._idle.clear()
        for conn in list(self._connections):
            conn.abort(None)
        self._connections.clear()

    async def _acquire(self, address: str, *, fresh: bool = False) -> _ClientConnection:
        if self._closed:
            raise InstanceUnavailable(f"RpcClient is closed; cannot call {address}")
        idle = self._idle.get(address)
        while idle and not fresh:
            conn = idle.pop()
            if conn.reusable:
                conn.reused = True
                return conn
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"request-plane address must be 'host:port', got {address!r}")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _ClientConnection(self, self._max_frame_bytes),
                    host.strip("[]"), int(port))
        except TimeoutError as exc:
            raise InstanceUnavailable(
                f"connect to {address} timed out after {self._connect_timeout}s") from exc
        except OSError as exc:
            raise InstanceUnavailable(f"cannot connect to {address}: {exc}") from exc
        self._connections.add(conn)
        return conn

    def _release(self, address: str, conn: _ClientConnection) -> None:
        idle = self._idle.setdefault(address, [])
        if conn.reusable and not self._closed and len(idle) < self._max_idle:
            idle.append(conn)
        else:
            conn.abort(None)

    def _forget(self, conn: _ClientConnection) -> None:
        self._connections.discard(conn)


class RpcStream:
    """The async iterator returned by ``RpcClient.call``: decoded response items.

    Use ``async for``; or ``async with client.call(...) as stream`` to scope it;
    ``aclose()`` cancels the remote handler if the stream has not ended.
    """

    def __init__(self, client: RpcClient, address: str, endpoint: str, request: bytes) -> None:
        self._client = client
        self._address = address
        self._endpoint = endpoint
        self._request: bytes | None = request
        self._conn: _ClientConnection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done = False
        self._held: list[Any] | None = None  # a terminal frame ``take_ready`` came upon

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
                frame: list[Any] | None = self._held
                if frame is not None:
                    self._held = None
                else:
                    frame = conn.next_frame()
                if frame is None:
                    if conn.closed and self._request is not None and conn.stale:
                        conn = await self._open(fresh=True)  # request not delivered: resend
                        continue
                    if conn.closed and self._request is not None:
                        # Servers answer every request with a frame before its handler runs.
                        raise InstanceUnavailable(
                            f"{self._address} closed the connection before taking "
                            f"{self._endpoint!r}" + (f": {conn.lost_reason}"
                                                     if conn.lost_reason else ""))
                    if conn.closed:
                        raise StreamBroken(
                            f"connection to {self._address} lost during {self._endpoint!r}"
                            + (f": {conn.lost_reason}" if conn.lost_reason else ""))
                    await conn.wait(self._client.idle_timeout, self._address, self._endpoint)
                    continue
                self._request = None  # delivered; never resend from here on
                if frame[0] == ITEM and len(frame) == 2:
                    return frame[1]
                if frame[0] == ALIVE:
                    continue
                break
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
        conn = self._conn
        if conn is None or self._held is not None or self._request is not None:
            return NOT_READY
        while True:
            try:
                frame = conn.next_frame()
            except BaseException:
                self._abort()
                raise
            if frame is None:
                return NOT_READY
            if frame[0] == ITEM and len(frame) == 2:
                return frame[1]
            if frame[0] != ALIVE:
                self._held = frame
                return NOT_READY

    async def _open(self, *, fresh: bool = False) -> _ClientConnection:
        """Send the request on a pooled (or, if ``fresh``, a new) connection.

        The request bytes are kept until the first response frame: a pooled connection
        that the server had already closed answers the request with a reset and no
        data, which proves it was not delivered, so it is resent once on a new one.
        """
        request = self._request
        assert request is not None
        self._conn = None
        self._done = True  # until the request is on a connection, nothing to cancel
        conn = await self._client._acquire(self._address, fresh=fresh)
        self._loop = asyncio.get_running_loop()
        conn.send_request(request)
        self._conn = conn
        self._done = False
        if fresh:
            self._request = None
        return conn

    def _finish(self, frame: list[Any]) -> None:
        """Handle a terminal frame: END, ERROR or garbage. Always raises."""
        conn = self._conn
        assert conn is not None
        self._conn = None
        self._done = True
        kind = frame[0]
        if kind == END:
            conn.end_stream()
            self._client._release(self._address, conn)
            raise StopAsyncIteration
        if kind == ERROR:
            conn.end_stream()
            self._client._release(self._address, conn)
            raise error_from_frame(frame)
        conn.abort(None)
        raise ProtocolError(f"unexpected frame kind {kind!r} from {self._address}")

    def _cancel(self) -> None:
        """Stop a running stream: CANCEL, and pool the connection once the callee's
        terminal frame is read (``_ClientConnection.cancel``)."""
        held, self._held = self._held, None
        if held is not None:  # the stream had ended: nothing to cancel
            with contextlib.suppress(Exception):  # StopAsyncIteration, or its error
                self._finish(held)
            return
        conn = self._conn
        self._conn = None
        self._done = True
        if conn is not None:
            conn.cancel(self._client._encoder.cancel(), self._address)

    def _abort(self) -> None:
        conn = self._conn
        self._conn = None
        self._done = True
        if conn is not None:
            conn.abort(self._client._encoder.cancel())

    async def aclose(self) -> None:
        """End the stream; if it was still running, the remote handler is cancelled.

        Never waits: the connection reads up to the callee's answer to CANCEL in the
        background and then goes back to the pool.
        """
        self._cancel()

    async def __aenter__(self) -> RpcStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        self._cancel()

    def __del__(self) -> None:
        conn = self._conn
        if conn is not None and not conn.closed and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # loop already closed
                self._loop.call_soon_threadsafe(conn.abort, self._client._encoder.cancel())


class _ClientConnection(asyncio.Protocol):
    """One TCP connection to a server; carries one stream at a time."""

    def __init__(self, client: RpcClient, max_frame_bytes: int) -> None:
        self._client = client
        self._decoder = FrameDecoder(max_frame_bytes)
        self._transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._in_stream = False
        self.closed = False
        self.lost_reason = ""
        self.reused = False
        self._received = False
        self._reset = False
        self._draining: str | None = None  # address to pool at, after a CANCEL's answer
        self._drain_timer: asyncio.TimerHandle | None = None

    @property
    def reusable(self) -> bool:
        return (not self.closed and not self._in_stream and self._decoder.buffered == 0
                and self._transport is not None and not self._transport.is_closing())

    @property
    def stale(self) -> bool:
        """A reused connection reset by the server before any response byte arrived."""
        return self.reused and self._reset and not self._received

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)

    def data_received(self, data: bytes) -> None:
        if not self._in_stream:
            log.warning("unexpected data on an idle request-plane connection; closing it")
            self.abort(None)
            return
        self._received = True
        self._decoder.feed(data)
        if self._draining is not None:
            self._drain()
            return
        if self._decoder.buffered > READ_HIGH_WATER and not self._reading_paused:
            assert self._transport is not None
            self._reading_paused = True
            self._transport.pause_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_draining()
        if exc is not None:
            self.lost_reason = str(exc) or type(exc).__name__
            self._reset = isinstance(exc, ConnectionResetError | BrokenPipeError)
        self._wake()
        self._client._forget(self)

    def send_request(self, request: bytes) -> None:
        assert self._transport is not None and not self._in_stream
        self._in_stream = True
        self._received = False
        self._transport.write(request)

    def end_stream(self) -> None:
        self._in_stream = False

    def next_frame(self) -> list[Any] | None:
        """The next complete frame, or None if more bytes are needed."""
        frame = self._decoder.next()
        if self._reading_paused and (frame is None or self._decoder.buffered < READ_LOW_WATER):
            assert self._transport is not None
            self._reading_paused = False
            if not self.closed:
                self._transport.resume_reading()
        return frame

    async def wait(self, idle_timeout: float | None, address: str, endpoint: str) -> None:
        """Wait until more bytes arrive or the connection is lost.

        Raises StreamBroken after ``idle_timeout`` seconds of silence, counted only while
        this process runs: the clock advances in steps of an eighth of the limit, and a
        step this process overran (it was starved of CPU, in a long GC, or the whole host
        was paused: 2-7 s seen on this VM under an engine's load) counts as at most 1.5
        steps, so a stall of the *caller* is never taken for a frozen callee. After the
        limit, one more loop turn reads what is waiting on the socket.
        """
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        try:
            if idle_timeout is None:
                await waiter
                return
            step, silent = idle_timeout / 8, 0.0
            while not waiter.done():
                if silent >= idle_timeout:
                    await asyncio.sleep(0)  # one more loop turn: read what has arrived
                    if waiter.done():
                        break
                    raise StreamBroken(f"{endpoint!r} at {address} sent nothing for "
                                       f"{idle_timeout}s (idle_timeout); cancelled")
                began = loop.time()
                # asyncio.wait, not asyncio.timeout: a deadline that falls in the same loop
                # turn as the bytes that end the wait must not cancel the waiting task.
                await asyncio.wait((waiter,), timeout=step)
                silent += min(loop.time() - began, 1.5 * step)
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def cancel(self, cancel_frame: bytes, address: str) -> None:
        """Send CANCEL, then read (discarding items) up to the callee's terminal frame
        and give the connection back to the pool for ``address``; closed instead if it
        does not come within ``CANCEL_DRAIN_S``."""
        if self.closed or self._transport is None or self._transport.is_closing():
            self.abort(None)
            return
        self._transport.write(cancel_frame)
        self._draining = address
        if self._reading_paused:
            self._reading_paused = False
            self._transport.resume_reading()
        self._drain_timer = asyncio.get_running_loop().call_later(
            CANCEL_DRAIN_S, self.abort, None)
        self._drain()

    def _drain(self) -> None:
        address = self._draining
        while address is not None:
            try:
                frame = self._decoder.next()
            except ProtocolError as exc:
                log.warning("bad frame from %s after CANCEL: %s; closing", address, exc)
                self.abort(None)
                return
            if frame is None:
                return
            if frame[0] in (END, ERROR):
                self._stop_draining()
                self.end_stream()
                self._client._release(address, self)
                return

    def _stop_draining(self) -> None:
        self._draining = None
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None

    def abort(self, cancel_frame: bytes | None) -> None:
        """Close the connection, sending ``cancel_frame`` first if given."""
        self._stop_draining()
        self._in_stream = False
        if self._transport is not None and not self._transport.is_closing():
            if cancel_frame is not None:
                self._transport.write(cancel_frame)
            self._transport.close()
