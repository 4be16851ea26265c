"""Calls to a server of this very process, without the socket (``RpcClient.call``).

A component embedded in its caller's process (``ServiceArgs.embed-in``: the Processor in
the Frontend's) still runs its own ``RpcServer``, registered in discovery like any
other. When a caller in the same process picks that server's address, the call runs
the handler directly in the caller's task: no framing, no encoding of every item, no
wake-up of a second event loop per token.

What stays as on the wire: the request payload is copied through msgpack (the handler
gets the plain types it would get from a socket, and the caller may reuse its object);
errors arrive as the wire would deliver them (``WIRE_ERRORS`` as themselves, anything
else as ``RemoteError``, logged by the callee's server as it logs them); a stopping
server refuses new calls with ``InstanceUnavailable``; the server's ``stop()`` waits
(its grace) for local streams as for remote ones; closing the stream early cancels the
handler (``ctx.cancelled``, then its ``finally`` blocks). Items are handed over as the
handler yields them, not copied: handlers yield fresh builtins (``to_wire()``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from types import TracebackType
from typing import TYPE_CHECKING, Any

import msgpack

from dynagraph.aio import aclose
from dynagraph.errors import InstanceUnavailable

from ._context import RequestContext
from ._framing import _default, error_body, error_from_body

if TYPE_CHECKING:
    from ._server import RpcServer

_SERVERS: dict[str, RpcServer] = {}
"""Started servers of this process by address."""


def register(server: RpcServer) -> None:
    _SERVERS[server.address] = server


def unregister(server: RpcServer) -> None:
    if _SERVERS.get(server.address) is server:
        del _SERVERS[server.address]


def has_local_servers() -> bool:
    return bool(_SERVERS)


def local_server(address: str) -> RpcServer | None:
    """The server of this process listening at ``address``, if any."""
    return _SERVERS.get(address)


def wire_copy(payload: Any) -> Any:
    """``payload`` as the callee would decode it from the wire (TypeError if it cannot
    travel, as ``RpcClient.call`` raises for a remote call)."""
    return msgpack.unpackb(msgpack.packb(payload, default=_default), strict_map_key=False)


class LocalStream:
    """The iterator ``RpcClient.call`` returns for a server of this process (the same
    interface as ``RpcStream``)."""

    def __init__(self, server: RpcServer, endpoint: str, headers: dict[str, str],
                 payload: Any) -> None:
        self._server = server
        self._endpoint = endpoint
        self._headers = dict(headers)
        self._payload = wire_copy(payload)
        self._ctx: RequestContext | None = None
        self._agen = self._run()

    def __aiter__(self) -> LocalStream:
        return self

    async def __anext__(self) -> Any:
        return await anext(self._agen)

    async def _run(self) -> AsyncGenerator[Any, None]:
        server = self._server
        if server.stopping:
            raise InstanceUnavailable(f"server {server.address} is stopping")
        handler = server.handler(self._endpoint)
        if handler is None:
            from ._server import UnknownEndpoint

            raise error_from_body(error_body(UnknownEndpoint(
                f"no endpoint {self._endpoint!r} on {server.address} "
                f"(serving: {', '.join(server.endpoints) or 'none'})")))
        ctx = self._ctx = RequestContext.from_headers(self._headers, endpoint=self._endpoint,
                                                      peer="local")
        done = server.local_started()
        try:
            items = handler(self._payload, ctx)
            try:
                async for item in items:
                    yield item
            finally:
                await aclose(items)
        except (asyncio.CancelledError, GeneratorExit):
            ctx.cancelled = True
            raise
        except Exception as exc:  # as the wire delivers it
            server.log_handler_error(ctx, exc)
            raise error_from_body(error_body(exc)) from exc
        finally:
            done()

    async def aclose(self) -> None:
        """End the stream; a handler still running is closed (``ctx.cancelled`` first)."""
        if self._ctx is not None:
            self._ctx.cancelled = True
        await self._agen.aclose()

    async def __aenter__(self) -> LocalStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()
