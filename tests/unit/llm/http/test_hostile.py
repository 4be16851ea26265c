"""Hostile or broken clients: clear errors naming what was wrong, nothing unbounded."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from dynagraph.llm.http.admission import Admission
from dynagraph.llm.http.limits import RequestLimits

from .conftest import AppFactory, FakeBackend, chat_body, client_for, completion_body


async def test_a_body_over_the_limit_is_413(make_app: AppFactory) -> None:
    app = make_app(FakeBackend(), limits=RequestLimits(max_body_bytes=2048))
    async with client_for(app) as client:
        r = await client.post("/v1/completions", json=completion_body(prompt="x" * 5000))
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


@pytest.mark.parametrize(("fields", "param"), [
    ({"stop": [f"s{i}" for i in range(65)]}, "stop"),
    ({"stop": "x" * 513}, "stop"),
    ({"stop_token_ids": list(range(1025))}, "stop_token_ids"),
    ({"n": 129, "temperature": 1.0}, "n"),
    ({"messages": [{"role": "user", "content": "hi"}] * 1025}, "messages"),
    ({"messages": [{"role": "user", "content": "é" * 600_000}]}, "messages"),
])
async def test_limits_name_the_field(make_app: AppFactory, fields: dict[str, Any],
                                     param: str) -> None:
    async with client_for(make_app(FakeBackend())) as client:
        r = await client.post("/v1/chat/completions", json=chat_body(**fields))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("raw", [
    b'{"model": "tiny-llama", "prompt": "x", "temperature": NaN}',
    b'{"model": "tiny-llama", "prompt": "x", "logit_bias": {"5": Infinity}}',
    b'{"model": "tiny-llama", "prompt": "x", "junk": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
])
async def test_nan_inf_and_deep_json_are_400(make_app: AppFactory, raw: bytes) -> None:
    async with client_for(make_app(FakeBackend())) as client:
        r = await client.post("/v1/completions", content=raw,
                              headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


async def test_unknown_route_and_wrong_method(make_app: AppFactory) -> None:
    async with client_for(make_app(FakeBackend())) as client:
        missing = await client.get("/v2/nothing")
        wrong = await client.get("/v1/completions")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"


async def test_no_worker_yet_waits_then_503_with_retry_after(make_app: AppFactory) -> None:
    backend = FakeBackend()
    backend.has_models = False
    app = make_app(backend, worker_wait_s=0.2)
    async with client_for(app) as client:
        r = await client.post("/v1/completions", json=completion_body())
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "no_instances"

        async def worker_arrives() -> None:
            await asyncio.sleep(0.05)
            backend.has_models = True

        arrival = asyncio.create_task(worker_arrives())
        app2 = make_app(backend, worker_wait_s=5)
        async with client_for(app2) as client2:
            ok = await client2.post("/v1/completions", json=completion_body())
        await arrival
    assert ok.status_code == 200, ok.text


async def test_a_full_server_answers_429_with_retry_after(make_app: AppFactory) -> None:
    backend = FakeBackend(block_at=0)  # every request blocks until cancelled
    app = make_app(backend, admission=Admission(max_inflight=1, max_queued=0, queue_timeout=0))
    async with client_for(app) as client:
        held = asyncio.create_task(client.post("/v1/completions",
                                               json=completion_body(stream=False)))
        await asyncio.wait_for(backend.blocked.wait(), 5)
        r = await client.post("/v1/completions", json=completion_body())
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "overloaded"
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)


async def test_openapi_describes_the_served_routes(make_app: AppFactory) -> None:
    async with client_for(make_app(FakeBackend())) as client:
        doc = (await client.get("/openapi.json")).json()
    assert doc["openapi"].startswith("3.1")
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith(
        "ChatCompletionRequest")
    assert "ChatCompletionRequest" in doc["components"]["schemas"]
    assert set(doc["paths"]) >= {"/v1/completions", "/v1/models", "/health", "/tokenize"}
