"""The app behind a real uvicorn server (in-process, 127.0.0.1, port 0): a client that
closes a stream mid-way cancels the backend, as with the raw ASGI driver."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
import uvicorn

from dynagraph.llm.http.asgi import App

from .conftest import MODEL, FakeBackend, chat_body, chunks_for

AppFactory = Callable[..., App]


@pytest.fixture
async def serve(make_app: AppFactory) -> AsyncIterator[Callable[[FakeBackend], str]]:
    servers: list[tuple[uvicorn.Server, asyncio.Task[None], socket.socket]] = []

    def start(backend: FakeBackend) -> str:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(make_app(backend), log_level="warning", lifespan="off")
        server = uvicorn.Server(config)
        servers.append((server, asyncio.ensure_future(server.serve(sockets=[sock])), sock))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    yield start
    for server, task, sock in servers:
        server.should_exit = True
        await asyncio.wait_for(task, timeout=10)
        sock.close()


async def wait_started(base: str) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=1) as client:
        for _ in range(200):
            try:
                if (await client.get("/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.01)
    raise TimeoutError(f"{base} did not come up")


async def test_client_closing_a_stream_cancels_the_backend(
    serve: Callable[[FakeBackend], str],
) -> None:
    backend = FakeBackend(chunks_for(["a", "b", "c"]), block_at=1)
    base = serve(backend)
    await wait_started(base)
    async with httpx.AsyncClient(base_url=base, timeout=5) as client:
        async with client.stream(
            "POST", "/v1/chat/completions", json=chat_body(stream=True)
        ) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    break
            await asyncio.wait_for(backend.blocked.wait(), timeout=5)
        # leaving the block closes the connection mid-stream
        await asyncio.wait_for(backend.cancelled.wait(), timeout=5)
        metrics = (await client.get("/metrics")).text
    assert f'dynamo_frontend_client_disconnects_total{{model="{MODEL}"}} 1.0' in metrics


async def test_real_server_full_stream(serve: Callable[[FakeBackend], str]) -> None:
    base = serve(FakeBackend(chunks_for(["x"] * 20)))
    await wait_started(base)
    async with httpx.AsyncClient(base_url=base, timeout=5) as client:
        resp = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "p", "stream": True}
        )
    assert resp.text.count("data: ") == 21 and resp.text.endswith("data: [DONE]\n\n")
