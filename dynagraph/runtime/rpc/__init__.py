"""The request plane: direct streaming RPC between processes.

A callee process runs one ``RpcServer`` with named endpoints; each endpoint is an async
generator function ``handler(payload, ctx)``. A caller process uses one ``RpcClient``;
``client.call(address, endpoint, payload)`` returns an async iterator of the responses.

Wire: TCP, length-prefixed msgpack frames (see ``_framing``); a caller process keeps one
connection to each server and runs all its streams to it over that connection, each
with its own flow control. Errors, as seen by the caller:

    InstanceUnavailable   not taken (connect refused/timed out, server stopping, or the
                          connection closed before the server's first frame): retry elsewhere
    StreamBroken          connection lost after the request was sent (or idle_timeout)
    RemoteError           the handler raised (``remote_type``, ``remote_message``);
                          types in ``dynagraph.errors.WIRE_ERRORS`` arrive as themselves
    ProtocolError         the peer broke the wire format

A server started with ``local_calls=True`` (an embedded component's) is reached by callers
of its own process without the socket (``_local``), with the same errors and cancellation.

Cancelling the caller's iteration (break, ``aclose()``, task cancelled) cancels the
handler; a slow caller holds the handler at its ``yield`` (bounded buffers).
"""

from __future__ import annotations

from ._client import RpcClient
from ._context import REQUEST_ID_HEADER, Handler, RequestContext
from ._framing import ProtocolError
from ._local import LocalStream, has_local_servers, local_server, wire_copy
from ._server import RpcServer, UnknownEndpoint
from ._stream import NOT_READY, RpcStream

__all__ = [
    "NOT_READY",
    "REQUEST_ID_HEADER",
    "Handler",
    "LocalStream",
    "ProtocolError",
    "RequestContext",
    "RpcClient",
    "RpcServer",
    "RpcStream",
    "UnknownEndpoint",
    "has_local_servers",
    "local_server",
    "wire_copy",
]
