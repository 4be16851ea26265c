"""A request-plane server process for the integration tests.

    python -m tests.integration.rpc.server_main

Prints ``ADDRESS host:port`` on stdout once serving; stops on SIGTERM or SIGINT.
Endpoints: ``count`` (yields 0..n-1), ``slow`` (yields "first", then waits 30 s),
``state`` (yields the set of request ids whose handler saw CancelledError),
``fail`` (raises InvalidRequest).
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

from dynagraph.errors import InvalidRequest
from dynagraph.runtime.rpc import RequestContext, RpcServer

cancelled: list[str] = []


async def count(payload: Any, ctx: RequestContext) -> AsyncIterator[int]:
    for i in range(payload):
        yield i


async def slow(payload: Any, ctx: RequestContext) -> AsyncIterator[str]:
    try:
        yield "first"
        await asyncio.sleep(30)
        yield "never"
    except asyncio.CancelledError:
        cancelled.append(ctx.request_id)
        raise


async def state(payload: Any, ctx: RequestContext) -> AsyncIterator[list[str]]:
    yield cancelled


async def fail(payload: Any, ctx: RequestContext) -> AsyncIterator[int]:
    raise InvalidRequest(f"bad request {payload}", param="prompt")
    yield 0  # an async generator


async def main() -> None:
    server = RpcServer()
    for name, handler in [("count", count), ("slow", slow), ("state", state), ("fail", fail)]:
        server.add_endpoint(name, handler)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    sys.stdout.write(f"ADDRESS {server.address}\n")
    sys.stdout.flush()
    await stop.wait()
    await server.stop(grace=1.0)


if __name__ == "__main__":
    asyncio.run(main())
