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

The client is in three modules, by role:

    _client       ``RpcClient``: owns the connections (one per address, made once
                  however many callers wait for it) and the idle watchdog of all its
                  streams (``idle_timeout``)
    _stream       ``RpcStream``: one call as the caller iterates it (send, resend once
                  if provably undelivered, credit, cancel, error mapping)
    _connection   ``_ClientConnection``: the asyncio protocol of one TCP connection,
                  which demultiplexes frames into each stream's ``_Inbox``
"""

from __future__ import annotations

import asyncio
from typing import Any

from dynagraph.errors import InstanceUnavailable

from ._connection import _ClientConnection
from ._framing import FrameEncoder
from ._local import LocalStream, local_server
from ._stream import RpcStream

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

