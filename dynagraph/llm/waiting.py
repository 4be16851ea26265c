"""A worker's requests that have not produced output yet, and handing them back.

``engine_stream`` waits for a request's first output through :meth:`WaitingRequests.first`;
until it arrives the request can be released (:meth:`release`, the worker's ``release``
endpoint, called by the Router's rebalancing): its stream then aborts it in the engine
and raises :class:`~dynagraph.errors.Requeued`, and the Processor places it again.
Nothing was sent to the client, so nothing is lost or repeated.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from dynagraph.errors import Requeued

T = TypeVar("T")


class WaitingRequests:
    """Requests without output yet, oldest first."""

    def __init__(self) -> None:
        self._released: dict[str, asyncio.Future[None]] = {}

    def __len__(self) -> int:
        return len(self._released)

    async def first(self, request_id: str, outs: AsyncIterator[T]) -> T:
        """``outs``' first item (``StopAsyncIteration`` if it has none), unless the
        request is released before it comes: then ``Requeued`` (``outs`` was cancelled,
        which aborts the request in the engine)."""
        released: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._released[request_id] = released
        item = asyncio.ensure_future(anext(outs))
        try:
            waits: set[asyncio.Future[Any]] = {item, released}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            item.cancel()
            raise
        finally:
            self._released.pop(request_id, None)
        if item.done():  # an output that came with the release still counts
            return item.result()
        item.cancel()
        with contextlib.suppress(BaseException):
            await item
        raise Requeued(f"request {request_id} was handed back before it started (a place "
                       "is free on another worker)")

    def release(self, count: int) -> list[str]:
        """Release the ``count`` newest requests still waiting; their ids."""
        pending = [r for r, fut in self._released.items() if not fut.done()]
        ids = pending[-count:] if count > 0 else []
        for request_id in ids:
            self._released[request_id].set_result(None)
        return ids
