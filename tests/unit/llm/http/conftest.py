"""In-memory Backend and helpers for the HTTP app tests."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, MutableMapping
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from dynagraph.llm.http import create_app
from dynagraph.llm.http.asgi import App
from dynagraph.llm.http.backend import ModelInfo
from dynagraph.llm.protocol import OpenAIRequest, TextChunk, TokenizeKind
from dynagraph.llm.tenants import TenantToken

MODEL = "tiny-llama"

AppFactory = Callable[..., App]


def chunks_for(texts: list[str], finish: str = "stop", prompt_tokens: int = 5) -> list[TextChunk]:
    """One chunk per text, one token each; the last carries ``finish``."""
    out = [
        TextChunk(text=t, prompt_tokens=prompt_tokens, completion_tokens=i + 1)
        for i, t in enumerate(texts)
    ]
    out[-1].finish_reason = finish  # type: ignore[assignment]
    return out


class OneModelBackend:
    """The Backend surface every fake here shares: one model, always ready, no /tokenize."""

    model = MODEL

    def ready(self) -> bool:
        return True

    def models(self) -> list[ModelInfo]:
        return [ModelInfo(self.model)]

    async def tokenize(self, kind: TokenizeKind, model: str, body: dict[str, Any]
                       ) -> dict[str, Any]:
        raise NotImplementedError


class FakeBackend(OneModelBackend):
    """Scripted Backend: yields ``chunks``, optionally raising ``error`` at ``error_at``.

    With ``block_at`` it waits forever before yielding that chunk (until cancelled), and
    records whether it observed cancellation.
    """

    def __init__(
        self,
        chunks: list[TextChunk] | None = None,
        *,
        error: BaseException | None = None,
        error_at: int = 0,
        block_at: int | None = None,
        ready: bool = True,
    ) -> None:
        self.chunks = chunks if chunks is not None else chunks_for(["Hello", " world", "!"])
        self.error = error
        self.error_at = error_at
        self.block_at = block_at
        self.is_ready = ready
        self.has_models = True
        self.calls: list[tuple[OpenAIRequest, str]] = []
        self.tenants: list[TenantToken | None] = []
        self.cancelled = asyncio.Event()
        self.closed = asyncio.Event()
        self.blocked = asyncio.Event()

    def ready(self) -> bool:
        return self.is_ready

    def models(self) -> list[ModelInfo]:
        return super().models() if self.has_models else []

    async def generate(self, request: OpenAIRequest, request_id: str,
                       tenant: TenantToken | None = None) -> AsyncIterator[TextChunk]:
        self.calls.append((request, request_id))
        self.tenants.append(tenant)
        try:
            for index, chunk in enumerate(self.chunks):
                if self.error is not None and index == self.error_at:
                    raise self.error
                if index == self.block_at:
                    self.blocked.set()
                    await asyncio.sleep(30)
                    raise AssertionError("the backend was never cancelled")
                yield chunk
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        finally:
            self.closed.set()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def make_app(registry: CollectorRegistry) -> Callable[..., App]:
    def make(backend: FakeBackend, max_model_len: int | None = 2048, **options: Any) -> App:
        return create_app(
            backend, served_model_name=MODEL, max_model_len=max_model_len, registry=registry,
            **options,
        )

    return make


def client_for(app: App) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def completion_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", **fields}


def sse_events(body: str) -> list[Any]:
    """Decode an SSE body into its data payloads (JSON, or the string ``[DONE]``)."""
    events: list[Any] = []
    assert body.endswith("\n\n"), body
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def raw_asgi_call(
    app: App, path: str, body: dict[str, Any], *, disconnect_after_body_chunks: int
) -> list[MutableMapping[str, Any]]:
    """Drive the ASGI app directly; report ``http.disconnect`` after N body messages.

    (httpx's ASGITransport buffers whole responses, so it cannot disconnect mid-stream.)
    """
    payload = json.dumps(body).encode()
    sent: list[MutableMapping[str, Any]] = []
    disconnect = asyncio.Event()
    if disconnect_after_body_chunks == 0:
        disconnect.set()
    request_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body":
            count = sum(1 for m in sent if m["type"] == "http.response.body")
            if count >= disconnect_after_body_chunks:
                disconnect.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return sent
