from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from dynagraph.errors import EngineError
from dynagraph.llm.protocol import TextChunk

from .conftest import (
    MODEL,
    AppFactory,
    FakeBackend,
    chat_body,
    chunks_for,
    client_for,
    completion_body,
    raw_asgi_call,
    sse_events,
)


async def test_chat_stream_format(make_app: AppFactory) -> None:
    backend = FakeBackend(chunks_for(["Hé", "llo 🙂", ""], prompt_tokens=4))
    async with client_for(make_app(backend)) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(stream=True))
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["x-request-id"]
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 3
    rid = resp.headers["x-request-id"]
    for c in chunks:
        assert c["id"] == f"chatcmpl-{rid}" and c["object"] == "chat.completion.chunk"
        assert c["model"] == MODEL and "usage" not in c
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hé"}
    assert chunks[1]["choices"][0]["delta"] == {"content": "llo 🙂"}
    assert chunks[2]["choices"][0]["delta"] == {}
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "stop"]


async def test_stream_include_usage(make_app: AppFactory) -> None:
    backend = FakeBackend(chunks_for(["a", "b"], finish="length", prompt_tokens=3))
    body = chat_body(stream=True, stream_options={"include_usage": True})
    async with client_for(make_app(backend)) as client:
        resp = await client.post("/v1/chat/completions", json=body)
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    assert all(e["usage"] is None for e in events[:-2])
    final = events[-2]
    assert final["choices"] == []
    assert final["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": None,
    }


async def test_completion_stream_format(make_app: AppFactory) -> None:
    backend = FakeBackend(chunks_for(["x", "y"], finish="length"))
    async with client_for(make_app(backend)) as client:
        resp = await client.post("/v1/completions", json=completion_body(stream=True))
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["x", "y"]
    assert events[0]["object"] == "text_completion"
    assert events[1]["choices"][0]["finish_reason"] == "length"


async def test_error_after_stream_started_is_an_sse_error_event(make_app: AppFactory) -> None:
    backend = FakeBackend(chunks_for(["a", "b", "c"]), error=EngineError("engine died"), error_at=1)
    async with client_for(make_app(backend)) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(stream=True))
    assert resp.status_code == 200
    events = sse_events(resp.text)
    assert len(events) == 2 and "[DONE]" not in events
    assert events[0]["choices"][0]["delta"]["content"] == "a"
    assert events[1]["error"]["type"] == "internal_server_error"
    assert "engine died" in events[1]["error"]["message"]


async def test_disconnect_mid_stream_cancels_backend(
    make_app: AppFactory, registry: CollectorRegistry
) -> None:
    backend = FakeBackend(chunks_for(["a", "b", "c"]), block_at=1)
    sent = await raw_asgi_call(
        make_app(backend),
        "/v1/chat/completions",
        chat_body(stream=True),
        disconnect_after_body_chunks=1,
    )
    assert backend.cancelled.is_set() and backend.closed.is_set()
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert len(bodies) == 1 and b'"content":"a"' in bodies[0]["body"]
    labels = {"model": MODEL}
    assert registry.get_sample_value("dynamo_frontend_client_disconnects_total", labels) == 1
    assert registry.get_sample_value("dynamo_frontend_inflight_requests", labels) == 0
    ok = {**labels, "endpoint": "chat_completions", "request_type": "stream"}
    assert registry.get_sample_value("dynamo_frontend_requests_total", {**ok, "status": "error"})


@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_before_first_token_cancels_backend(
    make_app: AppFactory, registry: CollectorRegistry, stream: bool
) -> None:
    backend = FakeBackend(block_at=0)
    sent = await raw_asgi_call(
        make_app(backend),
        "/v1/chat/completions",
        chat_body(stream=stream),
        disconnect_after_body_chunks=0,
    )
    assert backend.cancelled.is_set() and backend.closed.is_set()
    assert (
        registry.get_sample_value("dynamo_frontend_client_disconnects_total", {"model": MODEL}) == 1
    )
    assert registry.get_sample_value("dynamo_frontend_inflight_requests", {"model": MODEL}) == 0
    assert sent[0]["status"] == 499


async def test_slow_client_sees_every_chunk_without_cancellation(make_app: AppFactory) -> None:
    backend = FakeBackend(chunks_for([str(i) for i in range(50)]))
    sent = await raw_asgi_call(
        make_app(backend), "/v1/completions", completion_body(stream=True),
        disconnect_after_body_chunks=10**6,
    )  # fmt: skip
    assert not backend.cancelled.is_set()
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    events = sse_events(body.decode())
    assert len(events) == 51 and events[-1] == "[DONE]"


async def test_openai_client_understands_the_responses(make_app: AppFactory) -> None:
    app = make_app(FakeBackend(chunks_for(["Hello", " there"], prompt_tokens=2)))
    http_client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    async with openai.AsyncOpenAI(
        base_url="http://test/v1",
        api_key="unused",
        http_client=http_client,  # type: ignore[arg-type]  # openai 3 annotates httpx2
        max_retries=0,
    ) as client:
        reply = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.choices[0].message.content == "Hello there"
        assert reply.usage is not None and reply.usage.total_tokens == 4

        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        assert text == "Hello there" and usage is not None and usage.completion_tokens == 2

        completion = await client.completions.create(model=MODEL, prompt="hi")
        assert completion.choices[0].text == "Hello there"

        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="other", prompt="hi")
        with pytest.raises(openai.BadRequestError) as exc:
            await client.completions.create(model=MODEL, prompt="hi", max_tokens=-3)
        assert exc.value.body is not None and "max_tokens" in str(exc.value.body)


async def test_concurrent_streams_are_independent(make_app: AppFactory) -> None:
    app = make_app(FakeBackend(chunks_for(["a", "b", "c"])))
    async with client_for(app) as client:
        responses = await asyncio.gather(
            *(client.post("/v1/completions", json=completion_body(stream=True)) for _ in range(16))
        )
    ids = {r.headers["x-request-id"] for r in responses}
    assert len(ids) == 16
    assert all(sse_events(r.text)[-1] == "[DONE]" for r in responses)


class TaskRecordingBackend(FakeBackend):
    """Checks that one task drives the backend iterator from start to end, with an
    ``asyncio.timeout`` spanning the yields (it breaks if the iterator changes task)."""

    def __init__(self) -> None:
        super().__init__(chunks_for(["a", "b", "c"]))
        self.tasks: list[asyncio.Task[object] | None] = []

    async def generate(self, request: object, request_id: str,  # type: ignore[override]
                       tenant: object = None) -> AsyncIterator[TextChunk]:
        async with asyncio.timeout(10):
            for chunk in self.chunks:
                self.tasks.append(asyncio.current_task())
                await asyncio.sleep(0)
                yield chunk


@pytest.mark.parametrize("stream", [True, False])
async def test_backend_iterator_stays_in_one_task(make_app: AppFactory, stream: bool) -> None:
    backend = TaskRecordingBackend()
    async with client_for(make_app(backend)) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(stream=stream))
    assert resp.status_code == 200 and "error" not in resp.text
    assert len(backend.tasks) == 3 and len(set(map(id, backend.tasks))) == 1
