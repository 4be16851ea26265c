"""Request-plane server: serves named streaming endpoints over TCP.

A connection carries many streams at once (``_framing``): a caller process keeps one
connection to each server. Each stream runs its handler in its own task.

The server is in two modules, by role:

    _server              ``RpcServer``: owns the endpoints, the listening socket, the
                         accepted connections and their heartbeat, and the drain on
                         ``stop()``
    _server_connection   ``_ServerConnection``: the asyncio protocol of one accepted
                         connection, which runs its streams (``_Stream``: a handler's task
                         and flow-control state), batches their output into one write per
                         event-loop iteration and applies backpressure
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from dynagraph.errors import WIRE_ERRORS

from . import _local
from ._context import Handler, RequestContext
from ._server_connection import _ServerConnection

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
"""A stream whose handler sent nothing for this long gets an ALIVE frame, so a caller can
tell a quiet handler from a frozen process (``RpcClient(idle_timeout=...)``)."""


class UnknownEndpoint(LookupError):
    """Sent to a caller that named an endpoint this server does not serve."""


class RpcServer:
    """Serves streaming endpoints. Owned by one component process.

    Call ``add_endpoint`` for each endpoint, then ``start()``; publish ``address``
    through discovery; ``stop()`` on shutdown.

    A handler is cancelled when its caller cancels or disconnects, or when ``stop()``'s
    grace runs out; ``ctx.cancelled`` is set first. A handler waiting at an ``await``
    sees ``CancelledError`` there; one held at its ``yield`` by backpressure is closed
    (``GeneratorExit``). Either way its ``finally`` blocks run. An exception raised by
    a handler is sent to the caller and logged here (at INFO for ``WIRE_ERRORS``).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *,
                 max_frame_bytes: int = 64 << 20, heartbeat_s: float = HEARTBEAT_S,
                 local_calls: bool = False) -> None:
        """``local_calls``: callers of this process reach it without the socket
        (``_local``; an embedded component's server)."""
        self.local_calls = local_calls
        self._host = host
        self._port = port
        self._max_frame_bytes = max_frame_bytes
        self._heartbeat_s = heartbeat_s
        self._heartbeat: asyncio.Task[None] | None = None
        self._handlers: dict[str, Handler] = {}
        self._subscriptions: set[str] = set()
        self._server: asyncio.Server | None = None
        self._connections: set[_ServerConnection] = set()
        self._address: str | None = None
        self._stopping = False
        self._local_streams = 0
        self._local_idle = asyncio.Event()
        self._local_idle.set()

    def add_endpoint(self, name: str, handler: Handler, *, drain: bool = True) -> None:
        """Register ``handler`` (an async generator function ``(payload, ctx)``) as ``name``.

        ``drain=False``: a subscription, cancelled at once by ``stop()`` (not drained).
        """
        if name in self._handlers:
            raise ValueError(f"endpoint {name!r} is already registered")
        self._handlers[name] = handler
        if not drain:
            self._subscriptions.add(name)

    @property
    def stopping(self) -> bool:
        """True once ``stop()`` has begun: new requests are refused (InstanceUnavailable)."""
        return self._stopping

    @property
    def endpoints(self) -> list[str]:
        return sorted(self._handlers)

    def handler(self, name: str) -> Handler | None:
        return self._handlers.get(name)

    async def start(self) -> None:
        """Bind and start accepting connections."""
        if self._server is not None:
            raise RuntimeError("RpcServer already started")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _ServerConnection(self, self._max_frame_bytes), self._host, self._port)
        sockname = self._server.sockets[0].getsockname()
        self._address = f"{sockname[0]}:{sockname[1]}"
        if self.local_calls:
            _local.register(self)
        if self._heartbeat_s > 0:
            self._heartbeat = loop.create_task(self._beat(), name="rpc-heartbeat")
        log.info("request plane listening on %s, endpoints %s", self._address, self.endpoints)

    @property
    def address(self) -> str:
        """``host:port`` the server listens on (valid after ``start()``)."""
        if self._address is None:
            raise RuntimeError("RpcServer.address is only known after start()")
        return self._address

    async def _beat(self) -> None:
        """Every ``heartbeat_s``: an ALIVE frame on each stream that sent nothing since."""
        while True:
            await asyncio.sleep(self._heartbeat_s)
            for conn in self._connections:
                conn.heartbeat()

    def local_started(self) -> Callable[[], None]:
        """Count a stream of a caller in this process (``_local.LocalStream``) until the
        returned function is called, so ``stop()`` drains it too."""
        self._local_streams += 1
        self._local_idle.clear()

        def done() -> None:
            self._local_streams -= 1
            if not self._local_streams:
                self._local_idle.set()

        return done

    @staticmethod
    def log_handler_error(ctx: RequestContext, exc: Exception) -> None:
        if any(cls.__name__ in WIRE_ERRORS for cls in type(exc).__mro__):
            log.info("request %s on %s: %s: %s", ctx.request_id, ctx.endpoint,
                     type(exc).__name__, exc)
        else:
            log.error("request %s on %s failed", ctx.request_id, ctx.endpoint, exc_info=exc)

    def _track(self, conn: _ServerConnection, alive: bool) -> None:
        if alive:
            self._connections.add(conn)
        else:
            self._connections.discard(conn)

    async def stop(self, grace: float = 5.0) -> None:
        """Stop accepting; give in-flight streams ``grace`` seconds, then cancel them.

        Idle connections are closed at once; a connection closes after its stream ends.
        Callers whose stream was cancelled see ``StreamBroken``.
        """
        if self._server is None or self._stopping:
            return
        self._stopping = True
        _local.unregister(self)
        self._server.close()
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        for conn in list(self._connections):
            conn.stopping()
        draining = sum(1 for c in self._connections for st in c.streams.values()
                       if st.ctx.endpoint not in self._subscriptions)
        if draining:
            log.info("draining %d request stream(s) (grace %.1fs)", draining, grace)
        tasks = [st.task for c in self._connections for st in c.streams.values()
                 if st.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace)
            if pending:
                log.warning("cancelling %d streams still running after %.1fs grace",
                            len(pending), grace)
                for conn in list(self._connections):
                    conn.cancel_streams()
                _, stuck = await asyncio.wait(pending, timeout=1.0)
                if stuck:
                    log.error("%d handlers ignored cancellation; closing their connections",
                              len(stuck))
        if self._local_streams:  # callers in this process: they run in their own tasks
            log.info("waiting for %d local stream(s) (grace %.1fs)", self._local_streams, grace)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await self._local_idle.wait()
        for conn in list(self._connections):
            conn.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                await self._server.wait_closed()
        log.info("request plane on %s stopped", self._address)
