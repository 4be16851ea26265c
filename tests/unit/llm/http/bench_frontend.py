"""Frontend overhead benchmark: the HTTP app over uvicorn with an instant fake backend.

Runs the app in a child process (uvloop + httptools, 127.0.0.1, port 0) whose backend
yields ``--tokens`` one-token chunks with ``--itl`` seconds between them, and drives it
with ``--streams`` concurrent aiohttp streaming clients. With ``--itl 0`` the result is
the frontend's capacity in chunks/s; TTFT is pure frontend + HTTP overhead.

    python -m tests.unit.llm.http.bench_frontend --streams 16 --tokens 256 --requests 64

``server_cpu_us_per_chunk`` is the server process's CPU time per streamed chunk (includes
the warm-up request). Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

from dynagraph.llm.protocol import OpenAIRequest, TextChunk
from dynagraph.llm.tenants import TenantToken
from tests.unit.llm.http.conftest import MODEL, OneModelBackend


class InstantBackend(OneModelBackend):
    def __init__(self, tokens: int, itl: float) -> None:
        self.tokens = tokens
        self.itl = itl

    async def generate(self, request: OpenAIRequest, request_id: str,
                       tenant: TenantToken | None = None) -> AsyncIterator[TextChunk]:
        n = self.tokens
        for i in range(n):
            if self.itl:
                await asyncio.sleep(self.itl)
            yield TextChunk(
                text=" tok",
                finish_reason="length" if i == n - 1 else None,
                prompt_tokens=8,
                completion_tokens=i + 1,
            )


def _serve(port_queue: Any, tokens: int, itl: float) -> None:
    import uvicorn

    from dynagraph.llm.http import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port_queue.put(sock.getsockname()[1])
    app = create_app(InstantBackend(tokens, itl), served_model_name=MODEL)
    config = uvicorn.Config(app, loop="uvloop", http="httptools", log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])


async def _one(session: Any, url: str, body: bytes) -> tuple[float, int, float]:
    start = time.perf_counter()
    ttft = 0.0
    chunks = 0
    async with session.post(url, data=body, headers={"content-type": "application/json"}) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: {"):
                if chunks == 0:
                    ttft = time.perf_counter() - start
                chunks += 1
    return ttft, chunks, time.perf_counter() - start


async def _drive(port: int, streams: int, requests: int, endpoint: str) -> dict[str, float]:
    import aiohttp

    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    url = f"http://127.0.0.1:{port}{path}"
    payload: dict[str, Any] = {"model": MODEL, "stream": True}
    if endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": "hi"}]
    else:
        payload["prompt"] = "hi"
    body = json.dumps(payload).encode()
    results: list[tuple[float, int, float]] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=streams)) as session:
        await _one(session, url, body)  # warm-up

        async def worker() -> None:
            while not queue.empty():
                queue.get_nowait()
                results.append(await _one(session, url, body))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(streams)))
        elapsed = time.perf_counter() - start
    ttfts = sorted(r[0] for r in results)
    total_chunks = sum(r[1] for r in results)
    return {
        "streams": streams,
        "requests": len(results),
        "chunks_per_s": total_chunks / elapsed,
        "ttft_p50_ms": statistics.median(ttfts) * 1e3,
        "ttft_p90_ms": ttfts[int(len(ttfts) * 0.9) - 1] * 1e3,
        "elapsed_s": elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--itl", type=float, default=0.0)
    parser.add_argument("--endpoint", choices=["chat", "completion"], default="chat")
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    port_queue = ctx.Queue()
    server = ctx.Process(target=_serve, args=(port_queue, args.tokens, args.itl), daemon=True)
    server.start()
    try:
        port = port_queue.get(timeout=60)
        deadline = time.monotonic() + 30
        while True:  # poll for readiness
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        import psutil

        proc = psutil.Process(server.pid)
        before = proc.cpu_times()
        result = asyncio.run(_drive(port, args.streams, args.requests, args.endpoint))
        after = proc.cpu_times()
        cpu = (after.user - before.user) + (after.system - before.system)
        chunks = result["chunks_per_s"] * result["elapsed_s"]
        result["server_cpu_us_per_chunk"] = cpu / chunks * 1e6
    finally:
        server.terminate()
        server.join(timeout=10)
    print(json.dumps({**vars(args), **result}, indent=2))


if __name__ == "__main__":
    main()
