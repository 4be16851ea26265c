"""One request-plane client connection: the asyncio protocol that carries any number
of streams to one server over one TCP socket.

Owned by ``RpcClient`` (which makes it and forgets it once it is closed or retired) and
used by ``RpcStream`` through ``open_stream``, ``send``, ``forget``, ``cancel_stream``,
``abandon``, ``retire`` and ``fail``. It keeps an ``_Inbox`` per open stream and files
each incoming frame into the inbox of its stream id, waking that stream's reader; frames
for a forgotten stream are dropped, as are those of a cancelled one up to its terminal
frame (or for ``CANCEL_DRAIN_S``). Everything sent in one event-loop iteration goes out
in one socket write. A wire-format violation (``ProtocolError``) closes the connection
(``error`` is set) and every stream on it sees it closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
from collections import deque
from typing import TYPE_CHECKING, Any, cast

from ._framing import END, ERROR, FrameDecoder, ProtocolError

if TYPE_CHECKING:
    from ._client import RpcClient

log = logging.getLogger(__name__)

CANCEL_DRAIN_S = 2.0
"""How long a cancelled stream waits for the callee's terminal frame before its id is
forgotten (the frames of a handler that ignores cancellation are then dropped)."""


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
