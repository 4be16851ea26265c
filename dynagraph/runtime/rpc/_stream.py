"""One request-plane call as its caller sees it: ``RpcStream``, an async iterator of
the decoded response items.

``RpcClient.call`` makes it; it sends the request on its first ``__anext__`` over the
client's connection to the address (``_connection``). Callers may rely on:

- the request is resent once, on a new connection, only when the old connection proves
  it was not delivered (reset with no byte received after it); never after a frame of
  the stream has arrived;
- items are credited to the callee as the reader takes them (``CREDIT_BYTES`` at a
  time), so a slow reader holds only its own stream's handler;
- leaving early (``aclose()``, ``async with``, task cancelled, garbage collection)
  sends CANCEL and never waits for the callee's answer;
- errors are those of the package docstring: ``InstanceUnavailable``, ``StreamBroken``
  (also after ``idle_timeout`` of silence, judged by the client's watchdog),
  ``RemoteError`` or a ``WIRE_ERRORS`` type, ``ProtocolError``.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType
from typing import TYPE_CHECKING, Any

from dynagraph.errors import InstanceUnavailable, StreamBroken

from ._framing import ALIVE, END, ERROR, ITEM, STREAM_WINDOW, ProtocolError, error_from_body

if TYPE_CHECKING:
    from ._client import RpcClient
    from ._connection import _ClientConnection, _Inbox

CREDIT_BYTES = STREAM_WINDOW // 4
"""Item bytes a stream's reader takes before the stream credits them to the callee."""
NOT_READY: Any = object()
"""``RpcStream.take_ready``'s answer when no whole item is waiting."""


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
