"""The Frontend's HTTP server: an idle client connection outlives the client's own."""

from __future__ import annotations

import asyncio

from components.frontend import Frontend, FrontendConfig
from dynagraph.runtime.discovery import MemoryDiscovery, MemoryStore
from dynagraph.sdk import RuntimeContext


class NoProcessor:
    def instance_ids(self) -> list[int]:
        return []


async def test_an_idle_connection_is_kept_longer_than_clients_keep_theirs() -> None:
    disc = MemoryDiscovery(MemoryStore())
    await disc.start()
    rt = RuntimeContext(namespace="dynamo", component="Frontend", worker_index=0,
                        instance_id=disc.instance_id, discovery=disc)
    frontend = Frontend(FrontendConfig(host="127.0.0.1", port=0), runtime=rt,
                        processor=NoProcessor())
    await frontend.start()
    try:
        assert frontend._server is not None
        assert frontend._server.config.timeout_keep_alive == 75.0
        port = frontend._server.servers[0].sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 ")
        writer.close()
    finally:
        await frontend.stop()
        await disc.close()
