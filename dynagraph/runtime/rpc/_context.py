"""What a request-plane handler receives besides its payload."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

REQUEST_ID_HEADER = "x-request-id"


@dataclass
class RequestContext:
    """Per-request data handed to a handler with the decoded payload.

    ``request_id`` comes from the ``x-request-id`` header, or is generated (and then
    also written into ``headers``) so that it can be forwarded to the next hop.
    ``cancelled`` turns True just before the server cancels the handler because the
    caller went away, cancelled, or the server is stopping.
    """

    request_id: str
    headers: dict[str, str]
    endpoint: str = ""
    peer: str = ""
    cancelled: bool = field(default=False)

    @classmethod
    def from_headers(cls, headers: dict[str, str], *, endpoint: str = "",
                     peer: str = "") -> RequestContext:
        request_id = headers.get(REQUEST_ID_HEADER)
        if not request_id:
            request_id = uuid.uuid4().hex
            headers[REQUEST_ID_HEADER] = request_id
        return cls(request_id=request_id, headers=headers, endpoint=endpoint, peer=peer)


Handler = Callable[[Any, RequestContext], AsyncIterator[Any]]
"""An async generator function ``async def h(payload, ctx): yield ...``."""
