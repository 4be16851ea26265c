"""The replay driver against an in-process fake OpenAI SSE server (aiohttp): open-loop
timing, latency from the due time, request bodies, and error/truncation detection."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from benchmarks.traces.prompts import PromptSynthesizer
from benchmarks.traces.replay import ReplayOptions, replay, wait_ready
from benchmarks.traces.trace import TraceRecord

TOKEN = b'data: {"choices":[{"index":0,"text":"x","finish_reason":null}]}\n\n'


@dataclass
class Fake:
    """Scripted behaviour per request index (from x-request-id), and what it saw."""

    first_token_s: float = 0.0
    itl_s: float = 0.0
    kinds: dict[int, str] = field(default_factory=dict)
    arrivals: dict[int, float] = field(default_factory=dict)
    bodies: dict[int, dict[str, Any]] = field(default_factory=dict)
    active: int = 0
    max_active: int = 0

    async def completions(self, request: web.Request) -> web.StreamResponse:
        i = int(request.headers["x-request-id"].rsplit("-", 1)[1])
        self.arrivals[i] = time.perf_counter()
        body = await request.json()
        self.bodies[i] = body
        kind = self.kinds.get(i, "ok")
        if kind == "http400":
            return web.json_response({"error": {"message": "prompt too long", "type":
                                                "invalid_request_error", "code": 400}},
                                     status=400)
        if kind == "http500-text":
            return web.Response(text="upstream exploded", status=500)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            return await self._stream(request, body, kind)
        finally:
            self.active -= 1

    async def _stream(self, request: web.Request, body: dict[str, Any], kind: str
                      ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(self.first_token_s)
        n = 2 if kind == "short" else body["max_tokens"]
        for k in range(n):
            if k:
                await asyncio.sleep(self.itl_s)
            await resp.write(TOKEN)
            if k == 1 and kind == "stream-error":
                await resp.write(b'data: {"error":{"message":"engine died","type":'
                                 b'"internal_error","code":500}}\n\n')
                await resp.write_eof()
                return resp
            if k == 1 and kind == "drop":
                assert request.transport is not None
                request.transport.close()
                return resp
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                 "total_tokens": len(body["prompt"]) + n,
                 "prompt_tokens_details": {"cached_tokens": 512}}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode()
                         + b"\n\n")
        if kind != "no-done":
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def models(_: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": []})


@contextlib.asynccontextmanager
async def serving(f: Fake) -> AsyncIterator[tuple[Fake, str]]:
    """The fake's /v1/completions and /v1/models on 127.0.0.1: (fake, base URL)."""
    app = web.Application()
    app.router.add_post("/v1/completions", f.completions)
    app.router.add_get("/v1/models", models)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield f, str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@pytest.fixture
async def fake() -> AsyncIterator[tuple[Fake, str]]:
    async with serving(Fake()) as served:
        yield served


def rec(ts_ms: float, n_out: int = 3, n_in: int = 600, ids: tuple[int, ...] = (0, 1)
        ) -> TraceRecord:
    return TraceRecord(timestamp=ts_ms, input_length=n_in, output_length=n_out, hash_ids=ids)


PROMPTS = PromptSynthesizer(lo=5, hi=2048, block_tokens=512)


async def test_open_loop_timing_with_a_slow_server(fake: tuple[Fake, str]) -> None:
    f, url = fake
    f.first_token_s, f.itl_s = 1.0, 0.01  # far slower than the 100 ms arrival gaps
    records = [rec(100.0 * i) for i in range(6)]
    run = await replay(records, PROMPTS, ReplayOptions(url=url, model="m"))
    assert [r.index for r in run.results] == list(range(6))
    assert all(r.ok for r in run.results), [r.error for r in run.results]
    t0 = f.arrivals[0]
    offsets = [f.arrivals[i] - t0 for i in range(6)]
    # sent on schedule, not after the previous answer (1 s each): tolerances leave room for
    # this VM's pauses, and a closed loop would still miss them by seconds
    for i, off in enumerate(offsets):
        assert abs(off - 0.1 * i) < 0.3, offsets
    assert f.max_active == 6
    for r in run.results:
        assert r.ttft_s is not None and 0.95 < r.ttft_s < 2.0
        assert r.sent_s - r.scheduled_s < 0.3
        assert r.output_tokens == 3 and r.cached_tokens == 512 and len(r.token_times) == 3
    assert 1.5 < run.wall_s < 3.5
    assert len(run.loop_lag_s) > 50  # the 10 ms loop watch ran throughout


async def test_latency_counts_from_the_due_time_when_connections_run_out(
        fake: tuple[Fake, str]) -> None:
    f, url = fake
    f.first_token_s = 0.3
    records = [rec(0.0, n_out=1), rec(0.0, n_out=1), rec(0.0, n_out=1)]
    run = await replay(records, PROMPTS, ReplayOptions(url=url, model="m", max_connections=1))
    assert f.max_active == 1
    ttfts = sorted(r.ttft_s or 0.0 for r in run.results)
    lags = sorted(r.sent_s - r.scheduled_s for r in run.results)
    assert ttfts[0] == pytest.approx(0.3, abs=0.1)
    assert ttfts[2] == pytest.approx(0.9, abs=0.2)  # waited for two others first
    assert lags[2] == pytest.approx(0.6, abs=0.15)


async def test_request_body(fake: tuple[Fake, str]) -> None:
    f, url = fake
    r = rec(0.0, n_out=4, n_in=700, ids=(5, 6))
    await replay([r], PROMPTS, ReplayOptions(url=url, model="tiny", extra_body={"seed": 1}))
    body = f.bodies[0]
    assert body == {"model": "tiny", "prompt": PROMPTS.prompt(r), "max_tokens": 4,
                    "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}, "seed": 1}
    assert len(body["prompt"]) == 700


async def test_errors_and_truncation(fake: tuple[Fake, str]) -> None:
    f, url = fake
    kinds = ["ok", "http400", "http500-text", "short", "no-done", "stream-error", "drop"]
    f.kinds = dict(enumerate(kinds))
    records = [rec(10.0 * i, n_out=4) for i in range(len(kinds))]
    run = await replay(records, PROMPTS, ReplayOptions(url=url, model="m"))
    errors = [r.error for r in run.results]
    assert errors[0] is None
    assert errors[1] == "HTTP 400: invalid_request_error: prompt too long"
    assert errors[2] == "HTTP 500: upstream exploded"
    assert errors[3] == "truncated: 2 of 4 tokens"
    assert errors[4] == "truncated: the stream ended without [DONE]"
    assert errors[5] == "stream error: engine died"
    assert errors[6] is not None and (errors[6].startswith("connection:")
                                      or errors[6].startswith("truncated:")), errors[6]
    assert [r.status for r in run.results[:3]] == [200, 400, 500]
    assert all(r.end_s is not None for r in run.results)


async def test_silent_stream_times_out(fake: tuple[Fake, str]) -> None:
    f, url = fake
    f.first_token_s = 5.0
    run = await replay([rec(0.0)], PROMPTS, ReplayOptions(url=url, model="m",
                                                          request_timeout_s=0.3))
    assert run.results[0].error == "timeout: no end after 0.3 s"


async def test_connection_refused_is_recorded() -> None:
    run = await replay([rec(0.0), rec(5.0)], PROMPTS,
                       ReplayOptions(url="http://127.0.0.1:9", model="m"))
    assert [r.error is not None and r.error.startswith("connection:") for r in run.results] == [
        True, True]


async def test_wait_ready(fake: tuple[Fake, str]) -> None:
    _, url = fake
    await wait_ready(url, 5.0)
    with pytest.raises(TimeoutError, match="not ready"):
        await wait_ready("http://127.0.0.1:9", 0.5)
