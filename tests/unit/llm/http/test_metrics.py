from __future__ import annotations

import asyncio
import shutil

import pytest
from prometheus_client import CollectorRegistry

from dynagraph.llm.http.asgi import App

from .conftest import (
    MODEL,
    AppFactory,
    FakeBackend,
    chat_body,
    chunks_for,
    client_for,
    completion_body,
)


async def exercise(app: App) -> str:
    async with client_for(app) as client:
        assert (await client.post("/v1/chat/completions", json=chat_body())).status_code == 200
        stream = await client.post("/v1/completions", json=completion_body(stream=True))
        assert stream.status_code == 200
        bad = await client.post("/v1/chat/completions", json=chat_body(max_tokens=0))
        assert bad.status_code == 400
        resp = await client.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    return resp.text


async def test_metrics_values(make_app: AppFactory, registry: CollectorRegistry) -> None:
    backend = FakeBackend(chunks_for(["a", "b", "c", "d"], prompt_tokens=6))
    text = await exercise(make_app(backend))
    assert "dynamo_frontend_time_to_first_token_seconds_bucket" in text
    model = {"model": MODEL}

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {**model, **labels})

    assert value("dynamo_frontend_requests_total", endpoint="chat_completions",
                 request_type="unary", status="success") == 1  # fmt: skip
    assert value("dynamo_frontend_requests_total", endpoint="completions",
                 request_type="stream", status="success") == 1  # fmt: skip
    assert value("dynamo_frontend_requests_total", endpoint="chat_completions",
                 request_type="unary", status="error") == 1  # fmt: skip
    assert value("dynamo_frontend_inflight_requests") == 0
    assert value("dynamo_frontend_time_to_first_token_seconds_count") == 2
    assert value("dynamo_frontend_request_duration_seconds_count") == 2
    assert value("dynamo_frontend_inter_token_latency_seconds_count") == 3  # stream: 4 chunks
    assert value("dynamo_frontend_input_sequence_tokens_sum") == 12
    assert value("dynamo_frontend_output_sequence_tokens_sum") == 8
    assert value("dynamo_frontend_client_disconnects_total") == 0


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
async def test_promtool_check_metrics_is_clean(make_app: AppFactory) -> None:
    text = await exercise(make_app(FakeBackend()))
    proc = await asyncio.create_subprocess_exec(
        "promtool", "check", "metrics",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(text.encode()), timeout=30)
    assert proc.returncode == 0, (out + err).decode()
    assert out.strip() == b"" and err.strip() == b"", (out + err).decode()


def test_two_apps_in_one_registry_share_its_metrics(make_app: AppFactory) -> None:
    a, b = make_app(FakeBackend()), make_app(FakeBackend())
    assert a.state.metrics.ttft is b.state.metrics.ttft  # one family per name per registry
